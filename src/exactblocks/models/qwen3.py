"""Qwen3 (HF ``Qwen3ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer with a per-head RMSNorm of q and k over head_dim before RoPE (HF ``Qwen3Attention``
``q_norm``/``k_norm``, same epsilon as the block norms), optional attention biases on q/k/v and
o (``attention_bias``), a free head_dim (default 128, HF's) and per-layer windows from
``layer_types``. GGUF: ``general.architecture == "qwen3"``.
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, layer_windows, rope_fields
from ._gguf import (
    _QWEN_BLOCK,
    _TOP,
    GGUFArch,
    _qwen_config,
)
from .qwen2 import sliding_layer_types

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)

#: ``Qwen3Config`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Qwen3 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Qwen3Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.qwen2.spec_from_config`.
    """
    c = ConfigReader(config, DEFAULTS, "qwen3")
    sizes = heads_and_dims(c)
    sliding_layer_types(c, sizes["n_layers"])
    bias = c.flag("attention_bias")
    spec = DecoderSpec(
        family="qwen3",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        windows=layer_windows(c, sizes["n_layers"]),
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


GGUF = GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", _qwen_config, _QWEN_BLOCK, _TOP)
