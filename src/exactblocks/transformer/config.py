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

from collections.abc import Mapping
from functools import partial

import numpy as np

from .._options import REQUIRED, Option, check_all, fill_fields
from .._validation import (
    _fmt_int,
    check_choice,
    check_flag,
    check_int,
    check_real,
    describe_type,
)

__all__ = ["OPTIONS", "check_options", "core_config", "resolve"]

MAX_POSITIONS_LIMIT = 1 << 24  # positions are exact in binary32 below 2^24 (SPEC.md 4.4)
# Upper bound of the integer options (n_heads, n_kv_heads, head_dim, window, rope_dim). Sizes
# this large are already far beyond any real layer (and every size must also fit the weights);
# the bound keeps every integer handed to the C++ core well inside int64. A window >=
# max_positions behaves like window=0 (causal), so 2^24 loses nothing.
_MAX_INT_OPTION = 1 << 24

NORMS = ("rmsnorm", "layernorm", "rmsnorm_offset")
MLPS = ("swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh")
GATED_MLPS = ("swiglu", "geglu", "geglu_tanh")
_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_NUMBERS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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
    allowed = set(_ROPE_NUMBERS[kind]) | {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
    }
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


def rope_params(rope_scaling) -> tuple:
    """``(kind, factor, low_freq_factor, high_freq_factor, original_max)`` of a checked
    rope_scaling (None = the default RoPE); the fingerprint spells rope_scaling this way."""
    rs = rope_scaling
    kind = None if rs is None else rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return ("default", 1.0, 1.0, 1.0, 0)
    if kind == "linear":
        return ("linear", rs["factor"], 1.0, 1.0, 0)
    return (
        "llama3",
        rs["factor"],
        rs["low_freq_factor"],
        rs["high_freq_factor"],
        rs["original_max_position_embeddings"],
    )


def _rope_to_core(rope_scaling, core_mod) -> tuple:
    kind, factor, low, high, omax = rope_params(rope_scaling)
    return (getattr(core_mod.RopeScaling, kind), float(factor), float(low), float(high), int(omax))


def _check_rope_dim(value, name: str, where: str):
    v = check_int(value, name, where, allow_none=True)
    if v is not None and not -_MAX_INT_OPTION <= v <= _MAX_INT_OPTION:
        raise ValueError(
            f"{where}: rope_dim must be an even int in [2, head_dim]; got {_fmt_int(v)}"
        )
    return v


def _int(*, lo, hi=_MAX_INT_OPTION, allow_none=False):
    return partial(check_int, min_value=lo, max_value=hi, allow_none=allow_none)


def _copy_mapping(value):
    return None if value is None else dict(value)


# Stages keep the order in which the options were always checked: sizes and numbers (0), flags
# (1), kinds, epsilons and caps (2), then rope_scaling (3).
OPTIONS: tuple[Option, ...] = (
    Option("n_heads", REQUIRED, _int(lo=1), "int: Query heads.", field="n_heads"),
    Option(
        "n_kv_heads",
        None,
        _int(lo=1, allow_none=True),
        "int: K/V heads (resolved).",
        field="n_kv_heads",
    ),
    Option(
        "head_dim",
        None,
        _int(lo=1, allow_none=True),
        "int: Width of one head (resolved).",
        field="head_dim",
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
        field=(
            "rope_scaling",
            "rope_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
            "rope_original_max",
        ),
        to_core=_rope_to_core,
        stage=3,
        public=_copy_mapping,
        canonical=rope_params,
    ),
    Option(
        "rope_dim",
        None,
        _check_rope_dim,
        "int: Rotated dims per head (resolved).",
        field="rope_dim",
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
    Option("qk_norm", False, check_flag, "bool: Per-head q/k norm.", field="qk_norm", stage=1),
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
        "numeric_profile",
        None,
        partial(check_choice, choices=("fp32",), allow_none=True),
        "str or None: Numeric profile (None = 'fp32').",
        stage=2,
        canonical=lambda v: "fp32",  # None and 'fp32' are the same arithmetic
    ),
)


# --------------------------------------------------------------------------------------------
# checks between options, and with the weights
# --------------------------------------------------------------------------------------------


