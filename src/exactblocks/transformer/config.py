"""Transformer options: the option table, every option check, and the typed core config.

What lives here: :data:`OPTIONS`, one :class:`~exactblocks._options.Option` per keyword option
of :class:`TransformerBlockInference` in SPEC.md 4.1 order (default, check, property doc line,
the ``_core.TransformerConfig`` field it fills), the checks between options, the resolution of
the options the weights complete (``n_kv_heads``, ``head_dim``, ``rope_dim``) with the RoPE
table check, and :func:`core_config`, the one place that fills ``_core.TransformerConfig``.
What does not: weight names and shapes (``weights.py``), the block (``block.py``), arithmetic
(``csrc/blocks/transformer/``; the RoPE inv_freq table is built in C++ from these parameters).

Adding an option: one :class:`Option` in :data:`OPTIONS` (plus, if it involves other options,
a line in :func:`_check_combinations`; if it makes tensors present, their :class:`Presence` in
``weights.py``), the C++ field and op that use it, the class docstring, tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

import numpy as np

from .._options import Option, check_all, fill_fields
from .._validation import (
    check_choice,
    check_flag,
    check_int,
    check_real,
    describe_type,
    fmt_int,
)
from .moe import MOE_OPTIONS, check_moe_combinations, is_moe

__all__ = ["DENSE_OPTIONS", "OPTIONS", "check_options", "core_config", "resolve", "rope_set_for"]

MAX_POSITIONS_LIMIT = 1 << 24  # positions are exact in binary32 below 2^24 (SPEC.md 4.4)
# Upper bound of the integer options (n_heads, n_kv_heads, head_dim, window, rope_dim). Sizes
# this large are already far beyond any real layer (and every size must also fit the weights);
# the bound keeps every integer handed to the C++ core well inside int64. A window >=
# max_positions behaves like window=0 (causal), so 2^24 loses nothing.
_MAX_INT_OPTION = 1 << 24

NORMS = ("rmsnorm", "layernorm", "rmsnorm_offset")
MLPS = ("swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu2")
GATED_MLPS = ("swiglu", "geglu", "geglu_tanh")
BLOCK_PARTS = ("full", "attention", "mlp")
NORM_PLACEMENTS = ("pre", "sandwich", "post", "parallel")
QK_NORM_SCOPES = ("head", "all_heads", "per_head_weights")
# block_parts -> the _core.BlockParts name
_CORE_PARTS = {"full": "full", "attention": "attention_only", "mlp": "mlp_only"}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Required keys of each rope type (numbers checked here; the factor lists of longrope below).
_ROPE_NUMBERS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),
}
# Optional keys of each rope type (None = not given, as in HF configs), with their checks.
_ROPE_OPTIONAL = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("factor", "attention_factor"),
}
_ROPE_LISTS = {"longrope": ("short_factor", "long_factor")}


# --------------------------------------------------------------------------------------------
# checks of one option
# --------------------------------------------------------------------------------------------


def _check_rope_scaling(value, name: str, where: str):
    """Structural checks of rope_scaling (``name``); returns a normalized copy (numbers checked)
    or None."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where}: rope_scaling must be None or a mapping (dict); got {describe_type(value)}"
        )
    for k in value:
        if not isinstance(k, str):
            raise TypeError(f"{where}: rope_scaling keys must be str; got {describe_type(k)} {k!r}")
    types = {k: value[k] for k in ("rope_type", "type") if k in value}
    if not types:
        raise ValueError(
            f"{where}: rope_scaling['rope_type'] is missing; expected one of {list(_ROPE_TYPES)}"
        )
    for k, t in types.items():
        if not isinstance(t, str):
            raise TypeError(
                f"{where}: rope_scaling[{k!r}] must be a str; got {describe_type(t)} {t!r}"
            )
    if len(types) == 2 and types["rope_type"] != types["type"]:
        raise ValueError(
            f"{where}: rope_scaling['rope_type']={types['rope_type']!r} and "
            f"rope_scaling['type']={types['type']!r} disagree"
        )
    kind = next(iter(types.values()))
    key = next(iter(types))
    if kind == "dynamic":
        raise ValueError(
            f"{where}: rope_scaling[{key!r}]='dynamic' is not supported yet; "
            f"supported: {list(_ROPE_TYPES)}"
        )
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_scaling[{key!r}]={kind!r} is not supported; "
            f"supported: {list(_ROPE_TYPES)}"
        )
    allowed = (
        set(_ROPE_NUMBERS[kind])
        | set(_ROPE_OPTIONAL.get(kind, ()))
        | set(_ROPE_LISTS.get(kind, ()))
        | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    )
    for k in value:
        if k not in allowed:
            raise ValueError(
                f"{where}: rope_scaling[{k!r}] is not supported for rope type "
                f"{kind!r}; allowed keys: {sorted(allowed)}"
            )
    norm = dict(value)
    for k in _ROPE_NUMBERS[kind]:
        if k not in value:
            raise ValueError(
                f"{where}: rope_scaling[{k!r}] is missing (needed by rope type {kind!r})"
            )
        label = f"rope_scaling[{k!r}]"
        if k == "original_max_position_embeddings":
            norm[k] = check_int(value[k], label, where, min_value=1, max_value=MAX_POSITIONS_LIMIT)
        else:
            norm[k] = check_real(value[k], label, where, gt=0.0)
    for k in _ROPE_OPTIONAL.get(kind, ()):
        label = f"rope_scaling[{k!r}]"
        if k not in value or value[k] is None:
            continue  # absent or None: HF's default or derivation
        elif k == "truncate":
            norm[k] = check_flag(value[k], label, where)
        elif k in ("mscale", "mscale_all_dim"):
            norm[k] = check_real(value[k], label, where, ge=0.0)
        elif k == "attention_factor":
            norm[k] = check_real(value[k], label, where, gt=0.0, float32=True)
        else:
            norm[k] = check_real(value[k], label, where, gt=0.0)
    for k in _ROPE_LISTS.get(kind, ()):
        norm[k] = _check_factor_list(value.get(k), k, kind, where)
    if kind == "longrope" and norm["original_max_position_embeddings"] < 2:
        raise ValueError(
            f"{where}: rope_scaling['original_max_position_embeddings']="
            f"{norm['original_max_position_embeddings']} must be >= 2 for longrope (its "
            "attention factor divides by log(original_max_position_embeddings))"
        )
    if kind == "llama3" and not norm["high_freq_factor"] > norm["low_freq_factor"]:
        raise ValueError(
            f"{where}: rope_scaling['high_freq_factor']={norm['high_freq_factor']!r}"
            f" must be > rope_scaling['low_freq_factor']="
            f"{norm['low_freq_factor']!r}"
        )
    if "rope_theta" in value:
        norm["rope_theta"] = check_real(
            value["rope_theta"], "rope_scaling['rope_theta']", where, gt=0.0
        )
    if "partial_rotary_factor" in value:
        norm["partial_rotary_factor"] = check_real(
            value["partial_rotary_factor"], "rope_scaling['partial_rotary_factor']", where, gt=0.0
        )
    return norm


