"""Subnormals are kept and FTZ/DAZ set by someone else in the process changes no bit
(SPEC 3.2): each computing thread clears FTZ/DAZ on entry and restores the caller's on exit."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_transformer_weights

import exactblocks as eb
from exactblocks import _ext


def test_caller_ftz_daz_changes_no_bit():
    core = _ext.core()
    rng = np.random.default_rng(0)
    w = make_transformer_weights(rng, 32, 4, 2, 8, 48)
    # tiny weights and inputs push many intermediate values into the subnormal range
    w["v_proj.weight"] *= np.float32(1e-36)
    w["down_proj.weight"] *= np.float32(1e-37)
    blk = eb.TransformerBlockInference(w, n_heads=4)
    x = (rng.standard_normal((2, 9, 32)) * 1e-38).astype(np.float32)
    sub = np.float32(np.finfo(np.float32).tiny / 4)  # subnormal inputs
    x[0, 0, :4] = sub
    saved = eb.get_num_threads()
    try:
        eb.set_num_threads(1)  # the computation runs on the calling thread itself
        ref = blk.forward(x)
        if not core._set_caller_ftz_daz(True):
            pytest.skip("FTZ/DAZ control is x86-only in this test")
        try:
            got = blk.forward(x)
        finally:
            core._set_caller_ftz_daz(False)
    finally:
        eb.set_num_threads(saved)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    # and subnormals really occur and survive in the output path
    e = core.elementwise("exp", np.array([-100.0, -103.0], np.float32))
    assert 0 < e[0] < np.finfo(np.float32).tiny and 0 < e[1] < np.finfo(np.float32).tiny


def test_subnormal_sums_are_kept():
    core = _ext.core()
    tiny = np.float32(np.finfo(np.float32).tiny)
    a = np.full(20, tiny / 8, np.float32)
    ref = core.sum_l16(a)
    core._set_caller_ftz_daz(True)
    try:
        got = core.sum_l16(a)
    finally:
        core._set_caller_ftz_daz(False)
    assert np.float32(ref) == np.float32(got) > 0


def _subnormal_q4_block() -> np.ndarray:
    """32 Q4_1-like weights whose code-1 values are 2^-127 (subnormal), written as 0.0: with
    FTZ on, fma(d, 1, m) flushes to 0.0, so a packer that checked its guess in the caller's
    mode would take the block for Q4_1 and the kernels (subnormals kept) would rebuild 2^-127."""
    q = np.arange(32) % 16
    w = np.float32(-(2.0**-120) + (2.0**-120 + 2.0**-127) * q)
    w[q == 1] = 0.0
    return w.astype(np.float32)


def _libm_fesetround():
    import ctypes
    import ctypes.util
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    return libm.fesetround, libm.fegetround


@pytest.mark.parametrize("mode", ["ftz_daz", "round_upward"])
def test_construction_ignores_the_callers_fp_mode(mode):
    """Building a block (RoPE table, packing and its exactness checks, A = -exp(A_log)) under
    another FP mode gives the same storage and the same bits (SPEC 3.2)."""
    core = _ext.core()
    rng = np.random.default_rng(4)
    w = make_transformer_weights(rng, 64, 4, 2, 16, 64)
    w["down_proj.weight"] = np.tile(_subnormal_q4_block(), (64, 2))
    x = (0.5 * rng.standard_normal((1, 6, 64))).astype(np.float32)
    x[..., ::2] = 0.0
    ref = eb.TransformerBlockInference(w, n_heads=4, n_kv_heads=2)
    if mode == "ftz_daz":
        if not core._set_caller_ftz_daz(True):
            pytest.skip("FTZ/DAZ control is x86-only in this test")
        try:
            other = eb.TransformerBlockInference(w, n_heads=4, n_kv_heads=2)
        finally:
            core._set_caller_ftz_daz(False)
    else:
        fns = _libm_fesetround()
        if fns is None:
            pytest.skip("fesetround constants are x86-only in this test")
        fesetround, fegetround = fns
        saved = fegetround()
        assert fesetround(0x800) == 0  # FE_UPWARD
        try:
            other = eb.TransformerBlockInference(w, n_heads=4, n_kv_heads=2)
        finally:
            fesetround(saved)
    assert ref.weight_storage() == other.weight_storage()
    assert ref.weight_storage()[-1][1] == "float32"  # the block is not exactly Q4_1
    assert np.array_equal(ref.forward(x).view(np.uint32), other.forward(x).view(np.uint32))


@pytest.mark.parametrize("kind", ["transformer", "mamba2"])
def test_float_options_ignore_the_callers_rounding_mode(kind):
    """norm_eps, attn_softcap and dt_limit become float32 under round-to-nearest, whatever the
    caller's rounding mode while the block is built."""
    from helpers import make_mamba2_weights

    fns = _libm_fesetround()
    if fns is None:
        pytest.skip("fesetround constants are x86-only in this test")
    fesetround, fegetround = fns
    rng = np.random.default_rng(5)
    if kind == "transformer":
        w = make_transformer_weights(rng, 64, 4, 2, 16, 64)

        def build():
            return eb.TransformerBlockInference(
                w, n_heads=4, n_kv_heads=2, norm_eps=1e-5, attn_softcap=50.1
            )

        x = (1e-4 * rng.standard_normal((1, 5, 64))).astype(np.float32)
    else:
        w = make_mamba2_weights(6)

        def build():
            return eb.Mamba2BlockInference(w, dt_limit=(0.0011, 0.0913), norm_eps=1e-5)

        x = (1e-4 * rng.standard_normal((1, 5, 24))).astype(np.float32)  # eps then matters
    ref = build()
    saved = fegetround()
    for mode in (0x800, 0x400, 0xC00):  # FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO
        assert fesetround(mode) == 0
        try:
            other = build()
        finally:
            fesetround(saved)
        assert np.array_equal(ref.forward(x).view(np.uint32), other.forward(x).view(np.uint32)), (
            mode
        )
