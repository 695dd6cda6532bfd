"""Mistral (HF ``MistralForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer with a sliding window on every layer (HF ``MistralAttention`` passes
``sliding_window`` to every layer and ``MistralModel`` builds a sliding-window causal mask when
it is set), no attention or MLP biases. HF fields read (transformers 5.23 ``MistralConfig``): as
Llama without attention_bias/mlp_bias, plus sliding_window (null = full attention).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("MistralForCausalLM",)
MODEL_TYPES = ("mistral",)
GGUF = None  # llama.cpp writes Mistral models with general.architecture == "llama"

#: ``MistralConfig`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Mistral model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``MistralConfig`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.llama.spec_from_config`; also a ``sliding_window`` that is
        not null or an integer >= 1, and ``layer_types`` (HF MistralModel ignores them and
        warns: such a file is meant for another class).
    """
    c = ConfigReader(config, DEFAULTS, "mistral")
    if c.raw.get("layer_types") is not None:
        raise ValueError(
            "load_model: config field 'layer_types' is set, which MistralForCausalLM ignores "
            "(transformers warns to use the Ministral classes); refusing a silently different model"
        )
    sizes = heads_and_dims(c)
    window = c.integer("sliding_window", allow_none=True)
    spec = DecoderSpec(
        family="mistral",
        **sizes,
        **rope_fields(c),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        windows=(window or 0,) * sizes["n_layers"],
    )
    return spec, c.resolved
