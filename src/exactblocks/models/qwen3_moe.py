"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``): HF config -> :class:`DecoderSpec`.

Qwen3's attention (per-head q/k RMSNorm before RoPE) with a mixture-of-experts MLP (HF
``Qwen3MoeSparseMoeBlock``, transformers 5.23): a linear router over ``num_experts`` experts,
softmax, the top ``num_experts_per_tok`` (renormalised with ``norm_topk_prob``), SwiGLU
experts of width ``moe_intermediate_size``; layers listed in ``mlp_only_layers``, or not a
multiple of ``decoder_sparse_step`` (``(i + 1) % step != 0``), keep a dense SwiGLU MLP of
``intermediate_size``. The block's MoE arithmetic: SPEC.md 4.8. GGUF:
``general.architecture == "qwen3moe"`` (every layer sparse, the top-k weights always
renormalised: llama.cpp's qwen3moe.cpp fixes ``norm_w = true``, the file states nothing).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import _GLU, _QWEN_BLOCK, _TOP, GGUFArch, _Keys
from ._gguf_moe import MOE_BLOCK, MOE_REQUIRED, moe_convert, qwen_moe_config, stack_experts
from .moe_config import moe_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)

#: ``Qwen3MoeConfig`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_local_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Qwen3-MoE model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Qwen3MoeConfig`` fields (``num_experts`` is HF's alias of ``num_local_experts``;
        either spelling is read).

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.qwen3.spec_from_config`; also ``use_sliding_window``
        true (not supported yet), and the MoE fields :func:`moe_config.moe_fields` refuses.
    """
    c = ConfigReader(config, DEFAULTS, "qwen3_moe")
    sizes = heads_and_dims(c)
    if c.flag("use_sliding_window"):
        raise ValueError(
            "load_model: config field 'use_sliding_window'=True is not supported by the "
            "qwen3_moe family yet (expected false)"
        )
    bias = c.flag("attention_bias")
    n = sizes["n_layers"]
    spec = DecoderSpec(
        family="qwen3_moe",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        windows=(0,) * n,
        **moe_fields(c, n, norm_topk_key="norm_topk_prob"),
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _gguf_config(k: _Keys, names) -> dict:
    """src/models/qwen3moe.cpp: Qwen3's keys, every layer an MoE layer of
    ``expert_feed_forward_length`` wide experts (llama.cpp's default when absent:
    ``feed_forward_length / expert_used_count``), softmax routing, top-k renormalised (fixed in
    llama.cpp's graph: ``norm_topk_prob=True`` whatever the HF checkpoint said)."""
    return qwen_moe_config(k, names, shared=False)


GGUF = GGUFArch(
    "qwen3moe",
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    _gguf_config,
    {**{k: v for k, v in _QWEN_BLOCK.items() if k not in _GLU}, **MOE_BLOCK},
    _TOP,
    convert=moe_convert,
    finish=stack_experts,
    required=MOE_REQUIRED,
)
