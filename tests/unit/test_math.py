"""Accuracy and exactness of exactblocks' own elementary functions (SPEC.md 3.4, 3.5).

Each binary32 routine of ``csrc/math/`` is reached through ``_core.elementwise(name, x)`` and
compared with a float64 reference (NumPy, or :mod:`math` where NumPy has no such function).
Error is measured in binary32 ulps of the reference value (spacing 2^-149 in the subnormal
range); the contract is <= 1 ulp. The derived activations are checked bit for bit against the
SPEC.md 3.4 formula evaluated step by step in NumPy float32 on top of our own exp/log1p/erf/tanh,
and for closeness with a bound derived from that formula's roundings. The exhaustive sweep
lives in ``tests/cpp/math_check.cpp``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

core = pytest.importorskip("exactblocks._core")

F32 = np.float32
N_RANDOM = 1_000_000
FLT_MAX = float(np.finfo(np.float32).max)
# Real values at or beyond this round to +-inf in binary32 (FLT_MAX + half its ulp).
OVERFLOW_EDGE = 2.0**128 - 2.0**103

ELEMENTARY = ("exp", "log1p", "tanh", "erf", "sin", "cos")
DERIVED = ("silu", "softplus", "gelu", "gelu_tanh")


def f32(values) -> np.ndarray:
    """Return ``values`` as a 1-D float32 array (exact for values given as float32 bits)."""
    return np.ascontiguousarray(np.asarray(values, dtype=np.float32).ravel())


def from_bits(bits) -> np.ndarray:
    """Return the float32 values with the given uint32 bit patterns."""
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def run(name: str, x: np.ndarray) -> np.ndarray:
    """Call ``_core.elementwise`` and check the result's dtype and shape."""
    y = core.elementwise(name, x)
    y = np.asarray(y)
    assert y.dtype == np.float32 and y.shape == x.shape, (name, y.dtype, y.shape)
    return y


