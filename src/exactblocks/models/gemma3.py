"""Gemma 3 text (HF ``Gemma3ForCausalLM``, ``model_type`` gemma3_text): HF config -> spec.

Gemma 2's layer (sandwich norms, Gemma RMSNorm ``x * (1 + w)``, scores scaled by
``query_pre_attn_scalar ** -0.5``, embedding times ``sqrt(hidden_size)``, optional attention
and final softcaps) plus a per-head Gemma RMSNorm of q and k over head_dim before RoPE, a
per-layer sliding/global pattern (``layer_types``; absent: every ``sliding_window_pattern``-th
layer is global, HF ``__post_init__``) and a RoPE per layer type: ``rope_parameters`` holds one
entry for ``sliding_attention`` and one for ``full_attention`` (files written by 4.x:
``rope_local_base_freq`` for sliding layers, ``rope_theta`` and ``rope_scaling`` for global
ones; HF defaults 10000 and 1e6). HF fields read (transformers 5.23 ``Gemma3TextConfig``): as
Gemma 2, plus sliding_window_pattern, rope_local_base_freq. GGUF: ``general.architecture ==
"gemma3"`` (``exactblocks.loaders.gguf`` maps the file to these fields; its norm weights are
stored as ``1 + w``, so a GGUF's spec takes ``norm='rmsnorm'``, ``GGUF_SPEC_CHANGES``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._config import ConfigReader
from ._decoder import DecoderSpec, freeze
from .gemma2 import gemma_common
from .llama import layer_windows

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF_ARCHS", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = ("gemma3_text",)
GGUF_ARCHS = ("gemma3",)

#: ``Gemma3TextConfig`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

#: ``Gemma3TextConfig.default_theta``: the RoPE base of each layer type when the file has none.
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def layer_type_ropes(c: ConfigReader) -> dict:
    """``{layer type: (rope_theta, scaling items or None)}`` as HF
    ``Gemma3TextConfig.convert_rope_params_to_dict`` resolves them."""
    rp = c.raw.get("rope_parameters")
    if rp is None:  # 4.x file: rope_theta / rope_scaling for global, rope_local_base_freq local
        legacy = c.raw.get("rope_scaling")
        full = dict(legacy) if isinstance(legacy, Mapping) else {"rope_type": "default"}
        full.setdefault("rope_theta", c.raw.get("rope_theta", DEFAULT_THETA["full_attention"]))
        local_theta = c.raw.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])
        local = {"rope_type": "default", "rope_theta": local_theta}
        per_type = {
            "full_attention": (full, "rope_scaling"),
            "sliding_attention": (local, "rope_local_base_freq"),
        }
    else:
        if not isinstance(rp, Mapping) or not set(rp) <= set(DEFAULT_THETA):
            expected = "a mapping keyed by 'full_attention' and 'sliding_attention'"
            c._fail("rope_parameters", rp, expected + " (one RoPE per layer type)")
        per_type = {
            t: (dict(rp.get(t) or {"rope_type": "default"}), f"rope_parameters[{t!r}]")
            for t in DEFAULT_THETA
        }
    out = {}
    for t, (params, field) in per_type.items():
        theta, scaling, _ = c.rope(DEFAULT_THETA[t], params=params, field=field)
        out[t] = (theta, freeze(scaling))
    return out


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Gemma 3 text model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Gemma3TextConfig`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.gemma2.spec_from_config`; also a malformed
        ``rope_parameters`` or ``sliding_window_pattern``.
    """
    c = ConfigReader(config, DEFAULTS, "gemma3")
    common = gemma_common(c, "gemma3")
    n = common["n_layers"]
    if c.resolved.get("layer_types") is None:  # HF Gemma3TextConfig.__post_init__
        c.resolved.setdefault("sliding_window_pattern", 6)
        pattern = c.int("sliding_window_pattern")
        c.resolved["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
    windows = layer_windows(c, n)
    ropes = layer_type_ropes(c)
    layer_ropes = tuple(ropes[t] for t in c.resolved["layer_types"])
    spec = DecoderSpec(
        **common,
        rope_theta=ropes["full_attention"][0],
        rope_scaling=ropes["full_attention"][1],
        qk_norm=True,
        windows=windows,
        layer_ropes=layer_ropes,
    )
    return spec, c.resolved
