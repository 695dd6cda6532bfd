"""SmolLM3 (HF ``SmolLM3ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer where some layers have no RoPE at all (``no_rope_layers[i] == 0``; absent: every
``no_rope_layer_interval``-th layer, HF ``__post_init__``) and optional sliding windows per
layer (``use_sliding_window`` with ``layer_types``). HF fields read (transformers 5.23
``SmolLM3Config``): as Llama (default RoPE base 2e6), plus no_rope_layers,
no_rope_layer_interval, use_sliding_window, sliding_window, layer_types.
GGUF: ``general.architecture == "smollm3"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, freeze, heads_and_dims, layer_windows
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

ARCHITECTURES = ("SmolLM3ForCausalLM",)
MODEL_TYPES = ("smollm3",)

#: ``SmolLM3Config`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
    "sliding_window": None,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "layer_types": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a SmolLM3 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``SmolLM3Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.llama.spec_from_config`; also a ``no_rope_layers`` that is
        not one 0/1 flag per layer, bad ``layer_types`` / ``sliding_window``.
    """
    c = ConfigReader(config, DEFAULTS, "smollm3")
    sizes = heads_and_dims(c)
    n = sizes["n_layers"]
    if c.resolved.get("no_rope_layers") is None:  # HF SmolLM3Config.__post_init__
        every = c.integer("no_rope_layer_interval")
        c.resolved["no_rope_layers"] = [int((i + 1) % every != 0) for i in range(n)]
    flags = c.get("no_rope_layers")
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        c._fail("no_rope_layers", flags, f"{n} flags, 1 = RoPE, 0 = none (num_hidden_layers)")
    sliding = c.flag("use_sliding_window")
    if c.resolved.get("layer_types") is None:
        c.resolved["layer_types"] = [
            "sliding_attention"
            if sliding and c.get("sliding_window") is not None and not f
            else "full_attention"
            for f in flags
        ]
    # HF SmolLM3Model masks each layer by its layer type (create_sliding_window_causal_mask
    # with config.sliding_window for 'sliding_attention'), whatever use_sliding_window says
    windows = layer_windows(c, n)
    theta, scaling, _ = c.rope(default_theta=2_000_000.0)
    spec = DecoderSpec(
        family="smollm3",
        **sizes,
        rope_theta=theta,
        rope_scaling=freeze(scaling),
        qkv_bias=c.flag("attention_bias"),
        o_bias=c.flag("attention_bias"),
        mlp_bias=c.flag("mlp_bias"),
        qk_norm=False,
        windows=windows,
        nope_layers=tuple(i for i, f in enumerate(flags) if not f),
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _smollm3_config(k: _Keys, names) -> dict:
    """src/models/smollm3.cpp: ``n_no_rope_layer_step = 4`` fixed (layer il has RoPE iff
    (il + 1) % 4 != 0), no sliding window; q/k rows permuted as Llama (SmolLM3Model extends
    LlamaModel in conversion/llama.py)."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    n = c["num_hidden_layers"]
    c["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(n)]
    c["use_sliding_window"] = False
    c["layer_types"] = ["full_attention"] * n
    c["attention_bias"] = _has(names, "attn_q.bias")
    c["mlp_bias"] = _has(names, "ffn_up.bias")
    c["hidden_act"] = "silu"
    return c


GGUF = GGUFArch(
    "smollm3",
    "SmolLM3ForCausalLM",
    "smollm3",
    _smollm3_config,
    _LLAMA_LIKE,
    _TOP,
    convert=_unpermute_qk,
)
