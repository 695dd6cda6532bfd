"""The Transformer weight table and the checks of a weight dict against the options.

What lives here: :data:`TENSORS`, one row per tensor of SPEC.md 4.2 (short name, HF name, shape
symbols, the option that makes it present), the spellings derived from it, the other HF
spellings folded onto it (:func:`fold_spellings`: Phi-3's fused ``qkv_proj`` / ``gate_up_proj``,
Nemotron-H's ``mixer.`` and ``norm``, GraniteMoeHybrid's ``shared_mlp``, StableLM's per-head
``q_layernorm.norms.N``), the refusals that recognise another layer shape's weights, the
key-set check for the options in force, and :func:`check_shapes`, which derives d_model,
head_dim, n_kv_heads and intermediate from the shapes and checks every shape. What does not:
the generic name and key-set machinery, copies and fingerprints (``_weights.py``), option checks
(``config.py``), packing (the C++ core).

Shape symbols: ``d`` = d_model (length of the first block norm weight), ``QW`` =
n_heads*head_dim, ``KW`` = n_kv_heads*head_dim, ``IT`` = intermediate (rows of up_proj.weight),
``HD`` = head_dim. The q/k norm shapes depend on qk_norm_scope (:func:`check_shapes`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from .._validation import check_array, format_shape
from .._weights import Presence, Tensor, check_key_set, expected_names, used_with
from .config import GATED_MLPS
from .moe import is_moe

__all__ = [
    "HF_PREFIXES",
    "SHORT_TO_HF",
    "TENSORS",
    "check_names",
    "check_shapes",
    "fold_spellings",
]


def _attn(o) -> bool:
    return o["block_parts"] != "mlp"


def _mlp(o) -> bool:
    return o["block_parts"] != "attention"


def _dense(o) -> bool:  # the dense MLP's gate/up/down (an MoE block has experts instead)
    return _mlp(o) and not is_moe(o)


def _flag(option: str, note: str = "", half=_attn) -> Presence:
    return Presence(f"{option}=True{note}", lambda o: half(o) and o[option])


def _norm(used: str, test) -> tuple[Presence, Presence]:
    """Presence of a block norm's weight and of its bias (norm_bias)."""
    return (
        Presence(used, test),
        Presence(f"{used} with norm_bias=True", lambda o: test(o) and o["norm_bias"]),
    )


# Which block norms each placement has (config.hpp): the attention input norm, the attention
# output norm (post_attention_layernorm under sandwich/post), the MLP input norm
# (post_attention_layernorm under pre, pre_feedforward_layernorm under sandwich), the MLP output
# norm.
_IN_W, _IN_B = _norm(
    "the attention half under norm_placement 'pre', 'sandwich' or 'parallel'",
    lambda o: _attn(o) and o["norm_placement"] in ("pre", "sandwich", "parallel"),
)
_PA_W, _PA_B = _norm(
    "norm_placement='pre' (the MLP input norm) or 'sandwich' / 'post' (the attention output norm)",
    lambda o: (
        (_mlp(o) and o["norm_placement"] == "pre")
        or (_attn(o) and o["norm_placement"] in ("sandwich", "post"))
    ),
)
_PF_W, _PF_B = _norm(
    "norm_placement='sandwich' (Gemma 2/3) with an MLP half",
    lambda o: _mlp(o) and o["norm_placement"] == "sandwich",
)
_QF_W, _QF_B = _norm(
    "norm_placement='sandwich' (Gemma 2/3) or 'post' (OLMo 2) with an MLP half",
    lambda o: _mlp(o) and o["norm_placement"] in ("sandwich", "post"),
)
_ATTN = Presence("an attention half (block_parts 'full' or 'attention')", _attn)
_MLP = Presence("an MLP half without experts (block_parts 'full' or 'mlp', num_experts=0)", _dense)
_MOE = Presence("num_experts >= 1 (an MoE MLP half)", is_moe)
_SHARED = Presence("shared_expert=True", lambda o: is_moe(o) and o.get("shared_expert", False))
_QKV_BIAS = _flag("qkv_bias")
_O_BIAS = _flag("o_bias")
_QK_NORM = _flag("qk_norm")
_MLP_BIAS = _flag("mlp_bias", half=_dense)
_GATED = Presence(
    "a gated mlp ('swiglu', 'geglu', 'geglu_tanh')",
    lambda o: _dense(o) and o["mlp"] in GATED_MLPS,
)
_GATED_BIAS = Presence(
    "a gated mlp with mlp_bias=True",
    lambda o: _dense(o) and o["mlp"] in GATED_MLPS and o["mlp_bias"],
)

