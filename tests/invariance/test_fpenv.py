"""Subnormals are kept and FTZ/DAZ set by someone else in the process changes no bit
(SPEC 3.2): each computing thread clears FTZ/DAZ on entry and restores the caller's on exit."""

from __future__ import annotations

import numpy as np
import pytest

import exactblocks as eb
from exactblocks import _ext
from helpers import make_transformer_weights


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
