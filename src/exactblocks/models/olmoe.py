"""OLMoE (HF ``OlmoeForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's pre-norm layer with an RMSNorm of q over all ``heads * head_dim`` values and of k over
all ``kv_heads * head_dim`` values before RoPE (HF ``OlmoeAttention`` ``q_norm`` / ``k_norm``,
as OLMo 2's) and a mixture-of-experts MLP in every layer (HF ``OlmoeSparseMoeBlock``,
transformers 5.23): softmax router, top ``num_experts_per_tok`` of ``num_experts``
(renormalised with ``norm_topk_prob``), SwiGLU experts of ``intermediate_size``. The block's
MoE arithmetic: SPEC.md 4.8. ``clip_qkv`` (clamping q, k, v) is refused. GGUF:
``general.architecture == "olmoe"`` (experts ``feed_forward_length`` wide; the top-k weights
never renormalised: llama.cpp's olmoe.cpp fixes ``norm_w = false``, the file states nothing).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import _ATTN, _ATTN_BIAS, _PRE_NORMS, _TOP, GGUFArch, _common, _has, _Keys, _rope
from ._gguf_moe import MOE_BLOCK, MOE_REQUIRED, moe_config, moe_convert, stack_experts
from .moe_config import moe_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("OlmoeForCausalLM",)
MODEL_TYPES = ("olmoe",)

#: ``OlmoeConfig`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "clip_qkv": None,
    "num_experts_per_tok": 8,
    "num_experts": 64,
    "norm_topk_prob": False,
    "bos_token_id": None,
    "eos_token_id": 50279,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of an OLMoE model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``OlmoeConfig`` fields (``num_local_experts`` is HF's alias of ``num_experts``).

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.llama.spec_from_config`; also ``clip_qkv`` set, and the
        MoE fields :func:`~exactblocks.models.moe_config.moe_fields` refuses.
    """
    c = ConfigReader(config, DEFAULTS, "olmoe")
    if c.get("clip_qkv") is not None:
        raise ValueError(
            f"load_model: config field 'clip_qkv'={c.get('clip_qkv')!r} is not supported by "
            "the olmoe family (the block does not clamp q, k and v; expected null)"
        )
    sizes = heads_and_dims(c)
    bias = c.flag("attention_bias")
    n = sizes["n_layers"]
    spec = DecoderSpec(
        family="olmoe",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        qk_norm_scope="all_heads",
        windows=(0,) * n,
        **moe_fields(c, n, norm_topk_key="norm_topk_prob"),
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _gguf_config(k: _Keys, names) -> dict:
    """src/models/olmoe.cpp: the common keys, q/k RMSNorms over all heads, every layer an MoE
    layer of ``feed_forward_length`` wide experts, softmax routing, top-k not renormalised
    (fixed in llama.cpp's graph). The file has no clamp of q/k/v (conversion/olmo.py writes
    none for OLMoE)."""
    c = _common(k, names, eps_key="rms_norm_eps", experts=True)
    c.update(_rope(k, c["head_dim"]))
    c.update(hidden_act="silu", clip_qkv=None, attention_bias=_has(names, "attn_q.bias"))
    c.update(moe_config(k, n_ff=c["intermediate_size"], width_key=None, shared=False))
    return c


GGUF = GGUFArch(
    "olmoe",
    "OlmoeForCausalLM",
    "olmoe",
    _gguf_config,
    {
        **_ATTN,
        **_ATTN_BIAS,
        **_PRE_NORMS,
        **MOE_BLOCK,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    _TOP,
    convert=moe_convert,
    finish=stack_experts,
    required=MOE_REQUIRED,
)
