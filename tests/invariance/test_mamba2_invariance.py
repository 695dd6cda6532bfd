"""Bitwise invariance of Mamba2BlockInference (SPEC.md 3.1, 7.3, 8, 9; STYLE 5.7, 5.11).

Exact claims, compared as ``view(np.uint32)``: one ``forward`` == token-by-token ``step`` ==
random chunk splits with a carried state (outputs and state buffers); a ragged row == that row
alone, with and without a state; padding is exactly +0.0 and never read (NaN there changes
nothing); writing ``h``/``conv_window`` by hand == continuing the sequence; 1 thread == 2
threads (in process and via ``EXACTBLOCKS_NUM_THREADS`` in a subprocess); every SIMD path the
machine has == the scalar path. Shapes are also drawn with hypothesis. Finally the block is
compared with a float64 NumPy recurrent reference, within a first-order forward error bound
computed alongside it (not a magic tolerance). A bitwise failure here is a bug, never a
tolerance to widen.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_bitwise_equal, force_num_threads
from helpers import make_mamba2_weights as make_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactblocks as eb
from exactblocks import _ext

U = 2.0**-24  # unit roundoff of binary32


CONFIGS = {
    "default": (dict(), dict(n_groups=2)),
    "biases_k2": (dict(k=2, proj_bias=True), dict(n_groups=2)),
    "no_conv_bias_k1": (dict(k=1, conv_bias=False, ng=1), dict()),
    "dt_limit_groups3": (dict(ng=3, ns=3, nh=6), dict(n_groups=3, dt_limit=(0.01, 0.05))),
    "wide_state_k5": (dict(ns=33, ng=1, k=5, di=36, nh=4), dict(norm_eps=1e-3)),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def blk(request):
    wkw, okw = CONFIGS[request.param]
    return eb.Mamba2BlockInference(make_weights(11, **wkw), **okw)


def rand_x(seed, b, n, d, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal((b, n, d))).astype(np.float32)


def u32(a):
    return np.ascontiguousarray(a).view(np.uint32)


def snap(s):
    return (s.conv_window.tobytes(), s.h.tobytes(), s.row_tokens.tobytes())


def chunks_run(block, x, cuts):
    """Run x through ``block`` in chunks [cuts[i], cuts[i+1]) with one carried state."""
    s = block.allocate_state(x.shape[0])
    ys = [block.forward(x[:, a:b], s) for a, b in zip(cuts[:-1], cuts[1:])]
    return np.concatenate(ys, axis=1), s


# ------------------------------------------------------------------------------------------
# step == forward == chunks
# ------------------------------------------------------------------------------------------


def test_forward_step_chunks_bitwise(blk):
    x = rand_x(1, 3, 13, blk.d_model)
    s_full = blk.allocate_state(3)
    y = blk.forward(x, s_full)
    assert_bitwise_equal(blk.forward(x), y, "state=None vs fresh state")
    s_step = blk.allocate_state(3)
    y_step = np.concatenate([blk.step(x[:, t], s_step) for t in range(13)], axis=1)
    assert_bitwise_equal(y_step, y, "step loop vs forward")
    assert snap(s_step) == snap(s_full)
    rng = np.random.default_rng(2)
    for _ in range(4):
        inner = sorted(rng.choice(np.arange(1, 13), size=rng.integers(1, 6), replace=False))
        y_c, s_c = chunks_run(blk, x, [0, *inner, 13])
        assert_bitwise_equal(y_c, y, f"chunks {inner}")
        assert snap(s_c) == snap(s_full)


def test_ragged_chunked_streams_equal_rows_alone(blk):
    """Each call gives each row a random number of its remaining tokens (0 allowed)."""
    b, n, d = 4, 12, blk.d_model
    x = rand_x(3, b, n, d)
    alone = [blk.forward(x[i : i + 1])[0] for i in range(b)]
    s = blk.allocate_state(b)
    done = np.zeros(b, np.int64)
    outs = [[] for _ in range(b)]
    rng = np.random.default_rng(4)
    while (done < n).any():
        lc = int(rng.integers(1, 5))
        lens = np.minimum(rng.integers(0, lc + 1, size=b), n - done)
        xc = np.full((b, lc, d), np.nan, np.float32)  # padding is NaN: never read
        for i in range(b):
            xc[i, : lens[i]] = x[i, done[i] : done[i] + lens[i]]
        idle = {i: (s.conv_window[i].tobytes(), s.h[i].tobytes()) for i in range(b) if lens[i] == 0}
        yc = blk.forward(xc, s, lengths=lens)
        for i in range(b):
            outs[i].append(yc[i, : lens[i]])
            assert (u32(yc[i, lens[i] :]) == 0).all(), "padding output must be +0.0"
            if i in idle:
                assert (s.conv_window[i].tobytes(), s.h[i].tobytes()) == idle[i]
        done += lens
        assert s.row_tokens.tolist() == done.tolist()
    for i in range(b):
        assert_bitwise_equal(np.concatenate(outs[i]), alone[i], f"row {i} streamed vs alone")


# ------------------------------------------------------------------------------------------
# ragged rows, padding
# ------------------------------------------------------------------------------------------


def test_ragged_row_equals_row_alone_without_state(blk):
    x = rand_x(5, 4, 9, blk.d_model)
    lens = [9, 3, 0, 7]
    y = blk.forward(x, lengths=lens)
    xn = x.copy()
    for i, n in enumerate(lens):
        xn[i, n:] = np.nan
        assert (u32(y[i, n:]) == 0).all()
        if n:
            assert_bitwise_equal(y[i, :n], blk.forward(x[i : i + 1, :n])[0], f"row {i}")
    assert_bitwise_equal(blk.forward(xn, lengths=lens), y, "NaN padding")
    assert_bitwise_equal(blk.forward(x, lengths=[9] * 4), blk.forward(x), "full lengths")
    # Other rows and a different batch size do not change a row.
    big = np.concatenate([rand_x(6, 2, 9, blk.d_model), x[1:2]], axis=0)
    assert_bitwise_equal(blk.forward(big, lengths=[9, 5, 3])[2, :3], y[1, :3], "batch 3")


def test_ragged_row_equals_row_alone_with_state(blk):
    d = blk.d_model
    prefix = rand_x(7, 3, 6, d)
    s = blk.allocate_state(3)
    blk.forward(prefix, s, lengths=[6, 2, 4])  # rows at different positions
    x = rand_x(8, 3, 5, d)
    lens = [5, 0, 3]
    singles = []
    for i in range(3):  # each row alone, from a 1-row copy
        si = blk.allocate_state(1)
        si.conv_window[0] = s.conv_window[i]
        si.h[0] = s.h[i]
        singles.append((si, blk.forward(x[i : i + 1, : lens[i]], si) if lens[i] else None))
    row1 = (s.conv_window[1].tobytes(), s.h[1].tobytes())
    y = blk.forward(x, s, lengths=lens)
    assert s.row_tokens.tolist() == [11, 2, 7]
    assert (s.conv_window[1].tobytes(), s.h[1].tobytes()) == row1, "idle row touched"
    assert (u32(y[1]) == 0).all()
    for i in (0, 2):
        si, yi = singles[i]
        assert_bitwise_equal(y[i, : lens[i]], yi[0], f"row {i}")
        assert_bitwise_equal(s.h[i], si.h[0], f"h row {i}")
        assert_bitwise_equal(s.conv_window[i], si.conv_window[0], f"conv_window row {i}")


def test_written_state_equals_continuing_sequence(blk):
    """SPEC 8: h and conv_window written before a call == the sequence that produced them."""
    d = blk.d_model
    x = rand_x(9, 2, 10, d)
    y_full = blk.forward(x)
    for cut in (1, 4, 9):
        s1 = blk.allocate_state(2)
        blk.forward(x[:, :cut], s1)
        s2 = blk.allocate_state(2)
        s2.conv_window[...] = s1.conv_window
        s2.h[...] = s1.h
        assert_bitwise_equal(blk.forward(x[:, cut:], s2), y_full[:, cut:], f"cut {cut}")


# ------------------------------------------------------------------------------------------
# threads and ISAs
# ------------------------------------------------------------------------------------------


def _digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def test_threads_in_process(blk):
    x = rand_x(10, 5, 7, blk.d_model)
    old = eb.get_num_threads()
    try:
        res = []
        for n in (1, 2, 3):
            force_num_threads(n)
            s = blk.allocate_state(5)
            y = blk.forward(x, s, lengths=[7, 1, 0, 5, 7])
            res.append((y, s.h.copy(), s.conv_window.copy()))
    finally:
        eb.set_num_threads(old)
    for y, h, cw in res[1:]:
        assert_bitwise_equal(y, res[0][0], "threads: y")
        assert_bitwise_equal(h, res[0][1], "threads: h")
        assert_bitwise_equal(cw, res[0][2], "threads: conv_window")


_SUBPROCESS = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    sys.path.insert(0, {inv!r})
    import exactblocks as eb
    from helpers import make_mamba2_weights as make_weights
    blk = eb.Mamba2BlockInference(make_weights(11), n_groups=2)
    x = (np.random.default_rng(12).standard_normal((4, 9, 24))).astype(np.float32)
    s = blk.allocate_state(4)
    y = blk.forward(x, s, lengths=[9, 2, 6, 0])
    print(eb.get_num_threads(), hashlib.sha256(y.tobytes() + s.h.tobytes()).hexdigest())
""")