def _check_factor_list(value, key: str, kind: str, where: str) -> tuple:
    """A longrope factor list: a non-empty sequence of finite reals > 0 (length checked later,
    against rope_dim / 2). Returned as a tuple of Python floats."""
    label = f"rope_scaling[{key!r}]"
    if value is None:
        raise ValueError(f"{where}: {label} is missing (needed by rope type {kind!r})")
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
        raise TypeError(
            f"{where}: {label} must be a list of reals (rope_dim / 2 of them); got "
            f"{describe_type(value)}"
        )
    items = list(np.asarray(value).tolist()) if isinstance(value, np.ndarray) else list(value)
    if not items:
        raise ValueError(f"{where}: {label} is empty; it needs rope_dim / 2 factors")
    return tuple(check_real(v, f"{label}[{i}]", where, gt=0.0) for i, v in enumerate(items))


def rope_params(rope_scaling) -> tuple:
    """``(kind, factor, low_freq_factor, high_freq_factor, original_max)`` of a checked
    rope_scaling (None = the default RoPE); the fingerprint spells rope_scaling this way."""
    rs = rope_scaling
    kind = None if rs is None else rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return ("default", 1.0, 1.0, 1.0, 0)
    if kind == "linear":
        return ("linear", rs["factor"], 1.0, 1.0, 0)
    if kind == "llama3":
        return (
            "llama3",
            rs["factor"],
            rs["low_freq_factor"],
            rs["high_freq_factor"],
            rs["original_max_position_embeddings"],
        )
    # yarn / longrope: every key, None where not given (the derivations are fixed functions of
    # these and of max_positions, which the fingerprint holds too)
    keys = _ROPE_NUMBERS[kind] + _ROPE_OPTIONAL[kind] + _ROPE_LISTS.get(kind, ())
    return (kind,) + tuple(rs.get(k) for k in sorted(set(keys)))


