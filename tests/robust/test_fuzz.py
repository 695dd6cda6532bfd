"""Bounded property fuzz of the bit promises (SPEC.md 3.1, 9) over random configurations of
both blocks: for random sizes, GQA ratios, windows, RoPE settings,
norm/MLP kinds, biases, n_groups, d_state and conv kernels, with random token splits and
ragged lengths,

- steps == one forward == a random chunking, bit for bit (outputs and final state);
- a ragged row == that row alone (padding outputs exactly +0.0);
- 1 thread == 2 threads.

Derandomized (the same examples on every run), sized for well under a minute on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import force_num_threads, make_mamba2_weights, make_transformer_weights

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
given, settings = hypothesis.given, hypothesis.settings

import exactblocks as eb  # noqa: E402

# ~15 s each on 2 busy cores; the Transformer's examples cost more (more options, attention).
FUZZ_TRANSFORMER = settings(max_examples=150, deadline=None, derandomize=True, database=None)
FUZZ_MAMBA2 = settings(max_examples=250, deadline=None, derandomize=True, database=None)

pytestmark = pytest.mark.fuzz


def bits(a):
    """The raw bytes of an array (any dtype), shaped as it is with one more axis."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(*a.shape, a.itemsize)


def same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
    diff = np.flatnonzero((bits(a) != bits(b)).any(axis=-1))
    assert diff.size == 0, f"{what}: {diff.size} elements differ, first at flat {diff[0]}"


@st.composite
def transformer_cases(draw):
    n_kv = draw(st.integers(1, 3))
    n_heads = n_kv * draw(st.integers(1, 3))
    head_dim = 2 * draw(st.integers(1, 8))
    d = draw(st.sampled_from([8, 16, 24, 40]))
    inter = draw(st.integers(4, 48))
    norm = draw(st.sampled_from(["rmsnorm", "layernorm", "rmsnorm_offset"]))
    mlp = draw(st.sampled_from(["swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh"]))
    opts = {
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": head_dim,
        "window": draw(st.sampled_from([0, 0, 1, 2, 3, 5, 8])),
        "rope_dim": 2 * draw(st.integers(1, head_dim // 2)),
        "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 17.5])),
        "norm": norm,
        "mlp": mlp,
        "qkv_bias": draw(st.booleans()),
        "o_bias": draw(st.booleans()),
        "mlp_bias": draw(st.booleans()),
        "qk_norm": norm != "layernorm" and draw(st.booleans()),
        "norm_bias": norm == "layernorm" and draw(st.booleans()),
        "attn_softcap": draw(st.sampled_from([None, None, 5.0])),
    }
    kind = draw(st.sampled_from(["none", "linear", "llama3"]))
    if kind == "linear":
        opts["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif kind == "llama3":
        opts["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    seed = draw(st.integers(0, 2**31 - 1))
    flags = ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_bias", "norm", "mlp")
    w = make_transformer_weights(
        np.random.default_rng(seed), d, n_heads, n_kv, head_dim, inter,
        **{k: opts[k] for k in flags},
    )  # fmt: skip
    return w, opts, d, seed


@st.composite
def mamba2_cases(draw):
    ng = draw(st.integers(1, 3))
    nh = ng * draw(st.integers(1, 3))
    di = nh * draw(st.integers(1, 6))
    if di % ng:
        di *= ng
    d = draw(st.sampled_from([8, 16, 24]))
    ns = draw(st.integers(1, 9))
    k = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    w = make_mamba2_weights(
        seed,
        d=d,
        di=di,
        nh=nh,
        ns=ns,
        ng=ng,
        k=k,
        conv_bias=draw(st.booleans()),
        proj_bias=draw(st.booleans()),
    )
    return w, {"n_groups": ng}, d, seed


def _splits(draw, n):
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))))
    cuts = [c for c in cuts if 0 < c < n]
    return [0, *cuts, n]


def _state_of(blk, batch, tokens):
    if isinstance(blk, eb.Mamba2BlockInference):
        return blk.allocate_state(batch)
    return blk.allocate_state(batch, tokens)


def _state_bits(s):
    return [getattr(s, n).copy() for n in (*type(s)._BUFFERS, "row_tokens")]


def _check_block(blk, d, seed, data):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, 12), label="tokens")
    batch = data.draw(st.integers(1, 3), label="batch")
    x = rng.standard_normal((batch, n, d)).astype(np.float32)

    # one forward with a state == stateless forward == token steps == a random chunking
    whole_state = _state_of(blk, batch, n)
    y = blk.forward(x, whole_state)
    same(y, blk.forward(x), "state vs no state")
    step_state = _state_of(blk, batch, n)
    steps = np.concatenate([blk.step(x[:, t], step_state) for t in range(n)], axis=1)
    same(steps, y, "steps vs forward")
    cuts = _splits(data.draw, n)
    chunk_state = _state_of(blk, batch, n)
    chunks = np.concatenate(
        [blk.forward(x[:, a:b], chunk_state) for a, b in zip(cuts, cuts[1:])], axis=1
    )
    same(chunks, y, f"chunks {cuts} vs forward")
    for a, b, c in zip(_state_bits(whole_state), _state_bits(step_state), _state_bits(chunk_state)):
        same(a, b, "state after steps")
        same(a, c, "state after chunks")

    # ragged rows == each row alone, padding exactly +0.0
    lens = data.draw(st.lists(st.integers(0, n), min_size=batch, max_size=batch), label="lens")
    xr = x.copy()
    for b, nb in enumerate(lens):
        xr[b, nb:] = np.nan  # padding is never read
    rag_state = _state_of(blk, batch, n)
    yr = blk.forward(xr, rag_state, lengths=lens)
    for b, nb in enumerate(lens):
        alone_state = _state_of(blk, 1, n)
        if nb:  # an idle row: untouched, as a fresh state
            alone = blk.forward(x[b : b + 1, :nb], alone_state)
            same(yr[b : b + 1, :nb], alone, f"ragged row {b} (lengths {lens})")
        assert not bits(yr[b, nb:]).any(), "padding is not +0.0"
        for ra, rb in zip(_state_bits(rag_state), _state_bits(alone_state)):
            same(ra[b : b + 1], rb, f"ragged state row {b}")

    # 1 thread == 2 threads
    saved = eb.get_num_threads()
    try:
        force_num_threads(1)
        y1 = blk.forward(x, lengths=lens)
        force_num_threads(2)
        y2 = blk.forward(x, lengths=lens)
    finally:
        eb.set_num_threads(saved)
    same(y1, y2, "1 vs 2 threads")
    same(y1, yr, "stateless vs state (ragged)")


@FUZZ_TRANSFORMER
@given(case=transformer_cases(), data=st.data())
def test_fuzz_transformer_bit_promises(case, data):
    w, opts, d, seed = case
    blk = eb.TransformerBlockInference(w, **opts)
    _check_block(blk, d, seed, data)


@FUZZ_MAMBA2
@given(case=mamba2_cases(), data=st.data())
def test_fuzz_mamba2_bit_promises(case, data):
    w, opts, d, seed = case
    blk = eb.Mamba2BlockInference(w, **opts)
    _check_block(blk, d, seed, data)