# SPEC.md 4.2: short (canonical, mojolearn's) name, HF decoder-layer state_dict() name, shape,
# presence. Table order is the order shapes are checked in; the first block norm present gives d.
TENSORS: tuple[Tensor, ...] = (
    Tensor("input_layernorm.weight", "input_layernorm.weight", ("d",), _IN_W),
    Tensor("input_layernorm.bias", "input_layernorm.bias", ("d",), _IN_B),
    Tensor("post_attention_layernorm.weight", "post_attention_layernorm.weight", ("d",), _PA_W),
    Tensor("post_attention_layernorm.bias", "post_attention_layernorm.bias", ("d",), _PA_B),
    Tensor("pre_feedforward_layernorm.weight", "pre_feedforward_layernorm.weight", ("d",), _PF_W),
    Tensor("pre_feedforward_layernorm.bias", "pre_feedforward_layernorm.bias", ("d",), _PF_B),
    Tensor("post_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", ("d",), _QF_W),
    Tensor("post_feedforward_layernorm.bias", "post_feedforward_layernorm.bias", ("d",), _QF_B),
    Tensor("q_proj.weight", "self_attn.q_proj.weight", ("QW", "d"), _ATTN),
    Tensor("q_proj.bias", "self_attn.q_proj.bias", ("QW",), _QKV_BIAS),
    Tensor("k_proj.weight", "self_attn.k_proj.weight", ("KW", "d"), _ATTN),
    Tensor("k_proj.bias", "self_attn.k_proj.bias", ("KW",), _QKV_BIAS),
    Tensor("v_proj.weight", "self_attn.v_proj.weight", ("KW", "d"), _ATTN),
    Tensor("v_proj.bias", "self_attn.v_proj.bias", ("KW",), _QKV_BIAS),
    Tensor("o_proj.weight", "self_attn.o_proj.weight", ("d", "QW"), _ATTN),
    Tensor("o_proj.bias", "self_attn.o_proj.bias", ("d",), _O_BIAS),
    Tensor("q_norm.weight", "self_attn.q_norm.weight", (), _QK_NORM),
    Tensor("k_norm.weight", "self_attn.k_norm.weight", (), _QK_NORM),
    Tensor("gate_proj.weight", "mlp.gate_proj.weight", ("IT", "d"), _GATED),
    Tensor("gate_proj.bias", "mlp.gate_proj.bias", ("IT",), _GATED_BIAS),
    Tensor("up_proj.weight", "mlp.up_proj.weight", ("IT", "d"), _MLP),
    Tensor("up_proj.bias", "mlp.up_proj.bias", ("IT",), _MLP_BIAS),
    Tensor("down_proj.weight", "mlp.down_proj.weight", ("d", "IT"), _MLP),
    Tensor("down_proj.bias", "mlp.down_proj.bias", ("d",), _MLP_BIAS),
    # MoE MLP half (SPEC.md 4.8): HF Qwen3MoeSparseMoeBlock's state_dict() (transformers 5.x
    # stacks the experts: expert e is row block e; its gate is the first IT rows of the 2 IT)
    Tensor("router.weight", "mlp.gate.weight", ("E", "d"), _MOE),
    Tensor("experts.gate_up_proj", "mlp.experts.gate_up_proj", ("E", "IT2", "d"), _MOE),
    Tensor("experts.down_proj", "mlp.experts.down_proj", ("E", "d", "IT"), _MOE),
    Tensor(
        "shared_expert.gate_proj.weight",
        "mlp.shared_expert.gate_proj.weight",
        ("SIT", "d"),
        _SHARED,
    ),  # fmt: skip
    Tensor(
        "shared_expert.up_proj.weight", "mlp.shared_expert.up_proj.weight", ("SIT", "d"), _SHARED
    ),  # fmt: skip
    Tensor(
        "shared_expert.down_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        ("d", "SIT"),
        _SHARED,
    ),  # fmt: skip
    Tensor("shared_expert_gate.weight", "mlp.shared_expert_gate.weight", ("ONE", "d"), _SHARED),
)
SHORT_TO_HF: dict[str, str] = {t.name: t.hf for t in TENSORS}
HF_PREFIXES = ("self_attn.", "mlp.")
_USED_WITH = used_with(TENSORS)
_NORM_NAMES = tuple(t.name for t in TENSORS[:8])

