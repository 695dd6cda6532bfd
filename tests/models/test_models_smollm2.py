"""The real model: SmolLM2-135M-Instruct from its Q4_1 GGUF through ``load_model``, greedy text
equal to HF transformers float32 on the same dequantised weights (32 tokens, three prompts)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from models_helpers import TORCH_THREADS, require

import exactblocks

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.fixture(scope="module")
def smollm2_path():
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.mark.slow
def test_smollm2_gguf_greedy_text_equals_hf(smollm2_path):
    torch = require("torch", "torch runs the HF oracle")
    transformers = require("transformers", "transformers is the oracle")
    require("accelerate", "transformers needs accelerate to load a GGUF model")
    model = exactblocks.load_model(smollm2_path)
    assert model.family == "llama" and len(model.blocks) == 30 and model.tokenizer is not None
    folder, name = os.path.split(smollm2_path)
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        for i, prompt in enumerate(PROMPTS):
            chat = [{"role": "user", "content": prompt}]
            ids = model.tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=True
            )
            assert (
                ids
                == hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)[
                    "input_ids"
                ]
            )
            out = model.generate(ids, max_new_tokens=32)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)
            ref = ref[0, len(ids) :].tolist()
            if ref and ref[-1] in model.eos_token_ids:  # HF keeps the stop token, we do not
                ref = ref[:-1]
                assert out.finish_reason == "stop"
            assert out.ids == ref, prompt
            assert out.text == hf_tok.decode(ref), prompt
            if i:
                continue
            # the logits of the whole exchange: decode == prefill, bit for bit
            full = model.forward(np.asarray([ids + out.ids]))
            st = model.allocate_state(1, len(ids) + len(out.ids))
            parts = [model.forward(np.asarray([ids]), st)]
            parts += [model.step([t], st) for t in out.ids]
            assert np.array_equal(np.concatenate(parts, 1).view(np.uint32), full.view(np.uint32))
    finally:
        torch.set_num_threads(before)


def test_smollm2_direct_packing_equals_dequantise_then_pack(smollm2_path):
    """GGUF blocks packed directly (load_model's path) == gguf's float32 values packed by the
    detecting packer (the old path), on a few layers and the head: the same storage formats,
    fingerprints, weights and output bits."""
    from exactblocks._weights import QuantizedMatrix
    from exactblocks.models.loading import load_gguf_model

    _, direct, _ = load_gguf_model(smollm2_path, direct=True)
    cfg, plain, _ = load_gguf_model(smollm2_path)
    assert isinstance(direct["model.layers.0.self_attn.q_proj.weight"], QuantizedMatrix)
    assert isinstance(direct["model.embed_tokens.weight"], QuantizedMatrix)  # Q8_0
    model = exactblocks.load_model(smollm2_path)
    spec, mp = model.spec, model.max_positions
    x = np.random.default_rng(0).standard_normal((2, 6, spec.d_model)).astype(np.float32)
    for layer in (0, 13, 29):
        p = spec.layer_prefix.format(layer)
        a = spec.build_layer(layer, {k: v for k, v in direct.items() if k.startswith(p)}, mp)
        b = spec.build_layer(layer, {k: v for k, v in plain.items() if k.startswith(p)}, mp)
        assert [f for _, f, _ in a.weight_storage()] == ["q4_1"] * 4
        assert a.weight_storage() == b.weight_storage()
        assert a.fingerprint == b.fingerprint == model.blocks[layer].fingerprint
        for n, v in b._impl.weights.items():
            assert np.array_equal(a._impl.weights[n].view(np.uint32), v.view(np.uint32)), n
        ya, yb = a.forward(x, lengths=[6, 3]), b.forward(x, lengths=[6, 3])
        assert np.array_equal(ya.view(np.uint32), yb.view(np.uint32)), layer
    # the head and the tied embedding: rows of the packed Q8_0 head == gguf's values
    embed = plain["model.embed_tokens.weight"]
    assert model.weight_storage()["q8_0"] > 0
    ids = np.array([[0, 1, 2, 49151], [77, 5000, 12345, 3]])
    rows = model._embed[ids]
    assert np.array_equal(rows.view(np.uint32), embed[ids].view(np.uint32))
