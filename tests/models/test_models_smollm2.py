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