# --------------------------------------------------------------------------------------------
# other spellings of the same tensors
# --------------------------------------------------------------------------------------------

_ATTN_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")
# GraniteMoeHybrid's dense MLP: input_linear = [gate; up] (chunk(2), act(first) * second)
_GRANITE_MLP = {
    "shared_mlp.input_linear.weight": "mlp.gate_up_proj.weight",
    "shared_mlp.output_linear.weight": "mlp.down_proj.weight",
}
_PER_HEAD = re.compile(r"^(self_attn\.)?([qk])_layernorm\.norms\.(\d+)\.weight$")


def _prefixed(hf: bool, prefix: str, leaf: str) -> str:
    return f"{prefix}{leaf}" if hf else leaf


def fold_spellings(weights, o: dict, where: str) -> tuple[object, dict]:
    """Fold the other HF spellings of a layer onto the table's names (SPEC.md 4.2).

    Parameters
    ----------
    weights : object
        The user's weights; returned unchanged unless it is a Mapping with str keys (the
        generic checks then report what is wrong with it).
    o : dict
        The checked options (``n_heads``, ``head_dim``, ``block_parts``, ``norm_placement``,
        ``qk_norm_scope``).
    where : str
        ``"Class.method"``.

    Returns
    -------
    weights : Mapping
        A dict in the table's short or HF spelling (the user's arrays, the fused ones split into
        row views), or ``weights`` itself when nothing was folded.
    origin : dict of str to str
        Folded key -> how the user spelled that tensor (for messages).

    Raises
    ------
    TypeError
        A fused tensor is not a float32 buffer.
    ValueError
        A tensor given both fused and split, or twice; a fused tensor whose rows do not split;
        the single-norm name ``norm.weight`` of a full block or of a two-norm half.
    """
    if not isinstance(weights, Mapping) or not all(isinstance(k, str) for k in weights):
        return weights, {}
    keys = list(weights)
    special = [
        k
        for k in keys
        if k.startswith("mixer.")
        or k in ("norm.weight", "norm.bias")
        or k in _GRANITE_MLP
        or _PER_HEAD.match(k)
        or k.rsplit(".", 1)[0]
        in ("qkv_proj", "self_attn.qkv_proj", "gate_up_proj", "mlp.gate_up_proj")
    ]
    if not special:
        return weights, {}
    out: dict = {}
    origin: dict = {}

    def put(key, value, src):
        if key in out:
            raise ValueError(
                f"{where}: weights give {key!r} twice: as {origin.get(key, key)!r} and as "
                f"{src!r}; pass it once"
            )
        out[key] = value
        if src != key:
            origin[key] = src

    for k in keys:
        if k not in special:
            put(k, weights[k], k)
    hf = any(k.startswith(HF_PREFIXES + ("mixer.", "shared_mlp.")) for k in keys)
    per_head: dict = {}
    for k in special:
        v = weights[k]
        if k.startswith("mixer."):  # Nemotron-H: one mixer per block, attention or MLP
            leaf = k[len("mixer.") :]
            stem = leaf.split(".", 1)[0]
            prefix = "self_attn." if stem in _ATTN_LEAVES else "mlp." if stem in _MLP_LEAVES else ""
            put(f"{prefix}{leaf}" if prefix else k, v, k)
        elif k in ("norm.weight", "norm.bias"):
            put(_single_norm(k, o, where), v, k)
        elif k in _GRANITE_MLP:
            target = _GRANITE_MLP[k]
            if target.endswith("gate_up_proj.weight"):
                _split_gate_up(put, v, k, hf, where)
            else:
                put(target, v, k)
        elif _PER_HEAD.match(k):
            m = _PER_HEAD.match(k)
            per_head.setdefault(m.group(2), {})[int(m.group(3))] = (k, v)
        elif k.rsplit(".", 1)[0].endswith("qkv_proj"):
            _split_qkv(put, v, k, weights, o, where)
        else:
            _split_gate_up(put, v, k, hf, where)
    for qk, rows in sorted(per_head.items()):
        n = len(rows)
        first = min(rows)
        if sorted(rows) != list(range(n)):
            raise ValueError(
                f"{where}: the per-head norm weights {qk}_layernorm.norms.N.weight must be "
                f"numbered 0 .. n-1 without gaps; got N = {sorted(rows)}"
            )
        arrs = [check_array(rows[h][1], f"weights[{rows[h][0]!r}]", where) for h in range(n)]
        shapes = {a.shape for a in arrs}
        if len(shapes) != 1 or arrs[0].ndim != 1:
            raise ValueError(
                f"{where}: the per-head norm weights {qk}_layernorm.norms.N.weight must all be "
                f"1-D of one length (head_dim); got shapes {sorted(shapes)}"
            )
        src = rows[first][0].replace(f".norms.{first}.", ".norms.*.")
        put(_prefixed(hf, "self_attn.", f"{qk}_norm.weight"), np.stack(arrs), src)
    return out, origin


