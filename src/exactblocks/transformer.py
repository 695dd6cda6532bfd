"""TransformerBlockInference: one Llama-family decoder block, bit-exact on the CPU.

What lives here: every option and weight check of SPEC.md 4 and 10, the resolved configuration
handed to the C++ core, the fingerprint, the call path shared by ``forward``, ``step`` and the
decode session (all checks first, then one core call with the GIL released, then the counters).
What does not: arithmetic (``csrc/core/transformer_block.cpp``), the RoPE inv_freq table (built in
C++ from the rope parameters), state buffers (``state.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np

from . import _ext
from ._block import BlockCommon
from ._validation import (
    _fmt_int,
    check_array,
    check_choice,
    check_flag,
    check_int,
    check_real,
    describe_type,
    format_shape,
)
from .state import _PRIVATE, TransformerState, _state_type_error
from .weights import (
    TRANSFORMER_HF_PREFIXES,
    TRANSFORMER_SHORT_TO_HF,
    canonical_copy,
    check_key_set,
    fingerprint,
    resolve_names,
    transformer_expected_names,
)

__all__ = ["TransformerBlockInference"]

_CLS = "TransformerBlockInference"
_MAX_POSITIONS_LIMIT = 1 << 24  # positions are exact in binary32 below 2^24 (SPEC.md 4.4)
# Upper bound of the integer options (n_heads, n_kv_heads, head_dim, window, rope_dim). Sizes
# this large are already far beyond any real layer (and every size must also fit the weights);
# the bound keeps every integer handed to the C++ core well inside int64. A window >=
# max_positions behaves like window=0 (causal), so 2^24 loses nothing.
_MAX_INT_OPTION = 1 << 24
_MAX_BATCH = 1 << 62  # allocate_state's batch_size; memory is the real limit (MemoryError)

_NORMS = ("rmsnorm", "layernorm", "rmsnorm_offset")
_MLPS = ("swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh")
_GATED = frozenset({"swiglu", "geglu", "geglu_tanh"})
_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KIND = {"default": 0, "linear": 1, "llama3": 2}
_ROPE_NUMBERS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Keyword options in SPEC.md 4.1 order, with their defaults.
_DEFAULTS = {
    "n_heads": None,
    "n_kv_heads": None,
    "head_dim": None,
    "window": 0,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_dim": None,
    "max_positions": 8192,
    "qkv_bias": False,
    "o_bias": False,
    "norm": "rmsnorm",
    "norm_eps": 1e-06,
    "norm_bias": False,
    "mlp": "swiglu",
    "mlp_bias": False,
    "qk_norm": False,
    "attn_softcap": None,
    "numeric_profile": None,
}
_OPTION_NAMES = tuple(_DEFAULTS)

_ALL_OPTIONAL = {
    "input_layernorm.bias": "norm_bias=True (with norm='layernorm')",
    "post_attention_layernorm.bias": "norm_bias=True (with norm='layernorm')",
    "q_proj.bias": "qkv_bias=True",
    "k_proj.bias": "qkv_bias=True",
    "v_proj.bias": "qkv_bias=True",
    "o_proj.bias": "o_bias=True",
    "q_norm.weight": "qk_norm=True",
    "k_norm.weight": "qk_norm=True",
    "gate_proj.weight": "a gated mlp ('swiglu', 'geglu', 'geglu_tanh')",
    "gate_proj.bias": "a gated mlp with mlp_bias=True",
    "up_proj.bias": "mlp_bias=True",
    "down_proj.bias": "mlp_bias=True",
}


class _Impl:
    """Everything one configuration needs; swapped as a whole by ``set_params``."""

    __slots__ = (
        "raw",
        "opts",
        "weights",
        "fingerprint",
        "d_model",
        "intermediate",
        "core",
        "cfg",
        "rope_scaling",
    )


# --------------------------------------------------------------------------------------------
# option and weight checks
# --------------------------------------------------------------------------------------------


def _check_rope_scaling(value, where: str):
    """Structural checks of rope_scaling; returns (type, normalized dict) or (None, None)."""
    if value is None:
        return None, None
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
        name = f"rope_scaling[{k!r}]"
        if k == "original_max_position_embeddings":
            norm[k] = check_int(value[k], name, where, min_value=1, max_value=_MAX_POSITIONS_LIMIT)
        else:
            norm[k] = check_real(value[k], name, where, gt=0.0)
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
    return kind, norm


def _check_options(raw: dict, where: str) -> dict:
    """Type and range checks of every keyword option that does not need the weights."""
    o = {}
    big = _MAX_INT_OPTION
    o["n_heads"] = check_int(raw["n_heads"], "n_heads", where, min_value=1, max_value=big)
    o["n_kv_heads"] = check_int(
        raw["n_kv_heads"], "n_kv_heads", where, min_value=1, max_value=big, allow_none=True
    )
    o["head_dim"] = check_int(
        raw["head_dim"], "head_dim", where, min_value=1, max_value=big, allow_none=True
    )
    o["window"] = check_int(raw["window"], "window", where, min_value=0, max_value=big)
    o["rope_theta"] = check_real(raw["rope_theta"], "rope_theta", where, gt=0.0)
    o["rope_dim"] = check_int(raw["rope_dim"], "rope_dim", where, allow_none=True)
    if o["rope_dim"] is not None and not -big <= o["rope_dim"] <= big:
        raise ValueError(
            f"{where}: rope_dim must be an even int in [2, head_dim]; got {_fmt_int(o['rope_dim'])}"
        )
    o["max_positions"] = check_int(
        raw["max_positions"], "max_positions", where, min_value=1, max_value=_MAX_POSITIONS_LIMIT
    )
    for flag in ("qkv_bias", "o_bias", "norm_bias", "mlp_bias", "qk_norm"):
        o[flag] = check_flag(raw[flag], flag, where)
    o["norm"] = check_choice(raw["norm"], "norm", where, _NORMS)
    o["norm_eps"] = check_real(raw["norm_eps"], "norm_eps", where, gt=0.0, float32=True)
    o["mlp"] = check_choice(raw["mlp"], "mlp", where, _MLPS)
    o["attn_softcap"] = check_real(
        raw["attn_softcap"], "attn_softcap", where, gt=0.0, allow_none=True, float32=True
    )
    o["numeric_profile"] = check_choice(
        raw["numeric_profile"], "numeric_profile", where, ("fp32",), allow_none=True
    )
    o["rope_kind"], o["rope_scaling"] = _check_rope_scaling(raw["rope_scaling"], where)
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
    return o


def _check_shapes(arrs: dict, o: dict, spell, where: str) -> dict:
    """Derive d_model, head_dim, n_kv_heads, intermediate from the weights and check every shape.

    Returns a dict of the derived sizes.
    """

    def name(n):
        return f"weights[{spell(n)!r}]"

    def rank(n, r):
        a = arrs[n]
        if a.ndim != r:
            raise ValueError(f"{where}: {name(n)} must be {r}-D; got shape {format_shape(a.shape)}")
        return a.shape

    (d,) = rank("input_layernorm.weight", 1)
    if d < 1:
        raise ValueError(
            f"{where}: {name('input_layernorm.weight')} is empty; its length is "
            "d_model, which must be >= 1"
        )
    dims = {"d": (d, f"d_model={d} (length of {name('input_layernorm.weight')})")}
    n_heads = o["n_heads"]

    qr, qc = rank("q_proj.weight", 2)
    if o["head_dim"] is None:
        if qr % n_heads or qr == 0:
            raise ValueError(
                f"{where}: {name('q_proj.weight')} has {qr} rows, not a positive "
                f"multiple of n_heads={n_heads}; head_dim = rows / n_heads must "
                "be exact (or pass head_dim)"
            )
        head_dim = qr // n_heads
        hd_src = f"head_dim={head_dim} ({name('q_proj.weight')} rows / n_heads)"
    else:
        head_dim = o["head_dim"]
        hd_src = f"head_dim={head_dim} (argument)"
    qw = n_heads * head_dim
    dims["QW"] = (qw, f"n_heads*head_dim={n_heads}*{head_dim} (n_heads argument, {hd_src})")

    kr, _ = rank("k_proj.weight", 2)
    if o["n_kv_heads"] is None:
        if kr % head_dim or kr == 0:
            raise ValueError(
                f"{where}: {name('k_proj.weight')} has {kr} rows, not a positive "
                f"multiple of head_dim={head_dim} ({hd_src}); n_kv_heads = rows / "
                "head_dim must be exact (or pass n_kv_heads)"
            )
        n_kv = kr // head_dim
        if n_heads % n_kv:
            raise ValueError(
                f"{where}: n_heads={n_heads} is not divisible by n_kv_heads={n_kv}"
                f" ({name('k_proj.weight')} rows {kr} / head_dim {head_dim})"
            )
        kv_src = f"n_kv_heads={n_kv} ({name('k_proj.weight')} rows / head_dim)"
    else:
        n_kv = o["n_kv_heads"]
        kv_src = f"n_kv_heads={n_kv} (argument)"
    dims["KW"] = (n_kv * head_dim, f"n_kv_heads*head_dim={n_kv}*{head_dim} ({kv_src}, {hd_src})")

    ur, _ = rank("up_proj.weight", 2)
    if ur == 0:
        raise ValueError(
            f"{where}: {name('up_proj.weight')} has 0 rows; its rows give "
            "intermediate, which must be >= 1"
        )
    dims["IT"] = (ur, f"intermediate={ur} (rows of {name('up_proj.weight')})")
    dims["HD"] = (head_dim, hd_src)

    table = {
        "input_layernorm.bias": ("d",),
        "post_attention_layernorm.weight": ("d",),
        "post_attention_layernorm.bias": ("d",),
        "q_proj.weight": ("QW", "d"),
        "q_proj.bias": ("QW",),
        "k_proj.weight": ("KW", "d"),
        "k_proj.bias": ("KW",),
        "v_proj.weight": ("KW", "d"),
        "v_proj.bias": ("KW",),
        "o_proj.weight": ("d", "QW"),
        "o_proj.bias": ("d",),
        "q_norm.weight": ("HD",),
        "k_norm.weight": ("HD",),
        "gate_proj.weight": ("IT", "d"),
        "gate_proj.bias": ("IT",),
        "up_proj.weight": ("IT", "d"),
        "up_proj.bias": ("IT",),
        "down_proj.weight": ("d", "IT"),
        "down_proj.bias": ("d",),
    }
    for n, spec in table.items():
        if n not in arrs:
            continue
        exp = tuple(dims[s][0] for s in spec)
        got = arrs[n].shape
        if got != exp:
            axes = ("rows", "columns") if len(spec) == 2 else ("length",)
            src = "; ".join(f"{ax} = {dims[s][1]}" for ax, s in zip(axes, spec))
            raise ValueError(
                f"{where}: {name(n)} has shape {format_shape(got)}; expected "
                f"{format_shape(exp)}: {src}"
            )
    return {"d_model": d, "head_dim": head_dim, "n_kv_heads": n_kv, "intermediate": ur}


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
                _ROPE_KIND[kind],
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


def _options_repr(opts: dict, rope_params: tuple) -> str:
    """Canonical, platform-independent spelling of the resolved options (for the fingerprint)."""
    items = []
    for k in _OPTION_NAMES:
        if k == "rope_scaling":
            items.append((k, rope_params))
        elif k == "numeric_profile":
            items.append((k, "fp32"))  # None and 'fp32' are the same arithmetic
        else:
            v = opts[k]
            items.append((k, float(v) if isinstance(v, float) else v))
    return repr(tuple(items))


def _typed(cfg, values: dict):
    """Fill a typed core config (``_core.TransformerConfig``) from a dict of its fields."""
    for k, v in values.items():
        setattr(cfg, k, v)
    return cfg


def _build(raw: dict, where: str, weights=None, canonical=None) -> _Impl:
    """Check everything, copy the weights, build the core. Nothing observable changes on error."""
    o = _check_options(raw, where)
    if canonical is None:
        by_short, user_key, _ = resolve_names(
            weights, where, TRANSFORMER_SHORT_TO_HF, TRANSFORMER_HF_PREFIXES
        )
    else:
        by_short, user_key = canonical, {k: k for k in canonical}

    def spell(n):
        return user_key.get(n, n)

    gated = o["mlp"] in _GATED
    if not gated and "gate_proj.weight" in by_short:
        raise ValueError(
            f"{where}: weights[{spell('gate_proj.weight')!r}] is present but "
            f"mlp={o['mlp']!r} is ungated; use a gated mlp ('swiglu', 'geglu', "
            "'geglu_tanh') or remove the tensor"
        )
    expected = transformer_expected_names(
        qkv_bias=o["qkv_bias"],
        o_bias=o["o_bias"],
        norm_bias=o["norm_bias"],
        gated=gated,
        mlp_bias=o["mlp_bias"],
        qk_norm=o["qk_norm"],
    )
    check_key_set(by_short, expected, _ALL_OPTIONAL, where, spell)

    arrs = {n: check_array(v, f"weights[{spell(n)!r}]", where) for n, v in by_short.items()}
    sizes = _check_shapes(arrs, o, spell, where)
    head_dim = sizes["head_dim"]

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

    kind = o["rope_kind"]
    if rs is not None:
        if "rope_theta" in rs and rs["rope_theta"] != o["rope_theta"]:
            raise ValueError(
                f"{where}: rope_scaling['rope_theta']={rs['rope_theta']!r} differs "
                f"from rope_theta={o['rope_theta']!r}"
            )
        if prf is not None:
            if int(head_dim * prf) != rope_dim:
                raise ValueError(
                    f"{where}: rope_scaling['partial_rotary_factor']={prf!r} gives "
                    f"rope_dim=int({head_dim}*{prf!r})={int(head_dim * prf)}, but "
                    f"rope_dim={rope_dim} is in force; pass rope_dim="
                    f"{int(head_dim * prf)}"
                )
    if kind in (None, "default"):
        rope_params = ("default", 1.0, 1.0, 1.0, 0)
    elif kind == "linear":
        rope_params = ("linear", rs["factor"], 1.0, 1.0, 0)
    else:
        rope_params = (
            "llama3",
            rs["factor"],
            rs["low_freq_factor"],
            rs["high_freq_factor"],
            rs["original_max_position_embeddings"],
        )

    core_mod = _ext.core()
    _check_rope_table(core_mod, o["rope_theta"], rope_params, rope_dim, o["max_positions"], where)

    if canonical is None:
        weights_c = {n: canonical_copy(a, f"weights[{spell(n)!r}]", where) for n, a in arrs.items()}
    else:
        weights_c = canonical  # already private, read-only and checked finite

    opts = {
        "n_heads": o["n_heads"],
        "n_kv_heads": sizes["n_kv_heads"],
        "head_dim": head_dim,
        "window": o["window"],
        "rope_theta": o["rope_theta"],
        "rope_scaling": None if rs is None else dict(rs),
        "rope_dim": rope_dim,
        "max_positions": o["max_positions"],
        "qkv_bias": o["qkv_bias"],
        "o_bias": o["o_bias"],
        "norm": o["norm"],
        "norm_eps": o["norm_eps"],
        "norm_bias": o["norm_bias"],
        "mlp": o["mlp"],
        "mlp_bias": o["mlp_bias"],
        "qk_norm": o["qk_norm"],
        "attn_softcap": o["attn_softcap"],
        "numeric_profile": o["numeric_profile"],
    }
    cfg = {
        "d_model": sizes["d_model"],
        "n_heads": o["n_heads"],
        "n_kv_heads": sizes["n_kv_heads"],
        "head_dim": head_dim,
        "intermediate": sizes["intermediate"],
        "window": o["window"],
        "rope_dim": rope_dim,
        "max_positions": o["max_positions"],
        "rope_theta": o["rope_theta"],
        "norm_eps": o["norm_eps"],
        "attn_softcap": 0.0 if o["attn_softcap"] is None else o["attn_softcap"],
        "rope_scaling": getattr(core_mod.RopeScaling, rope_params[0]),
        "rope_factor": float(rope_params[1]),
        "rope_low_freq_factor": float(rope_params[2]),
        "rope_high_freq_factor": float(rope_params[3]),
        "rope_original_max": int(rope_params[4]),
        "norm": getattr(core_mod.NormKind, o["norm"]),
        "mlp": getattr(core_mod.MlpKind, o["mlp"]),
        "qkv_bias": o["qkv_bias"],
        "o_bias": o["o_bias"],
        "norm_bias": o["norm_bias"],
        "mlp_bias": o["mlp_bias"],
        "qk_norm": o["qk_norm"],
    }
    fp = fingerprint(
        _CLS, str(core_mod.arithmetic_version()), _options_repr(opts, rope_params), weights_c
    )
    impl = _Impl()
    impl.raw = {
        k: (dict(v) if k == "rope_scaling" and v is not None else v) for k, v in raw.items()
    }
    impl.opts = opts
    impl.weights = weights_c
    impl.fingerprint = fp
    impl.d_model = sizes["d_model"]
    impl.intermediate = sizes["intermediate"]
    impl.cfg = cfg
    impl.rope_scaling = rope_params
    impl.core = core_mod.TransformerCore(_typed(core_mod.TransformerConfig(), cfg), weights_c)
    return impl


# --------------------------------------------------------------------------------------------
# state checks shared by the block's calls and the session
# --------------------------------------------------------------------------------------------


def _check_readable(
    state: TransformerState,
    start: np.ndarray,
    lens: np.ndarray,
    where: str,
    reader: str = "read by this call",
) -> None:
    """SPEC.md 5 reading rule: slots of positions j0 .. q0-1 of every advancing row are finite.

    The error names the first non-finite element in (row, k_cache then v_cache, KV head,
    position) order, whatever the thread count and whether the window wraps the ring.
    ``reader`` completes the message ("read by this call", or the session's next step).
    """
    w, cap = state.window, state.capacity
    spans, first_pos = [], []  # (b, a, e) slot ranges; position held by slot a of each
    for b in range(state.batch_size):
        q0 = int(start[b])
        if lens[b] == 0 or q0 == 0:
            continue
        j0 = max(0, q0 - w + 1) if w > 0 else 0
        s0 = j0 % cap
        count = q0 - j0
        spans.append((b, s0, min(cap, s0 + count)))
        first_pos.append(j0)
        if s0 + count > cap:
            spans.append((b, 0, s0 + count - cap))
            first_pos.append(j0 + cap - s0)
    if not spans:
        return
    span_arr = np.array(spans, dtype=np.int64)
    core = _ext.core()
    hits = []  # the first bad element in (row, buffer, span) order, as the rows are read
    for k, buf_name in enumerate(("k_cache", "v_cache")):
        hit = core.first_nonfinite_spans(getattr(state, buf_name), span_arr)
        if hit is not None:
            i, g, slot, dd = (int(v) for v in hit)
            hits.append((spans[i][0], k, i, buf_name, g, slot, dd))
    if hits:
        b, _, i, buf_name, g, slot, dd = min(hits)
        pos = first_pos[i] + (slot - spans[i][1])
        buf = getattr(state, buf_name)
        raise ValueError(
            f"{where}: state.{buf_name}[{b}, {g}, {slot}, {dd}] (row {b}, position "
            f"{pos}, {reader}) must be finite; got {float(buf[b, g, slot, dd])!r}"
        )


def _check_counters(state: TransformerState, where: str) -> np.ndarray:
    """Re-check the state's buffers, then return a copy of row_tokens, each in [0, max_tokens].

    Called (under the state's lock) before anything is computed or written, by every block call
    and by the session's ``load_state``.
    """
    state._check_buffers(where)
    rt = np.array(state.row_tokens, dtype=np.int64, copy=True)
    for b, n in enumerate(rt.tolist()):
        if not 0 <= n <= state.max_tokens:
            raise ValueError(
                f"{where}: state.row_tokens[{b}]={n} is outside [0, max_tokens={state.max_tokens}]"
            )
    return rt


# --------------------------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------------------------


class TransformerBlockInference(BlockCommon):
    """One pre-norm decoder block (attention + MLP), bit-exact float32 inference on the CPU.

    Computes HF ``LlamaDecoderLayer.forward`` (transformers 5.x) and its Mistral, Qwen2, Qwen3,
    Gemma, StableLM and Starcoder2 variants selected by the options, with a fixed sequence of
    binary32 operations per output element (SPEC.md 3), so that ``step`` == ``forward`` == any
    chunking, a ragged row == that row alone, and 1 thread == N threads, bit for bit.

    Parameters
    ----------
    weights : Mapping of str to float32 buffer
        In torch's [out, in] layout, with the short names (``'q_proj.weight'``, ...) or the HF
        layer names (the keys of ``LlamaDecoderLayer.state_dict()``, ``'self_attn.q_proj.weight'``,
        ``'mlp.up_proj.weight'``, ...). With QW = n_heads*head_dim, KW = n_kv_heads*head_dim,
        IT = rows of up_proj.weight, d = d_model = len(input_layernorm.weight):
        ``input_layernorm.weight``, ``post_attention_layernorm.weight`` (d,) [``.bias`` (d,)
        with norm_bias]; ``q_proj.weight`` (QW, d), ``k_proj.weight``, ``v_proj.weight`` (KW, d)
        [``.bias`` with qkv_bias]; ``o_proj.weight`` (d, QW) [``.bias`` (d,) with o_bias];
        ``q_norm.weight``, ``k_norm.weight`` (head_dim,) with qk_norm; ``gate_proj.weight``
        (IT, d) for gated MLPs; ``up_proj.weight`` (IT, d); ``down_proj.weight`` (d, IT)
        [biases with mlp_bias]. The key set must be exact. Arrays are copied (editing them later
        has no effect) and never written.
    n_heads : int
        Query heads (HF ``num_attention_heads``), in [1, 2**24].
    n_kv_heads : int or None, default=None
        K/V heads, dividing n_heads (HF ``num_key_value_heads``), in [1, 2**24]; None = k_proj
        rows / head_dim.
    head_dim : int or None, default=None
        Width of a head, in [1, 2**24]; None = q_proj rows / n_heads (exact). Free of d_model.
    window : int, default=0
        0 = causal attention; W in [1, 2**24] = sliding window: a query at position p sees keys
        ``p-W+1 .. p`` (W keys including itself; HF ``sliding_window``). A window >=
        max_positions gives the same outputs as 0.
    rope_theta : float, default=10000.0
        RoPE base, finite > 0. Together with rope_scaling and max_positions it must give a
        usable float32 table: every ``inv_freq_i`` (computed in binary64, scaled, rounded to
        float32) finite and > 0, and ``float32(max_positions - 1) * max(inv_freq)`` finite;
        otherwise ValueError (e.g. rope_theta=1e-300 or a linear factor of 1e-300).
    rope_scaling : Mapping or None, default=None
        HF ``rope_scaling`` / ``rope_parameters``: ``{'rope_type': 'default'}``,
        ``{'rope_type': 'linear', 'factor': f}`` or ``{'rope_type': 'llama3', 'factor',
        'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'}`` (legacy key
        ``'type'`` accepted; original_max_position_embeddings an int in [1, 2**24]). Extra keys
        allowed: ``'rope_theta'`` (must equal rope_theta) and ``'partial_rotary_factor'``: with
        rope_dim=None it gives ``rope_dim = int(head_dim * partial_rotary_factor)`` (HF StableLM
        ``rotary_ndims``), which must be even and in [2, head_dim]; with rope_dim given the two
        must agree.
    rope_dim : int or None, default=None
        Rotate the first rope_dim dims of each head (even, in [2, head_dim]); None = derived
        from ``rope_scaling['partial_rotary_factor']`` when present, else head_dim.
    max_positions : int, default=8192
        Positions p < max_positions can be computed; in [1, 2**24].
    qkv_bias, o_bias : bool, default=False
        Biases on q/k/v (Qwen2) and on o_proj.
    norm : {'rmsnorm', 'layernorm', 'rmsnorm_offset'}, default='rmsnorm'
        ``LlamaRMSNorm``; ``torch.nn.LayerNorm``; ``GemmaRMSNorm`` (scale 1 + w).
    norm_eps : float, default=1e-06
        Epsilon of every norm of the block, > 0, used as float32: it must round to a positive
        finite float32, i.e. lie in about [1.4e-45, 3.4028235e38] (1e-50 or 1e39 are refused).
    norm_bias : bool, default=False
        LayerNorm biases; needs norm='layernorm'.
    mlp : {'swiglu', 'geglu', 'geglu_tanh', 'gelu', 'gelu_tanh'}, default='swiglu'
        Gated ``down(act(gate) * up)`` with silu / erf-GELU / tanh-GELU, or ungated
        ``down(act(up))``.
    mlp_bias : bool, default=False
        Biases on up, down and (gated) gate.
    qk_norm : bool, default=False
        Per-head norm of q and k over head_dim before RoPE (Qwen3, Gemma3); not with layernorm.
    attn_softcap : float or None, default=None
        Scores s -> cap * tanh(s / cap) before the mask (Gemma2), > 0, used as float32: it must
        round to a positive finite float32 (about [1.4e-45, 3.4028235e38]).
    numeric_profile : {None, 'fp32'}, default=None
        float32 weights and arithmetic (the only profile in v1).

    Attributes
    ----------
    d_model, n_heads, n_kv_heads, head_dim, intermediate, window, rope_theta, rope_scaling,
    rope_dim, max_positions, qkv_bias, o_bias, norm, norm_eps, norm_bias, mlp, mlp_bias, qk_norm,
    attn_softcap, numeric_profile : read-only
        The resolved configuration (assignment raises AttributeError; use ``set_params``).
    fingerprint : str
        32 lowercase hex digits (XXH3-128) over the class, ``arithmetic_version()``, the resolved
        options and the weight bytes; states carry it.

    Raises
    ------
    TypeError
        ``weights`` not a Mapping, a key not a str, a weight not a float32 buffer (the message
        gives the exact widening where one exists), an option of the wrong type, a positional or
        unknown option.
    ValueError
        Missing, unknown or mixed-spelling weight names; an optional tensor present while its
        option is off; a wrong shape (tensor, shape got, shape expected and where each number
        came from); a NaN or infinite weight (tensor, flat index, value); an option out of range
        or inconsistent with another option or the weights.
    ImportError
        The compiled extension is missing or of another version.

    See Also
    --------
    TransformerState, TransformerDecodeSession

    Notes
    -----
    Per row and real position p (SPEC.md 4.3, HF ``LlamaDecoderLayer`` order):
    ``h = N_in(x)``; ``q, k, v = Wq h, Wk h, Wv h`` (+biases); optional q/k norm; RoPE at p
    (rotate_half layout, RoFormer); k, v of p go to the state; attention over the window with
    scale ``head_dim**-0.5`` (float32), optional softcap, two-pass softmax; ``x1 = x + Wo o``;
    ``y = x1 + Wd act(Wg N_post(x1)) * (Wu N_post(x1))`` (gated) or ``x1 + Wd act(Wu ...)``.
    Agreement with HF float32 eager attention is within rtol = atol = 2e-4 at test sizes; bit
    equality with PyTorch is not promised.

    References
    ----------
    .. [1] Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
       arXiv:2104.09864.

    Examples
    --------
    >>> import numpy as np, exactblocks
    >>> rng = np.random.default_rng(0)
    >>> d, hd, it = 32, 8, 64
    >>> def r(*s): return (0.1 * rng.standard_normal(s)).astype(np.float32)
    >>> w = {'input_layernorm.weight': 1 + r(d), 'post_attention_layernorm.weight': 1 + r(d),
    ...      'q_proj.weight': r(4 * hd, d), 'k_proj.weight': r(2 * hd, d),
    ...      'v_proj.weight': r(2 * hd, d), 'o_proj.weight': r(d, 4 * hd),
    ...      'gate_proj.weight': r(it, d), 'up_proj.weight': r(it, d),
    ...      'down_proj.weight': r(d, it)}
    >>> blk = exactblocks.TransformerBlockInference(w, n_heads=4)
    >>> blk.n_kv_heads, blk.head_dim
    (2, 8)
    >>> x = r(1, 5, d)
    >>> st = blk.allocate_state(1, 16)
    >>> y = np.concatenate([blk.step(x[:, t], st) for t in range(5)], axis=1)
    >>> bool((y.view(np.uint32) == blk.forward(x).view(np.uint32)).all())
    True
    """

    _defaults = _DEFAULTS
    _build = staticmethod(_build)

    def __init__(
        self,
        weights,
        *,
        n_heads,
        n_kv_heads=None,
        head_dim=None,
        window=0,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_dim=None,
        max_positions=8192,
        qkv_bias=False,
        o_bias=False,
        norm="rmsnorm",
        norm_eps=1e-06,
        norm_bias=False,
        mlp="swiglu",
        mlp_bias=False,
        qk_norm=False,
        attn_softcap=None,
        numeric_profile=None,
    ):
        raw = {
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "window": window,
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "rope_dim": rope_dim,
            "max_positions": max_positions,
            "qkv_bias": qkv_bias,
            "o_bias": o_bias,
            "norm": norm,
            "norm_eps": norm_eps,
            "norm_bias": norm_bias,
            "mlp": mlp,
            "mlp_bias": mlp_bias,
            "qk_norm": qk_norm,
            "attn_softcap": attn_softcap,
            "numeric_profile": numeric_profile,
        }
        object.__setattr__(self, "_impl", _build(raw, f"{_CLS}.__init__", weights=weights))

    # -- read-only attributes -------------------------------------------------------------------
    d_model = property(
        lambda self: self._impl.d_model,
        doc="int: Residual width, the length of input_layernorm.weight.",
    )
    intermediate = property(
        lambda self: self._impl.intermediate,
        doc="int: MLP hidden width, the rows of up_proj.weight.",
    )
    fingerprint = property(
        lambda self: self._impl.fingerprint,
        doc="str: 32 hex digits identifying class, arithmetic, options and "
        "weights; states carry it.",
    )
    n_heads = property(lambda self: self._impl.opts["n_heads"], doc="int: Query heads.")
    n_kv_heads = property(
        lambda self: self._impl.opts["n_kv_heads"], doc="int: K/V heads (resolved)."
    )
    head_dim = property(
        lambda self: self._impl.opts["head_dim"], doc="int: Width of one head (resolved)."
    )
    window = property(
        lambda self: self._impl.opts["window"], doc="int: Sliding window in tokens (0 = causal)."
    )
    rope_theta = property(lambda self: self._impl.opts["rope_theta"], doc="float: RoPE base.")
    rope_scaling = property(
        lambda self: (
            None
            if self._impl.opts["rope_scaling"] is None
            else dict(self._impl.opts["rope_scaling"])
        ),
        doc="dict or None: A copy of the RoPE scaling mapping in force.",
    )
    rope_dim = property(
        lambda self: self._impl.opts["rope_dim"], doc="int: Rotated dims per head (resolved)."
    )
    max_positions = property(
        lambda self: self._impl.opts["max_positions"],
        doc="int: Positions p < max_positions can be computed.",
    )
    qkv_bias = property(lambda self: self._impl.opts["qkv_bias"], doc="bool: q/k/v biases.")
    o_bias = property(lambda self: self._impl.opts["o_bias"], doc="bool: o_proj bias.")
    norm = property(lambda self: self._impl.opts["norm"], doc="str: Norm kind.")
    norm_eps = property(lambda self: self._impl.opts["norm_eps"], doc="float: Norm epsilon.")
    norm_bias = property(lambda self: self._impl.opts["norm_bias"], doc="bool: LayerNorm biases.")
    mlp = property(lambda self: self._impl.opts["mlp"], doc="str: MLP kind.")
    mlp_bias = property(lambda self: self._impl.opts["mlp_bias"], doc="bool: MLP biases.")
    qk_norm = property(lambda self: self._impl.opts["qk_norm"], doc="bool: Per-head q/k norm.")
    attn_softcap = property(
        lambda self: self._impl.opts["attn_softcap"], doc="float or None: Attention logit softcap."
    )
    numeric_profile = property(
        lambda self: self._impl.opts["numeric_profile"],
        doc="str or None: Numeric profile (None = 'fp32').",
    )

    # -- sklearn-style parameters -------------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict:
        """Return every keyword option with the value in force.

        Parameters
        ----------
        deep : bool, default=True
            Accepted for scikit-learn compatibility and ignored.

        Returns
        -------
        dict
            The 18 keyword options of the constructor (``weights`` is not included), resolved:
            ``n_kv_heads``, ``head_dim`` and ``rope_dim`` as ints; ``rope_scaling`` a copy.
        """
        opts = dict(self._impl.opts)
        if opts["rope_scaling"] is not None:
            opts["rope_scaling"] = dict(opts["rope_scaling"])
        return opts

    # -- identity, copying --------------------------------------------------------------------
    def __repr__(self) -> str:
        o = self._impl.opts
        inner = ", ".join(
            [f"d_model={self._impl.d_model}", f"intermediate={self._impl.intermediate}"]
            + [f"{k}={o[k]!r}" for k in _OPTION_NAMES]
        )
        return f"{_CLS}({inner})"

    # -- states and sessions ------------------------------------------------------------------
    def allocate_state(self, batch_size: int, max_tokens: int) -> TransformerState:
        """Return a zeroed KV cache for ``batch_size`` sequences of up to ``max_tokens`` positions.

        Parameters
        ----------
        batch_size : int
            Rows, in [1, 2**62] (memory is the practical limit).
        max_tokens : int
            Positions each row may hold, in [1, max_positions].

        Returns
        -------
        TransformerState
            ``k_cache``/``v_cache`` of shape (batch_size, n_kv_heads, capacity, head_dim),
            capacity = max_tokens (min(window, max_tokens) with a window), all +0.0;
            ``row_tokens`` zeros; the block's fingerprint. Memory:
            2 * batch_size * n_kv_heads * capacity * head_dim * 4 bytes.

        Raises
        ------
        TypeError
            A non-int argument.
        ValueError
            An argument < 1, batch_size > 2**62, or max_tokens > max_positions.
        MemoryError
            The buffers cannot be allocated; the message gives the bytes asked for.
        """
        where = f"{_CLS}.allocate_state"
        impl = self._impl
        b = check_int(batch_size, "batch_size", where, min_value=1, max_value=_MAX_BATCH)
        m = check_int(max_tokens, "max_tokens", where, min_value=1, max_value=_MAX_POSITIONS_LIMIT)
        if m > impl.opts["max_positions"]:
            raise ValueError(
                f"{where}: max_tokens={m} exceeds max_positions="
                f"{impl.opts['max_positions']} of the block (raise max_positions, "
                "up to 2**24, with set_params or at construction)"
            )
        kv, hd, w = impl.opts["n_kv_heads"], impl.opts["head_dim"], impl.opts["window"]
        cap = min(w, m) if w > 0 else m
        nbytes = 2 * b * kv * cap * hd * 4 + 8 * b
        try:
            if nbytes > sys.maxsize:
                raise MemoryError
            return TransformerState._make(
                _PRIVATE,
                batch_size=b,
                n_kv_heads=kv,
                head_dim=hd,
                max_tokens=m,
                window=w,
                fingerprint=impl.fingerprint,
            )
        except MemoryError:
            raise MemoryError(
                f"{where}: cannot allocate a state of batch_size={b}, max_tokens={m}: k_cache "
                f"and v_cache of shape {format_shape((b, kv, cap, hd))} float32 plus row_tokens "
                f"need {nbytes} bytes ({nbytes / 2**30:.3g} GiB)"
            ) from None

    def decode_session(self, state: TransformerState):
        """Open an exclusive decode session working in place on ``state``.

        Parameters
        ----------
        state : TransformerState
            A state of this block (same fingerprint), not claimed by another open session.

        Returns
        -------
        TransformerDecodeSession
            Holds the claim until ``close()``, ``discard()``, the end of a ``with`` block or its
            garbage collection.

        Raises
        ------
        TypeError
            ``state`` is None or not a TransformerState.
        ValueError
            The state belongs to another block, or is claimed by an open session.
        """
        from .session import TransformerDecodeSession

        where = f"{_CLS}.decode_session"
        if not isinstance(state, TransformerState):
            raise _state_type_error(where, state)
        self._check_fingerprint(self._impl, state, where)
        return TransformerDecodeSession._open_claim(self, state, where)

    # -- calls --------------------------------------------------------------------------------
    def forward(self, x, state: TransformerState | None = None, *, lengths=None) -> np.ndarray:
        """Run the block on ``x``; with a state, advance each row by its real tokens.

        Parameters
        ----------
        x : buffer of shape (batch, n_tokens, d_model), dtype float32
            Any float32 buffer (NumPy array, memoryview, ...); never written. Non-contiguous
            input is copied once (bytes only).
        state : TransformerState or None, default=None
            None: every row starts at position 0 with an empty cache used for this call only
            (then n_tokens <= max_positions).
            Otherwise a state of this block with ``batch_size == batch``; row b's tokens take
            positions ``row_tokens[b] .. row_tokens[b] + n_b - 1`` and ``row_tokens[b] += n_b``.
        lengths : None, sequence of int or 1-D integer array, default=None
            Real tokens per row ``n_b`` in [0, n_tokens]; ``x[b, n_b:]`` is padding, never read.

        Returns
        -------
        ndarray of shape (batch, n_tokens, d_model), dtype float32
            Fresh, C-contiguous; padding positions are exactly +0.0.

        Raises
        ------
        TypeError
            ``x`` not a float32 buffer; ``state`` not a TransformerState; bad ``lengths`` type.
        ValueError
            Wrong shape of ``x``; NaN/inf in a real position of ``x`` (index and value);
            bad ``lengths`` count or range; a state of another block or batch size, claimed by an
            open session, with ``row_tokens`` outside [0, max_tokens], with non-finite readable
            slots, or without room (row, held, asked, limit); positions >= max_positions (without
            a state: n_tokens > max_positions, whatever ``lengths``); a state buffer reshaped,
            retyped, made read-only or replaced in place (checked before anything is written).
        RuntimeError
            The state is in use by another call.

        Notes
        -----
        Every check completes before the state is touched; the native computation runs with the
        GIL released. Output bits depend only on each row's own tokens and starting state
        (SPEC.md 3.1).
        """
        return self._call(x, state, lengths, f"{_CLS}.forward", step=False, session=None)

    __call__ = forward

    def step(self, x, state: TransformerState) -> np.ndarray:
        """Advance every row of ``state`` by one token and return the block output.

        Parameters
        ----------
        x : buffer of shape (batch, d_model) or (batch, 1, d_model), dtype float32
            One token per row.
        state : TransformerState
            Required; as in :meth:`forward`.

        Returns
        -------
        ndarray of shape (batch, 1, d_model), dtype float32
            Bitwise equal to ``forward(x, state)`` with one token.

        Raises
        ------
        TypeError
            ``state`` is None or not a TransformerState; ``x`` not a float32 buffer.
        ValueError
            As in :meth:`forward`; also ``x`` with n_tokens != 1.
        RuntimeError
            The state is in use by another call.
        """
        return self._call(x, state, None, f"{_CLS}.step", step=True, session=None)

    # -- internals ----------------------------------------------------------------------------
    def _call(self, x, state, lengths, where: str, *, step: bool, session) -> np.ndarray:
        impl = self._impl  # one snapshot: set_params swaps configurations atomically
        xa, lens = self._check_call_inputs(
            x,
            state,
            lengths,
            where,
            step=step,
            d_model=impl.d_model,
            state_cls=TransformerState,
            type_error=_state_type_error,
            alloc_call="allocate_state(batch_size, max_tokens)",
        )
        bsz, n_tok, _ = xa.shape
        core = impl.core
        opts = impl.opts
        max_pos = opts["max_positions"]

        if state is None:
            # SPEC.md 4.5: a state-less call needs L <= max_positions, whatever the lengths.
            if n_tok > max_pos:
                raise ValueError(
                    f"{where}: x has {n_tok} tokens per row (shape "
                    f"{format_shape(xa.shape)}); without a state every row starts "
                    f"at position 0, and the limit is max_positions={max_pos} "
                    "tokens (raise max_positions, up to 2**24)"
                )
            # Capacity 0: no cache is read (every row starts at 0) or kept, so no scratch
            # cache is allocated (and page-faulted) per call.
            shape = (bsz, opts["n_kv_heads"], 0, opts["head_dim"])
            k = np.zeros(shape, np.float32)
            v = np.zeros(shape, np.float32)
            return core.forward(xa, lens, np.zeros(bsz, np.int64), k, v)

        self._check_state_fits(impl, state, xa, where)
        owner = state._open_session()
        if owner is not None and owner is not session:
            raise ValueError(
                f"{where}: state is claimed by an open decode session {owner!r}; "
                "call the session's step/forward, or close it first"
            )
        self._lock_state(state, where)
        try:
            start = _check_counters(state, where)
            for b in range(bsz):
                held, asked = int(start[b]), int(lens[b])
                limit = min(state.max_tokens, max_pos)
                if held + asked > limit:
                    which = "max_tokens" if state.max_tokens <= max_pos else "max_positions"
                    if held + asked <= max_pos:
                        hint = f"create the state with max_tokens >= {held + asked}"
                    elif held + asked <= _MAX_POSITIONS_LIMIT:
                        hint = (
                            f"build the block with max_positions >= {held + asked} and the "
                            f"state with max_tokens >= {held + asked}"
                        )
                    else:
                        hint = (
                            f"positions stop at {_MAX_POSITIONS_LIMIT} (2^24); start a new "
                            "sequence or roll back row_tokens"
                        )
                    raise ValueError(
                        f"{where}: row {b} holds {held} positions and this call adds {asked}; "
                        f"the limit is {which}={limit} ({hint})"
                    )
            ws = session._workspace if session is not None else None
            # The native call checks the slots each row reads (SPEC 5) as it reads them, and
            # returns None before writing anything when one is not finite; the Python check
            # then names the first such element (the same rule, so it always finds one).
            y = core.forward(xa, lens, start, state.k_cache, state.v_cache, ws, check_cache=True)
            if y is None:
                _check_readable(state, start, lens, where)
                raise RuntimeError(
                    f"{where}: internal error: the native cache check failed "
                    "but no non-finite slot was found"
                )
            state.row_tokens[:] = start + lens
        finally:
            state._lock.release()
        return y
