"""StableLM (HF ``StableLmForCausalLM``; StableLM 2): HF config -> :class:`DecoderSpec`.

Llama's layer with LayerNorms (weights and biases, ``layer_norm_eps``, the final norm too),
partial RoPE (the first ``int(head_dim * partial_rotary_factor)`` dims of each head, HF
``rotary_ndims``), optional q/k/v biases (``use_qkv_bias``; o_proj has none), optional per-head
LayerNorms of q and k without bias, each head its own weights (``qk_layernorm``, HF
``StableLmLayerNormPerHead``: ``self_attn.q_layernorm.norms.H.weight``, stacked into the block's
``(heads, head_dim)`` ``q_norm`` once at load), and the parallel residual
``x + attn(ln(x)) + mlp(ln(x))`` (``use_parallel_residual``: one norm per layer). HF fields
read (transformers 5.23 ``StableLmConfig``): vocab_size, hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_act (silu: SwiGLU),
max_position_embeddings, layer_norm_eps, rope_parameters (with partial_rotary_factor),
use_qkv_bias, qk_layernorm, use_parallel_residual, tie_word_embeddings.
GGUF: ``general.architecture == "stablelm"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

import numpy as np

from ._config import ConfigReader
from ._decoder import DecoderSpec, freeze, heads_and_dims
from ._gguf import (
    _ATTN,
    _ATTN_BIAS,
    _GLU,
    _PRE_NORMS,
    _TOP_LN,
    GGUFArch,
    _common,
    _has,
    _Keys,
    _rope,
)

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("StableLmForCausalLM",)
MODEL_TYPES = ("stablelm",)

#: ``StableLmConfig`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 50304,
    "intermediate_size": 6912,
    "hidden_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "layer_norm_eps": 1e-5,
    "use_qkv_bias": False,
    "qk_layernorm": False,
    "use_parallel_residual": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

#: The block's q/k norm names -> StableLM's (the per-head rows are ``.norms.H.weight``).
RENAMES = (("self_attn.q_norm.", "self_attn.q_layernorm."),
           ("self_attn.k_norm.", "self_attn.k_layernorm."))  # fmt: skip


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a StableLM model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``StableLmConfig`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        A ``hidden_act`` other than silu, a RoPE type the blocks do not compute, a partial
        rotary factor giving an odd or empty rotated width, bad sizes.
    """
    c = ConfigReader(config, DEFAULTS, "stablelm")
    sizes = heads_and_dims(c, eps_key="layer_norm_eps", acts={"silu": "swiglu"})
    theta, scaling, prf = c.rope(default_theta=10000.0, partial=True, default_partial=0.25)
    hd = sizes["head_dim"]
    rope_dim = int(hd * prf)  # HF StableLmAttention.rotary_ndims
    if rope_dim % 2 or rope_dim < 2:
        c._fail("partial_rotary_factor", prf, f"a factor giving an even width >= 2 of {hd}")
    bias = c.flag("use_qkv_bias")
    qk_norm = c.flag("qk_layernorm")
    spec = DecoderSpec(
        family="stablelm",
        **sizes,
        rope_theta=theta,
        rope_scaling=freeze(scaling),
        qkv_bias=bias,
        o_bias=False,
        mlp_bias=False,
        qk_norm=qk_norm,
        windows=(0,) * sizes["n_layers"],
        norm="layernorm",
        norm_bias=True,
        norm_placement="parallel" if c.flag("use_parallel_residual") else "pre",
        qk_norm_scope="per_head_weights",
        rope_dim=None if rope_dim == hd else rope_dim,
        renames=RENAMES,
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _stablelm_config(k: _Keys, names) -> dict:
    """src/models/stablelm.cpp: LayerNorm with biases, the parallel residual exactly when a
    layer has no ``ffn_norm`` (the graph's test), q/k/v biases optional; conversion/stablelm.py
    writes rope.dimension_count = int(partial_rotary_factor * head_dim)."""
    c = _common(k, names, eps_key="layer_norm_eps")
    c.update(_rope(k, c["head_dim"], partial=True))
    c.setdefault("partial_rotary_factor", 1.0)
    parallel = not _has(names, "ffn_norm.weight")
    stated = k.get("use_parallel_residual", parallel)
    if stated != parallel:
        k.fail("use_parallel_residual", stated, f"{parallel}, as the file's ffn_norm tensors say")
    c["use_parallel_residual"] = parallel
    c["use_qkv_bias"] = _has(names, "attn_q.bias")
    c["qk_layernorm"] = _has(names, "attn_q_norm.weight")  # stablelm.cpp: optional (12B)
    c["hidden_act"] = "silu"
    return c


def _stablelm_split_norms(name: str, w, config: dict):
    """conversion/stablelm.py ``_stack_qk_norm`` stacks HF's per-head LayerNorm weights
    (``self_attn.q_layernorm.norms.H.weight``, H < heads) into one (heads, head_dim) tensor
    (ne = [head_dim, heads], stablelm.cpp): split it back, one row per head."""
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        a = np.asarray(w, dtype=np.float32)
        heads = config["num_attention_heads" if "q_layernorm" in name else "num_key_value_heads"]
        if a.ndim != 2 or a.shape[0] != heads:
            raise ValueError(
                f"load_gguf_model: the stablelm q/k norm {name!r} has shape {a.shape}; expected "
                f"({heads}, head_dim)"
            )
        stem = name[: -len(".weight")]
        return [(f"{stem}.norms.{h}.weight", a[h]) for h in range(heads)]
    return [(name, w)]


GGUF = GGUFArch(
    "stablelm",
    "StableLmForCausalLM",
    "stablelm",
    _stablelm_config,
    {
        **_ATTN,
        **{k: v for k, v in _ATTN_BIAS.items() if k != "attn_output.bias"},
        **_GLU,
        **_PRE_NORMS,
        "attn_norm.bias": "input_layernorm.bias",
        "ffn_norm.bias": "post_attention_layernorm.bias",
        "attn_q_norm.weight": "self_attn.q_layernorm.weight",
        "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    },
    _TOP_LN,
    convert=_stablelm_split_norms,
)