def _single_norm(key: str, o: dict, where: str) -> str:
    """The table name of a half block's single norm (``norm.weight``, Nemotron-H's name)."""
    parts, placement = o["block_parts"], o["norm_placement"]
    if parts == "full":
        raise ValueError(
            f"{where}: weights[{key!r}] is the single norm of a half block (Nemotron-H's "
            "NemotronHBlock, whose mixer is attention or an MLP): pass block_parts='attention' "
            "or block_parts='mlp'; a full block names its norms input_layernorm and "
            "post_attention_layernorm"
        )
    if placement != "pre":
        raise ValueError(
            f"{where}: weights[{key!r}] names the single norm of a pre-norm half block, but "
            f"norm_placement={placement!r} gives the {parts} half two norms; use their names "
            "(SPEC.md 4.2)"
        )
    leaf = key.split(".")[1]
    return f"{'input_layernorm' if parts == 'attention' else 'post_attention_layernorm'}.{leaf}"


def _rows(value, key: str, where: str) -> np.ndarray:
    a = check_array(value, f"weights[{key!r}]", where)
    if a.ndim not in (1, 2):
        raise ValueError(
            f"{where}: weights[{key!r}] must be 2-D (a weight) or 1-D (a bias); got shape "
            f"{format_shape(a.shape)}"
        )
    return a


def _split_gate_up(put, value, key: str, hf: bool, where: str) -> None:
    """Phi-3 ``gate_up_proj`` (GraniteMoeHybrid ``shared_mlp.input_linear``): rows [gate; up],
    split in half (HF ``chunk(2)``: the first half is the gate)."""
    a = _rows(value, key, where)
    if a.shape[0] % 2 or a.shape[0] == 0:
        raise ValueError(
            f"{where}: weights[{key!r}] has {a.shape[0]} rows; a fused gate/up projection has "
            "2 * intermediate rows (gate rows first, then up rows)"
        )
    it = a.shape[0] // 2
    leaf = key.rsplit(".", 1)[1]
    put(_prefixed(hf, "mlp.", f"gate_proj.{leaf}"), a[:it], f"{key} rows 0:{it} (gate)")
    put(_prefixed(hf, "mlp.", f"up_proj.{leaf}"), a[it:], f"{key} rows {it}:{2 * it} (up)")


