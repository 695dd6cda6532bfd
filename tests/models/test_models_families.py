"""Every family against HF float32, and the bitwise promises through the whole model.

For each tiny model (conftest.family_configs): logits within rtol = atol = 2e-4 of HF's; greedy
``generate`` equal to HF ``generate(do_sample=False)`` for 24 tokens; token-by-token ``step``
and chunked ``forward`` == one ``forward`` bit for bit (logits); ragged rows == rows alone;
the in-memory transformers object == the saved folder, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from models_helpers import FAMILIES, FAMILY_OF, N_BLOCKS, bits, hf_logits

import exactblocks

RTOL = ATOL = 2e-4


def _ids(shape, seed=1, vocab=320):
    return np.random.default_rng(seed).integers(0, vocab, shape)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_close_to_hf(tiny, name):
    folder, hf = tiny(name)
    model = exactblocks.load_model(folder)
    ids = _ids((2, 16))
    got, want = model.forward(ids), hf_logits(hf, ids)
    assert got.dtype == np.float32 and got.shape == want.shape == (2, 16, model.vocab_size)
    err = float(np.abs(got - want).max())
    print(f"{name}: max |logit - HF| = {err:.3g}")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generate_equals_hf(tiny, name):
    import torch

    folder, hf = tiny(name)
    model = exactblocks.load_model(folder)
    prompt = [3, 17, 250, 41, 99, 8]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24
        )[0, len(prompt) :].tolist()
        # the comparison is meaningful only when HF's own choices are well separated
        lg = hf(torch.tensor([prompt + ref]), use_cache=False).logits[0, len(prompt) - 1 : -1]
        top2 = torch.topk(lg, 2).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "ill-conditioned seed"
    out = model.generate(prompt, max_new_tokens=24, stop=())
    assert out.ids == ref
    assert out.finish_reason == "length" and len(out.ids) == 24
    assert (out.text is None) == (model.tokenizer is None)


@pytest.mark.parametrize("name", FAMILIES)
def test_decode_and_chunks_equal_prefill(tiny, name):
    folder, _ = tiny(name)
    model = exactblocks.load_model(folder)
    ids = _ids((2, 20), seed=2)
    full = model.forward(ids)
    st = model.allocate_state(2, 20)
    parts = [model.forward(ids[:, :7], st), model.forward(ids[:, 7:12], st)]
    parts += [model.step(ids[:, t], st) for t in range(12, 20)]
    assert np.array_equal(bits(np.concatenate(parts, axis=1)), bits(full))
    assert st.row_tokens.tolist() == [20, 20]


@pytest.mark.parametrize("name", FAMILIES)
def test_ragged_rows_equal_rows_alone(tiny, name):
    folder, _ = tiny(name)
    model = exactblocks.load_model(folder)
    ids = _ids((3, 10), seed=3)
    lengths = [10, 4, 7]
    out = model.forward(ids, lengths=lengths)
    for b, n in enumerate(lengths):
        alone = model.forward(ids[b : b + 1, :n])[0]
        assert np.array_equal(bits(out[b, :n]), bits(alone))
        assert not out[b, n:].any()  # padding positions are +0.0
    # continuous batching: rows advance by their own lengths, then decode together
    st = model.allocate_state(3, 16)
    model.forward(ids, st, lengths=lengths)
    nxt = _ids((3,), seed=4)
    y = model.step(nxt, st)
    for b, n in enumerate(lengths):
        seq = np.concatenate([ids[b, :n], nxt[b : b + 1]])[None]
        assert np.array_equal(bits(y[b, 0]), bits(model.forward(seq)[0, -1]))


@pytest.mark.parametrize("name", FAMILIES)
def test_in_memory_object_equals_folder(tiny, name):
    folder, hf = tiny(name)
    ids = _ids((1, 12), seed=5)
    a = exactblocks.load_model(folder)
    b = exactblocks.load_model(hf)
    c = exactblocks.load_model(hf.state_dict(), config=hf.config)
    assert a.fingerprint == b.fingerprint == c.fingerprint
    assert np.array_equal(bits(a.forward(ids)), bits(b.forward(ids)))
    assert np.array_equal(bits(a.forward(ids)), bits(c.forward(ids)))
    assert a.family == FAMILY_OF.get(name, name)
    assert a.config["vocab_size"] == 320
    assert len(a.blocks) == N_BLOCKS.get(name, hf.config.num_hidden_layers)


@pytest.mark.parametrize("name", FAMILIES)
def test_last_position_logits_equal_full_forward(tiny, name):
    folder, _ = tiny(name)
    model = exactblocks.load_model(folder)
    V = model.vocab_size
    ids = _ids((4, 12), seed=6)
    lengths = [12, 5, 0, 9]
    full = model.forward(ids, lengths=lengths)
    last = model.forward(ids, lengths=lengths, logits="last")
    assert last.shape == (4, V) and last.dtype == np.float32 and last.flags.c_contiguous
    for b, n in enumerate(lengths):
        if n:
            assert np.array_equal(bits(last[b]), bits(full[b, n - 1])), (name, b)
        else:
            assert not last[b].any()  # a row without a real token: +0.0
    assert np.array_equal(bits(model.forward(ids, logits="last")), bits(model.forward(ids)[:, -1]))

    # chunk splits with a state, ragged: each chunk's last real position of each row equals
    # that position in one stateless forward, and the state advances as with logits="all"
    ids = _ids((3, 20), seed=7)
    ref = model.forward(ids)
    st_last, st_all = model.allocate_state(3, 21), model.allocate_state(3, 21)
    pos = np.zeros(3, np.int64)
    for chunk in ([5, 1, 0], [7, 6, 9], [0, 13, 1], [8, 0, 10]):
        c = np.asarray(chunk)
        part = np.zeros((3, int(c.max())), np.int64)
        for b in range(3):
            part[b, : c[b]] = ids[b, pos[b] : pos[b] + c[b]]
        got = model.forward(part, st_last, lengths=c, logits="last")
        every = model.forward(part, st_all, lengths=c)
        for b in range(3):
            if c[b]:
                assert np.array_equal(bits(got[b]), bits(ref[b, pos[b] + c[b] - 1])), (name, b)
                assert np.array_equal(bits(got[b]), bits(every[b, c[b] - 1]))
            else:
                assert not got[b].any()
        pos += c
    assert pos.tolist() == [20, 20, 20]
    assert st_last.row_tokens.tolist() == st_all.row_tokens.tolist() == [20, 20, 20]
    nxt = _ids((3,), seed=8)
    assert np.array_equal(bits(model.step(nxt, st_last)), bits(model.step(nxt, st_all)))


def test_forward_logits_option_is_checked_first(tiny):
    model = exactblocks.load_model(tiny("llama")[0])
    st = model.allocate_state(1, 8)
    with pytest.raises(ValueError, match=r"Model.forward: logits='first' is not supported"):
        model.forward([[1, 2]], st, logits="first")
    with pytest.raises(TypeError, match=r"Model.forward: logits must be a str"):
        model.forward([[1, 2]], st, logits=None)
    assert st.row_tokens.tolist() == [0]  # nothing ran
