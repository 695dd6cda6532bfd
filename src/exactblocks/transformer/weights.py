"""The Transformer weight table and the checks of a weight dict against the options.

What lives here: :data:`TENSORS`, one row per tensor of SPEC.md 4.2 (short name, HF name, shape
symbols, the option that makes it present), the spellings derived from it, the key-set check for
the options in force, and :func:`check_shapes`, which derives d_model, head_dim, n_kv_heads and
intermediate from the shapes and checks every shape. What does not: the generic name and key-set
machinery, copies and fingerprints (``_weights.py``), option checks (``config.py``), packing
(the C++ core).

Shape symbols: ``d`` = d_model (length of input_layernorm.weight), ``QW`` = n_heads*head_dim,
``KW`` = n_kv_heads*head_dim, ``IT`` = intermediate (rows of up_proj.weight), ``HD`` = head_dim.
"""

from __future__ import annotations

from .._validation import format_shape
from .._weights import Presence, Tensor, check_key_set, expected_names, used_with
from .config import GATED_MLPS

__all__ = ["HF_PREFIXES", "SHORT_TO_HF", "TENSORS", "check_names", "check_shapes"]


def _flag(option: str, note: str = "") -> Presence:
    return Presence(f"{option}=True{note}", lambda o: o[option])


_NORM_BIAS = _flag("norm_bias", " (with norm='layernorm')")
_QKV_BIAS = _flag("qkv_bias")
_O_BIAS = _flag("o_bias")
_QK_NORM = _flag("qk_norm")
_MLP_BIAS = _flag("mlp_bias")
_GATED = Presence("a gated mlp ('swiglu', 'geglu', 'geglu_tanh')", lambda o: o["mlp"] in GATED_MLPS)
_GATED_BIAS = Presence(
    "a gated mlp with mlp_bias=True", lambda o: o["mlp"] in GATED_MLPS and o["mlp_bias"]
)

# SPEC.md 4.2: short (canonical, mojolearn's) name, HF LlamaDecoderLayer.state_dict() name,
# shape, presence. Table order is the order shapes are checked in.
TENSORS: tuple[Tensor, ...] = (
    Tensor("input_layernorm.weight", "input_layernorm.weight", ("d",)),
    Tensor("input_layernorm.bias", "input_layernorm.bias", ("d",), _NORM_BIAS),
    Tensor("post_attention_layernorm.weight", "post_attention_layernorm.weight", ("d",)),
    Tensor("post_attention_layernorm.bias", "post_attention_layernorm.bias", ("d",), _NORM_BIAS),
    Tensor("q_proj.weight", "self_attn.q_proj.weight", ("QW", "d")),
    Tensor("q_proj.bias", "self_attn.q_proj.bias", ("QW",), _QKV_BIAS),
    Tensor("k_proj.weight", "self_attn.k_proj.weight", ("KW", "d")),
    Tensor("k_proj.bias", "self_attn.k_proj.bias", ("KW",), _QKV_BIAS),
    Tensor("v_proj.weight", "self_attn.v_proj.weight", ("KW", "d")),
    Tensor("v_proj.bias", "self_attn.v_proj.bias", ("KW",), _QKV_BIAS),
    Tensor("o_proj.weight", "self_attn.o_proj.weight", ("d", "QW")),
    Tensor("o_proj.bias", "self_attn.o_proj.bias", ("d",), _O_BIAS),
    Tensor("q_norm.weight", "self_attn.q_norm.weight", ("HD",), _QK_NORM),
    Tensor("k_norm.weight", "self_attn.k_norm.weight", ("HD",), _QK_NORM),
    Tensor("gate_proj.weight", "mlp.gate_proj.weight", ("IT", "d"), _GATED),
    Tensor("gate_proj.bias", "mlp.gate_proj.bias", ("IT",), _GATED_BIAS),
    Tensor("up_proj.weight", "mlp.up_proj.weight", ("IT", "d")),
    Tensor("up_proj.bias", "mlp.up_proj.bias", ("IT",), _MLP_BIAS),
    Tensor("down_proj.weight", "mlp.down_proj.weight", ("d", "IT")),
    Tensor("down_proj.bias", "mlp.down_proj.bias", ("d",), _MLP_BIAS),
)
SHORT_TO_HF: dict[str, str] = {t.name: t.hf for t in TENSORS}
HF_PREFIXES = ("self_attn.", "mlp.")
_USED_WITH = used_with(TENSORS)


def check_names(by_short: dict, o: dict, spell, where: str) -> None:
    """The short names given are exactly the tensors of these options (SPEC.md 4.2).

    ``spell`` maps a short name to the user's spelling (for messages).
    """
    if o["mlp"] not in GATED_MLPS and "gate_proj.weight" in by_short:
        raise ValueError(
            f"{where}: weights[{spell('gate_proj.weight')!r}] is present but "
            f"mlp={o['mlp']!r} is ungated; use a gated mlp ('swiglu', 'geglu', "
            "'geglu_tanh') or remove the tensor"
        )
    check_key_set(by_short, expected_names(TENSORS, o, by_short), _USED_WITH, where, spell)


def check_shapes(arrs: dict, o: dict, spell, where: str) -> dict:
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

    for t in TENSORS:
        n, spec = t.name, t.shape
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
