"""Mixtral (HF ``MixtralForCausalLM``): HF config -> :class:`DecoderSpec`.

Mistral's layer (GQA, optional sliding window over every layer) with a mixture-of-experts MLP
in every layer (HF ``MixtralSparseMoeBlock``, transformers 5.23): softmax router, the top
``num_experts_per_tok`` of ``num_local_experts`` always renormalised, SwiGLU experts of
``intermediate_size``. Checkpoints name them ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.e.{w1,w3,w2}`` (gate, up, down); transformers 5's in-memory model
stacks them under ``mlp.``. The block's MoE arithmetic: SPEC.md 4.8. ``router_jitter_noise``
other than 0 is refused (training only). GGUF: not yet.
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from .moe_config import moe_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)

#: ``MixtralConfig`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
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
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_jitter_noise": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

GGUF = None


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Mixtral model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``MixtralConfig`` fields (``num_experts`` is HF's alias of ``num_local_experts``).

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.mistral.spec_from_config`; also the MoE fields
        :func:`~exactblocks.models.moe_config.moe_fields` refuses.
    """
    c = ConfigReader(config, DEFAULTS, "mixtral")
    sizes = heads_and_dims(c)
    window = c.integer("sliding_window", allow_none=True)
    n = sizes["n_layers"]
    spec = DecoderSpec(
        family="mixtral",
        **sizes,
        **rope_fields(c),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        windows=(window or 0,) * n,
        moe_files=("block_sparse_moe.", "w1", "w3", "w2"),
        **moe_fields(c, n, norm_topk_key=None),
    )
    return spec, c.resolved