def _rope_core_fields(rope_scaling, max_positions: int, core_mod) -> dict:
    """The _core.TransformerConfig RoPE fields of a checked rope_scaling (HF's derivations:
    transformers/modeling_rope_utils.py _compute_yarn_parameters, _compute_longrope_parameters).
    """
    rs = rope_scaling
    kind = "default" if rs is None else rs.get("rope_type", rs.get("type"))
    f = {"rope_scaling": getattr(core_mod.RopeScaling, kind)}
    if kind in ("default", "linear", "llama3"):
        _, factor, low, high, omax = rope_params(rs)
        f.update(
            rope_factor=float(factor),
            rope_low_freq_factor=float(low),
            rope_high_freq_factor=float(high),
            rope_original_max=int(omax),
        )
        return f
    omax = rs["original_max_position_embeddings"]
    factor = rs.get("factor")
    if factor is None:  # HF: max_position_embeddings / original_max_position_embeddings
        factor = max_positions / omax
    f.update(rope_factor=float(factor), rope_original_max=int(omax))
    af = rs.get("attention_factor")
    f["rope_attention_factor"] = 0.0 if af is None else float(af)
    if kind == "yarn":
        f["rope_beta_fast"] = float(rs.get("beta_fast") or 32.0)  # HF: `or 32`
        f["rope_beta_slow"] = float(rs.get("beta_slow") or 1.0)  # HF: `or 1`
        f["rope_truncate"] = True if rs.get("truncate") is None else bool(rs["truncate"])
        ms, msa = rs.get("mscale"), rs.get("mscale_all_dim")
        both = bool(ms) and bool(msa)  # HF: `if mscale and mscale_all_dim`
        f["rope_mscale"] = float(ms) if both else 0.0
        f["rope_mscale_all_dim"] = float(msa) if both else 0.0
    else:
        f["rope_short_factor"] = [float(v) for v in rs["short_factor"]]
        f["rope_long_factor"] = [float(v) for v in rs["long_factor"]]
    return f


def rope_kind(rope_scaling) -> str:
    """The rope type of a checked rope_scaling ('default' for None)."""
    rs = rope_scaling
    return "default" if rs is None else rs.get("rope_type", rs.get("type"))


def _copy_rope_scaling(value):
    """A copy of a checked rope_scaling for get_params (factor tuples as lists, as HF has them)."""
    if value is None:
        return None
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in value.items()}


def _check_rope_dim(value, name: str, where: str):
    v = check_int(value, name, where, allow_none=True)
    if v is not None and not -_MAX_INT_OPTION <= v <= _MAX_INT_OPTION:
        raise ValueError(
            f"{where}: rope_dim must be 0 (no RoPE) or an even int in [2, head_dim]; got "
            f"{fmt_int(v)}"
        )
    return v