def _split_qkv(put, value, key: str, weights: Mapping, o: dict, where: str) -> None:
    """Phi-3 ``qkv_proj``: rows [q (QW); k (KW); v (KW)], QW = n_heads*head_dim."""
    a = _rows(value, key, where)
    hf = key.startswith("self_attn.")
    leaf = key.rsplit(".", 1)[1]
    n_heads = o["n_heads"]
    rows = a.shape[0]
    if o["head_dim"] is not None:
        qw = n_heads * o["head_dim"]
        src = f"n_heads*head_dim={n_heads}*{o['head_dim']}"
    else:
        o_key = _prefixed(hf, "self_attn.", "o_proj.weight")
        o_w = weights.get(o_key)
        shape = getattr(o_w, "shape", None)
        if shape is None or len(shape) != 2:
            raise ValueError(
                f"{where}: weights[{key!r}] is fused q/k/v; splitting it needs n_heads*head_dim "
                f"(the columns of a 2-D weights[{o_key!r}], or pass head_dim)"
            )
        qw = int(shape[1])
        src = f"the columns of weights[{o_key!r}]"
    kw2 = rows - qw
    if qw <= 0 or kw2 <= 0 or kw2 % 2:
        raise ValueError(
            f"{where}: weights[{key!r}] has {rows} rows; fused q/k/v has n_heads*head_dim + "
            f"2*n_kv_heads*head_dim rows, with n_heads*head_dim = {qw} ({src}), which leaves "
            f"{kw2} rows, not a positive even number, for k and v"
        )
    kw = kw2 // 2
    for name, a0, a1 in (("q", 0, qw), ("k", qw, qw + kw), ("v", qw + kw, rows)):
        put(_prefixed(hf, "self_attn.", f"{name}_proj.{leaf}"), a[a0:a1], f"{key} rows {a0}:{a1}")


# --------------------------------------------------------------------------------------------
# key sets
# --------------------------------------------------------------------------------------------


def _looks_like(by_short: dict, o: dict, spell, where: str) -> None:
    """Refuse, naming the architecture and the option to pass, a weight dict whose names are
    another layer shape's. Runs before the generic key-set check."""
    have = set(by_short)
    placement, parts = o["norm_placement"], o["block_parts"]

    def refuse(what: str, option: str) -> None:
        raise ValueError(f"{where}: these weights look like {what}; pass {option}")

    pre_ff = "pre_feedforward_layernorm.weight" in have
    post_ff = "post_feedforward_layernorm.weight" in have
    if pre_ff and post_ff and placement != "sandwich":
        refuse(
            "a Gemma 2 / Gemma 3 layer (pre_feedforward_layernorm and "
            "post_feedforward_layernorm: norms before and after each sublayer)",
            "norm_placement='sandwich' (Gemma also uses norm='rmsnorm_offset', "
            "mlp='geglu_tanh' and query_pre_attn_scalar)",
        )
    if post_ff and not pre_ff and "input_layernorm.weight" not in have and placement != "post":
        refuse(
            "an OLMo 2 layer (post_attention_layernorm and post_feedforward_layernorm on the "
            "sublayer outputs, no input_layernorm)",
            "norm_placement='post'",
        )
    attn_names = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    mlp_names = {"up_proj.weight", "down_proj.weight"}
    if parts == "full" and placement == "pre":
        if (
            attn_names <= have
            and not (mlp_names & have)
            and "post_attention_layernorm.weight" not in have
        ):
            refuse(
                "an attention-only layer (attention weights and input_layernorm, no MLP: "
                "Nemotron-H attention, or a half of a hybrid layer)",
                "block_parts='attention'",
            )
        if mlp_names <= have and not (attn_names & have) and "input_layernorm.weight" not in have:
            refuse(
                "an MLP-only layer (MLP weights and one norm, no attention: Nemotron-H MLP "
                "layers, the dense half of a Granite-4.0-H Mamba layer)",
                "block_parts='mlp' (its norm is post_attention_layernorm.weight or norm.weight)",
            )
    if "router.weight" in have and not is_moe(o):
        e = getattr(by_short["router.weight"], "shape", (0,))[0]
        refuse(
            "an MoE layer (router.weight and stacked experts: Qwen3-MoE, Qwen2-MoE, OLMoE, "
            "Mixtral)",
            f"num_experts={e} and num_experts_per_tok (HF num_experts_per_tok)",
        )
    if "q_norm.weight" in have and not o["qk_norm"]:
        q = getattr(by_short["q_norm.weight"], "shape", ())
        scope = {1: "'head' (Qwen3, Gemma 3) or 'all_heads' (OLMo 2)", 2: "'per_head_weights'"}
        refuse(
            f"a layer with q/k norms (q_norm.weight of shape {format_shape(q)})",
            f"qk_norm=True with qk_norm_scope={scope.get(len(q), 'head')}",
        )


