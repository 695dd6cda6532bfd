"""Mamba2BlockInference.backward's contract (SPEC 7.6): what it returns, and bad input refused
with a clear error (argument, expected, got) before any work, nothing the caller owns changed.
(The Transformer block's backward always raises: tests/api/test_transformer_api.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import make_mamba2_weights

import exactblocks as eb
from exactblocks.mamba2.weights import SHORT_TO_HF

D = 24


@pytest.fixture(scope="module")
def blk():
    return eb.Mamba2BlockInference(make_mamba2_weights(3, proj_bias=True), n_groups=2)


def rand(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_returns_one_gradient_per_weight(blk):
    w = make_mamba2_weights(3, proj_bias=True)
    x, gy = rand(1, (2, 6, D)), rand(2, (2, 6, D))
    g = blk.backward(x, gy)
    assert list(g)[0] == "x" and set(g) == {"x", *w}
    assert g["x"].shape == x.shape
    for k, v in w.items():
        assert g[k].shape == v.shape and g[k].dtype == np.float32, k
        assert g[k].flags.c_contiguous and g[k].flags.writeable
        assert np.isfinite(g[k]).all() and np.abs(g[k]).max() > 0, k


def test_conv_weight_shape_as_given():
    w = make_mamba2_weights(4)
    w["conv1d.weight"] = w["conv1d.weight"].reshape(w["conv1d.weight"].shape[0], -1)
    b2 = eb.Mamba2BlockInference(w, n_groups=2)
    g = b2.backward(rand(1, (1, 3, D)), rand(2, (1, 3, D)))
    assert g["conv1d.weight"].shape == w["conv1d.weight"].shape


def test_hf_names_in_hf_names_out_and_kept_by_set_params():
    w = {SHORT_TO_HF[k]: v for k, v in make_mamba2_weights(3).items()}
    b = eb.Mamba2BlockInference(w, n_groups=2)
    x, gy = rand(1, (1, 4, D)), rand(2, (1, 4, D))
    assert set(b.backward(x, gy)) == {"x", *w}
    b.set_params(norm_eps=1e-6)
    g = b.backward(x, gy)
    assert set(g) == {"x", *w}
    assert g["mixer.conv1d.weight"].shape == w["mixer.conv1d.weight"].shape


def test_names_survive_pickle_and_copy():
    import copy
    import pickle

    w = {SHORT_TO_HF[k]: v for k, v in make_mamba2_weights(3).items()}
    b = eb.Mamba2BlockInference(w, n_groups=2)
    x, gy = rand(1, (1, 4, D)), rand(2, (1, 4, D))
    ref = b.backward(x, gy)
    for back in (pickle.loads(pickle.dumps(b)), copy.deepcopy(b)):
        got = back.backward(x, gy)
        assert list(got) == list(ref)
        for k in ref:
            assert got[k].shape == ref[k].shape
            np.testing.assert_array_equal(got[k].view(np.uint32), ref[k].view(np.uint32))


def test_lengths_zero_row_and_padding(blk):
    x, gy = rand(3, (2, 5, D)), rand(4, (2, 5, D))
    g = blk.backward(x, gy, lengths=[0, 5])
    assert not g["x"][0].any()
    alone = blk.backward(x[1:], gy[1:])
    for k in alone:
        np.testing.assert_array_equal(g[k][1:] if k == "x" else g[k], alone[k])
    z = blk.backward(x, gy, lengths=[0, 0])
    assert all(not v.any() for v in z.values())


def test_any_float32_buffer(blk):
    x, gy = rand(5, (1, 3, D)), rand(6, (1, 3, D))
    ref = blk.backward(x, gy)
    got = blk.backward(memoryview(x), np.asfortranarray(gy))
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])


def _raises(exc, pattern, fn, *args, **kw):
    with pytest.raises(exc, match=pattern):
        fn(*args, **kw)


def test_bad_input_clear_errors(blk):
    x, gy = rand(7, (2, 4, D)), rand(8, (2, 4, D))
    x0, g0 = x.copy(), gy.copy()
    bw = blk.backward
    _raises(TypeError, r"backward: x .*float32.*float64", bw, x.astype(np.float64), gy)
    _raises(TypeError, r"backward: grad_output .*float32.*float64", bw, x, gy.astype(np.float64))
    _raises(ValueError, r"backward: x has shape \(2, 4, 23\)", bw, x[..., :23], gy[..., :23])
    _raises(
        ValueError,
        re.escape("grad_output has shape (2, 3, 24); expected the shape of x, (2, 4, 24)"),
        bw,
        x,
        gy[:, :3],
    )
    _raises(ValueError, r"grad_output has shape \(4, 24\)", bw, x, gy[0])
    bad = gy.copy()
    bad[1, 2, 3] = np.nan
    _raises(ValueError, r"backward: grad_output.*\[1, 2, 3\].*nan", bw, x, bad)
    bad = x.copy()
    bad[0, 1, 2] = np.inf
    _raises(ValueError, r"backward: x.*\[0, 1, 2\].*inf", bw, bad, gy)
    _raises(ValueError, r"lengths", bw, x, gy, lengths=[5, 1])
    st = blk.allocate_state(2)
    _raises(ValueError, r"backward: state must be None .*zero-state prefill", bw, x, gy, state=st)
    _raises(TypeError, r"backward: takes x and grad_output; got 1 extra", bw, x, gy, st)
    assert not st.h.any() and not st.conv_window.any() and not st.row_tokens.any()
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(gy, g0)