def _none_to_zero(v, core_mod):
    return 0 if v is None else v


def _int(*, lo, hi=_MAX_INT_OPTION, allow_none=False):
    return partial(check_int, min_value=lo, max_value=hi, allow_none=allow_none)


# Stages keep the order in which the options were always checked: sizes and numbers (0), flags
# (1), kinds, epsilons and caps (2), then rope_scaling (3).
OPTIONS: tuple[Option, ...] = (
    Option(
        "n_heads",
        None,
        _int(lo=1, allow_none=True),
        "int or None: Query heads (None only for block_parts='mlp').",
        field="n_heads",
        to_core=_none_to_zero,
    ),
    Option(
        "n_kv_heads",
        None,
        _int(lo=1, allow_none=True),
        "int or None: K/V heads (resolved; None for block_parts='mlp').",
        field="n_kv_heads",
        to_core=_none_to_zero,
    ),
    Option(
        "head_dim",
        None,
        _int(lo=1, allow_none=True),
        "int or None: Width of one head (resolved; None for block_parts='mlp').",
        field="head_dim",
        to_core=_none_to_zero,
    ),
    Option(
        "window",
        0,
        _int(lo=0),
        "int: Sliding window in tokens (0 = causal).",
        field="window",
    ),
    Option(
        "rope_theta",
        10000.0,
        partial(check_real, gt=0.0),
        "float: RoPE base.",
        field="rope_theta",
    ),
    Option(
        "rope_scaling",
        None,
        _check_rope_scaling,
        "dict or None: A copy of the RoPE scaling mapping in force.",
        stage=3,  # its fields: core_config (longrope's factor needs max_positions)
        public=_copy_rope_scaling,
        canonical=rope_params,
    ),
    Option(
        "rope_dim",
        None,
        _check_rope_dim,
        "int or None: Rotated dims per head, 0 = no RoPE (resolved; None for block_parts='mlp').",
        field="rope_dim",
        to_core=_none_to_zero,
    ),
    Option(
        "max_positions",
        8192,
        _int(lo=1, hi=MAX_POSITIONS_LIMIT),
        "int: Positions p < max_positions can be computed.",
        field="max_positions",
    ),
    Option("qkv_bias", False, check_flag, "bool: q/k/v biases.", field="qkv_bias", stage=1),
    Option("o_bias", False, check_flag, "bool: o_proj bias.", field="o_bias", stage=1),
    Option(
        "norm",
        "rmsnorm",
        partial(check_choice, choices=NORMS),
        "str: Norm kind.",
        field="norm",
        to_core=lambda v, core: getattr(core.NormKind, v),
        stage=2,
    ),
    Option(
        "norm_eps",
        1e-06,
        partial(check_real, gt=0.0, float32=True),
        "float: Norm epsilon.",
        field="norm_eps",
        stage=2,
    ),
    Option(
        "norm_bias",
        False,
        check_flag,
        "bool: LayerNorm biases.",
        field="norm_bias",
        stage=1,
    ),
    Option(
        "mlp",
        "swiglu",
        partial(check_choice, choices=MLPS),
        "str: MLP kind.",
        field="mlp",
        to_core=lambda v, core: getattr(core.MlpKind, v),
        stage=2,
    ),
    Option("mlp_bias", False, check_flag, "bool: MLP biases.", field="mlp_bias", stage=1),
    Option("qk_norm", False, check_flag, "bool: q/k norms.", field="qk_norm", stage=1),
    Option(
        "qk_norm_scope",
        "head",
        partial(check_choice, choices=QK_NORM_SCOPES),
        "str: Span of the q/k norms ('head', 'all_heads', 'per_head_weights').",
        field="qk_norm_scope",
        to_core=lambda v, core: getattr(core.QkNormScope, v),
        stage=2,
    ),
    Option(
        "attn_softcap",
        None,
        partial(check_real, gt=0.0, allow_none=True, float32=True),
        "float or None: Attention logit softcap.",
        field="attn_softcap",
        to_core=lambda v, core: 0.0 if v is None else v,
        stage=2,
    ),
    Option(
        "query_pre_attn_scalar",
        None,
        partial(check_real, gt=0.0, allow_none=True),
        "float or None: Scores scaled by query_pre_attn_scalar**-0.5 (Gemma 2/3).",
        stage=2,  # fills attn_scale with the option below (core_config)
    ),
    Option(
        "attn_scale",
        None,
        partial(check_real, gt=0.0, allow_none=True, float32=True),
        "float or None: Score scale (None = head_dim**-0.5).",
        stage=2,
    ),
    Option(
        "residual_multiplier",
        1.0,
        partial(check_real, gt=0.0, float32=True),
        "float: Factor of both residual branches (Granite).",
        field="residual_multiplier",
        stage=2,
    ),
    Option(
        "norm_placement",
        "pre",
        partial(check_choice, choices=NORM_PLACEMENTS),
        "str: Where the block norms sit ('pre', 'sandwich', 'post', 'parallel').",
        field="norm_placement",
        to_core=lambda v, core: getattr(core.NormPlacement, v),
        stage=2,
    ),
    Option(
        "block_parts",
        "full",
        partial(check_choice, choices=BLOCK_PARTS),
        "str: The halves of the block ('full', 'attention', 'mlp').",
        field="block_parts",
        to_core=lambda v, core: getattr(core.BlockParts, _CORE_PARTS[v]),
        stage=2,
    ),
    Option(
        "numeric_profile",
        None,
        partial(check_choice, choices=("fp32",), allow_none=True),
        "str or None: Numeric profile (None = 'fp32').",
        stage=2,
        canonical=lambda v: "fp32",  # None and 'fp32' are the same arithmetic
    ),
)
#: The options of every block before the MoE ones: a dense block's fingerprint spells these
#: only, so that it stays what it was before the MoE options existed (block.py).
DENSE_OPTIONS = OPTIONS
OPTIONS = OPTIONS + MOE_OPTIONS


