"""Every fast kernel against its plain twin, bit for bit, on every ISA.

The twins (csrc/ops/ref/, bound as ``<op>_ref``) are simple scalar loops over the documented
op order (SPEC 3.3 SEQ and L16, 3.4, 4.3 step 6, 4.4, 7.3), compiled once, written from the
contract and not from the kernels' structure. Comparing a kernel only with its own template
instantiated for one scalar lane (``<VecScalar>``) cannot catch an algorithm bug shared by
all instantiations; comparing with the twin can. Each test draws seeded inputs over a sweep of
shapes that includes the vector tails (sizes around multiples of 4, 8 and 16) and special values
where the contract speaks (subnormals, signed zeros, saturating softcaps), runs the kernel on
every ISA of this CPU and requires the twin's bits (NEON: tests/cpp/digest_main.cpp under qemu).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exactblocks import _ext

F32 = np.float32
MLP_KINDS = {"swiglu": 0, "geglu": 1, "geglu_tanh": 2, "gelu": 3, "gelu_tanh": 4}
GATED = ("swiglu", "geglu", "geglu_tanh")


@pytest.fixture(scope="module")
def core():
    return _ext.core()


def each_isa(core):
    """Yield every ISA of this CPU with the kernel table switched to it, then restore."""
    saved = core.get_isa()
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            yield isa
    finally:
        core.set_isa(saved)


def assert_bits(got, want, what, **config):
    """Assert bit equality of two float32 arrays; name the config, first index and both values."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape, f"{what} {config}: shape {got.shape} != twin {want.shape}"
    g, w = got.view(np.uint32), want.view(np.uint32)
    bad = np.flatnonzero(g.ravel() != w.ravel())
    if bad.size:
        i = np.unravel_index(bad[0], got.shape)
        raise AssertionError(
            f"{what} {config}: {bad.size} of {g.size} elements differ from the twin; first at "
            f"{tuple(int(x) for x in i)}: kernel {got[i]!r} (0x{int(g[i]):08x}), "
            f"twin {want[i]!r} (0x{int(w[i]):08x})"
        )


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(F32)


def specials(rng, a):
    """Overwrite about a quarter of ``a`` (in place) with signed zeros and subnormals."""
    flat = a.reshape(-1)
    pick = rng.random(flat.size) < 0.25
    vals = np.array([0.0, -0.0, 1e-40, -1e-40, 1.4e-45, -3e-39, 1e-30, -1e-30], F32)
    flat[pick] = vals[rng.integers(0, vals.size, int(pick.sum()))]
    return a


# ---- L16 reductions --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "special"])
def test_l16(core, kind):
    """dot_l16<V> and sum_l16<V> (SPEC 3.3 L16) against the 16 written-out partial sums."""
    rng = np.random.default_rng(7 if kind == "normal" else 8)
    for n in [0, 1, 2, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 1000]:
        a, b = randn(rng, n), randn(rng, n)
        if kind == "special":
            specials(rng, a)
            specials(rng, b)
        want_dot = np.array([core.dot_l16_ref(a, b)], F32)
        want_sum = np.array([core.sum_l16_ref(a)], F32)
        for isa in each_isa(core):
            cfg = dict(isa=isa, n=n, kind=kind)
            assert_bits(np.array([core.dot_l16(a, b)], F32), want_dot, "dot_l16", **cfg)
            assert_bits(np.array([core.sum_l16(a)], F32), want_sum, "sum_l16", **cfg)


