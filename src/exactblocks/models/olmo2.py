"""OLMo 2 (HF ``Olmo2ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's attention and MLP with the norms after them instead of before (``post`` placement:
``x + N(attn(x))``, then ``x + N(mlp(x))``, weights ``post_attention_layernorm`` and
``post_feedforward_layernorm``, no input norm) and an RMSNorm of q over all
``heads * head_dim`` values and of k over all ``kv_heads * head_dim`` values before RoPE (HF
``Olmo2Attention`` ``q_norm`` / ``k_norm``, one weight element per value). HF fields read
(transformers 5.23 ``Olmo2Config``): as Llama (``attention_bias`` gives q/k/v/o biases; no
mlp_bias). GGUF: ``general.architecture == "olmo2"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import (
    _ATTN,
    _GLU,
    _TOP,
    GGUFArch,
    _common,
    _Keys,
    _rope,
)

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Olmo2ForCausalLM",)
MODEL_TYPES = ("olmo2",)

#: ``Olmo2Config`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": 50279,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of an OLMo 2 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Olmo2Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.llama.spec_from_config`.
    """
    c = ConfigReader(config, DEFAULTS, "olmo2")
    sizes = heads_and_dims(c)
    bias = c.flag("attention_bias")
    spec = DecoderSpec(
        family="olmo2",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        windows=(0,) * sizes["n_layers"],
        norm_placement="post",
        qk_norm_scope="all_heads",
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _olmo2_config(k: _Keys, names) -> dict:
    """src/models/olmo2.cpp: norms after attention and MLP, RMSNorm of all q (k) values; a
    sliding window (OLMo 3) is not OLMo 2 and is refused."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    window = k.get("attention.sliding_window", 0)
    if window:
        k.fail("attention.sliding_window", window, "none: OLMo 2 has no sliding window")
    k.get("attention.sliding_window_pattern")
    c["attention_bias"] = False
    c["hidden_act"] = "silu"
    return c


GGUF = GGUFArch(
    "olmo2",
    "Olmo2ForCausalLM",
    "olmo2",
    _olmo2_config,
    {
        **_ATTN,
        **_GLU,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    _TOP,
)