# --------------------------------------------------------------------------------------------
# checks between options, and with the weights
# --------------------------------------------------------------------------------------------


# Options of the attention half, and their defaults: an MLP-only block refuses other values.
_ATTENTION_OPTIONS = {
    "n_heads": None,
    "n_kv_heads": None,
    "head_dim": None,
    "window": 0,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_dim": None,
    "qkv_bias": False,
    "o_bias": False,
    "qk_norm": False,
    "qk_norm_scope": "head",
    "attn_softcap": None,
    "query_pre_attn_scalar": None,
    "attn_scale": None,
}
_MLP_OPTIONS = {"mlp": "swiglu", "mlp_bias": False}
_FLOAT32_TRUE_MIN = 1.4012984643e-45
_FLOAT32_MAX = 3.4028234663852886e38


def scale_of(o: Mapping) -> float:
    """The binary64 score scale the options ask for, 0.0 = the default head_dim**-0.5.

    ``query_pre_attn_scalar`` q gives ``1 / sqrt(q)`` (IEEE sqrt and divide in binary64, so
    the same on every platform; HF computes ``q**-0.5`` in Python, the same value but at a
    binary64 tie); the core rounds the result to float32 once.
    """
    if o["query_pre_attn_scalar"] is not None:
        return 1.0 / math.sqrt(o["query_pre_attn_scalar"])
    return 0.0 if o["attn_scale"] is None else float(o["attn_scale"])


