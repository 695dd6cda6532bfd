"""Mixtral (HF ``MixtralForCausalLM``): HF config -> :class:`DecoderSpec`.

Mistral's layer (GQA, optional sliding window over every layer) with a mixture-of-experts MLP
in every layer (HF ``MixtralSparseMoeBlock``, transformers 5.23): softmax router, the top
``num_experts_per_tok`` of ``num_local_experts`` always renormalised, SwiGLU experts of
``intermediate_size``. Checkpoints name them ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.e.{w1,w3,w2}`` (gate, up, down); transformers 5's in-memory model
stacks them under ``mlp.``. The block's MoE arithmetic: SPEC.md 4.8. ``router_jitter_noise``
other than 0 is refused (training only). GGUF: ``general.architecture == "llama"`` with
``llama.expert_count`` >= 1 (:data:`GGUF_EXPERTS`; llama.cpp's converter writes Mixtral so):
experts ``feed_forward_length`` wide, the top-k weights always renormalised (llama.cpp's
llama.cpp graph fixes ``norm_w = true``, as HF Mixtral), no sliding window (llama.cpp's llama
graph has none).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import _ATTN, _PRE_NORMS, _TOP, GGUFArch, _Keys, _unpermute_qk
from ._gguf_moe import MOE_BLOCK, MOE_REQUIRED, moe_config, moe_convert, stack_experts
from .llama import _llama_config
from .moe_config import moe_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "GGUF_EXPERTS", "MODEL_TYPES", "spec_from_config"]

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

#: llama.cpp writes Mixtral under ``llama`` (:data:`GGUF_EXPERTS`), not an architecture of its own
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


# -- GGUF: llama.cpp writes Mixtral as arch llama with experts ----------------------------------


def _gguf_config(k: _Keys, names) -> dict:
    """src/models/llama.cpp with ``expert_count`` >= 1: Llama's keys (as
    :func:`exactblocks.models.llama._llama_config`), every layer an MoE layer of
    ``feed_forward_length`` wide experts, softmax routing, top-k renormalised (fixed in
    llama.cpp's graph). Granite-MoE's shared expert (``expert_shared_feed_forward_length``)
    is refused."""
    shared = k.get("expert_shared_feed_forward_length", 0)
    if shared:
        k.fail("expert_shared_feed_forward_length", shared, "0: a Mixtral has no shared expert")
    ff = k.need("feed_forward_length")
    moe = moe_config(k, n_ff=ff if isinstance(ff, int) else 0, width_key=None, shared=False)
    c = _llama_config(k, names, experts=True)
    for key in ("attention_bias", "mlp_bias"):  # not MixtralConfig fields: Mixtral has neither
        c.pop(key)
    moe["num_local_experts"] = moe.pop("num_experts")
    del moe["norm_topk_prob"]  # (HF Mixtral always renormalises, as llama.cpp)
    c.update(moe, sliding_window=None, router_jitter_noise=0.0)
    return c


def _convert(name: str, w, config: dict):
    """The router as float32 (:func:`~exactblocks.models._gguf_moe.moe_convert`), q/k rows
    un-permuted (conversion/llama.py permutes them, as for a Llama)."""
    return [pair for n, a in moe_convert(name, w, config) for pair in _unpermute_qk(n, a, config)]


GGUF_EXPERTS = GGUFArch(
    "llama",
    "MixtralForCausalLM",
    "mixtral",
    _gguf_config,
    {**_ATTN, **_PRE_NORMS, **MOE_BLOCK},
    _TOP,
    convert=_convert,
    finish=stack_experts,
    required=MOE_REQUIRED,
)
