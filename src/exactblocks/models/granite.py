"""Granite (HF ``GraniteForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer with four scalars: the embedding rows times ``embedding_multiplier``, the
attention scores times ``attention_multiplier`` (instead of ``head_dim ** -0.5``), both
residual branches times ``residual_multiplier`` and the logits divided by ``logits_scaling``
(HF ``GraniteForCausalLM.forward``: ``logits / logits_scaling`` in float32). HF fields read
(transformers 5.23 ``GraniteConfig``): as Llama, plus those four.
GGUF: ``general.architecture == "granite"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import (
    _LLAMA_LIKE,
    _TOP,
    GGUFArch,
    _common,
    _has,
    _Keys,
    _rope,
    _unpermute_qk,
)

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("GraniteForCausalLM",)
MODEL_TYPES = ("granite",)

#: ``GraniteConfig`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def granite_scalars(c: ConfigReader) -> dict:
    """The four Granite multipliers as :class:`DecoderSpec` fields (shared with
    Granite-4.0-H)."""
    emb = c.number("embedding_multiplier")
    return {
        "embed_scale": None if emb == 1.0 else emb,
        "attn_scale": c.number("attention_multiplier"),
        "residual_multiplier": c.number("residual_multiplier"),
        "logits_scaling": c.number("logits_scaling"),
    }


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Granite model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``GraniteConfig`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.llama.spec_from_config`; also a multiplier that is not a
        finite number > 0.
    """
    c = ConfigReader(config, DEFAULTS, "granite")
    sizes = heads_and_dims(c)
    bias = c.flag("attention_bias")
    spec = DecoderSpec(
        family="granite",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=c.flag("mlp_bias"),
        qk_norm=False,
        windows=(0,) * sizes["n_layers"],
        **granite_scalars(c),
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _granite_config(k: _Keys, names) -> dict:
    """src/models/granite.cpp: logit_scale required; residual/embedding scale 0 (absent) = none;
    attention.scale 0 (absent) = 1/sqrt(head_dim); rope.scaling.finetuned is its RoPE switch
    (default true; false = no RoPE, which HF Granite does not have)."""
    c = _common(k, names, eps_key="rms_norm_eps")
    if k.get("rope.scaling.finetuned", True) is not True:
        k.fail("rope.scaling.finetuned", False, "true: Granite without RoPE is not an HF model")
    c.update(_rope(k, c["head_dim"]))
    c["logits_scaling"] = float(k.need("logit_scale"))
    c["residual_multiplier"] = float(k.get("residual_scale", 0.0)) or 1.0
    c["embedding_multiplier"] = float(k.get("embedding_scale", 0.0)) or 1.0
    c["attention_multiplier"] = float(k.get("attention.scale", 0.0)) or c["head_dim"] ** -0.5
    if k.get("expert_shared_feed_forward_length"):
        k.fail("expert_shared_feed_forward_length", k.get("expert_shared_feed_forward_length"),
               "none: Granite MoE is not read")  # fmt: skip
    c["attention_bias"] = _has(names, "attn_q.bias")
    c["mlp_bias"] = _has(names, "ffn_up.bias")
    c["hidden_act"] = "silu"
    return c


GGUF = GGUFArch(
    "granite",
    "GraniteForCausalLM",
    "granite",
    _granite_config,
    _LLAMA_LIKE,
    _TOP,
    convert=_unpermute_qk,
)