def _check_combinations(o: dict, where: str) -> None:
    parts = o["block_parts"]
    if o["n_heads"] is None and parts != "mlp":
        raise TypeError(
            f"{where}: n_heads is required (the number of query heads, HF "
            "num_attention_heads); only an MLP-only block (block_parts='mlp') has none"
        )
    if parts == "mlp":
        for k, default in _ATTENTION_OPTIONS.items():
            if o[k] != default or (default is None and o[k] is not None):
                raise ValueError(
                    f"{where}: {k}={o[k]!r} is an attention option, but block_parts='mlp' "
                    f"builds the MLP half only (no attention); leave {k} at its default "
                    f"{default!r}"
                )
    if parts == "attention":
        for k, default in _MLP_OPTIONS.items():
            if o[k] != default:
                raise ValueError(
                    f"{where}: {k}={o[k]!r} is an MLP option, but block_parts='attention' "
                    f"builds the attention half only (no MLP); leave {k} at its default "
                    f"{default!r}"
                )
    if o["norm_placement"] == "parallel" and parts != "full":
        raise ValueError(
            f"{where}: norm_placement='parallel' (attention and MLP read one norm and add in "
            f"parallel) needs block_parts='full'; got block_parts={parts!r}"
        )
    if o["n_kv_heads"] is not None and o["n_heads"] % o["n_kv_heads"]:
        raise ValueError(
            f"{where}: n_heads={o['n_heads']} is not divisible by n_kv_heads={o['n_kv_heads']}"
        )
    if o["norm_bias"] and o["norm"] != "layernorm":
        raise ValueError(f"{where}: norm_bias=True needs norm='layernorm'; got norm={o['norm']!r}")
    if o["qk_norm_scope"] != "head" and not o["qk_norm"]:
        raise ValueError(
            f"{where}: qk_norm_scope={o['qk_norm_scope']!r} needs qk_norm=True (it says how "
            "the q/k norms span the heads)"
        )
    if o["query_pre_attn_scalar"] is not None and o["attn_scale"] is not None:
        raise ValueError(
            f"{where}: query_pre_attn_scalar={o['query_pre_attn_scalar']!r} and "
            f"attn_scale={o['attn_scale']!r} both set the score scale; pass one of them "
            "(query_pre_attn_scalar=q means attn_scale=q**-0.5)"
        )
    if o["query_pre_attn_scalar"] is not None:
        s = scale_of(o)
        if not _FLOAT32_TRUE_MIN / 2 < s < _FLOAT32_MAX:
            raise ValueError(
                f"{where}: query_pre_attn_scalar={o['query_pre_attn_scalar']!r} gives the score "
                f"scale {s!r}, which does not round to a positive finite float32"
            )


def check_options(raw: Mapping, where: str) -> dict:
    """Check every keyword option that does not need the weights; return the checked values.

    ``n_kv_heads``, ``head_dim`` and ``rope_dim`` may still be None (:func:`resolve` completes
    them); ``rope_scaling`` is a normalized copy.
    """
    o = check_all(OPTIONS, raw, where)
    _check_combinations(o, where)
    check_moe_combinations(o, where, GATED_MLPS)
    return o