def check_names(by_short: dict, o: dict, spell, where: str) -> None:
    """The short names given are exactly the tensors of these options (SPEC.md 4.2).

    ``spell`` maps a short name to the user's spelling (for messages). A dict carrying another
    layer shape's names is refused with the architecture it looks like and the option to pass.
    """
    _looks_like(by_short, o, spell, where)
    if _mlp(o) and o["mlp"] not in GATED_MLPS and "gate_proj.weight" in by_short:
        raise ValueError(
            f"{where}: weights[{spell('gate_proj.weight')!r}] is present but "
            f"mlp={o['mlp']!r} is ungated; use a gated mlp ('swiglu', 'geglu', "
            "'geglu_tanh') or remove the tensor"
        )
    check_key_set(by_short, expected_names(TENSORS, o, by_short), _USED_WITH, where, spell)


# --------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------


def check_shapes(arrs: dict, o: dict, spell, where: str) -> dict:
    """Derive d_model, head_dim, n_kv_heads, intermediate from the weights and check every shape.

    Returns a dict of the derived sizes (head_dim and n_kv_heads None without an attention
    half, intermediate 0 without an MLP half).
    """

    def name(n):
        return f"weights[{spell(n)!r}]"

    def rank(n, r):
        a = arrs[n]
        if a.ndim != r:
            raise ValueError(f"{where}: {name(n)} must be {r}-D; got shape {format_shape(a.shape)}")
        return a.shape

    first = next(n for n in _NORM_NAMES if n in arrs and n.endswith(".weight"))
    (d,) = rank(first, 1)
    if d < 1:
        raise ValueError(
            f"{where}: {name(first)} is empty; its length is d_model, which must be >= 1"
        )
    dims = {"d": (d, f"d_model={d} (length of {name(first)})")}
    head_dim = n_kv = None
    it = 0
    if _attn(o):
        n_heads = o["n_heads"]
        qr, _ = rank("q_proj.weight", 2)
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
        dims["KW"] = (
            n_kv * head_dim,
            f"n_kv_heads*head_dim={n_kv}*{head_dim} ({kv_src}, {hd_src})",
        )
        dims["HD"] = (head_dim, hd_src)
    shared = 0
    if is_moe(o):
        it, shared = _moe_dims(arrs, o, dims, name, rank, where)
    elif _mlp(o):
        ur, _ = rank("up_proj.weight", 2)
        if ur == 0:
            raise ValueError(
                f"{where}: {name('up_proj.weight')} has 0 rows; its rows give "
                "intermediate, which must be >= 1"
            )
        it = ur
        dims["IT"] = (ur, f"intermediate={ur} (rows of {name('up_proj.weight')})")

    for t in TENSORS:
        n, spec = t.name, t.shape
        if n not in arrs or not spec:
            continue
        exp = tuple(dims[s][0] for s in spec)
        got = arrs[n].shape
        if got != exp:
            axes = {1: ("length",), 2: ("rows", "columns")}.get(
                len(spec), ("experts", "rows", "columns")
            )
            src = "; ".join(f"{ax} = {dims[s][1]}" for ax, s in zip(axes, spec))
            raise ValueError(
                f"{where}: {name(n)} has shape {format_shape(got)}; expected "
                f"{format_shape(exp)}: {src}"
            )
    if "q_norm.weight" in arrs:
        _check_qk_norm_shapes(arrs, o, dims, name, where)
    out = {"d_model": d, "head_dim": head_dim, "n_kv_heads": n_kv, "intermediate": it}
    if is_moe(o):
        out["shared_intermediate"] = shared
    return out