def test_threads_env_subprocess():
    here = os.path.dirname(os.path.abspath(__file__))
    code = _SUBPROCESS.format(tests=os.path.dirname(here), inv=here)
    outs = {}
    for n in ("1", "2"):
        env = dict(os.environ, EXACTBLOCKS_NUM_THREADS=n, PYTHONPATH=os.pathsep.join(sys.path))
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        got_n, dig = r.stdout.split()
        assert got_n == n
        outs[n] = dig
    blk = eb.Mamba2BlockInference(make_weights(11), n_groups=2)
    x = (np.random.default_rng(12).standard_normal((4, 9, 24))).astype(np.float32)
    s = blk.allocate_state(4)
    y = blk.forward(x, s, lengths=[9, 2, 6, 0])
    here_dig = hashlib.sha256(y.tobytes() + s.h.tobytes()).hexdigest()
    assert outs["1"] == outs["2"] == here_dig


def test_every_isa_equals_scalar(blk):
    core = _ext.core()
    isas = list(core.available_isas())
    assert "scalar" in isas
    x = rand_x(13, 3, 8, blk.d_model)
    old = core.get_isa()
    res = {}
    try:
        for isa in isas:
            core.set_isa(isa)
            s = blk.allocate_state(3)
            y = blk.forward(x[:, :5], s, lengths=[5, 3, 1])
            y2 = blk.step(x[:, 5], s)
            res[isa] = (y, y2, s.h.copy(), s.conv_window.copy())
    finally:
        core.set_isa(old)
    for isa, r in res.items():
        for a, b, what in zip(r, res["scalar"], ("forward", "step", "h", "conv_window")):
            assert_bitwise_equal(a, b, f"{isa} vs scalar: {what}")