def _check_combinations(o: dict, where: str) -> None:
    if o["n_kv_heads"] is not None and o["n_heads"] % o["n_kv_heads"]:
        raise ValueError(
            f"{where}: n_heads={o['n_heads']} is not divisible by n_kv_heads={o['n_kv_heads']}"
        )
    if o["norm_bias"] and o["norm"] != "layernorm":
        raise ValueError(f"{where}: norm_bias=True needs norm='layernorm'; got norm={o['norm']!r}")
    if o["qk_norm"] and o["norm"] == "layernorm":
        raise ValueError(
            f"{where}: qk_norm=True cannot be combined with norm='layernorm' (q/k "
            "norms use the block norm kind: 'rmsnorm' or 'rmsnorm_offset')"
        )


def check_options(raw: Mapping, where: str) -> dict:
    """Check every keyword option that does not need the weights; return the checked values.

    ``n_kv_heads``, ``head_dim`` and ``rope_dim`` may still be None (:func:`resolve` completes
    them); ``rope_scaling`` is a normalized copy.
    """
    o = check_all(OPTIONS, raw, where)
    _check_combinations(o, where)
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
    elif rope_dim % 2 or not 2 <= rope_dim <= head_dim:
        raise ValueError(
            f"{where}: rope_dim={rope_dim} must be an even int in [2, head_dim={head_dim}]"
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
    return rope_dim


def _check_rope_table(
    core_mod, theta: float, rope_params: tuple, rope_dim: int, max_positions: int, where: str
) -> None:
    """The float32 inverse-frequency table must make every angle of every position finite.

    The table is the one the core will use (``_core.rope_inv_freq``: binary64, scaled, rounded
    to float32 once, SPEC.md 4.4). Options finite in float64 can still give an entry that
    overflows to inf (rope_theta=1e-300, a linear factor of 1e-300), underflows to 0, or an angle
    ``float32(p) * inv_freq`` that overflows for the last position; each would make every call
    return NaN, so the constructor refuses them.
    """
    kind, factor, low, high, omax = rope_params
    with np.errstate(over="ignore", invalid="ignore"):
        inv = np.asarray(
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
        bad = np.flatnonzero(~(np.isfinite(inv) & (inv > 0)))
        last = np.float32(max_positions - 1) * np.float32(inv.max()) if inv.size else 0.0
    what = f"rope_theta={theta!r}"
    if kind != "default":
        what += f" with rope_scaling['factor']={factor!r}"
    what += f" (rope_dim={rope_dim})"
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{where}: {what} gives the float32 RoPE inverse frequency "
            f"inv_freq[{i}]={float(inv[i])!r}; every entry of the table "
            f"(rope_theta**(-2i/rope_dim), scaled) must be finite and > 0 in float32 "
            f"(positive float32 values lie in [1.4e-45, 3.4e38])"
        )
    if not np.isfinite(last):
        raise ValueError(
            f"{where}: {what} gives max(inv_freq)={float(inv.max())!r}, so the "
            f"RoPE angle of the last position, float32(max_positions - 1) * "
            f"max(inv_freq) = {max_positions - 1} * {float(inv.max())!r}, overflows "
            "float32; lower max_positions or use a larger rope_theta / factor"
        )


def resolve(o: dict, sizes: Mapping, core_mod, where: str) -> dict:
    """Return the options in force: ``o`` completed with what the weights gave.

    ``n_kv_heads`` and ``head_dim`` come from ``sizes`` (the shape check resolved them),
    ``rope_dim`` from the head width and ``rope_scaling``; then the float32 RoPE table must be
    usable (:func:`_check_rope_table`).
    """
    opts = dict(o)
    opts["n_kv_heads"] = sizes["n_kv_heads"]
    opts["head_dim"] = sizes["head_dim"]
    opts["rope_dim"] = _resolve_rope_dim(o, sizes["head_dim"], where)
    _check_rope_table(
        core_mod,
        opts["rope_theta"],
        rope_params(opts["rope_scaling"]),
        opts["rope_dim"],
        opts["max_positions"],
        where,
    )
    return opts


def core_config(core_mod, opts: Mapping, sizes: Mapping):
    """Return the ``_core.TransformerConfig`` of these options in force and weight sizes.

    The only place a TransformerConfig is filled: every option's field(s) from :data:`OPTIONS`,
    plus the two sizes only the weights give.
    """
    cfg = core_mod.TransformerConfig()
    cfg.d_model = sizes["d_model"]
    cfg.intermediate = sizes["intermediate"]
    fill_fields(OPTIONS, cfg, opts, core_mod)
    return cfg