def _moe_dims(arrs: dict, o: dict, dims: dict, name, rank, where: str) -> tuple[int, int]:
    """The MoE shape symbols (E, IT, IT2, SIT, ONE) into ``dims``; returns (IT, SIT)."""
    e, it2, _ = rank("experts.gate_up_proj", 3)
    n = o["num_experts"]
    if e != n or it2 == 0 or it2 % 2:
        raise ValueError(
            f"{where}: {name('experts.gate_up_proj')} has shape "
            f"{format_shape(arrs['experts.gate_up_proj'].shape)}; "
            f"expected (num_experts={n}, 2*intermediate, d_model) with intermediate >= 1 (each "
            "expert's gate rows then its up rows)"
        )
    it = it2 // 2
    src = f"the experts' intermediate={it} (half the rows of {name('experts.gate_up_proj')})"
    dims["E"] = (n, f"num_experts={n} (argument)")
    dims["IT"] = (it, src)
    dims["IT2"] = (it2, src)
    dims["ONE"] = (1, "the shared expert gate's single output")
    shared = 0
    if o["shared_expert"]:
        sr, _ = rank("shared_expert.up_proj.weight", 2)
        if sr == 0:
            raise ValueError(f"{where}: {name('shared_expert.up_proj.weight')} has 0 rows")
        shared = sr
        dims["SIT"] = (sr, f"shared_intermediate={sr} (rows of "
                           f"{name('shared_expert.up_proj.weight')})")  # fmt: skip
    return it, shared


_SCOPE_USE = {
    "head": "'head' (Qwen3, Gemma 3: one (head_dim,) weight shared by the heads)",
    "all_heads": "'all_heads' (OLMo 2: q over n_heads*head_dim, k over n_kv_heads*head_dim)",
    "per_head_weights": "'per_head_weights' (StableLM: one row per head, (n_heads, head_dim) "
    "and (n_kv_heads, head_dim))",
}


def _check_qk_norm_shapes(arrs: dict, o: dict, dims: dict, name, where: str) -> None:
    hd, qw, kw = dims["HD"][0], dims["QW"][0], dims["KW"][0]
    n_heads, n_kv = qw // hd, kw // hd
    by_scope = {
        "head": ((hd,), (hd,)),
        "all_heads": ((qw,), (kw,)),
        "per_head_weights": ((n_heads, hd), (n_kv, hd)),
    }
    scope = o["qk_norm_scope"]
    want = dict(zip(("q_norm.weight", "k_norm.weight"), by_scope[scope]))
    got = {n: tuple(arrs[n].shape) for n in want}
    if got == want:
        return
    fits = [s for s, shapes in by_scope.items() if s != scope and tuple(got.values()) == shapes]
    n = next(k for k in want if got[k] != want[k])
    msg = (
        f"{where}: {name(n)} has shape {format_shape(got[n])}; qk_norm_scope={scope!r} expects "
        f"{format_shape(want[n])} ({dims['HD'][1]}, {dims['QW'][1]}, {dims['KW'][1]})"
    )
    if fits:
        msg += f"; these q/k norm shapes are those of qk_norm_scope={_SCOPE_USE[fits[0]]}: pass it"
    raise ValueError(msg)