def _resolve_rope_dim(o: dict, head_dim: int, where: str) -> int:
    rope_dim = o["rope_dim"]
    rs = o["rope_scaling"]
    prf = None if rs is None else rs.get("partial_rotary_factor")
    if rope_dim is None and prf is not None:
        # HF StableLM: rotary_ndims = int(head_dim * partial_rotary_factor), in Python floats.
        rope_dim = int(head_dim * prf)
        if rope_dim % 2 or not 2 <= rope_dim <= head_dim:
            raise ValueError(
                f"{where}: rope_scaling['partial_rotary_factor']={prf!r} gives "
                f"rope_dim=int(head_dim*factor)=int({head_dim}*{prf!r})={rope_dim}, "
                f"which must be an even int in [2, head_dim={head_dim}]"
            )
    elif rope_dim is None:
        if head_dim % 2:
            raise ValueError(
                f"{where}: head_dim={head_dim} is odd, so RoPE cannot rotate the "
                "whole head; pass an even rope_dim <= head_dim (rope_dim=None means "
                "head_dim)"
            )
        rope_dim = head_dim
    elif rope_dim != 0 and (rope_dim % 2 or not 2 <= rope_dim <= head_dim):
        raise ValueError(
            f"{where}: rope_dim={rope_dim} must be 0 (no RoPE) or an even int in "
            f"[2, head_dim={head_dim}]"
        )
    if rs is not None:
        if "rope_theta" in rs and rs["rope_theta"] != o["rope_theta"]:
            raise ValueError(
                f"{where}: rope_scaling['rope_theta']={rs['rope_theta']!r} differs "
                f"from rope_theta={o['rope_theta']!r}"
            )
        if prf is not None and int(head_dim * prf) != rope_dim:
            raise ValueError(
                f"{where}: rope_scaling['partial_rotary_factor']={prf!r} gives "
                f"rope_dim=int({head_dim}*{prf!r})={int(head_dim * prf)}, but "
                f"rope_dim={rope_dim} is in force; pass rope_dim="
                f"{int(head_dim * prf)}"
            )
        for k in _ROPE_LISTS.get(rope_kind(rs), ()):
            if rope_dim and len(rs[k]) != rope_dim // 2:
                raise ValueError(
                    f"{where}: rope_scaling[{k!r}] has {len(rs[k])} factors; longrope needs "
                    f"rope_dim / 2 = {rope_dim // 2} (one per rotated pair, rope_dim={rope_dim})"
                )
        if rope_kind(rs) == "yarn" and o["rope_theta"] == 1.0 and rope_dim:
            raise ValueError(
                f"{where}: rope_theta=1.0 with yarn: yarn's correction range divides by "
                "log(rope_theta); use a rope_theta != 1"
            )
    return rope_dim