def test_l16_tail_padding_turns_a_negative_zero_lane_positive(core):
    """SPEC 3.3: L16 runs over n rounded up to a multiple of 16 with +0.0 terms, and
    fma(+0, +0, -0) = +0. n = 17 products that each underflow to -0: lanes 1..15 become +0, so
    the L16 dot is +0 on every ISA and in the twin alike, and so is the
    SSM's y = L16(h*C) + x*D with d_state % 16 != 0 and x*D = -0 (found by the twins). A lane
    can hold -0 only through fma: fma(a, b, +0) is -0 when a*b underflows from below."""
    a, b = np.full(17, -1e-30, F32), np.full(17, 1e-30, F32)
    assert np.float32(core.dot_l16_ref(a, b)).view(np.uint32) == 0x00000000
    # a sum lane starts at +0 and +0 + -0 = +0: sums of -0 are +0 with or without padding
    assert np.float32(core.sum_l16_ref(np.full(17, -0.0, F32))).view(np.uint32) == 0x00000000
    h, x = np.full((1, 17), -1e-30, F32), np.array([-0.0], F32)
    _, y_ref = core.ssm_scan_step_ref(h, F32(0.0), F32(-1.0), F32(1.0), x, np.ones(17, F32), b)
    assert y_ref.view(np.uint32)[0] == 0x00000000
    for isa in each_isa(core):
        assert_bits(np.array([core.dot_l16(a, b)], F32), np.array([0.0], F32), "dot_l16", isa=isa)
        for n in (16, 17):
            z = np.full(n, -0.0, F32)
            got = np.array([core.sum_l16(z)], F32)
            assert_bits(got, np.array([core.sum_l16_ref(z)], F32), f"sum_l16 n={n}", isa=isa)
        _, y = core.ssm_scan_step(h, F32(0.0), F32(-1.0), F32(1.0), x, np.ones(17, F32), b)
        assert_bits(y, y_ref, "ssm_scan_step y", isa=isa)


# ---- softmax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.0, 5.0, 50.0])
def test_softmax(core, softcap):
    rng = np.random.default_rng(int(softcap) + 1)
    for n, scale, kind in itertools.product(
        [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 257], [0.125, 1.0], ["normal", "special"]
    ):
        s = randn(rng, n, scale=4.0)
        if kind == "special":
            specials(rng, s)
            s[rng.integers(0, n)] = 1e4 if softcap else 80.0  # saturates tanh / dominates
        want = core.softmax_ref(s, scale, softcap)
        for isa in each_isa(core):
            got = core.softmax(s, scale, softcap)
            assert_bits(got, want, "softmax", isa=isa, n=n, scale=scale, softcap=softcap, kind=kind)


# ---- attention -------------------------------------------------------------------------------


def kv(rng, positions, hd, kind, scale=1.0):
    k, v = randn(rng, positions, hd, scale=scale), randn(rng, positions, hd)
    if kind == "special":
        specials(rng, k)
        specials(rng, v)
    return k, v


@pytest.mark.parametrize("hd", [1, 3, 8, 15, 16, 17, 24, 33, 64, 80, 128])
def test_attention_decode(core, hd):
    """attention_heads<V, R> for R = 1..4 heads sharing a KV head: key counts around multiples
    of 16 (the 16-key lane blocks), head_dim with tails (the zero-padded score lanes and the
    scalar value columns), windows (j0 > 0) and softcaps that saturate tanh."""
    rng = np.random.default_rng(hd)
    scale = F32(hd**-0.5)
    for n, R, softcap, kind in itertools.product(
        [1, 2, 15, 16, 17, 33, 100], [1, 2, 3, 4], [0.0, 20.0], ["normal", "special", "tiny"]
    ):
        j0 = int(rng.integers(0, 40)) if n > 2 else 0
        p = j0 + n - 1
        big = 30.0 if kind == "special" and softcap else 1.0  # scores far beyond the cap
        k, v = kv(rng, p + 1, hd, kind, scale=big)
        q = randn(rng, R, hd)
        if kind == "special":
            specials(rng, q)
        if kind == "tiny":  # every product q[d] * k_j[d] underflows: raw scores are signed zeros
            q = np.abs(q) * F32(1e-30)
            k = -np.abs(k) * F32(1e-30)
        o_ref, p_ref = core.attention_ref(q, k, v, j0, p, scale, softcap)
        for isa in each_isa(core):
            o, probs = core.attention_decode(q, k, v, j0, p, scale, softcap)
            cfg = dict(isa=isa, hd=hd, n_keys=n, j0=j0, R=R, softcap=softcap, kind=kind)
            assert_bits(probs, p_ref, "attention_decode probs", **cfg)
            assert_bits(o, o_ref, "attention_decode o", **cfg)