# ------------------------------------------------------------------------------------------
# float64 reference with a first-order forward error bound
# ------------------------------------------------------------------------------------------


def _gamma(n):
    return n * U / (1 - n * U)


def _silu(v):
    return v / (1 + np.exp(-v))


def reference_row(w, cfg, x, cw0, h0):
    """SPEC 7.3 in float64 for one row, plus an absolute error bound of the float32 result.

    Parameters: w short-name weights, cfg dict of sizes and options, x (n, d), cw0
    (conv_dim, K) and h0 (n_heads, head_dim, d_state) the starting state (taken as exact).
    Returns (out (n, d), bound (n, d), (conv_window, its bound), (h, its bound)). The bound
    propagates, to first order, the rounding of every binary32 operation (u = 2^-24 per op,
    gamma_n for each n-term fused dot or sum, 1 ulp = 2u for the library's exp and log1p)
    through the stages.
    """
    f = {k: np.asarray(v, np.float64) for k, v in w.items()}
    d, di, nh, hd = cfg["d_model"], cfg["d_inner"], cfg["n_heads"], cfg["head_dim"]
    ns, ng, cd, K = cfg["d_state"], cfg["n_groups"], cfg["conv_dim"], cfg["conv_kernel"]
    eps = float(np.float32(cfg["norm_eps"]))
    lo, hi = (float(np.float32(v)) for v in cfg["dt_limit"])
    win = np.array(cw0, np.float64)
    ewin = np.zeros_like(win)
    h = np.array(h0, np.float64)
    eh = np.zeros_like(h)
    conv_w = f["conv1d.weight"].reshape(cd, K)
    conv_b = f.get("conv1d.bias", np.zeros(cd))
    b_in = f.get("in_proj.bias", np.zeros(di + cd + nh))
    b_out = f.get("out_proj.bias", np.zeros(d))
    A = -np.exp(f["A_log"])
    eA = 2 * U * np.abs(A)
    hpg = nh // ng
    gs = di // ng
    outs, bounds = [], []
    for xt in np.asarray(x, np.float64):
        # 1. block RMSNorm
        ss = np.sum(xt * xt)
        r = 1 / np.sqrt(ss / d + eps)
        hn = f["block_norm.weight"] * (xt * r)
        ehn = np.abs(hn) * (0.5 * (_gamma(d) + 2 * U) + 4 * U)
        # 2. in_proj
        W = f["in_proj.weight"]
        zx = W @ hn + b_in
        ezx = _gamma(d + 1) * (np.abs(W) @ np.abs(hn) + np.abs(b_in)) + np.abs(W) @ ehn
        z, u, dt_raw = zx[:di], zx[di : di + cd], zx[di + cd :]
        ez, eu, edt_raw = ezx[:di], ezx[di : di + cd], ezx[di + cd :]
        # 3. conv over [window columns 1..K-1, u], then SiLU
        win = np.concatenate([win[:, 1:], u[:, None]], axis=1)
        ewin = np.concatenate([ewin[:, 1:], eu[:, None]], axis=1)
        c = np.sum(conv_w * win, axis=1) + conv_b
        ec = _gamma(K + 1) * (np.sum(np.abs(conv_w * win), axis=1) + np.abs(conv_b)) + np.sum(
            np.abs(conv_w) * ewin, axis=1
        )
        a = _silu(c)
        ea = 1.1 * ec + 4 * U * np.abs(a)
        xs, Bt, Ct = (
            a[:di].reshape(nh, hd),
            a[di : di + ng * ns].reshape(ng, ns),
            a[di + ng * ns :].reshape(ng, ns),
        )
        exs, eB, eC = (
            ea[:di].reshape(nh, hd),
            ea[di : di + ng * ns].reshape(ng, ns),
            ea[di + ng * ns :].reshape(ng, ns),
        )
        # 5. dt
        s_ = dt_raw + f["dt_bias"]
        es = edt_raw + U * np.abs(s_)
        sp = np.where(s_ > 20, s_, np.log1p(np.exp(np.minimum(s_, 20))))
        sig = 1 / (1 + np.exp(-s_))
        esp = sig * es + 4 * U * np.abs(sp)
        dt = np.clip(sp, lo, hi)
        edt = esp
        # 6. SSM recurrence
        y = np.empty((nh, hd))
        ey = np.empty((nh, hd))
        for i in range(nh):
            g = i // hpg
            p = dt[i] * A[i]
            ep = np.abs(A[i]) * edt[i] + abs(dt[i]) * eA[i] + U * abs(p)
            dA = np.exp(p)
            edA = dA * (ep + 2 * U)
            q = (dt[i] * Bt[g])[None, :] * xs[i][:, None]
            eq = (
                np.abs(Bt[g] * xs[i][:, None]) * edt[i]
                + np.abs(dt[i] * xs[i][:, None]) * eB[g]
                + np.abs(dt[i] * Bt[g])[None, :] * exs[i][:, None]
                + 2 * U * np.abs(q)
            )
            hnew = h[i] * dA + q
            eh[i] = dA * eh[i] + np.abs(h[i]) * edA + eq + U * np.abs(hnew)
            h[i] = hnew
            y[i] = h[i] @ Ct[g] + xs[i] * f["D"][i]
            ey[i] = (
                _gamma(ns) * (np.abs(h[i]) @ np.abs(Ct[g]))
                + eh[i] @ np.abs(Ct[g])
                + np.abs(h[i]) @ eC[g]
                + abs(f["D"][i]) * exs[i]
                + 2 * U * (np.abs(xs[i] * f["D"][i]) + np.abs(y[i]))
            )
        y, ey = y.reshape(di), ey.reshape(di)
        # 7. gate and gated RMSNorm per group
        sz = _silu(z)
        esz = 1.1 * ez + 4 * U * np.abs(sz)
        v = y * sz
        ev = np.abs(sz) * ey + np.abs(y) * esz + U * np.abs(v)
        o = np.empty(di)
        eo = np.empty(di)
        for g in range(ng):
            sl = slice(g * gs, (g + 1) * gs)
            ssg = np.sum(v[sl] ** 2)
            rg = 1 / np.sqrt(ssg / gs + eps)
            er = (
                0.5 * (_gamma(gs) * ssg + 2 * np.sum(np.abs(v[sl]) * ev[sl])) / (ssg + gs * eps)
                + 4 * U
            )
            o[sl] = v[sl] * rg * f["norm.weight"][sl]
            eo[sl] = np.abs(f["norm.weight"][sl]) * rg * (
                ev[sl] + np.abs(v[sl]) * er
            ) + 2 * U * np.abs(o[sl])
        # 8. out_proj and residual
        Wo = f["out_proj.weight"]
        out = xt + (Wo @ o + b_out)
        eout = (
            _gamma(di + 1) * (np.abs(Wo) @ np.abs(o) + np.abs(b_out))
            + np.abs(Wo) @ eo
            + U * np.abs(out)
            + U * np.abs(Wo @ o + b_out)
        )
        outs.append(out)
        bounds.append(eout)
    return np.array(outs), np.array(bounds), (win, ewin), (h, eh)


