"""Phi-3 (HF ``Phi3ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer with fused projections (``self_attn.qkv_proj``: q, k, v rows; ``mlp.gate_up_proj``:
gate rows then up rows, HF ``Phi3MLP`` ``chunk(2)``; the block splits them once at load),
partial RoPE (``partial_rotary_factor``), ``longrope`` scaling (legacy ``su`` / ``yarn`` names
mean longrope, as HF ``Phi3Config``) and an optional window on every layer. Longrope's short or
long factor set is fixed per state when it is allocated (``TransformerBlockInference``); HF
switches by the current length, so the two agree while a sequence stays on one side of
``original_max_position_embeddings``. HF fields read (transformers 5.23 ``Phi3Config``): as
Llama without biases, plus original_max_position_embeddings, sliding_window and the dropout
fields (no effect on inference).
GGUF: ``general.architecture == "phi3"`` (``exactblocks.loaders.gguf_archs``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._config import ConfigReader
from ._decoder import DecoderSpec, freeze
from .llama import heads_and_dims

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF_ARCHS", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Phi3ForCausalLM",)
MODEL_TYPES = ("phi3",)
GGUF_ARCHS = ("phi3",)

#: ``Phi3Config`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "bos_token_id": 1,
    "eos_token_id": 32000,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Phi-3 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Phi3Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        A RoPE type other than default/longrope (HF ``Phi3Config.validate_rope``), a partial
        rotary factor giving an odd or empty rotated width, a bad ``sliding_window``, bad sizes.
    """
    raw = dict(config)
    for key in ("rope_parameters", "rope_scaling"):  # HF: "su" and "yarn" mean longrope
        rp = raw.get(key)
        if isinstance(rp, Mapping) and rp.get("rope_type", rp.get("type")) in ("su", "yarn"):
            raw[key] = {**{k: v for k, v in rp.items() if k != "type"}, "rope_type": "longrope"}
    c = ConfigReader(raw, DEFAULTS, "phi3")
    sizes = heads_and_dims(c)
    theta, scaling, prf = c.rope(default_theta=10000.0, partial=True)
    if scaling is not None and scaling["rope_type"] != "longrope":
        c._fail("rope_parameters['rope_type']", scaling["rope_type"], "'default' or 'longrope'")
    hd = sizes["head_dim"]
    rope_dim = int(hd * prf)  # HF: int(head_dim * partial_rotary_factor)
    if rope_dim % 2 or rope_dim < 2:
        c._fail("partial_rotary_factor", prf, f"a factor giving an even width >= 2 of {hd}")
    window = c.int("sliding_window", allow_none=True)
    spec = DecoderSpec(
        family="phi3",
        **sizes,
        rope_theta=theta,
        rope_scaling=freeze(scaling),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        windows=(window or 0,) * sizes["n_layers"],
        rope_dim=None if rope_dim == hd else rope_dim,
        fused_qkv=True,
        fused_gate_up=True,
    )
    return spec, c.resolved
