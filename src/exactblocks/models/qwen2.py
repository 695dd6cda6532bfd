"""Qwen2 (HF ``Qwen2ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer with biases on q/k/v (always: HF ``Qwen2Attention`` builds them with
``bias=True``) and none on o_proj, and a per-layer window from ``layer_types``. HF fields read
(transformers 5.23 ``Qwen2Config``): as Llama without attention_bias/mlp_bias (head_dim, when
the file has none, = hidden_size // num_attention_heads), plus use_sliding_window, sliding_window,
max_window_layers and layer_types (derived as HF ``__post_init__`` does when absent).
GGUF: ``general.architecture == "qwen2"``.
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

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)

#: ``Qwen2Config`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


def sliding_layer_types(c: ConfigReader, n_layers: int) -> None:
    """HF ``Qwen2Config.__post_init__`` (Qwen3 alike): sliding_window is None unless
    use_sliding_window; absent layer_types become sliding for layers >= max_window_layers."""
    if not c.flag("use_sliding_window"):
        c.resolved["sliding_window"] = None
    if c.resolved.get("layer_types") is None:
        window = c.resolved["sliding_window"]
        first = c.integer("max_window_layers", minimum=0)
        c.resolved["layer_types"] = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(n_layers)
        ]


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Qwen2 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Qwen2Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.llama.spec_from_config`; also bad ``layer_types`` or
        ``sliding_window`` values.
    """
    c = ConfigReader(config, DEFAULTS, "qwen2")
    # Qwen2Attention: getattr(config, "head_dim", hidden_size // num_attention_heads)
    c.resolved.setdefault("head_dim", None)
    sizes = heads_and_dims(c)
    sliding_layer_types(c, sizes["n_layers"])
    spec = DecoderSpec(
        family="qwen2",
        **sizes,
        **rope_fields(c),
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        windows=layer_windows(c, sizes["n_layers"]),
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


GGUF = GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", _qwen_config, _QWEN_BLOCK, _TOP)
