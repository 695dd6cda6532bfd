"""Helpers and the session fixture of the whole-model tests: tiny random transformers models
saved with ``save_pretrained`` (one per family, built once per session), a tiny byte-level BPE
tokenizer with a chat template, and the oracle helpers.

Every model is float32 with eager attention and ``initializer_range`` large enough that the
greedy path's top-2 logit margins are far above float32 noise (the greedy test checks it).
Missing torch/transformers skip locally and fail under CI (``CI`` set), as in tests/model.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

TORCH_THREADS = 2
VOCAB = 320  # >= 256 byte symbols + merges + 3 special tokens for the tiny BPE tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def require(module: str, why: str):
    """Import ``module``; skip locally when it is missing, raise under CI."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"{why}: {exc}")


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    base.update(kw)
    return base


def family_configs():
    """family -> (config class name, kwargs): the tiny models every family test uses."""
    return {
        "llama": ("LlamaConfig", _common(tie_word_embeddings=True)),
        "llama_variant": (  # biases, llama3 RoPE scaling, tanh-GELU MLP, free head_dim
            "LlamaConfig",
            _common(
                attention_bias=True,
                mlp_bias=True,
                hidden_act="gelu_pytorch_tanh",
                head_dim=24,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
        "mistral": ("MistralConfig", _common(sliding_window=6)),
        "qwen2": ("Qwen2Config", _common(tie_word_embeddings=True)),
        "qwen3": (  # head_dim != hidden/heads; layer 1 slides (max_window_layers=1)
            "Qwen3Config",
            _common(head_dim=32, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        ),
        "qwen3_moe": (  # 8 experts, top-2 renormalised; layer 1 dense (mlp_only_layers)
            "Qwen3MoeConfig",
            _common(
                num_hidden_layers=3,
                head_dim=16,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                mlp_only_layers=[1],
            ),
        ),
        "qwen3_moe_top3": (  # top-3 of 6 experts, not renormalised, every layer sparse
            "Qwen3MoeConfig",
            _common(
                num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False
            ),
        ),
        "qwen2_moe": (  # shared expert; layer 1 dense; q/k/v biases
            "Qwen2MoeConfig",
            _common(
                num_hidden_layers=3,
                num_experts=6,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
                mlp_only_layers=[1],
            ),
        ),
        "olmoe": (  # q/k norms over all heads, top-2 of 6, not renormalised
            "OlmoeConfig",
            _common(num_experts=6, num_experts_per_tok=2, intermediate_size=32),
        ),
        "mixtral": (  # top-2 of 4 renormalised, sliding window 6 on every layer
            "MixtralConfig",
            _common(
                num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=6
            ),  # fmt: skip
        ),
        "mamba2": (
            "Mamba2Config",
            dict(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                state_size=16,
                head_dim=16,
                num_heads=8,
                n_groups=2,
                expand=2,
                initializer_range=0.2,
                bos_token_id=None,
                eos_token_id=None,
                pad_token_id=None,
            ),
        ),
        "starcoder2": (  # LayerNorm + biases, ungated tanh-GELU MLP, one window everywhere
            "Starcoder2Config",
            _common(sliding_window=6, num_hidden_layers=3),
        ),
        "stablelm": (  # LayerNorm + biases, partial RoPE (0.25 of head_dim), q/k/v biases
            "StableLmConfig",
            _common(use_qkv_bias=True, num_hidden_layers=3),
        ),
        "stablelm_parallel": (  # per-head LayerNorm q/k norms, parallel residual, half RoPE
            "StableLmConfig",
            _common(qk_layernorm=True, use_parallel_residual=True, partial_rotary_factor=0.5),
        ),
        "gemma2": (  # sandwich, (1 + w) norms, softcaps, alternating windows, scaled embedding
            "Gemma2Config",
            _common(
                num_hidden_layers=3,
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=5,
                attn_logit_softcapping=3.0,
                final_logit_softcapping=4.0,
            ),
        ),
        "gemma3": (  # + per-head q/k norms, 2:1 local/global, per-type RoPE base, global scaling
            "Gemma3TextConfig",
            _common(
                num_hidden_layers=3,
                head_dim=16,
                sliding_window=5,
                sliding_window_pattern=3,
                query_pre_attn_scalar=16,
                rope_theta=50000.0,
                rope_local_base_freq=2000.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            ),
        ),
        "olmo2": ("Olmo2Config", _common(num_hidden_layers=2)),  # post norms, all-heads q/k
        "smollm3": (  # NoPE every 2nd layer
            "SmolLM3Config",
            _common(num_hidden_layers=4, no_rope_layer_interval=2),
        ),
        "granite": (
            "GraniteConfig",
            _common(
                embedding_multiplier=3.0,
                attention_multiplier=0.3,
                residual_multiplier=0.6,
                logits_scaling=2.5,
            ),
        ),
        "phi3": (  # fused qkv / gate_up, partial RoPE, longrope (short set below 64 tokens)
            "Phi3Config",
            _common(
                num_hidden_layers=2,
                original_max_position_embeddings=64,
                partial_rotary_factor=0.5,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0, 1.3, 1.7, 2.2],
                    "long_factor": [1.5, 2.5, 4.0, 8.0],
                },
            ),
        ),
        "nemotron_h": (  # Mamba-2, attention (no RoPE), relu2 MLP layers
            "NemotronHConfig",
            dict(
                vocab_size=VOCAB,
                hidden_size=64,
                hybrid_override_pattern="M*-M",
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=128,
                ssm_state_size=16,
                mamba_num_heads=8,
                mamba_head_dim=16,
                n_groups=2,
                max_position_embeddings=128,
                initializer_range=0.2,
                bos_token_id=None,
                eos_token_id=None,
                pad_token_id=None,
            ),
        ),
        "granitemoehybrid": (  # dense Granite-4.0-H: Mamba-2 / attention + MLP, multipliers
            "GraniteMoeHybridConfig",
            _common(
                num_hidden_layers=3,
                layer_types=["mamba", "attention", "mamba"],
                num_local_experts=0,
                shared_intermediate_size=96,
                mamba_n_heads=8,
                mamba_d_state=16,
                mamba_n_groups=2,
                embedding_multiplier=3.0,
                attention_multiplier=0.3,
                residual_multiplier=0.6,
                logits_scaling=2.5,
            ),
        ),
    }


FAMILIES = list(family_configs())

#: Blocks per model where an HF layer becomes more than one block (default: the layers).
N_BLOCKS = {"granitemoehybrid": 6}

#: test name -> the family ``load_model`` reports (default: the test name itself).
FAMILY_OF = {
    "llama_variant": "llama",
    "stablelm_parallel": "stablelm",
    "qwen3_moe_top3": "qwen3_moe",
}

#: Families whose HF init leaves norm weights and biases constant (ones/zeros): the test
#: spreads them so that a swapped norm, a missing bias or a wrong (1 + w) shows.
PERTURBED = {
    "starcoder2",
    "stablelm",
    "stablelm_parallel",
    "gemma2",
    "gemma3",
    "olmo2",
    "smollm3",
    "granite",
    "phi3",
    "nemotron_h",
    "granitemoehybrid",
}


def perturb_constants(model):
    """Spread every 1-D parameter HF initialised to a constant (norm weights, biases)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and bool((p == p.flatten()[0]).all()):
                width = 0.2 if name.endswith(".bias") else 0.5
                p.add_(torch.empty_like(p).uniform_(-width, width))


def make_hf_model(name: str, seed: int = 0):
    """A tiny random transformers model of family ``name`` (float32, eager, eval mode)."""
    torch = require("torch", "torch runs the HF oracle")
    transformers = require("transformers", "transformers is the oracle")
    cls_name, kw = family_configs()[name]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    extra = {} if name == "mamba2" else {"attn_implementation": "eager"}
    model = transformers.AutoModelForCausalLM.from_config(cfg, **extra).float().eval()
    if name in PERTURBED:
        perturb_constants(model)
    if name == "mamba2":  # HF's init leaves these at 1/0: spread them so the test sees them
        with torch.no_grad():
            for layer in model.backbone.layers:
                layer.mixer.D.uniform_(0.5, 1.5)
                layer.mixer.norm.weight.uniform_(0.5, 1.5)
                layer.norm.weight.uniform_(0.5, 1.5)
    return model


def make_tokenizer(folder: str):
    """A tiny byte-level BPE tokenizer with a chat template, saved as transformers saves it."""
    tokenizers = require("tokenizers", "the tokenizers package builds the tokenizer")
    transformers = require("transformers", "transformers saves the tokenizer")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! How are you today? I am fine, thank you.",
        "Exact bits on every machine: decode equals prefill.",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() <= VOCAB
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(name)`` -> (folder, hf_model): saved once per session per family.

    The llama folder also holds the tiny tokenizer (tokenizer.json, chat template).
    """
    torch = require("torch", "torch runs the HF oracle")
    torch.set_num_threads(TORCH_THREADS)
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            model = make_hf_model(name)
            folder = str(tmp_path_factory.mktemp(f"tiny_{name}"))
            model.save_pretrained(folder)
            if name == "llama":
                make_tokenizer(folder)
            cache[name] = (folder, model)
        return cache[name]

    return get


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    """HF float32 logits of ids (B, L), no cache."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids), use_cache=False).logits.float().numpy()


def bits(a: np.ndarray) -> np.ndarray:
    """The raw float32 bits (for bitwise comparisons)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
