"""Sources and states: bf16/fp16 checkpoints, shards, a bare .safetensors file, the tokenizer
of a folder against transformers', state copies, pickles and ownership, threads."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil

import numpy as np
import pytest
from models_helpers import CHAT_TEMPLATE, bits, hf_logits, make_hf_model

import exactblocks


def _ids(shape, seed=1):
    return np.random.default_rng(seed).integers(0, 320, shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_safetensors_load_exactly(tmp_path, dtype):
    import torch

    hf = make_hf_model("qwen2").to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == dtype
    model = exactblocks.load_model(str(tmp_path))
    # the same values, widened by torch, from the in-memory object: the same bits
    assert np.array_equal(
        bits(model.forward(_ids((1, 9)))), bits(exactblocks.load_model(hf).forward(_ids((1, 9))))
    )
    # HF float32 on the widened values: a fresh float32 model (hf.float() would keep the RoPE
    # inv_freq buffer rounded to bf16 by .to(dtype))
    oracle = make_hf_model("qwen2")
    oracle.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    ref = hf_logits(oracle, _ids((1, 9)))
    np.testing.assert_allclose(model.forward(_ids((1, 9))), ref, rtol=2e-4, atol=2e-4)
    if dtype == "bfloat16":  # bf16 values are stored as bf16 by the packer (exactly)
        assert "bf16" in model.weight_storage()


def test_sharded_checkpoint_equals_single_file(tiny, tmp_path):
    folder, hf = tiny("mistral")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    a, b = exactblocks.load_model(folder), exactblocks.load_model(str(tmp_path))
    assert a.fingerprint == b.fingerprint
    assert np.array_equal(bits(a.forward(_ids((1, 8)))), bits(b.forward(_ids((1, 8)))))
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(tmp_path / shards[-1])
    with pytest.raises(FileNotFoundError, match="shard"):
        exactblocks.load_model(str(tmp_path))


def test_bare_safetensors_file_with_config(tiny, tmp_path):
    folder, hf = tiny("qwen3")
    shutil.copy(os.path.join(folder, "model.safetensors"), tmp_path / "w.safetensors")
    with pytest.raises(FileNotFoundError, match="config.json"):
        exactblocks.load_model(str(tmp_path / "w.safetensors"))
    model = exactblocks.load_model(str(tmp_path / "w.safetensors"), config=hf.config)
    ref = exactblocks.load_model(folder)
    assert np.array_equal(bits(model.forward(_ids((1, 5)))), bits(ref.forward(_ids((1, 5)))))


def test_folder_tokenizer_equals_transformers(tiny):
    from transformers import AutoTokenizer

    folder, _ = tiny("llama")
    model = exactblocks.load_model(folder)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    tok = model.tokenizer
    for text in ["Hello world!", "The lazy dog, exactly.", "<|im_start|>user\nhi<|im_end|>", ""]:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids)
    chat = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine."}]
    for gen in (False, True):
        assert tok.apply_chat_template(chat, add_generation_prompt=gen) == (
            hf_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
        )
        assert (
            tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
            == (
                hf_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)[
                    "input_ids"
                ]
            )
        )
    assert tok.chat_template == CHAT_TEMPLATE


def test_text_generation_stream_and_stop(tiny):
    folder, _ = tiny("llama")
    model = exactblocks.load_model(folder)
    out = model.generate("Hello world", max_new_tokens=12, stop=())
    assert out.prompt_ids == model.tokenizer.encode("Hello world")
    assert out.text == model.tokenizer.decode(out.ids)
    stream = model.generate("Hello world", max_new_tokens=12, stop=(), stream=True)
    pieces = list(stream)
    assert "".join(pieces) == out.text and stream.output.ids == out.ids
    # a stop token ends generation before it; a stop string cuts the text before it
    cut = model.generate("Hello world", max_new_tokens=12, stop=[out.ids[3]])
    assert cut.ids == out.ids[:3] and cut.finish_reason == "stop"
    if len(out.text) > 4:
        s = out.text[2:4]
        cut = model.generate("Hello world", max_new_tokens=12, stop=[s])
        assert cut.text == out.text[: out.text.find(s)] and cut.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tiny):
    folder, _ = tiny("qwen3")
    model = exactblocks.load_model(folder)
    kw = dict(max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.9, stop=())
    a = model.generate([5, 6, 7], seed=1234, **kw).ids
    assert a == model.generate([5, 6, 7], seed=1234, **kw).ids
    assert a != model.generate([5, 6, 7], seed=99, **kw).ids
    greedy = model.generate([5, 6, 7], max_new_tokens=16, stop=()).ids
    assert model.generate([5, 6, 7], seed=3, temperature=1.0, top_k=1, max_new_tokens=16,
                          stop=()).ids == greedy  # fmt: skip
    # the same seed, 1 thread or 2: the same tokens
    n = exactblocks.get_num_threads()
    try:
        exactblocks.set_num_threads(1)
        assert model.generate([5, 6, 7], seed=1234, **kw).ids == a
    finally:
        exactblocks.set_num_threads(n)


def test_state_copy_pickle_and_ownership(tiny):
    folder, _ = tiny("llama")
    model = exactblocks.load_model(folder)
    other = exactblocks.load_model(tiny("qwen2")[0])
    ids = _ids((2, 12), seed=7)
    full = model.forward(ids)
    st = model.allocate_state(2, 16)
    model.forward(ids[:, :8], st)
    clone, restored = copy.deepcopy(st), pickle.loads(pickle.dumps(st))
    a = model.forward(ids[:, 8:], st)
    for s in (clone, restored):
        assert np.array_equal(bits(model.forward(ids[:, 8:], s)), bits(a))
    assert np.array_equal(bits(a), bits(full[:, 8:]))
    with pytest.raises(ValueError, match="another model"):
        other.forward(ids[:, :2], model.allocate_state(2, 4))
    model.step(ids[:, 0], clone)  # clone holds 13 of 16 positions now
    before = [st_.k_cache.copy() for st_ in clone.layers]
    with pytest.raises(
        ValueError, match="holds 13 positions and this call adds 5; the limit is max_tokens=16"
    ):
        model.forward(ids[:, :5], clone)
    assert all(np.array_equal(b, s.k_cache) for b, s in zip(before, clone.layers))
    st.reset([0])
    assert st.row_tokens.tolist() == [0, 12]


def test_mamba2_state_has_no_position_limit(tiny):
    folder, _ = tiny("mamba2")
    model = exactblocks.load_model(folder)
    assert model.max_positions is None
    st = model.allocate_state(1)
    ids = _ids((1, 6))
    a = model.forward(ids[:, :3], st)
    b = model.forward(ids[:, 3:], st)
    assert np.array_equal(bits(np.concatenate([a, b], 1)), bits(model.forward(ids)))