def _cfg(blk):
    return {
        k: getattr(blk, k)
        for k in (
            "d_model",
            "d_inner",
            "n_heads",
            "head_dim",
            "d_state",
            "n_groups",
            "conv_dim",
            "conv_kernel",
            "norm_eps",
            "dt_limit",
        )
    }


def assert_within_bound(y32, ref, bound, what):
    err = np.abs(y32.astype(np.float64) - ref)
    # 2x covers second-order terms of the first-order bound; 1e-30 covers subnormal outputs.
    lim = 2 * bound + 1e-30
    bad = np.argwhere(err > lim)
    assert bad.size == 0, (
        f"{what}: {len(bad)} elements beyond the bound; first at "
        f"{tuple(bad[0])}: err {err[tuple(bad[0])]:.3g} > "
        f"{lim[tuple(bad[0])]:.3g}"
    )
    # The bound must be informative, not vacuous: a wrong op (group, tap, clamp, D, eps) moves
    # outputs by O(1e-2) of their scale or more; worst-case gamma_n terms put the bound near
    # 1e-4..5e-4 of the scale at these sizes (measured errors are ~1e-3 of the bound).
    scale = max(float(np.abs(ref).max()), 1.0)
    assert bound.max() < 2e-3 * scale, f"{what}: bound too loose ({bound.max() / scale:.3g})"


