"""Qwen2-MoE (HF ``Qwen2MoeForCausalLM``): HF config -> :class:`DecoderSpec`.

Qwen2's attention (biases on q, k, v with ``qkv_bias``) with a mixture-of-experts MLP (HF
``Qwen2MoeSparseMoeBlock``, transformers 5.23): softmax router, the top
``num_experts_per_tok`` of ``num_experts`` (renormalised with ``norm_topk_prob``), SwiGLU
experts of ``moe_intermediate_size``, plus a shared SwiGLU expert of
``shared_expert_intermediate_size`` on every token, scaled by ``sigmoid(shared_expert_gate
h)``. Layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` keep a dense MLP of
``intermediate_size``. The block's MoE arithmetic: SPEC.md 4.8. Sliding windows
(``use_sliding_window``) are not supported yet. GGUF: ``general.architecture ==
"qwen2moe"`` (every layer sparse, with the shared expert; the top-k weights never
renormalised: llama.cpp's qwen2moe.cpp fixes ``norm_w = false``, the file states nothing).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import _ATTN, _ATTN_BIAS, _PRE_NORMS, _TOP, GGUFArch, _Keys
from ._gguf_moe import (
    MOE_BLOCK,
    MOE_REQUIRED,
    SHARED_BLOCK,
    SHARED_REQUIRED,
    moe_convert,
    qwen_moe_config,
    stack_experts,
)
from .moe_config import moe_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
MODEL_TYPES = ("qwen2_moe",)

#: ``Qwen2MoeConfig`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
    "qkv_bias": True,
    "bos_token_id": None,
    "eos_token_id": None,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Qwen2-MoE model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Qwen2MoeConfig`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.qwen2.spec_from_config`; also ``use_sliding_window``
        true or a sliding ``layer_types`` entry (not supported yet), and the MoE fields
        :func:`~exactblocks.models.moe_config.moe_fields` refuses.
    """
    c = ConfigReader(config, DEFAULTS, "qwen2_moe")
    sizes = heads_and_dims(c)
    types = c.resolved.get("layer_types")
    if c.flag("use_sliding_window") or (types and any(t != "full_attention" for t in types)):
        raise ValueError(
            "load_model: config field 'use_sliding_window'=True (or a sliding 'layer_types' "
            "entry) is not supported by the qwen2_moe family yet (expected full attention)"
        )
    bias = c.flag("qkv_bias")
    n = sizes["n_layers"]
    spec = DecoderSpec(
        family="qwen2_moe",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        windows=(0,) * n,
        **moe_fields(
            c, n, norm_topk_key="norm_topk_prob", shared_key="shared_expert_intermediate_size"
        ),  # fmt: skip
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _gguf_config(k: _Keys, names) -> dict:
    """src/models/qwen2moe.cpp: Qwen2's keys (q/k/v biases when the file holds them), every
    layer an MoE layer of ``expert_feed_forward_length`` wide experts (default
    ``feed_forward_length / expert_used_count``) plus the shared expert of
    ``expert_shared_feed_forward_length`` (default ``feed_forward_length``) behind its sigmoid
    gate; softmax routing, top-k not renormalised (fixed in llama.cpp's graph)."""
    return qwen_moe_config(k, names, shared=True)


GGUF = GGUFArch(
    "qwen2moe",
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    _gguf_config,
    {
        **_ATTN,
        **{k: v for k, v in _ATTN_BIAS.items() if k != "attn_output.bias"},
        **_PRE_NORMS,
        **MOE_BLOCK,
        **SHARED_BLOCK,
    },
    _TOP,
    convert=moe_convert,
    finish=stack_experts,
    required=MOE_REQUIRED + SHARED_REQUIRED,
)