def ulp_error(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Return |y - ref| in binary32 ulps of ``ref`` (float64 array).

    ``ref`` beyond the binary32 overflow edge expects an infinity of the same sign (error 0,
    else inf); an infinite ``ref`` must be matched exactly.
    """
    y64 = y.astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    err = np.full(ref.shape, np.inf)
    big = np.abs(ref) >= OVERFLOW_EDGE
    err[big] = np.where(y64[big] == np.copysign(np.inf, ref[big]), 0.0, np.inf)
    fin = ~big
    _, e = np.frexp(ref[fin])
    ulp = np.ldexp(1.0, np.maximum(e - 1, -126) - 23)
    with np.errstate(invalid="ignore"):
        err[fin] = np.abs(y64[fin] - ref[fin]) / ulp
    err[fin & ~np.isfinite(y64)] = np.inf
    return err


def reference(name: str, x: np.ndarray) -> np.ndarray:
    """Float64 reference of an elementary function at the float32 inputs ``x``."""
    xd = x.astype(np.float64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if name == "exp":
            return np.exp(xd)
        if name == "log1p":
            return np.log1p(xd)
        if name == "tanh":
            return np.tanh(xd)
    pyfn = {"erf": math.erf, "sin": math.sin, "cos": math.cos}[name]
    return np.frompyfunc(pyfn, 1, 1)(xd).astype(np.float64)


SPECIAL_BITS = [
    0x00000000,
    0x80000000,  # +0, -0
    0x00000001,
    0x80000001,
    0x00000002,
    0x007FFFFF,
    0x807FFFFF,  # subnormals
    0x00800000,
    0x80800000,
    0x00800001,  # smallest normals
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7F000000,
    0xFF000000,  # huge
    0x33800000,
    0xB3800000,
    0x34000000,
    0x39800000,
    0x3F800000,
    0xBF800000,  # 2^-24.., +-1
]

# Interesting points per function (each is added with its float32 neighbours).
THRESHOLDS = {
    "exp": [
        88.72283172607422,
        88.72283935546875,
        -87.33654,
        -103.97207,
        -103.27893,
        -104.0,
        100.0,
        -110.0,
        0.34657359,
        -0.34657359,
        1e-8,
        -1e-8,
    ],
    "log1p": [
        -1.0,
        -0.99999994,
        -0.5,
        2.0**-29,
        -(2.0**-29),
        2.0**29,
        1e30,
        0.41421356,
        -0.29289322,
    ],
    "tanh": [9.0109133, -9.0109133, 10.0, -10.0, 2.0**-12, 0.5493061, 1e-20],
    "erf": [3.9192059, -3.9192059, 3.921875, -3.921875, 1.0, 2.0, -2.0, 1e-30],
    "sin": [
        math.pi / 2,
        math.pi,
        2.0**20,
        -(2.0**20),
        2.0**24,
        1e10,
        1e38,
        3.0,
        1e-30,
        16367173.0 * 2.0**72,
        201.06193,
    ],
    "cos": [
        math.pi / 2,
        math.pi,
        2.0**20,
        -(2.0**20),
        2.0**24,
        1e10,
        1e38,
        3.0,
        1e-30,
        16367173.0 * 2.0**72,
        201.06193,
    ],
}

# Where uniform samples are drawn (besides random bit patterns over the whole domain).
RANGES = {
    "exp": (-104.5, 89.0),
    "log1p": (-1.0, 8.0),
    "tanh": (-10.0, 10.0),
    "erf": (-4.0, 4.0),
    "sin": (-1000.0, 1000.0),
    "cos": (-1000.0, 1000.0),
}


def neighbours(values) -> np.ndarray:
    """Each value rounded to float32 plus its two float32 neighbours."""
    v = f32(values)
    return np.concatenate([v, np.nextafter(v, F32(np.inf)), np.nextafter(v, F32(-np.inf))])


def inputs_for(name: str, seed: int) -> np.ndarray:
    """~1e6 seeded float32 inputs spanning the domain of ``name`` including special values."""
    rng = np.random.default_rng(seed)
    n = N_RANDOM // 3
    bits = from_bits(rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32))
    lo, hi = RANGES.get(name, (-30.0, 30.0))
    uniform = f32(rng.uniform(lo, hi, size=n))
    # log-uniform magnitudes with random signs: every binade from 2^-149 to 2^128 is visited
    mag = f32(np.exp2(rng.uniform(-149.0, 128.0, size=n)))
    signed = np.where(rng.random(n) < 0.5, -mag, mag)
    x = np.concatenate(
        [
            bits,
            uniform,
            signed,
            from_bits(SPECIAL_BITS),
            neighbours(THRESHOLDS.get(name, [])),
        ]
    ).astype(np.float32)
    x = x[np.isfinite(x)]
    if name == "log1p":
        x = x[x >= F32(-1.0)]
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("name", ELEMENTARY)
def test_elementary_within_one_ulp(name):
    x = inputs_for(name, seed=1000 + ELEMENTARY.index(name))
    y = run(name, x)
    err = ulp_error(y, reference(name, x))
    worst = int(np.argmax(err))
    assert err[worst] <= 1.0, (
        f"{name}: max error {err[worst]:.4f} ulp at x={x[worst]!r} "
        f"(bits {x.view(np.uint32)[worst]:#010x}): got {y[worst]!r}, "
        f"float64 reference {reference(name, x[worst : worst + 1])[0]!r}"
    )


def test_exp_exactness():
    x = f32(
        [0.0, -0.0, 88.72283172607422, 88.72283935546875, 100.0, 1e30, FLT_MAX, -1000.0, -FLT_MAX]
    )
    y = run("exp", x)
    assert y[0] == F32(1.0) and y[1] == F32(1.0)
    assert np.isfinite(y[2]) and y[2] > F32(3.4e38)
    assert np.all(np.isposinf(y[3:7]))
    assert np.all(y[7:].view(np.uint32) == 0)  # exactly +0, not -0


def test_exp_underflows_through_subnormals():
    # every 7th float32 from -87 (result ~ the smallest normal) down to -104
    start = int(F32(-87.0).view(np.uint32))
    stop = int(F32(-104.0).view(np.uint32))
    x = from_bits(np.arange(start, stop + 1, 7, dtype=np.uint32))
    y = run("exp", x)
    ybits = y.view(np.uint32)
    assert np.all(np.diff(ybits.astype(np.int64)) <= 0), "exp not monotone in the underflow range"
    sub = (ybits > 0) & (ybits < 0x00800000)
    assert sub.sum() > 10_000, "exp skips the subnormal range"
    assert ybits[-1] == 0
    assert ulp_error(y, np.exp(x.astype(np.float64))).max() <= 1.0
    # the last input with a non-zero result and the first with +0
    edge = run("exp", f32([-103.97207, -103.97209]))
    assert edge.view(np.uint32)[0] == 1 and edge.view(np.uint32)[1] == 0


def test_tanh_erf_reach_one_and_are_odd():
    big = f32([9.02, 9.5, 10.0, 50.0, 1e10, FLT_MAX])
    for name in ("tanh", "erf"):
        assert np.all(run(name, big) == F32(1.0)), name
        assert np.all(run(name, -big) == F32(-1.0)), name
    assert np.all(run("erf", f32([3.92, 3.921875, 4.0])) == F32(1.0))
    # just below the thresholds the result is the float below 1
    assert run("tanh", f32([9.0]))[0] == np.nextafter(F32(1.0), F32(0.0))
    assert run("erf", f32([3.9]))[0] == np.nextafter(F32(1.0), F32(0.0))
    x = inputs_for("tanh", seed=7)[:200_000]
    for name in ("tanh", "erf", "sin"):
        pos, neg = run(name, x), run(name, np.ascontiguousarray(-x))
        assert np.array_equal(neg.view(np.uint32), pos.view(np.uint32) ^ np.uint32(0x80000000))
    assert np.array_equal(
        run("cos", x).view(np.uint32), run("cos", np.ascontiguousarray(-x)).view(np.uint32)
    )


def test_signed_zeros():
    z = f32([0.0, -0.0])
    for name in ("tanh", "erf", "sin", "log1p"):
        assert np.array_equal(run(name, z).view(np.uint32), z.view(np.uint32)), name
    assert np.all(run("cos", z) == F32(1.0))


def test_log1p_edges():
    y = run("log1p", f32([-1.0, FLT_MAX, 1e-45]))
    assert np.isneginf(y[0]) and np.isfinite(y[1]) and y[2] == F32(1e-45)


def test_sin_cos_large_arguments_deterministic_and_bounded():
    # above 2^20 the contract only asks for determinism; ours stays within 1 ulp (Payne-Hanek)
    rng = np.random.default_rng(11)
    x = f32(np.exp2(rng.uniform(20.0, 127.9, size=50_000)))
    for name in ("sin", "cos"):
        a, b = run(name, x), run(name, x.copy())
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert np.all(np.abs(a) <= F32(1.0))
        assert ulp_error(a, reference(name, x)).max() <= 1.0, name


# ---- derived activations: op order of SPEC.md 3.4, bit for bit ----

C_GELU = F32(1.0 / math.sqrt(2.0))
K_GELU_TANH = F32(math.sqrt(2.0 / math.pi))
A_GELU_TANH = F32(0.044715)


def test_derived_constants():
    assert C_GELU.view(np.uint32) == 0x3F3504F3
    assert K_GELU_TANH.view(np.uint32) == 0x3F4C422A
    assert A_GELU_TANH.view(np.uint32) == 0x3D372713


def derived_by_steps(name: str, v: np.ndarray) -> np.ndarray:
    """SPEC.md 3.4 formula as NumPy float32 steps, using our exp/log1p/erf/tanh."""
    one, half = F32(1.0), F32(0.5)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if name == "silu":
            return v / (one + run("exp", np.ascontiguousarray(-v)))
        if name == "softplus":
            return np.where(v > F32(20.0), v, run("log1p", run("exp", v)))
        if name == "gelu":
            return (v * half) * (one + run("erf", np.ascontiguousarray(v * C_GELU)))
        if name == "gelu_tanh":
            inner = K_GELU_TANH * (v + A_GELU_TANH * ((v * v) * v))
            return (half * v) * (one + run("tanh", np.ascontiguousarray(inner)))
    raise AssertionError(name)


@pytest.mark.parametrize("name", DERIVED)
def test_derived_follow_spec_op_order(name):
    v = inputs_for(name, seed=2000 + DERIVED.index(name))
    got = run(name, v)
    want = derived_by_steps(name, v).astype(np.float32)
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, (
        f"{name}: {diff.size} results differ from the SPEC.md 3.4 op order; first at "
        f"v={v[diff[0]]!r}: got {got[diff[0]]!r}, step-by-step {want[diff[0]]!r}"
    )


def derived_reference(name: str, v: np.ndarray) -> np.ndarray:
    """Float64 value of the activation (the real function, not its float32 op order)."""
    d = v.astype(np.float64)
    with np.errstate(over="ignore"):
        if name == "silu":
            return d / (1.0 + np.exp(-d))
        if name == "softplus":
            return np.where(d > 20.0, d, np.log1p(np.exp(d)))
        if name == "gelu":
            erf = np.frompyfunc(math.erf, 1, 1)(d / math.sqrt(2.0)).astype(np.float64)
            return 0.5 * d * (1.0 + erf)
        k = math.sqrt(2.0 / math.pi)
        return 0.5 * d * (1.0 + np.tanh(k * (d + 0.044715 * d**3)))


# Closeness of the float32 op order to the real function where it is well conditioned, as a
# relative error n * u, u = 2^-24 (each rounding <= u relative; conditioning factors <= 1):
# silu (v >= -80): exp u (damped by t/(1+t)), add u, divide u -> 3u.
# softplus (v >= -80): exp u (log1p's conditioning t/((1+t)log1p t) <= 1), log1p u -> 2u.
# gelu (v >= 0, so 1 + erf >= 1): v*c u and erf u, both halved by erf/(1+erf) <= 1/2; add u;
#   multiply u -> 3u.
# gelu_tanh (v >= 0): argument 6u (v*v, *v, *0.044715, +, *k, and k itself), halved; tanh u
#   halved; add u; multiply u -> 5.5u.
DERIVED_BOUNDS = {
    "silu": ((-80.0, 3e38), 3.0),
    "softplus": ((-80.0, 3e38), 2.0),
    "gelu": ((0.0, 3e38), 3.0),
    "gelu_tanh": ((0.0, 1e12), 5.5),
}


@pytest.mark.parametrize("name", DERIVED)
def test_derived_close_to_real_function(name):
    (lo, hi), n_u = DERIVED_BOUNDS[name]
    v = inputs_for(name, seed=3000 + DERIVED.index(name))
    v = np.ascontiguousarray(v[(v >= F32(lo)) & (v <= F32(hi))])
    got = run(name, v).astype(np.float64)
    ref = derived_reference(name, v)
    normal = np.abs(ref) >= 2.0**-126  # subnormal results only carry absolute accuracy
    assert np.all(np.abs(got[~normal] - ref[~normal]) <= 2.0**-149 * (1 + n_u))
    rel = np.abs(got[normal] - ref[normal]) / np.abs(ref[normal])
    worst = int(np.argmax(rel))
    bound = n_u * 2.0**-24 * (1 + 1e-6)
    assert rel[worst] <= bound, (
        f"{name}: relative error {rel[worst] / 2.0**-24:.3f} u (bound {n_u} u) at "
        f"v={v[normal][worst]!r}"
    )


def test_canonical_nan_out():
    # NaN never enters (SPEC.md 2.4), but the elementary routines still only emit 0x7FC00000.
    x = from_bits([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF])
    for name in ELEMENTARY:
        y = run(name, x)
        assert np.all(y.view(np.uint32) == 0x7FC00000), name


# ---- binary64 construction-time routines ----


def test_exp_f64_log_f64_relative_error():
    rng = np.random.default_rng(5)
    xs = np.concatenate(
        [
            rng.uniform(-700.0, 700.0, 20_000),
            rng.uniform(-1.0, 1.0, 5_000),
            [0.0, 1e-300, -1e-300, 0.5, 700.0, -700.0],
        ]
    )
    for x in xs.tolist():
        want = math.exp(x)
        assert abs(core.exp_f64(x) - want) <= 4e-16 * want, x
    ys = np.concatenate(
        [
            np.exp2(rng.uniform(-1000.0, 1000.0, 20_000)),
            1.0 + rng.uniform(-0.25, 0.25, 5_000),
            [1.0, 2.0, 0.5, 1e6, 1e-300],
        ]
    )
    for y in ys.tolist():
        want = math.log(y)
        got = core.log_f64(y)
        if want == 0.0:
            assert got == 0.0
        else:
            assert abs(got - want) <= 4e-16 * abs(want), y
    assert core.exp_f64(0.0) == 1.0 and core.log_f64(1.0) == 0.0