@pytest.mark.parametrize("hd", [1, 7, 16, 17, 40, 64])
def test_attention_prefill(core, hd):
    """attention_prefill_block<V>: Q queries x R heads (R > 4 runs the value pass in groups of
    4) over transposed key blocks from position `base`; windows, the 64-key value chunks and
    base offsets. Positions below the first query's window hold NaN: they must never be read.
    Each (query, head) must equal the one-head twin."""
    rng = np.random.default_rng(100 + hd)
    scale = F32(hd**-0.5)
    cases = itertools.product([1, 3, 8], [1, 3, 5], [0, 5, 16, 70], [0, 1, 5, 33])
    for Q, R, p0, window in cases:
        softcap = 0.0 if (Q + R + p0) % 2 else 10.0
        j00 = max(0, p0 - window + 1) if window else 0
        q = randn(rng, Q, R, hd)
        k, v = kv(rng, p0 + Q, hd, "normal")
        k[:j00], v[:j00] = np.nan, np.nan
        want = []
        for qi in range(Q):
            p = p0 + qi
            j0 = max(0, p - window + 1) if window else 0
            want.append(core.attention_ref(q[qi], k, v, j0, p, scale, softcap) + (j0,))
        for base in sorted({0, j00, j00 // 16 * 16, max(0, j00 - 3)}):
            for isa in each_isa(core):
                o, probs = core.attention_prefill(q, k, v, window, p0, base, scale, softcap)
                for qi, (o_ref, p_ref, j0) in enumerate(want):
                    cfg = dict(isa=isa, hd=hd, Q=Q, R=R, p0=p0, window=window, base=base, qi=qi)
                    assert_bits(probs[qi, :, : p0 + qi - j0 + 1], p_ref, "prefill probs", **cfg)
                    assert_bits(o[qi], o_ref, "prefill o", **cfg)


# ---- conv1d ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k_taps", [1, 2, 3, 4, 7, 16, 17, 24])
def test_conv1d(core, k_taps):
    """conv1d_token<V>: taps up to 16 (pointers hoisted) and beyond, channel counts and offsets
    with vector tails, with and without bias."""
    rng = np.random.default_rng(k_taps)
    for C, with_bias, kind in itertools.product(
        [1, 3, 7, 8, 9, 16, 17, 31, 64, 100, 300], [False, True], ["normal", "special"]
    ):
        w, u = randn(rng, k_taps, C), randn(rng, k_taps, C)
        bias = randn(rng, C) if with_bias else None
        if kind == "special":
            specials(rng, w)
            specials(rng, u)
            if bias is not None:
                specials(rng, bias)
        for c0, nc in {(0, C), (1, C - 1), (C // 3, C - C // 3 - 1)}:
            if nc < 0:
                continue
            want = core.conv1d_ref(w, u, bias, c0, nc)
            for isa in each_isa(core):
                got = core.conv1d(w, u, bias, c0, nc)
                cfg = dict(isa=isa, K=k_taps, C=C, c0=c0, nc=nc, bias=with_bias, kind=kind)
                assert_bits(got, want, "conv1d", **cfg)


# ---- SSM scan --------------------------------------------------------------------------------


def ssm_inputs(rng, hd, ns, T):
    h = randn(rng, hd, ns)
    dt = rng.uniform(0.001, 0.5, T).astype(F32)
    a = F32(-np.exp(rng.uniform(0.0, 2.0)))
    d = F32(rng.uniform(0.5, 1.5))
    return h, dt, a, d, randn(rng, T, hd), randn(rng, T, ns), randn(rng, T, ns)


@pytest.mark.parametrize("ns", [1, 3, 8, 12, 15, 16, 17, 24, 32, 48, 64, 128, 130])
def test_ssm_scan_step(core, ns):
    """ssm_scan_step<V>: d_state with and without tails (the L16 dot's padding), head_dim
    around the four-row blocks."""
    rng = np.random.default_rng(ns)
    for hd, kind in itertools.product([1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64], ["normal", "special"]):
        h, dt, a, d, x, b, c = ssm_inputs(rng, hd, ns, 1)
        if kind == "special":
            for arr in (h, x, b, c):
                specials(rng, arr)
        h_ref, y_ref = core.ssm_scan_step_ref(h, dt[0], a, d, x[0], b[0], c[0])
        for isa in each_isa(core):
            h_new, y = core.ssm_scan_step(h, dt[0], a, d, x[0], b[0], c[0])
            cfg = dict(isa=isa, hd=hd, ns=ns, kind=kind)
            assert_bits(h_new, h_ref, "ssm_scan_step h", **cfg)
            assert_bits(y, y_ref, "ssm_scan_step y", **cfg)


@pytest.mark.parametrize("ns", [16, 32, 48, 64, 80, 96, 112, 128, 12, 17, 144])
def test_ssm_scan_tokens(core, ns):
    """ssm_scan_tokens<V> over T tokens == T steps of the twin: d_state 16..128 (multiples of
    16: the register path with 1..8 lane groups) and others (the per-step fallback), head_dim
    multiples of 16 (whole row groups) or not (rows in blocks of R and singles), T = 1..32."""
    rng = np.random.default_rng(1000 + ns)
    for hd, T in itertools.product([1, 3, 4, 5, 7, 8, 16, 17, 32, 64], [1, 2, 5, 16, 17, 32]):
        h, dt, a, d, x, b, c = ssm_inputs(rng, hd, ns, T)
        if T == 5:
            for arr in (h, x, b, c):
                specials(rng, arr)
        h_ref, ys = h, []
        for t in range(T):
            h_ref, y_t = core.ssm_scan_step_ref(h_ref, dt[t], a, d, x[t], b[t], c[t])
            ys.append(y_t)
        y_ref = np.stack(ys)
        for isa in each_isa(core):
            h_new, y = core.ssm_scan_tokens(h, dt, a, d, x, b, c)
            cfg = dict(isa=isa, hd=hd, ns=ns, T=T)
            assert_bits(y, y_ref, "ssm_scan_tokens y", **cfg)
            assert_bits(h_new, h_ref, "ssm_scan_tokens h", **cfg)


# ---- RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_dim", [2, 4, 6, 10, 16, 32, 64, 128])
def test_rope(core, rope_dim):
    """rope_cos_sin + rope_apply at positions up to 2^24 - 1, with the library's inv_freq
    tables (default, linear, llama3) and random ones; partial rotary (rope_dim < head_dim)."""
    rng = np.random.default_rng(rope_dim)
    tables = [
        core.rope_inv_freq(rope_dim, 10000.0, 0, 1.0, 1.0, 4.0, 8192.0),
        core.rope_inv_freq(rope_dim, 500000.0, 2, 8.0, 1.0, 4.0, 8192.0),
        core.rope_inv_freq(rope_dim, 1000.0, 1, 4.0, 1.0, 4.0, 8192.0),
        rng.uniform(0.0, 2.0, rope_dim // 2).astype(F32),
    ]
    positions = [0, 1, 2, 7, 100, 4095, 8191, 65535, 10**6, 2**24 - 1]
    for (ti, inv_freq), hd, pos in itertools.product(
        enumerate(tables), [rope_dim, rope_dim + 3], positions
    ):
        v = randn(rng, 5, hd)
        specials(rng, v)
        want = core.rope_ref(v, rope_dim, pos, inv_freq)
        for isa in each_isa(core):
            got = core.rope(v, rope_dim, pos, inv_freq)
            assert_bits(got, want, "rope", isa=isa, rope_dim=rope_dim, hd=hd, pos=pos, table=ti)


# ---- MLP combine -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MLP_KINDS))
def test_mlp_combine(core, kind):
    """mlp_combine<V> for every MlpKind (SwiGLU through the ISA's vectorised exp), widths with
    vector tails, and arguments where the activations saturate, overflow or underflow."""
    rng = np.random.default_rng(MLP_KINDS[kind])
    edge = np.array(
        [0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-30, 20.0, -20.0, 88.7, -88.7, -89.0, 100.0, -104.0]
        + [-110.0, 1e30, -1e30, 3e38, -3e38],
        F32,
    )
    for it in [1, 3, 7, 8, 9, 16, 17, 100, 1000]:
        width = 2 * it if kind in GATED else it
        gu = randn(rng, 3, width, scale=3.0)
        gu[1] = edge[rng.integers(0, edge.size, width)]
        gu[2, : min(width, edge.size)] = edge[: min(width, edge.size)]
        want = core.mlp_combine_ref(MLP_KINDS[kind], gu)
        for isa in each_isa(core):
            got = core.mlp_combine(MLP_KINDS[kind], gu)
            assert_bits(got, want, "mlp_combine", isa=isa, kind=kind, it=it)
