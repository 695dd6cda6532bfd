"""GGUF files of the qwen2 and qwen3 architectures (written here from tiny HF models with
``gguf.GGUFWriter``, float32 tensors under llama.cpp's names): ``load_model`` gives the same
logits bits as the source model loaded in memory, and HF's own GGUF loader agrees."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from models_helpers import bits, hf_logits, make_hf_model, require

import exactblocks

# HF layer tensor -> llama.cpp tensor kind (convert_hf_to_gguf.py: no q/k permutation for qwen)
_KIND = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def write_gguf(hf, arch: str, path: str) -> None:
    gguf = require("gguf", "the gguf package writes the file")
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, t in hf.state_dict().items():
        if name == "model.embed_tokens.weight":
            kind = "token_embd.weight"
        elif name == "model.norm.weight":
            kind = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            kind = "output.weight"
        else:
            _, _, n, rest = name.split(".", 3)
            kind = f"blk.{n}.{_KIND[rest]}"
        w.add_tensor(kind, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen2_gguf_equals_the_source_model(tmp_path):
    """(llama GGUFs, whose q/k rows llama.cpp permutes, are covered by the SmolLM2 test.)"""
    import torch

    hf = make_hf_model("qwen2")
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, "qwen2", path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny file's token list is not a real tokenizer
        model = exactblocks.load_model(path)
    assert model.family == "qwen2"
    ids = np.random.default_rng(0).integers(0, 320, (2, 10))
    got = model.forward(ids)
    assert np.array_equal(bits(got), bits(exactblocks.load_model(hf).forward(ids)))
    transformers = require("transformers", "transformers reads the GGUF too")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    np.testing.assert_allclose(got, hf_logits(ref, ids), rtol=2e-4, atol=2e-4)


def test_qwen3_gguf_with_qk_norm(tmp_path):
    """qwen3 (q/k norms; head_dim read from key_length). HF's GGUF loader ignores key_length,
    so head_dim = hidden_size / heads here, and the source model is the oracle. A GGUF has no
    sliding-window field, so the source model has none either."""
    hf = make_hf_model("qwen3")
    cfg = {**hf.config.to_dict(), "head_dim": 16, "use_sliding_window": False, "layer_types": None}
    hf = type(hf)(type(hf.config)(**cfg)).eval()
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, "qwen3", path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = exactblocks.load_model(path)
    ids = np.random.default_rng(1).integers(0, 320, (1, 9))
    assert np.array_equal(bits(model.forward(ids)), bits(exactblocks.load_model(hf).forward(ids)))
    np.testing.assert_allclose(model.forward(ids), hf_logits(hf, ids), rtol=2e-4, atol=2e-4)


def test_unsupported_gguf_architecture(tmp_path):
    gguf = require("gguf", "the gguf package writes the file")
    path = str(tmp_path / "x.gguf")
    w = gguf.GGUFWriter(path, "gptneox")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gptneox' is not supported; supported: .*'mamba2'"):
        exactblocks.load_model(path)
    assert os.path.isfile(path)
