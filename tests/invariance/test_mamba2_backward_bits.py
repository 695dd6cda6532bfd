"""Bitwise claims of Mamba2BlockInference.backward (SPEC 7.6), compared as ``view(np.uint32)``.

The same bits: at 1, 2 and 3 threads (``force_num_threads`` oversubscribes on purpose), on
every SIMD path this CPU has (NEON: tests/cpp/digest_main.cpp under qemu), from the naive twins
of the gradient products and of the adjoint scan, on repeated calls, and for a row's ``x``
gradient alone or in any batch. Padding is exactly +0.0 in ``dx`` and never read (NaN there
changes nothing). The block is untouched: its forward output and fingerprint are the same
before and after, and a state's buffers are not touched by a backward call. Sizes include
d_state not a multiple of 16 (the unfused adjoint path), K = 1, one and three groups, and
rows across the scan's 32-token chunk.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_bitwise_equal, force_num_threads
from helpers import make_mamba2_weights as make_weights

import exactblocks as eb
from exactblocks import _ext

CONFIGS = {
    "ns5_g2": (dict(), dict(n_groups=2)),
    "ns16_g1_bias": (dict(ns=16, ng=1, proj_bias=True), dict(dt_limit=(0.002, 0.05))),
    "ns8_g3_k1": (dict(ns=8, ng=3, nh=6, k=1, conv_bias=False), dict(n_groups=3)),
    "ns32_g1_k3": (dict(ns=32, ng=1, k=3, d=40, di=64, nh=4), dict()),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def blk(request):
    wkw, okw = CONFIGS[request.param]
    return eb.Mamba2BlockInference(make_weights(5, **wkw), **okw)


def rand(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def flat(grads: dict) -> list:
    return [(k, grads[k]) for k in sorted(grads)]


def assert_same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b)
    for (k, x), (_, y) in zip(flat(a), flat(b)):
        assert_bitwise_equal(x, y, f"{what}: {k}")


def native(blk, x, gy, lengths, naive=False):
    dx, grads = _ext.core().mamba2_backward(
        blk._impl.core, x, gy, np.asarray(lengths, np.int64), naive
    )
    return {"x": dx, **grads}


LENGTHS = [40, 33, 1]


def test_threads_isas_and_naive_twin(blk):
    core = _ext.core()
    x, gy = rand(1, (3, 40, blk.d_model)), rand(2, (3, 40, blk.d_model))
    old_isa, old_threads = core.get_isa(), core.get_num_threads()
    base = None
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            for nt in (1, 2, 3):
                force_num_threads(nt)
                for naive in (False, True):
                    got = native(blk, x, gy, LENGTHS, naive)
                    if base is None:
                        base = got
                    else:
                        assert_same(got, base, f"{isa} threads={nt} naive={naive}")
    finally:
        core.set_isa(old_isa)
        force_num_threads(old_threads)
    assert "scalar" in core.available_isas()


def test_row_alone_equals_row_in_batch(blk):
    x, gy = rand(3, (3, 40, blk.d_model)), rand(4, (3, 40, blk.d_model))
    full = blk.backward(x, gy, lengths=LENGTHS)
    for b, n in enumerate(LENGTHS):
        alone = blk.backward(x[b : b + 1, :n], gy[b : b + 1, :n])
        assert_bitwise_equal(full["x"][b, :n], alone["x"][0], f"row {b} dx")
        assert not full["x"][b, n:].view(np.uint32).any(), "padding must be +0.0"
        # the same row in another batch, at another padded length
        other = np.concatenate(
            [rand(9, (1, 50, blk.d_model)), np.pad(x[b : b + 1], ((0, 0), (0, 10), (0, 0)))]
        )
        go = np.concatenate(
            [rand(10, (1, 50, blk.d_model)), np.pad(gy[b : b + 1], ((0, 0), (0, 10), (0, 0)))]
        )
        got = blk.backward(other, go, lengths=[50, n])
        assert_bitwise_equal(got["x"][1, :n], alone["x"][0], f"row {b} dx in another batch")


def test_full_rows_equal_lengths_none(blk):
    x, gy = rand(5, (2, 33, blk.d_model)), rand(6, (2, 33, blk.d_model))
    assert_same(blk.backward(x, gy), blk.backward(x, gy, lengths=[33, 33]), "lengths=None")


def test_padding_never_read(blk):
    x, gy = rand(7, (3, 40, blk.d_model)), rand(8, (3, 40, blk.d_model))
    ref = blk.backward(x, gy, lengths=LENGTHS)
    xn, gn = x.copy(), gy.copy()
    for b, n in enumerate(LENGTHS):
        xn[b, n:] = np.nan
        gn[b, n:] = np.inf
    assert_same(blk.backward(xn, gn, lengths=LENGTHS), ref, "NaN/inf in padding")


def test_repeated_calls_and_block_untouched(blk):
    x, gy = rand(11, (2, 37, blk.d_model)), rand(12, (2, 37, blk.d_model))
    x0, g0 = x.copy(), gy.copy()
    y_before = blk.forward(x)
    fp = blk.fingerprint
    st = blk.allocate_state(2)
    blk.forward(x[:, :5], st)
    snap = (st.conv_window.copy(), st.h.copy(), st.row_tokens.copy())
    first = blk.backward(x, gy)
    second = blk.backward(x, gy)
    assert_same(first, second, "repeated call")
    assert_bitwise_equal(x, x0, "x untouched")
    assert_bitwise_equal(gy, g0, "grad_output untouched")
    assert_bitwise_equal(blk.forward(x), y_before, "forward after backward")
    assert blk.fingerprint == fp
    assert_bitwise_equal(st.conv_window, snap[0], "state conv_window")
    assert_bitwise_equal(st.h, snap[1], "state h")
    assert (st.row_tokens == snap[2]).all()
    # the outputs are fresh arrays: editing one changes nothing later
    first["x"][:] = 7.0
    assert_same(blk.backward(x, gy), second, "after editing a returned array")


def test_hf_and_short_names_same_bits():
    w = make_weights(6, proj_bias=True)
    from exactblocks.mamba2.weights import SHORT_TO_HF

    short = eb.Mamba2BlockInference(w, n_groups=2)
    hf = eb.Mamba2BlockInference({SHORT_TO_HF[k]: v for k, v in w.items()}, n_groups=2)
    x, gy = rand(13, (2, 9, 24)), rand(14, (2, 9, 24))
    gs, gh = short.backward(x, gy), hf.backward(x, gy)
    assert set(gs) == {"x", *w}
    assert set(gh) == {"x", *(SHORT_TO_HF[k] for k in w)}
    for k in w:
        assert_bitwise_equal(gs[k], gh[SHORT_TO_HF[k]], k)
        assert gs[k].shape == w[k].shape and gs[k].dtype == np.float32


def test_compact_storage_same_gradient():
    """A bfloat16-valued matrix is stored compactly; its gradient is the float32 one."""
    w = make_weights(8, d=32, di=64, nh=4)  # compact formats need k_in % 32 == 0
    for k in ("in_proj.weight", "out_proj.weight"):
        w[k] = (w[k].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    blk = eb.Mamba2BlockInference(w, n_groups=2)
    assert {f for _, f, _ in blk.weight_storage()} == {"bf16"}
    f32 = blk._float32_storage_copy()
    assert {f for _, f, _ in f32.weight_storage()} == {"float32"}
    x, gy = rand(15, (2, 35, 32)), rand(16, (2, 35, 32))
    assert_same(blk.backward(x, gy), f32.backward(x, gy), "bf16 storage vs float32")
