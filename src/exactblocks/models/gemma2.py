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
GGUF: ``general.architecture == "gemma2"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

import numpy as np

from ._config import ConfigReader
from ._decoder import GATED_MLP, DecoderSpec, heads_and_dims, layer_windows, rope_fields
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

ARCHITECTURES = ("Gemma2ForCausalLM",)
MODEL_TYPES = ("gemma2",)

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
    return None if c.get(key) is None else c.number(key)


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
    bias = c.flag("attention_bias")
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
        "attn_scale": float(c.number("query_pre_attn_scalar")) ** -0.5,
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


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _gemma2_config(k: _Keys, names) -> dict:
    """src/models/gemma2.cpp ``load_arch_hparams``: window 4096 and period 2 unless stated,
    softcaps 50 / 30 unless stated (llama-hparams.h), scores scaled by head_dim ** -0.5 except
    the 46-layer (27B) model, hidden_size / heads (gemma_pytorch config.py); GELU (tanh) MLP."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    if k.get("rope.freq_base_swa", c["rope_theta"]) != c["rope_theta"]:
        k.fail("rope.freq_base_swa", k.get("rope.freq_base_swa"), "rope.freq_base (Gemma 2)")
    period = k.get("attention.sliding_window_pattern", 2)
    if isinstance(period, list) or not isinstance(period, int) or period < 0:
        k.fail("attention.sliding_window_pattern", period, "a period >= 0")
    n = c["num_hidden_layers"]
    # llama_hparams::set_swa_pattern: layer il slides iff n == 0 or il % n < n - 1
    c["layer_types"] = [
        "sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
        for i in range(n)
    ]
    c["sliding_window"] = k.get("attention.sliding_window", 4096)
    c["attn_logit_softcapping"] = float(k.get("attn_logit_softcapping", 50.0))
    c["final_logit_softcapping"] = float(k.get("final_logit_softcapping", 30.0))
    c["query_pre_attn_scalar"] = (
        c["hidden_size"] // c["num_attention_heads"] if n == 46 else c["head_dim"]
    )
    c["hidden_activation"] = "gelu_pytorch_tanh"  # build_ffn(..., LLM_FFN_GELU, LLM_FFN_PAR)
    c["tie_word_embeddings"] = True  # load_arch_tensors: output = token_embd, always
    return c


def _gemma_norm(name: str, w, config: dict):
    """The converter stores Gemma's RMSNorm weights as ``w + 1`` (conversion/gemma.py
    ``Gemma2Model.modify_tensors``: every ``norm.weight``); HF's ``Gemma2RMSNorm`` holds ``w``
    and computes ``1 + w``. ``s - 1`` is exact when ``s = float32(1 + w)`` lies in [0.5, 2]
    (Sterbenz), and the block's ``float32(1 + (s - 1))`` is then ``s`` again: the model
    computes with the file's values, bit for bit (an exhaustive check over every float32 ``w``
    found one exception, ``w = -16777218``; test_models_gguf_archs checks the bits)."""
    if name.endswith("norm.weight"):
        s = np.asarray(w, dtype=np.float32)
        return [(name, s - np.float32(1.0))]
    return [(name, w)]


GGUF = GGUFArch(
    "gemma2",
    "Gemma2ForCausalLM",
    "gemma2",
    _gemma2_config,
    {
        **_ATTN,
        **_GLU,
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    {k: v for k, v in _TOP.items() if k != "output.weight"},
    convert=_gemma_norm,
)
