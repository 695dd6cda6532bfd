"""Nemotron-H (HF ``NemotronHForCausalLM``): HF config -> :class:`HybridSpec`.

Every layer is one pre-norm residual block ``x + mixer(RMSNorm(x))`` (HF ``NemotronHBlock``,
weights ``norm.weight`` and ``mixer.*``) whose mixer is, by the layer's type:

- ``'linear_attention'`` (pattern letter ``M``): the Mamba-2 mixer, i.e. one
  :class:`exactblocks.Mamba2BlockInference` with the block's names unchanged. Checked against HF
  ``NemotronHMamba2Mixer``: the same pre-norm and residual, in_proj split ``z | xBC | dt``,
  SiLU depthwise conv, ``A = -exp(A_log)``, softplus dt with ``dt_bias``, the gated RMSNorm
  ``norm(y * silu(z))`` over ``n_groups`` groups of ``d_inner / n_groups`` (HF
  ``NemotronHRMSNormGated``, norm before gate = False), D skip, out_proj. HF clamps dt to
  ``(time_step_min, inf)`` (its ``time_step_limit`` field is not used by the mixer), which is the
  block's ``dt_limit`` here; HF's cached one-token decode skips the clamp, exactblocks always
  clamps (they differ only where ``softplus(dt) < time_step_min``).
- ``'full_attention'`` (``*``): causal attention without RoPE and without biases (HF
  ``NemotronHAttention`` builds none, whatever ``attention_bias`` says), a
  ``TransformerBlockInference(block_parts='attention', rope_dim=0)``.
- ``'mlp'`` (``-``): ``down(act(up(x)))`` (``mlp_hidden_act``: relu2 = squared ReLU), a
  ``TransformerBlockInference(block_parts='mlp')``.

MoE layers (``E`` / ``'moe'``) are refused: MoE is out of scope. HF fields read (transformers
5.23 ``NemotronHConfig``): vocab_size, hidden_size, layers_block_type (``layer_types``; legacy
``hybrid_override_pattern``), num_attention_heads, num_key_value_heads, head_dim,
max_position_embeddings, intermediate_size, mlp_hidden_act, mlp_bias, ssm_state_size,
mamba_num_heads, mamba_head_dim, mamba_hidden_act (silu), n_groups, conv_kernel,
time_step_min, use_conv_bias, use_bias (in/out projections of the mixer), layer_norm_epsilon,
tie_word_embeddings.
GGUF: ``general.architecture == "nemotron_h"`` (its ``GGUF`` record below).

Tensor names (HF ``NemotronHForCausalLM.state_dict()``)::

    backbone.embeddings.weight                     (vocab_size, hidden_size)
    backbone.layers.N.norm.weight                  (hidden_size,)
    backbone.layers.N.mixer.{in_proj,conv1d,dt_bias,A_log,D,norm,out_proj}.*   Mamba-2
    backbone.layers.N.mixer.{q,k,v,o}_proj.weight                              attention
    backbone.layers.N.mixer.{up,down}_proj.weight [.bias]                      MLP
    backbone.norm_f.weight                         (hidden_size,)
    lm_head.weight                                 (vocab_size, hidden_size), absent when tied
"""

from __future__ import annotations

import math

import numpy as np

from ._config import ConfigReader
from ._gguf import (
    _SSM_RESHAPED,
    GGUFArch,
    _has_any,
    _Keys,
    _mamba2_convert,
    _ssm_map,
    _unpermute_qk,
)
from ._hybrid import BlockPlan, HybridSpec, mamba2_tensors, transformer_tensors

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("NemotronHForCausalLM",)
MODEL_TYPES = ("nemotron_h",)

#: ``NemotronHConfig`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "layers_block_type": None,
    "tie_word_embeddings": False,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_min": 0.001,
    "use_conv_bias": True,
    "use_bias": False,
    "layer_norm_epsilon": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: ``hybrid_override_pattern`` letters (HF ``NemotronHConfig._pattern_to_list``).
PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
#: Legacy layer type names (HF ``configuration_utils._LEGACY_LAYER_TYPE_REMAP``).
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
#: HF ``mlp_hidden_act`` -> the block's ungated MLP.
UNGATED_MLP = {"relu2": "relu2", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def hybrid_layer_types(c: ConfigReader) -> list[str]:
    """The per-layer types as HF resolves them: ``layers_block_type`` / ``layer_types`` (legacy
    names remapped), else ``hybrid_override_pattern``; MoE and unknown types refused."""
    types = c.raw.get("layers_block_type", c.raw.get("layer_types"))
    field = "layers_block_type"
    if types is None and "hybrid_override_pattern" in c.raw:
        pattern = c.raw["hybrid_override_pattern"]
        field = "hybrid_override_pattern"
        if not isinstance(pattern, str) or not pattern:
            c._fail(field, pattern, "a non-empty string of 'M', '*', '-'")
        for i, ch in enumerate(pattern):
            if ch not in PATTERN:
                c._fail(f"hybrid_override_pattern[{i}]", ch,
                        "'M' (Mamba-2), '*' (attention) or '-' (MLP)")  # fmt: skip
        types = list(pattern)  # letters, mapped below (messages name the letter)
    if types is None:  # HF's default pattern has an MoE layer
        types = ["linear_attention", "moe", "full_attention", "mlp"]
    if not isinstance(types, list) or not types:
        c._fail(field, types, "a non-empty list of layer types")
    shown = list(types)
    types = [PATTERN.get(t, t) if field == "hybrid_override_pattern" else t for t in types]
    types = [LEGACY_TYPES.get(t, t) for t in types]
    for i, t in enumerate(types):
        where = f"{field}[{i}]"
        if t == "moe":
            raise ValueError(
                f"load_model: config {where}={shown[i]!r} is an MoE layer; MoE is out of scope "
                "for exactblocks (dense Mamba-2 / attention / MLP layers only)"
            )
        if t not in ("linear_attention", "full_attention", "mlp"):
            c._fail(where, shown[i], "'linear_attention', 'full_attention' or 'mlp'")
    c.resolved["layers_block_type"] = types
    return types


def spec_from_config(config) -> tuple[HybridSpec, dict]:
    """The frozen spec of a Nemotron-H model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``NemotronHConfig`` fields.

    Returns
    -------
    spec : HybridSpec
    resolved : dict

    Raises
    ------
    ValueError
        An MoE layer; an unknown pattern letter or layer type; a ``mamba_hidden_act`` other
        than silu or an ``mlp_hidden_act`` other than relu2/gelu/gelu_pytorch_tanh; bad sizes
        (the message names the field).
    """
    c = ConfigReader(config, DEFAULTS, "nemotron_h")
    types = hybrid_layer_types(c)
    c.choice("mamba_hidden_act", {"silu": "silu"})
    mlp = c.choice("mlp_hidden_act", UNGATED_MLP)
    d, eps = c.integer("hidden_size"), c.number("layer_norm_epsilon")
    n_heads, n_kv, hd = (
        c.integer("num_attention_heads"),
        c.integer("num_key_value_heads"),
        c.integer("head_dim"),
    )
    if n_heads % n_kv:
        c._fail("num_key_value_heads", n_kv, f"a divisor of num_attention_heads={n_heads}")
    it = c.integer("intermediate_size")
    mh, mhd, ns = (
        c.integer("mamba_num_heads"),
        c.integer("mamba_head_dim"),
        c.integer("ssm_state_size"),
    )
    groups, kernel = c.integer("n_groups"), c.integer("conv_kernel")
    if mh % groups:
        c._fail("n_groups", groups, f"a divisor of mamba_num_heads={mh}")
    di = mh * mhd  # HF: intermediate_size = mamba_num_heads * mamba_head_dim
    conv_dim = di + 2 * groups * ns
    proj_bias, conv_bias, mlp_bias = c.flag("use_bias"), c.flag("use_conv_bias"), c.flag("mlp_bias")
    dt_min = c.number("time_step_min", positive=False)
    if dt_min < 0:
        c._fail("time_step_min", dt_min, "a number >= 0")

    sizes = {"d": d, "QW": n_heads * hd, "KW": n_kv * hd, "IT": it}
    mamba = mamba2_tensors(
        {"d": d, "d_inner": di, "conv_dim": conv_dim, "n_heads": mh, "kernel": kernel},
        {},
        conv_bias=conv_bias,
        proj_bias=proj_bias,
    )
    half = {"norm_placement": "pre", "norm_bias": False, "qkv_bias": False, "o_bias": False,
            "qk_norm": False}  # fmt: skip
    attn = transformer_tensors(  # HF NemotronH: the layer's norm and mixer hold either
        {**half, "block_parts": "attention", "mlp": mlp, "mlp_bias": False},
        sizes,
        {"input_layernorm.": "norm.", "self_attn.": "mixer."},
    )
    mlp_t = transformer_tensors(
        {**half, "block_parts": "mlp", "mlp": mlp, "mlp_bias": mlp_bias},
        sizes,
        {"post_attention_layernorm.": "norm.", "mlp.": "mixer."},
    )
    plans = {
        "linear_attention": BlockPlan(
            "mamba2",
            (("dt_limit", (dt_min, math.inf)), ("n_groups", groups), ("norm_eps", eps)),
            mamba,
        ),
        "full_attention": BlockPlan(
            "transformer",
            tuple(
                sorted(
                    {
                        "block_parts": "attention",
                        "n_heads": n_heads,
                        "n_kv_heads": n_kv,
                        "head_dim": hd,
                        "rope_dim": 0,
                        "norm_eps": eps,
                    }.items()
                )
            ),  # fmt: skip
            attn,
        ),
        "mlp": BlockPlan(
            "transformer",
            tuple(
                sorted(
                    {
                        "block_parts": "mlp",
                        "mlp": mlp,
                        "mlp_bias": mlp_bias,
                        "norm_eps": eps,
                    }.items()
                )
            ),  # fmt: skip
            mlp_t,
        ),
    }
    spec = HybridSpec(
        family="nemotron_h",
        vocab_size=c.integer("vocab_size"),
        d_model=d,
        n_layers=len(types),
        norm_eps=eps,
        max_position_embeddings=c.integer("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        layers=tuple((plans[t],) for t in types),
        embed_name="backbone.embeddings.weight",
        norm_name="backbone.norm_f.weight",
        layer_prefix="backbone.layers.{}.",
        prefix_aliases=(("backbone.", "model."),),  # transformers 5 names it model. in memory
    )
    c.resolved["num_hidden_layers"] = len(types)
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _nemotron_h_config(k: _Keys, names) -> dict:
    """src/models/nemotron-h.cpp: a layer is Mamba-2 iff its head_count_kv and
    feed_forward_length are both 0, attention iff only feed_forward_length is 0, else a
    squared-ReLU MLP (``LLM_FFN_RELU_SQR``); attention has no RoPE (the graph rotates nothing,
    so the rope.* keys the converter writes change nothing) and scores scaled by
    attention.scale or 1/sqrt(head_dim); dt is not clamped (mamba-base.cpp), i.e. HF
    ``time_step_min`` 0. MoE and NextN (MTP) heads are refused."""
    d = k.need("embedding_length")
    n = k.need("block_count")
    n_heads = k.need("attention.head_count")
    kv = k.get("attention.head_count_kv", n_heads)
    ff = k.need("feed_forward_length")
    kv = kv if isinstance(kv, list) else [kv] * n
    ff = ff if isinstance(ff, list) else [ff] * n
    if isinstance(n_heads, list) or len(kv) != n or len(ff) != n:
        k.fail("attention.head_count_kv", kv, f"one count per layer ({n} layers)")
    for key in ("expert_count", "expert_used_count", "nextn_predict_layers"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0: MoE layers and MTP heads are out of scope")
    pattern = "".join("M" if not h and not f else "*" if not f else "-" for h, f in zip(kv, ff))
    kv_heads, widths = sorted({h for h in kv if h}), sorted({f for f in ff if f})
    if len(kv_heads) > 1:
        k.fail("attention.head_count_kv", kv, "one KV head count for every attention layer")
    if len(widths) > 1:
        k.fail("feed_forward_length", ff, "one width for every MLP layer")
    if kv_heads:
        k.heads_divide(n_heads, kv_heads[0])
    head_dim = k.head_width(d, n_heads)
    if k.get("attention.value_length", head_dim) != head_dim:
        k.fail("attention.value_length", k.get("attention.value_length"), f"key_length={head_dim}")
    scale = k.get("attention.scale", 0.0)
    if scale and np.float32(scale) != np.float32(head_dim**-0.5):
        k.fail("attention.scale", scale, f"head_dim ** -0.5 (HF NemotronHAttention, {head_dim})")
    for key in ("logit_scale", "residual_scale", "embedding_scale"):
        if k.get(key, 0.0) not in (0.0, 1.0):
            k.fail(key, k.get(key), "none: Nemotron-H has no Granite multipliers")
    for key in ("rope.freq_base", "rope.dimension_count", "rope.scaling.finetuned",
                "attention.layer_norm_epsilon", "expert_shared_feed_forward_length"):  # fmt: skip
        k.get(key)  # no effect in nemotron-h.cpp's dense layers (see above)
    d_inner, mh = k.need("ssm.inner_size"), k.need("ssm.time_step_rank")
    if d_inner % mh:
        k.fail("ssm.inner_size", d_inner, f"a multiple of ssm.time_step_rank={mh}")
    return {
        "hidden_size": d,
        "num_hidden_layers": n,
        "hybrid_override_pattern": pattern,
        "num_attention_heads": n_heads,
        "num_key_value_heads": kv_heads[0] if kv_heads else n_heads,
        "head_dim": head_dim,
        "intermediate_size": widths[0] if widths else 0,
        "mlp_hidden_act": "relu2",
        "mlp_bias": _has_any(names, "ffn_up.bias"),
        "attention_bias": False,
        "ssm_state_size": k.need("ssm.state_size"),
        "mamba_num_heads": mh,
        "mamba_head_dim": d_inner // mh,
        "mamba_hidden_act": "silu",
        "n_groups": k.need("ssm.group_count"),
        "conv_kernel": k.need("ssm.conv_kernel"),
        "time_step_min": 0.0,
        "use_conv_bias": _has_any(names, "ssm_conv1d.bias"),
        "use_bias": False,
        "layer_norm_epsilon": float(k.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": k.need("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
    }


def _nemotron_h_convert(name: str, w, config: dict):
    """Mamba-2 mixers as :func:`_mamba2_convert`; q/k rows as :func:`_unpermute_qk`
    (conversion/nemotron.py ``NemotronHModel`` extends ``GraniteHybridModel``,
    ``undo_permute = True``: permuted although Nemotron-H has no RoPE)."""
    if name.endswith(_SSM_RESHAPED):
        return _mamba2_convert(name, w, config)
    return _unpermute_qk(name, w, config)


GGUF = GGUFArch(
    "nemotron_h",
    "NemotronHForCausalLM",
    "nemotron_h",
    _nemotron_h_config,
    {
        "attn_norm.weight": "norm.weight",
        **_ssm_map("mixer."),
        "attn_q.weight": "mixer.q_proj.weight",
        "attn_k.weight": "mixer.k_proj.weight",
        "attn_v.weight": "mixer.v_proj.weight",
        "attn_output.weight": "mixer.o_proj.weight",
        "ffn_up.weight": "mixer.up_proj.weight",
        "ffn_up.bias": "mixer.up_proj.bias",
        "ffn_down.weight": "mixer.down_proj.weight",
        "ffn_down.bias": "mixer.down_proj.bias",
    },
    {
        "token_embd.weight": "backbone.embeddings.weight",
        "output_norm.weight": "backbone.norm_f.weight",
        "output.weight": "lm_head.weight",
    },
    convert=_nemotron_h_convert,
    layer_prefix="backbone.layers.{}.",
)
