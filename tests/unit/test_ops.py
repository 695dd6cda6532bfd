"""Each op against a float64 NumPy reference with a tolerance from its error bound, and
against its scalar twin bit for bit on every ISA (STYLE 5.10).

Error model (u = 2^-24, float32 unit roundoff): a dot product of K terms accumulated with
fused multiply-adds satisfies |s - s_exact| <= gamma_K * sum|a_i b_i|, gamma_K = K u / (1 - K u);
one more rounding for the bias. Norms add a few roundings per element on top of their sums.
"""

from __future__ import annotations

import numpy as np
import pytest

from exactblocks import _ext

U = 2.0**-24


@pytest.fixture(scope="module")
def core():
    return _ext.core()


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def each_isa(core):
    saved = core.get_isa()
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            yield isa
    finally:
        core.set_isa(saved)


@pytest.mark.parametrize(
    "m,k,n",
    [(1, 1, 1), (1, 17, 3), (3, 33, 31), (7, 64, 32), (13, 100, 65), (16, 257, 97), (40, 31, 200)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64_and_scalar_twin(core, m, k, n, with_bias):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    exact = a.astype(np.float64) @ w.T.astype(np.float64)
    mag = np.abs(a.astype(np.float64)) @ np.abs(w.T.astype(np.float64))
    if with_bias:
        exact = exact + bias
        mag = mag + np.abs(bias)
    bound = gamma(k + 1) * mag + 1e-45
    ref = core.gemm_ref(a, w, bias)
    err = np.abs(ref - exact)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"m={m} k={k} n={n}: worst {worst}: got {ref[worst]}, "
        f"exact {exact[worst]}, bound {bound[worst]}"
    )
    for isa in each_isa(core):
        got, _ = core.gemm(a, w, bias)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{isa} != gemm_ref"


def test_gemm_row_independent_of_tile_mates(core):
    """Row r of a GEMM == the same row computed alone (decode GEMV == prefill GEMM)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((23, 77)).astype(np.float32)
    w = rng.standard_normal((70, 77)).astype(np.float32)
    for isa in each_isa(core):
        full, _ = core.gemm(a, w)
        for r in (0, 5, 22):
            one, _ = core.gemm(np.ascontiguousarray(a[r : r + 1]), w)
            assert np.array_equal(full[r].view(np.uint32), one[0].view(np.uint32)), isa


@pytest.mark.parametrize("n", [1, 3, 15, 16, 17, 100, 4097])
def test_l16_reductions(core, n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    # the canonical order, emulated: 16 lanes, then the fixed tree (exact emulation needs fma
    # for the dot, so the dot is checked against its error bound; the plain sum is emulated).
    lanes = np.zeros(16, np.float32)
    for i in range(n):
        lanes[i % 16] = np.float32(lanes[i % 16] + a[i])
    for w in (8, 4, 2, 1):
        lanes[:w] = lanes[:w] + lanes[w : 2 * w]
    for isa in each_isa(core):
        s = core.sum_l16(a)
        assert np.float32(s).view(np.uint32) == lanes[0].view(np.uint32), isa
        d = core.dot_l16(a, b)
        exact = float(a.astype(np.float64) @ b.astype(np.float64))
        assert abs(d - exact) <= gamma(n) * float(np.abs(a) @ np.abs(b)) + 1e-45, isa


@pytest.mark.parametrize("seed", range(6))
def test_reduce16_x16_is_sixteen_l16_trees(core, seed):
    """The 16-at-once lane reduction (attention's key scores, the SSM scan's outputs) gives each
    row the bits of the L16 tree s_j += s_(j+w), w = 8, 4, 2, 1 (emulated in NumPy float32), on
    every ISA: rounding, signed zeros, infinities and NaN included."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-40, 38, (16, 16))
    acc = (rng.standard_normal((16, 16)) * scale).astype(np.float32)
    if seed >= 2:  # cancellations, -0.0, subnormals, overflow, inf - inf
        acc[0] = -0.0  # (sum_l16 would start its lanes at +0.0; the tree alone keeps -0.0)
        acc[1, ::2], acc[1, 1::2] = 1e30, -1e30
        acc[2] = np.float32(1e-45) * rng.integers(-3, 4, 16)
        acc[3, :8] = 3e38
        acc[4, 3], acc[4, 11] = np.inf, -np.inf
        acc[5, 7] = np.nan
        acc[6, rng.integers(0, 16)] = -np.inf
    for isa in each_isa(core):
        got = core.reduce16_x16(acc.reshape(-1))
        want = np.empty(16, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow and inf - inf on purpose
            for i in range(16):
                lanes = acc[i].copy()
                for w in (8, 4, 2, 1):
                    lanes[:w] = lanes[:w] + lanes[w : 2 * w]
                want[i] = lanes[0]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), isa


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 576])
def test_norms_match_float64(core, kind, n):
    rng = np.random.default_rng(kind * 100 + n)
    x = (3 * rng.standard_normal((5, n))).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32) if kind == 1 else None
    eps = 1e-5
    x64 = x.astype(np.float64)
    if kind == 1:
        c = x64 - x64.mean(-1, keepdims=True)
        ref = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w + b
    else:
        w_eff = (1.0 + w.astype(np.float64)) if kind == 2 else w.astype(np.float64)
        ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w_eff
    got = core.norm(kind, x, w, b, eps)
    # sums: gamma_n relative to the sum of magnitudes, i.e. relative on the scale factor;
    # plus ~6 roundings per element (mean, eps add, sqrt, divide, two products, bias).
    scale = np.abs(ref) + (np.abs(b) if b is not None else 0)
    bound = (gamma(n) * 4 + 10 * U) * scale + 1e-30
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"kind={kind} n={n} max err {err.max()} bound {bound.max()}"
    for _isa in each_isa(core):
        assert np.array_equal(core.norm(kind, x, w, b, eps).view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("kind,factor", [(0, 1.0), (1, 4.0), (2, 8.0)])
def test_rope_inv_freq_table(core, kind, factor):
    """inv_freq in binary64 then rounded once: within 1 float32 ulp of the exact value
    (2 for llama3's smoothed band, whose binary64 arithmetic adds a few ulp of double)."""
    import math

    rope_dim, theta, O = 64, 500000.0, 8192.0
    got = core.rope_inv_freq(rope_dim, theta, kind, factor, 1.0, 4.0, O)
    for i, g in enumerate(got):
        inv = theta ** (-2.0 * i / rope_dim)
        if kind == 1:
            inv /= factor
        elif kind == 2:
            lam = 2 * math.pi / inv
            if lam > O / 1.0:
                inv /= factor
            elif lam >= O / 4.0:
                s = (O / lam - 1.0) / 3.0
                inv = (1 - s) * inv / factor + s * inv
        ulp = np.spacing(np.float32(inv))
        assert abs(float(g) - inv) <= ulp, (i, g, inv)


def test_vectorised_exp_equals_scalar_exp_on_every_isa(core):
    """V::exp_array (binary64 lanes) == math::exp_f32 bit for bit, incl. tails and specials."""
    rng = np.random.default_rng(11)
    x = np.concatenate(
        [
            rng.uniform(-120, 95, 400_000),
            rng.uniform(-1, 1, 200_000),
            rng.standard_normal(200_000) * 20,
            np.linspace(-104.5, -86.0, 100_001),  # subnormal and tiny results
            np.linspace(87.5, 89.5, 10_001),  # around overflow
            [
                0.0,
                -0.0,
                88.72283935546875,
                88.7228317,
                -103.972084,
                -110.0,
                -110.00001,
                np.inf,
                -np.inf,
                np.nan,
                3.4e38,
                -3.4e38,
                1e-45,
                -1e-45,
            ],
        ]
    ).astype(np.float32)
    ref = core.elementwise("exp", x)
    for isa in each_isa(core):
        for n in (len(x), 13, 7, 1):  # odd lengths exercise the scalar tails
            got = core.elementwise("exp_vec", x[:n].copy())
            bad = np.flatnonzero(got.view(np.uint32) != ref[:n].view(np.uint32))
            assert bad.size == 0, (isa, n, x[bad[:5]], got[bad[:5]], ref[bad[:5]])
