"""Fingerprints computed on first read (exactblocks._weights.LazyFingerprint).

A block built from GGUF blocks would otherwise dequantise every weight only to hash it. The
digest is now computed when something asks for the string, from what the block keeps (small
tensors and the packed matrices rebuilt by the core). These tests check that the value is the
XXH3-128 of the weights the block was given (hashed here from the caller's float32 arrays, not
from the block), that states of the block are recognised without computing it, and that every
place that needs the string (a state of another block, pickling, copying) still gets it.
"""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest
from helpers import make_mamba2_weights, make_transformer_weights

import exactblocks as eb
from exactblocks import _ext
from exactblocks._options import options_repr
from exactblocks._weights import LazyFingerprint, fingerprint, same_fingerprint

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

HEADS = dict(n_heads=4, n_kv_heads=2, head_dim=16)
OPTS = dict(HEADS, max_positions=64)

MOE_OPTION_NAMES = {"num_experts", "num_experts_per_tok", "norm_topk_prob", "shared_expert"}


def expected(block, weights: dict) -> str:
    """The fingerprint's definition (SPEC 2.8) on the caller's float32 arrays."""
    impl = block._impl
    table = type(block)._options
    if not getattr(block, "num_experts", 0):  # a dense block spells the options it always had
        table = tuple(o for o in table if o.name not in MOE_OPTION_NAMES)
    return fingerprint(
        type(block).__name__,
        str(_ext.core().arithmetic_version()),
        options_repr(table, impl.opts),
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
    )


def q4_1_values(w: np.ndarray) -> np.ndarray:
    t = gguf.GGMLQuantizationType.Q4_1
    return dequantize(quantize(w, t), t).reshape(w.shape).astype(np.float32)


def gguf_blocks(w: np.ndarray):
    from exactblocks._weights import QuantizedMatrix

    t = gguf.GGMLQuantizationType.Q4_1
    raw = quantize(w, t)
    return QuantizedMatrix(int(t), raw, w.shape)


def test_block_fingerprint_is_lazy_and_equals_the_hash_of_the_given_weights():
    rng = np.random.default_rng(0)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **HEADS)
    direct = dict(w)
    values = dict(w)
    for n in w:
        if w[n].ndim == 2:
            direct[n] = gguf_blocks(w[n])
            values[n] = q4_1_values(w[n])
    blk = eb.TransformerBlockInference(direct, **OPTS)
    assert [f for _, f, _ in blk.weight_storage()] == ["q4_1"] * 4
    fp = blk._impl.fp
    assert isinstance(fp, LazyFingerprint) and fp._value is None
    # calls, states and sessions of this block compute nothing
    st = blk.allocate_state(2, 16)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    blk.forward(x, st)
    with blk.decode_session(st) as sess:
        sess.step(x[:, 0])
    blk.step(x[:, 1], st)
    assert fp._value is None
    # the value: the hash of the float32 weights the blocks stand for
    assert blk.fingerprint == expected(blk, values)
    assert fp._value == blk.fingerprint
    assert st.fingerprint == blk.fingerprint
    f32 = eb.TransformerBlockInference(values, **OPTS)
    assert f32.fingerprint == blk.fingerprint == expected(f32, values)


def test_mamba2_fingerprint_is_lazy_and_exact():
    rng = np.random.default_rng(1)
    w = make_mamba2_weights(1)  # d_model 24, 2 groups
    blk = eb.Mamba2BlockInference(w, n_groups=2)
    st = blk.allocate_state(1)
    blk.forward(rng.standard_normal((1, 3, 24)).astype(np.float32), st)
    assert blk._impl.fp._value is None
    canonical = dict(w)  # the block's canonical conv1d.weight is (conv_dim, K)
    canonical["conv1d.weight"] = w["conv1d.weight"].reshape(w["conv1d.weight"].shape[0], -1)
    assert blk.fingerprint == expected(blk, canonical) == st.fingerprint


def test_states_of_another_block_compare_by_value():
    """Two blocks of the same weights and options: different fingerprint objects, one digest,
    so each accepts the other's states; other options give another digest, and a refusal."""
    rng = np.random.default_rng(2)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **HEADS)
    a = eb.TransformerBlockInference(w, **OPTS)
    b = eb.TransformerBlockInference(w, **OPTS)
    assert a._impl.fp is not b._impl.fp
    sa = a.allocate_state(1, 8)
    x = rng.standard_normal((1, 3, 64)).astype(np.float32)
    y1 = b.forward(x, sa)  # b accepts a's state: the digests are computed and equal
    assert a._impl.fp._value == b._impl.fp._value is not None
    sb = b.allocate_state(1, 8)
    assert np.array_equal(y1.view(np.uint32), a.forward(x, sb).view(np.uint32))
    c = eb.TransformerBlockInference(w, **{**OPTS, "rope_theta": 5000.0})
    with pytest.raises(ValueError, match="fingerprint"):
        c.forward(x, a.allocate_state(1, 8))


def test_pickle_and_copy_of_a_state():
    rng = np.random.default_rng(3)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **HEADS)
    blk = eb.TransformerBlockInference(w, **OPTS)
    st = blk.allocate_state(1, 8)
    x = rng.standard_normal((1, 3, 64)).astype(np.float32)
    blk.forward(x, st)
    twin = copy.copy(st)  # a copy in this process keeps the object: nothing computed
    assert blk._impl.fp._value is None and twin._fingerprint is blk._impl.fp
    data = pickle.dumps(st)  # a pickle holds the string
    back = pickle.loads(data)
    assert isinstance(back._fingerprint, str) and back.fingerprint == blk.fingerprint
    y = rng.standard_normal((1, 1, 64)).astype(np.float32)
    out = [blk.step(y, s) for s in (st, twin, back)]
    assert all(np.array_equal(o.view(np.uint32), out[0].view(np.uint32)) for o in out)
    with pytest.raises(AttributeError):
        st.fingerprint = "0" * 32


def test_lazy_fingerprint_computes_once_across_threads():
    calls = []
    gate = threading.Event()

    def compute():
        calls.append(1)
        gate.wait(5)
        return "ab" * 16

    fp = LazyFingerprint(compute)
    out = []
    threads = [threading.Thread(target=lambda: out.append(fp.value)) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert out == ["ab" * 16] * 4 and len(calls) == 1 and fp._compute is None
    assert same_fingerprint(fp, "ab" * 16) and same_fingerprint(fp, fp)
    assert not same_fingerprint(fp, "cd" * 16)