def _rope_tables(core_mod, theta: float, rope_scaling, rope_dim: int, max_positions: int):
    """The float32 inverse-frequency table(s) of these options: one set, or longrope's short and
    long sets. default / linear / llama3: the core's own table (``_core.rope_inv_freq``); yarn
    and longrope: HF's formulas in binary64 with Python's log (the core uses its own log, which
    can move an entry by an ulp: enough for the finiteness checks below)."""
    kind = rope_kind(rope_scaling)
    if kind in ("default", "linear", "llama3"):
        _, factor, low, high, omax = rope_params(rope_scaling)
        return [
            np.asarray(
                core_mod.rope_inv_freq(
                    int(rope_dim),
                    float(theta),
                    getattr(core_mod.RopeScaling, kind).value,
                    float(factor),
                    float(low),
                    float(high),
                    float(omax),
                ),
                dtype=np.float32,
            )
        ]
    f = _rope_core_fields(rope_scaling, max_positions, core_mod)
    dim = float(rope_dim)
    pos = np.array([theta ** (2.0 * i / dim) for i in range(rope_dim // 2)], dtype=np.float64)
    if kind == "longrope":
        return [
            (1.0 / (np.asarray(f[k], np.float64) * pos)).astype(np.float32)
            for k in ("rope_short_factor", "rope_long_factor")
        ]
    omax, factor = f["rope_original_max"], f["rope_factor"]

    def corr(rot):
        return dim * math.log(omax / (rot * 2.0 * math.pi)) / (2.0 * math.log(theta))

    low, high = corr(f["rope_beta_fast"]), corr(f["rope_beta_slow"])
    if f["rope_truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2) - low) / (high - low), 0.0, 1.0)
    e = 1.0 - ramp
    return [((1.0 / (factor * pos)) * (1.0 - e) + (1.0 / pos) * e).astype(np.float32)]


def _check_rope_table(
    core_mod, theta: float, rope_scaling, rope_dim: int, max_positions: int, where: str
) -> None:
    """The float32 inverse-frequency table(s) must make every angle of every position finite.

    The tables are those the core will use (binary64, scaled, rounded to float32 once, SPEC.md
    4.4). Options finite in float64 can still give an entry that overflows to inf
    (rope_theta=1e-300, a linear factor of 1e-300), underflows to 0, or an angle
    ``float32(p) * inv_freq`` that overflows for the last position; each would make every call
    return NaN, so the constructor refuses them.
    """
    kind = rope_kind(rope_scaling)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        tables = _rope_tables(core_mod, theta, rope_scaling, rope_dim, max_positions)
    what = f"rope_theta={theta!r}"
    if kind != "default" and rope_scaling.get("factor") is not None:
        what += f" with rope_scaling['factor']={rope_scaling['factor']!r}"
    elif kind != "default":
        what += f" with rope_scaling type {kind!r}"
    what += f" (rope_dim={rope_dim})"
    for t, inv in enumerate(tables):
        name = "inv_freq" if len(tables) == 1 else ("short", "long")[t] + " inv_freq"
        with np.errstate(over="ignore", invalid="ignore"):
            bad = np.flatnonzero(~(np.isfinite(inv) & (inv > 0)))
            last = np.float32(max_positions - 1) * np.float32(inv.max()) if inv.size else 0.0
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{where}: {what} gives the float32 RoPE {name}[{i}]={float(inv[i])!r}; every "
                f"entry of the table (rope_theta**(-2i/rope_dim), scaled) must be finite and > 0 "
                f"in float32 (positive float32 values lie in [1.4e-45, 3.4e38])"
            )
        if not np.isfinite(last):
            raise ValueError(
                f"{where}: {what} gives max({name})={float(inv.max())!r}, so the "
                f"RoPE angle of the last position, float32(max_positions - 1) * "
                f"max({name}) = {max_positions - 1} * {float(inv.max())!r}, overflows "
                "float32; lower max_positions or use a larger rope_theta / factor"
            )


def resolve(o: dict, sizes: Mapping, core_mod, where: str) -> dict:
    """Return the options in force: ``o`` completed with what the weights gave.

    ``n_kv_heads`` and ``head_dim`` come from ``sizes`` (the shape check resolved them),
    ``rope_dim`` from the head width and ``rope_scaling``; then the float32 RoPE table(s) must
    be usable (:func:`_check_rope_table`). An MLP-only block keeps the three None.
    """
    opts = dict(o)
    if o["block_parts"] == "mlp":
        return opts
    opts["n_kv_heads"] = sizes["n_kv_heads"]
    opts["head_dim"] = sizes["head_dim"]
    opts["rope_dim"] = _resolve_rope_dim(o, sizes["head_dim"], where)
    if opts["rope_dim"]:
        _check_rope_table(
            core_mod,
            opts["rope_theta"],
            opts["rope_scaling"],
            opts["rope_dim"],
            opts["max_positions"],
            where,
        )
    return opts


def rope_set_for(opts: Mapping, max_tokens: int) -> str | None:
    """longrope's factor set of a state holding up to ``max_tokens`` positions: 'long' when
    max_tokens > original_max_position_embeddings, else 'short'; None without longrope (or
    without RoPE)."""
    rs = opts["rope_scaling"]
    if rope_kind(rs) != "longrope" or not opts["rope_dim"]:
        return None
    return "long" if max_tokens > rs["original_max_position_embeddings"] else "short"


def core_config(core_mod, opts: Mapping, sizes: Mapping):
    """Return the ``_core.TransformerConfig`` of these options in force and weight sizes.

    The only place a TransformerConfig is filled: every option's field(s) from :data:`OPTIONS`,
    the RoPE fields of ``rope_scaling`` (none without RoPE), the score scale of
    ``query_pre_attn_scalar`` / ``attn_scale``, plus the two sizes only the weights give.
    """
    cfg = core_mod.TransformerConfig()
    cfg.d_model = sizes["d_model"]
    cfg.intermediate = sizes["intermediate"]
    fill_fields(OPTIONS, cfg, opts, core_mod)
    if opts["rope_dim"]:
        fields = _rope_core_fields(opts["rope_scaling"], opts["max_positions"], core_mod)
        for k, v in fields.items():
            setattr(cfg, k, v)
    cfg.attn_scale = scale_of(opts)
    if is_moe(opts):
        cfg.shared_intermediate = sizes.get("shared_intermediate", 0)
    return cfg