def test_matches_float64_reference_with_initial_state(blk):
    """An arbitrary initial state (not produced by a sequence) vs the float64 recurrence."""
    cfg = _cfg(blk)
    rng = np.random.default_rng(14)
    x = rand_x(15, 2, 9, blk.d_model)
    s = blk.allocate_state(2)
    s.h[...] = (0.5 * rng.standard_normal(s.h.shape)).astype(np.float32)
    s.conv_window[...] = rng.standard_normal(s.conv_window.shape).astype(np.float32)
    cw0, h0 = s.conv_window.copy(), s.h.copy()
    y = blk.forward(x, s, lengths=[9, 6])
    w = blk._impl.weights
    for b, n in ((0, 9), (1, 6)):
        ref, bound, cw_ref, h_ref = reference_row(w, cfg, x[b, :n], cw0[b], h0[b])
        assert_within_bound(y[b, :n], ref, bound, f"row {b}")
        # The state the call leaves is bounded by the same analysis.
        assert (np.abs(s.conv_window[b] - cw_ref[0]) <= 2 * cw_ref[1] + 1e-30).all()
        assert (np.abs(s.h[b] - h_ref[0]) <= 2 * h_ref[1] + 1e-30).all()


# ------------------------------------------------------------------------------------------
# hypothesis: random small shapes
# ------------------------------------------------------------------------------------------


