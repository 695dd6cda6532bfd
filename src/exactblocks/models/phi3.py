"""Phi-3 (HF ``Phi3ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's layer with fused projections (``self_attn.qkv_proj``: q, k, v rows; ``mlp.gate_up_proj``:
gate rows then up rows, HF ``Phi3MLP`` ``chunk(2)``; the block splits them once at load),
partial RoPE (``partial_rotary_factor``), ``longrope`` scaling (legacy ``su`` / ``yarn`` names
mean longrope, as HF ``Phi3Config``) and an optional window on every layer. Longrope's short or
long factor set is fixed per state when it is allocated (``TransformerBlockInference``); HF
switches by the current length, so the two agree while a sequence stays on one side of
``original_max_position_embeddings``. HF fields read (transformers 5.23 ``Phi3Config``): as
Llama without biases, plus original_max_position_embeddings, sliding_window and the dropout
fields (no effect on inference).
GGUF: ``general.architecture == "phi3"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from exactblocks.loaders.gguf import dequantize

from ._config import ConfigReader
from ._decoder import DecoderSpec, freeze, heads_and_dims
from ._gguf import (
    _PRE_NORMS,
    _TOP,
    GGUFArch,
    _common,
    _Keys,
    _rope,
)

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Phi3ForCausalLM",)
MODEL_TYPES = ("phi3",)

#: ``Phi3Config`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "bos_token_id": 1,
    "eos_token_id": 32000,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Phi-3 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Phi3Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        A RoPE type other than default/longrope (HF ``Phi3Config.validate_rope``), a partial
        rotary factor giving an odd or empty rotated width, a bad ``sliding_window``, bad sizes.
    """
    raw = dict(config)
    for key in ("rope_parameters", "rope_scaling"):  # HF: "su" and "yarn" mean longrope
        rp = raw.get(key)
        if isinstance(rp, Mapping) and rp.get("rope_type", rp.get("type")) in ("su", "yarn"):
            raw[key] = {**{k: v for k, v in rp.items() if k != "type"}, "rope_type": "longrope"}
    c = ConfigReader(raw, DEFAULTS, "phi3")
    sizes = heads_and_dims(c)
    theta, scaling, prf = c.rope(default_theta=10000.0, partial=True)
    if scaling is not None and scaling["rope_type"] != "longrope":
        c._fail("rope_parameters['rope_type']", scaling["rope_type"], "'default' or 'longrope'")
    hd = sizes["head_dim"]
    rope_dim = int(hd * prf)  # HF: int(head_dim * partial_rotary_factor)
    if rope_dim % 2 or rope_dim < 2:
        c._fail("partial_rotary_factor", prf, f"a factor giving an even width >= 2 of {hd}")
    window = c.integer("sliding_window", allow_none=True)
    spec = DecoderSpec(
        family="phi3",
        **sizes,
        rope_theta=theta,
        rope_scaling=freeze(scaling),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        windows=(window or 0,) * sizes["n_layers"],
        rope_dim=None if rope_dim == hd else rope_dim,
        fused_qkv=True,
        fused_gate_up=True,
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _phi3_config(k: _Keys, names) -> dict:
    """conversion/phi.py ``Phi3MiniModel``: rope.dimension_count = partial rotary width;
    longrope as two whole-model tensors (``rope_factors_long/short.weight``), the original
    context and the attention factor as keys. src/models/phi3.cpp: SwiGLU on the fused
    ``ffn_up`` (gate rows first, as HF's ``gate_up_proj``)."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"], partial=True, kinds=("none", "linear", "longrope")))
    if "rope_scaling" in c:
        k.fail("rope.scaling.type", "linear", "longrope or none: HF Phi-3 has no linear RoPE")
    c["hidden_act"] = "silu"
    window = k.get("attention.sliding_window", 0)
    # HF Phi3 masks with sliding_window; llama.cpp 0.94 disables Phi SWA (phi3.cpp warns that
    # results "might be suboptimal"): the file states the window the model was trained with
    c["sliding_window"] = window or None
    long_f = _tensor(k.reader, "rope_factors_long.weight")
    short_f = _tensor(k.reader, "rope_factors_short.weight")
    orig = k.get("rope.scaling.original_context_length")
    attn = k.get("rope.scaling.attn_factor")
    if long_f is None and short_f is None:
        if k.get("rope.scaling.type") == "longrope":
            raise ValueError(
                "load_gguf_model: phi3.rope.scaling.type is 'longrope' but the file holds no "
                "rope_factors_long.weight / rope_factors_short.weight"
            )
        if attn not in (None, 1.0):
            k.fail("rope.scaling.attn_factor", attn, "1.0 without RoPE factor tensors")
        if orig is not None:
            c["original_max_position_embeddings"] = orig
        return c
    if long_f is None or short_f is None or orig is None:
        raise ValueError(
            "load_gguf_model: a phi3 GGUF with longrope needs rope_factors_long.weight, "
            "rope_factors_short.weight and phi3.rope.scaling.original_context_length"
        )
    c["original_max_position_embeddings"] = orig
    scaling = {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in long_f],
        "short_factor": [float(x) for x in short_f],
        "original_max_position_embeddings": orig,
    }
    if "partial_rotary_factor" in c:
        scaling["partial_rotary_factor"] = c["partial_rotary_factor"]
    # HF's default attention factor (Phi3 / _compute_longrope_parameters), in binary64; the
    # file holds it in float32, so only a different value is passed on
    factor = c["max_position_embeddings"] / orig
    default = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    if attn is not None and np.float32(attn) != np.float32(default):
        scaling["attention_factor"] = float(attn)
    scaling["rope_theta"] = c.pop("rope_theta")
    c["rope_parameters"] = scaling
    return c


def _tensor(reader, name: str):
    """A small whole-model F32 tensor as a float list, or None."""
    for t in reader.tensors:
        if t.name == name:
            return np.asarray(dequantize(t), dtype=np.float32).reshape(-1).tolist()
    return None


GGUF = GGUFArch(
    "phi3",
    "Phi3ForCausalLM",
    "phi3",
    _phi3_config,
    {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        **_PRE_NORMS,
    },
    _TOP,
    consumed=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
)
