"""Granite-4.0-H (HF ``GraniteMoeHybridForCausalLM``, dense only): HF config -> HybridSpec.

Each HF layer (``GraniteMoeHybridDecoderLayer``) is two residual halves, both with Granite's
``residual_multiplier`` m:

1. ``x + m * mixer(RMSNorm_in(x))``, the mixer being, by ``layer_types``, a Mamba-2 mixer
   (``'linear_attention'`` / legacy ``'mamba'``: a :class:`exactblocks.Mamba2BlockInference`,
   weights ``input_layernorm`` and ``mamba.*``; m multiplies ``out_proj`` once at load, see
   :class:`~exactblocks.models._hybrid.BlockPlan`) or causal attention (``'full_attention'`` /
   ``'attention'``: ``TransformerBlockInference(block_parts='attention')`` with scores scaled
   by ``attention_multiplier``, RoPE only when ``position_embedding_type == 'rope'``);
2. ``x + m * mlp(RMSNorm_post(x))``: the dense ``shared_mlp``, ``output_linear(act(g) * u)``
   with ``g | u`` the two halves of ``input_linear`` (gate first), a
   ``TransformerBlockInference(block_parts='mlp')`` reading the fused weight.

Outside the layers: embedding rows times ``embedding_multiplier``, final RMSNorm, logits
divided by ``logits_scaling``. The Mamba-2 mixer is HF ``GraniteMoeHybridMambaLayer``: the
same math as ``Mamba2Mixer`` (gated RMSNorm over ``mamba_n_groups`` groups, dt clamped to
``time_step_limit``, conv activation ``hidden_act``). MoE configs (``num_local_experts > 0``)
are refused: MoE is out of scope. HF fields read (transformers 5.23
``GraniteMoeHybridConfig``): vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, hidden_act (silu), max_position_embeddings, rms_norm_eps,
tie_word_embeddings, rope_parameters, attention_bias, the four Granite multipliers,
num_local_experts, shared_intermediate_size, position_embedding_type, layer_types, mamba_n_heads,
mamba_n_groups, mamba_d_state, mamba_d_head, mamba_d_conv, mamba_expand, mamba_conv_bias,
mamba_proj_bias, time_step_limit.
GGUF: ``general.architecture == "granitehybrid"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

import math

import numpy as np

from ._config import ConfigReader
from ._decoder import rope_fields, thaw
from ._gguf import (
    _ATTN,
    _ATTN_BIAS,
    _TOP,
    GGUFArch,
    _has_any,
    _Keys,
    _mamba2_convert,
    _rope,
    _ssm_map,
    _unpermute_qk,
)
from ._hybrid import BlockPlan, HybridSpec, mamba2_tensors, transformer_tensors
from .granite import granite_scalars
from .nemotron_h import LEGACY_TYPES

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("GraniteMoeHybridForCausalLM",)
MODEL_TYPES = ("granitemoehybrid",)

#: ``GraniteMoeHybridConfig`` class defaults (transformers 5.23.0), for omitted fields.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "shared_intermediate_size": 1024,
    "position_embedding_type": None,
    "layer_types": None,
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": "auto",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": (0.0, math.inf),
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def spec_from_config(config) -> tuple[HybridSpec, dict]:
    """The frozen spec of a dense Granite-4.0-H model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``GraniteMoeHybridConfig`` fields.

    Returns
    -------
    spec : HybridSpec
    resolved : dict

    Raises
    ------
    ValueError
        ``num_local_experts > 0`` (MoE is out of scope); an unknown layer type or
        ``position_embedding_type``; a ``hidden_act`` other than silu; inconsistent Mamba sizes;
        a malformed ``time_step_limit`` (the message names the field).
    """
    c = ConfigReader(config, DEFAULTS, "granitemoehybrid")
    experts = c.integer("num_local_experts", minimum=0, allow_none=True) or 0
    if experts > 0:
        raise ValueError(
            f"load_model: config num_local_experts={experts}: this Granite-4.0-H checkpoint has "
            "MoE layers, and MoE is out of scope for exactblocks (only dense configs, "
            "num_local_experts=0, load)"
        )
    c.choice("hidden_act", {"silu": "silu"})  # the MLP's gate and the Mamba conv activation
    d, n = c.integer("hidden_size"), c.integer("num_hidden_layers")
    eps = c.number("rms_norm_eps")
    n_heads = c.integer("num_attention_heads")
    n_kv = c.integer("num_key_value_heads", allow_none=True) or n_heads
    if n_heads % n_kv:
        c._fail("num_key_value_heads", n_kv, f"a divisor of num_attention_heads={n_heads}")
    hd = d // n_heads  # HF GraniteMoeHybridAttention: hidden_size // num_attention_heads
    c.resolved["num_key_value_heads"] = n_kv

    types = c.get("layer_types")
    if types is None:  # HF __post_init__: every layer Mamba
        types = ["linear_attention"] * n
    if not isinstance(types, list) or len(types) != n:
        c._fail("layer_types", types, f"{n} layer types (num_hidden_layers)")
    shown, types = list(types), [LEGACY_TYPES.get(t, t) for t in types]
    for i, t in enumerate(types):
        if t not in ("linear_attention", "full_attention"):
            c._fail(f"layer_types[{i}]", shown[i], "'linear_attention' / 'mamba' or "
                    "'full_attention' / 'attention'")  # fmt: skip
    c.resolved["layer_types"] = types

    scalars = granite_scalars(c)
    m = scalars["residual_multiplier"]
    pos = c.choice("position_embedding_type", {None: None, "nope": None, "rope": "rope"})
    rope = rope_fields(c) if pos == "rope" else None

    expand = c.get("mamba_expand")
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) or expand <= 0:
        c._fail("mamba_expand", expand, "a number > 0")
    di = int(expand * d)
    mh, ns, groups = (
        c.integer("mamba_n_heads"),
        c.integer("mamba_d_state"),
        c.integer("mamba_n_groups"),
    )
    mhd = c.get("mamba_d_head")
    if mhd == "auto":  # HF __post_init__
        mhd = di // mh
    if isinstance(mhd, bool) or not isinstance(mhd, int) or mhd * mh != di:
        c._fail("mamba_d_head", mhd, f"'auto' or an int with mamba_n_heads * it = {di}")
    if mh % groups:
        c._fail("mamba_n_groups", groups, f"a divisor of mamba_n_heads={mh}")
    kernel = c.integer("mamba_d_conv")
    limit = c.get("time_step_limit")
    if (
        not isinstance(limit, (list, tuple))
        or len(limit) != 2
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in limit)
    ):
        c._fail("time_step_limit", limit, "two numbers [lo, hi]")
    conv_dim = di + 2 * groups * ns
    it = c.integer("shared_intermediate_size")
    bias = c.flag("attention_bias")

    qw, kw = n_heads * hd, n_kv * hd
    sizes = {"d": d, "QW": qw, "KW": kw, "IT": it}
    mamba = mamba2_tensors(
        {"d": d, "d_inner": di, "conv_dim": conv_dim, "n_heads": mh, "kernel": kernel},
        {"norm.weight": "input_layernorm.weight", "mixer.": "mamba."},
        conv_bias=c.flag("mamba_conv_bias"),
        proj_bias=c.flag("mamba_proj_bias"),
    )
    half = {"norm_placement": "pre", "norm_bias": False, "qk_norm": False, "mlp": "swiglu"}
    attn = transformer_tensors(
        {**half, "block_parts": "attention", "qkv_bias": bias, "o_bias": bias, "mlp_bias": False},
        sizes,
        {},
    )
    mlp = transformer_tensors(  # HF's shared_mlp.input_linear = [gate; up]
        {**half, "block_parts": "mlp", "qkv_bias": False, "o_bias": False, "mlp_bias": False},
        sizes,
        {
            "mlp.gate_up_proj.": "shared_mlp.input_linear.",
            "mlp.down_proj.": "shared_mlp.output_linear.",
        },
        fused_gate_up=True,
    )
    attn_opts = {
        "block_parts": "attention",
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": hd,
        "norm_eps": eps,
        "qkv_bias": bias,
        "o_bias": bias,
        "attn_scale": scalars["attn_scale"],
        "residual_multiplier": m,
    }
    if rope is None:
        attn_opts["rope_dim"] = 0
    else:
        attn_opts.update(rope_theta=rope["rope_theta"], rope_scaling=thaw(rope["rope_scaling"]))
    mamba_opts = {"dt_limit": (float(limit[0]), float(limit[1])), "n_groups": groups,
                  "norm_eps": eps}  # fmt: skip
    mlp_opts = {"block_parts": "mlp", "mlp": "swiglu", "norm_eps": eps, "residual_multiplier": m}
    plans = {
        "linear_attention": BlockPlan(
            "mamba2", tuple(sorted(mamba_opts.items())), mamba, None if m == 1.0 else m
        ),
        "full_attention": BlockPlan(
            "transformer", tuple(sorted(attn_opts.items(), key=lambda kv: kv[0])), attn
        ),
    }
    mlp_plan = BlockPlan("transformer", tuple(sorted(mlp_opts.items())), mlp)
    spec = HybridSpec(
        family="granitemoehybrid",
        vocab_size=c.integer("vocab_size"),
        d_model=d,
        n_layers=n,
        norm_eps=eps,
        max_position_embeddings=c.integer("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        layers=tuple((plans[t], mlp_plan) for t in types),
        embed_scale=scalars["embed_scale"],
        logits_scaling=scalars["logits_scaling"],
    )
    c.resolved["time_step_limit"] = list(mamba_opts["dt_limit"])
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _granitehybrid_config(k: _Keys, names) -> dict:
    """src/models/granite-hybrid.cpp: a layer is Mamba-2 iff its ``attention.head_count_kv`` is
    0; d_inner = 2 * embedding_length (asserted there); logit/residual/embedding scale 0
    (absent) = none, attention.scale 0 = 1/sqrt(head_dim); rope.scaling.finetuned is the RoPE
    switch (conversion/granite.py writes false for hybrids: HF ``position_embedding_type``
    'nope'); no time-step clamp. MoE (expert_count > 0) is refused, as the HF family does."""
    d = k.need("embedding_length")
    n = k.need("block_count")
    n_heads = k.need("attention.head_count")
    kv = k.get("attention.head_count_kv", n_heads)
    kv = kv if isinstance(kv, list) else [kv] * n
    if isinstance(n_heads, list) or len(kv) != n:
        k.fail("attention.head_count_kv", kv, f"one count per layer ({n} layers)")
    kv_heads = sorted({h for h in kv if h})
    if len(kv_heads) > 1:
        k.fail("attention.head_count_kv", kv, "one KV head count for every attention layer")
    if kv_heads:
        k.heads_divide(n_heads, kv_heads[0])
    head_dim = k.head_width(d, n_heads)
    if head_dim != d // n_heads or k.get("attention.value_length", head_dim) != head_dim:
        k.fail("attention.key_length", head_dim, f"embedding_length / head_count = {d // n_heads}")
    for key in ("expert_count", "expert_used_count"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0: MoE is out of scope (llama.cpp asserts expert_used_count "
                   "== 0 when expert_count is 0)")  # fmt: skip
    ff = k.need("feed_forward_length")  # the dense MLP's width in granite-hybrid.cpp (n_ff)
    shared = k.get("expert_shared_feed_forward_length", ff)
    if shared != ff or isinstance(ff, list):
        k.fail("expert_shared_feed_forward_length", shared, f"feed_forward_length={ff}, the "
               "dense MLP width llama.cpp reads")  # fmt: skip
    d_inner = k.need("ssm.inner_size")
    if d_inner != 2 * d:
        k.fail("ssm.inner_size", d_inner, f"2 * embedding_length = {2 * d} (granite-hybrid.cpp)")
    mh = k.need("ssm.time_step_rank")
    rope = k.get("rope.scaling.finetuned", True)
    c = {
        "hidden_size": d,
        "num_hidden_layers": n,
        "num_attention_heads": n_heads,
        "num_key_value_heads": kv_heads[0] if kv_heads else n_heads,
        "layer_types": ["full_attention" if h else "linear_attention" for h in kv],
        "rms_norm_eps": float(k.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": k.need("context_length"),
        "shared_intermediate_size": ff,
        "num_local_experts": 0,
        "position_embedding_type": "rope" if rope else "nope",
        "mamba_n_heads": mh,
        "mamba_d_head": d_inner // mh,
        "mamba_expand": 2,
        "mamba_d_state": k.need("ssm.state_size"),
        "mamba_n_groups": k.need("ssm.group_count"),
        "mamba_d_conv": k.need("ssm.conv_kernel"),
        "mamba_conv_bias": _has_any(names, "ssm_conv1d.bias"),
        "mamba_proj_bias": False,
        "time_step_limit": [0.0, math.inf],
        "attention_bias": _has_any(names, "attn_q.bias"),
        "logits_scaling": float(k.get("logit_scale", 0.0)) or 1.0,
        "residual_multiplier": float(k.get("residual_scale", 0.0)) or 1.0,
        "embedding_multiplier": float(k.get("embedding_scale", 0.0)) or 1.0,
        "attention_multiplier": float(k.get("attention.scale", 0.0)) or head_dim**-0.5,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
    }
    if rope:
        c.update(_rope(k, head_dim))
    else:
        k.get("rope.freq_base")
        k.get("rope.dimension_count")
    return c


def _granitehybrid_convert(name: str, w, config: dict):
    if ".mamba." in name:
        return _mamba2_convert(name, w, config)
    return _unpermute_qk(name, w, config)


def _join_gate_up(tensors: dict, config: dict) -> dict:
    """conversion/granite.py ``GraniteMoeModel.modify_tensors`` split HF's
    ``shared_mlp.input_linear`` into ``ffn_gate`` (first half) and ``ffn_up``: stack them back
    (GGUF blocks row-wise, no value changes)."""
    from exactblocks._weights import QuantizedMatrix

    out = {}
    for name, w in tensors.items():
        if not name.endswith("#gate"):
            if not name.endswith("#up"):
                out[name] = w
            continue
        stem = name[: -len("#gate")]
        up = tensors.get(stem + "#up")
        if up is None:
            layer = stem.split(".")[2]
            raise ValueError(f"load_gguf_model: blk.{layer}.ffn_gate.weight has no ffn_up.weight")
        if (
            isinstance(w, QuantizedMatrix)
            and isinstance(up, QuantizedMatrix)
            and w.ggml_type == up.ggml_type
        ):
            both = np.concatenate([w.blocks, up.blocks])
            out[stem] = QuantizedMatrix(w.ggml_type, both, (w.shape[0] + up.shape[0], w.shape[1]))
        else:
            parts = [x.dequantize() if isinstance(x, QuantizedMatrix) else x for x in (w, up)]
            out[stem] = np.concatenate([np.asarray(x, dtype=np.float32) for x in parts])
    stray = [n for n in tensors if n.endswith("#up") and n[: -len("#up")] + "#gate" not in tensors]
    if stray:
        layer = stray[0].split(".")[2]
        raise ValueError(f"load_gguf_model: blk.{layer}.ffn_up.weight has no ffn_gate.weight")
    return out


GGUF = GGUFArch(
    "granitehybrid",
    "GraniteMoeHybridForCausalLM",
    "granitemoehybrid",
    _granitehybrid_config,
    {
        "attn_norm.weight": "input_layernorm.weight",
        **_ssm_map("mamba."),
        **_ATTN,
        **_ATTN_BIAS,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "shared_mlp.input_linear.weight#gate",
        "ffn_up.weight": "shared_mlp.input_linear.weight#up",
        "ffn_down.weight": "shared_mlp.output_linear.weight",
    },
    _TOP,
    convert=_granitehybrid_convert,
    finish=_join_gate_up,
)