@st.composite
def mamba_shapes(draw):
    ng = draw(st.integers(1, 4))
    nh = ng * draw(st.integers(1, 3))
    hd = draw(st.integers(1, 20))
    return dict(
        d=draw(st.integers(8, 48)),
        di=nh * hd,
        nh=nh,
        ns=draw(st.integers(1, 40)),
        ng=ng,
        k=draw(st.integers(1, 5)),
        conv_bias=draw(st.booleans()),
        proj_bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.005, 0.05), (0.0, 0.02)])),
        b=draw(st.integers(1, 3)),
        n=draw(st.integers(1, 7)),
    )


@settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(mamba_shapes())
def test_hypothesis_shapes(p):
    w = make_weights(
        p["seed"],
        d=p["d"],
        di=p["di"],
        nh=p["nh"],
        ns=p["ns"],
        ng=p["ng"],
        k=p["k"],
        conv_bias=p["conv_bias"],
        proj_bias=p["proj_bias"],
    )
    blk = eb.Mamba2BlockInference(w, n_groups=p["ng"], dt_limit=p["dt_limit"])
    assert (blk.d_state, blk.head_dim, blk.conv_kernel) == (p["ns"], p["di"] // p["nh"], p["k"])
    b, n = p["b"], p["n"]
    x = rand_x(p["seed"] + 1, b, n, p["d"])
    s = blk.allocate_state(b)
    y = blk.forward(x, s)
    s2 = blk.allocate_state(b)
    y_step = np.concatenate([blk.step(x[:, t], s2) for t in range(n)], axis=1)
    assert_bitwise_equal(y_step, y, "step vs forward")
    assert snap(s2) == snap(s)
    if n > 1:
        cut = 1 + p["seed"] % (n - 1)
        y_c, s3 = chunks_run(blk, x, [0, cut, n])
        assert_bitwise_equal(y_c, y, "chunks")
        assert snap(s3) == snap(s)
    lens = [(p["seed"] + i) % (n + 1) for i in range(b)]
    yr = blk.forward(x, lengths=lens)
    for i, li in enumerate(lens):
        assert (u32(yr[i, li:]) == 0).all()
        if li:
            assert_bitwise_equal(yr[i, :li], y[i, :li], f"ragged row {i}")
    ref, bound, _, _ = reference_row(
        blk._impl.weights,
        _cfg(blk),
        x[0],
        np.zeros((blk.conv_dim, blk.conv_kernel)),
        np.zeros((blk.n_heads, blk.head_dim, blk.d_state)),
    )
    assert_within_bound(y[0], ref, bound, "float64 reference")
