"""Gemma 2 (HF ``Gemma2ForCausalLM``): HF config -> :class:`DecoderSpec`.

Gemma's layer: sandwich norms (``input_layernorm`` and ``post_attention_layernorm`` around the
attention, ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP), the
Gemma RMSNorm ``x * (1 + w)`` everywhere (the final norm too), a gated tanh-GELU MLP, scores
scaled by ``query_pre_attn_scalar ** -0.5`` and softcapped (``attn_logit_softcapping``),
sliding and global layers alternating (``layer_types``; absent: even layers slide, HF
``__post_init__``), the embedding rows times ``hidden_size ** 0.5`` rounded to the embedding's
dtype (HF ``Gemma2TextScaledWordEmbedding``) and the final logits softcapped
(``final_logit_softcapping``). HF fields read (transformers 5.23 ``Gemma2Config``): vocab_size,
hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
head_dim, hidden_activation, max_position_embeddings, rms_norm_eps, tie_word_embeddings,
rope_parameters (or rope_theta/rope_scaling), attention_bias, query_pre_attn_scalar,
sliding_window, layer_types, final_logit_softcapping, attn_logit_softcapping,
use_bidirectional_attention (refused when set).
GGUF: ``general.architecture == "gemma2"`` (``exactblocks.loaders.gguf_archs``).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec
from .llama import GATED_MLP, heads_and_dims, layer_windows, rope_fields

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF_ARCHS", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Gemma2ForCausalLM",)
MODEL_TYPES = ("gemma2",)
GGUF_ARCHS = ("gemma2",)

#: ``Gemma2Config`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def optional_positive(c: ConfigReader, key: str) -> float | None:
    """A field that is null (off) or a finite number > 0 (softcaps)."""
    return None if c.get(key) is None else c.float(key)


def gemma_common(c: ConfigReader, family: str) -> dict:
    """The fields Gemma 2 and Gemma 3 read the same way (everything but RoPE and q/k norms).

    Raises
    ------
    ValueError
        ``use_bidirectional_attention`` set (an encoder-style mask the blocks do not have), or
        a field value the blocks cannot follow (named).
    """
    if c.get("use_bidirectional_attention"):
        c._fail("use_bidirectional_attention", c.get("use_bidirectional_attention"),
                "false: bidirectional attention is not causal decoding")  # fmt: skip
    sizes = heads_and_dims(c, act_key="hidden_activation", acts=GATED_MLP)
    bias = c.bool("attention_bias")
    return {
        "family": family,
        **sizes,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": False,
        "norm": "rmsnorm_offset",
        "norm_placement": "sandwich",
        # HF: self.scaling = config.query_pre_attn_scalar**-0.5, a binary64 pow, then a float32
        # multiply of the scores: the same value here, rounded to float32 once by the block
        "attn_scale": float(c.float("query_pre_attn_scalar")) ** -0.5,
        "attn_softcap": optional_positive(c, "attn_logit_softcapping"),
        # HF: nn.Buffer(torch.tensor(hidden_size**0.5)) cast to the embedding's dtype
        "embed_scale": float(sizes["d_model"]) ** 0.5,
        "logit_softcap": optional_positive(c, "final_logit_softcapping"),
    }


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Gemma 2 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Gemma2Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        A ``hidden_activation`` other than gelu_pytorch_tanh/gelu, a RoPE type the blocks do
        not compute, bad ``layer_types`` / ``sliding_window``, bidirectional attention, bad
        sizes (the message names the field).
    """
    c = ConfigReader(config, DEFAULTS, "gemma2")
    common = gemma_common(c, "gemma2")
    n = common["n_layers"]
    if c.resolved.get("layer_types") is None:  # HF Gemma2Config.__post_init__
        c.resolved["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
        ]
    spec = DecoderSpec(**common, **rope_fields(c), qk_norm=False, windows=layer_windows(c, n))
    return spec, c.resolved
