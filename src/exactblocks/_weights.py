"""Weight tables: names, spellings, shapes, canonical copies and fingerprints.

What lives here: the Transformer weight table of SPEC.md 4.2 (short and HF spellings), the
generic key-set checks (missing / unknown / mixed spellings), the canonical float32 copy of
each tensor with its finiteness check, and the block fingerprint (XXH3-128). What does not:
option checks (``transformer.py``) and any arithmetic (the C++ core packs the weights).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np
import xxhash

from ._validation import check_array, check_finite, describe_type

__all__ = [
    "TRANSFORMER_SHORT_TO_HF",
    "canonical_copy",
    "fingerprint",
    "resolve_names",
    "transformer_expected_names",
]

# SPEC.md 4.2: short (canonical, mojolearn's) name -> HF LlamaDecoderLayer.state_dict() name.
TRANSFORMER_SHORT_TO_HF: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "post_attention_layernorm.bias": "post_attention_layernorm.bias",
    **{
        f"{p}.{s}": f"self_attn.{p}.{s}"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        for s in ("weight", "bias")
    },
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    **{
        f"{p}.{s}": f"mlp.{p}.{s}"
        for p in ("gate_proj", "up_proj", "down_proj")
        for s in ("weight", "bias")
    },
}
TRANSFORMER_HF_PREFIXES = ("self_attn.", "mlp.")


def transformer_expected_names(
    *, qkv_bias: bool, o_bias: bool, norm_bias: bool, gated: bool, mlp_bias: bool, qk_norm: bool
) -> dict[str, str]:
    """Return the exact short-name key set for these options, each with its presence rule.

    Parameters
    ----------
    qkv_bias, o_bias, norm_bias, gated, mlp_bias, qk_norm : bool
        The resolved options (``gated`` = the MLP kind is swiglu, geglu or geglu_tanh).

    Returns
    -------
    dict of str to str
        ``{short_name: rule}`` for every tensor of the table (SPEC.md 4.2); the rule is
        ``"always"`` or the option that makes the tensor present, and only tensors present for
        these options are included.
    """
    names = {
        "input_layernorm.weight": "always",
        "post_attention_layernorm.weight": "always",
        "q_proj.weight": "always",
        "k_proj.weight": "always",
        "v_proj.weight": "always",
        "o_proj.weight": "always",
        "up_proj.weight": "always",
        "down_proj.weight": "always",
    }
    if norm_bias:
        names["input_layernorm.bias"] = "norm_bias=True"
        names["post_attention_layernorm.bias"] = "norm_bias=True"
    if qkv_bias:
        for p in ("q_proj", "k_proj", "v_proj"):
            names[f"{p}.bias"] = "qkv_bias=True"
    if o_bias:
        names["o_proj.bias"] = "o_bias=True"
    if qk_norm:
        names["q_norm.weight"] = "qk_norm=True"
        names["k_norm.weight"] = "qk_norm=True"
    if gated:
        names["gate_proj.weight"] = "gated mlp"
        if mlp_bias:
            names["gate_proj.bias"] = "gated mlp and mlp_bias=True"
    if mlp_bias:
        names["up_proj.bias"] = "mlp_bias=True"
        names["down_proj.bias"] = "mlp_bias=True"
    return names


def resolve_names(
    weights: object, where: str, short_to_hf: Mapping[str, str], hf_prefixes: tuple[str, ...]
) -> tuple[dict[str, object], dict[str, str], bool]:
    """Map a user weight dict to short names, checking its type and spelling.

    Parameters
    ----------
    weights : Mapping of str to buffer
        The user's weights, in the short or the HF spelling.
    where : str
        ``"Class.method"``.
    short_to_hf : Mapping of str to str
        Every known short name and its HF name.
    hf_prefixes : tuple of str
        A dict is in HF form iff some key starts with one of these.

    Returns
    -------
    by_short : dict of str to object
        The user's values under short names (not yet checked).
    user_key : dict of str to str
        Short name -> the key as the user spelled it (for messages).
    hf_form : bool
        Whether the dict was in HF form.

    Raises
    ------
    TypeError
        ``weights`` is not a Mapping, or a key is not a str.
    ValueError
        Short and HF spellings mixed (the message shows one key of each), or unknown names
        (each listed).
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{where}: weights must be a Mapping from str to float32 arrays; got "
            f"{describe_type(weights)}"
        )
    keys = list(weights.keys())
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"{where}: weights keys must be str; got {describe_type(k)} {k!r}")
    hf_to_short = {v: k for k, v in short_to_hf.items()}
    hf_form = any(k.startswith(hf_prefixes) for k in keys)
    table = hf_to_short if hf_form else {k: k for k in short_to_hf}
    if hf_form:
        # A short-only name next to HF names is a mixed spelling, not just an unknown name.
        shorts = [k for k in keys if k in short_to_hf and k not in hf_to_short]
        if shorts:
            hf_key = next(k for k in keys if k.startswith(hf_prefixes))
            raise ValueError(
                f"{where}: weights mix the short and the HF spellings: {shorts[0]!r} is short "
                f"form, {hf_key!r} is HF form; use one spelling for every key (HF form: "
                f"{short_to_hf[shorts[0]]!r})"
            )
    unknown = [k for k in keys if k not in table]
    if unknown:
        spelling = "HF" if hf_form else "short"
        hint = ""
        layer = re.match(r"^(.*?layers\.\d+\.)", unknown[0])
        if layer:  # a whole model's state_dict (model.layers.N..., backbone.layers.N...)
            p = layer.group(1)
            hint = (
                f"; these look like a whole model's names: pass one layer's weights without "
                f"the {p!r} prefix, e.g. {{k[{len(p)}:]: v for k, v in state_dict.items() "
                f"if k.startswith({p!r})}}"
            )
        raise ValueError(
            f"{where}: unknown weight names {unknown} (weights are in {spelling} "
            f"form); known names: {sorted(table)}{hint}"
        )
    by_short = {table[k]: weights[k] for k in keys}
    user_key = {table[k]: k for k in keys}
    return by_short, user_key, hf_form


def check_key_set(
    present: Iterable[str], expected: Mapping[str, str], all_optional: Mapping, where: str, spell
) -> None:
    """Compare the present short names with the expected set (SPEC.md 4.2).

    Parameters
    ----------
    present : iterable of str
        Short names given (already known to be valid names).
    expected : Mapping of str to str
        ``transformer_expected_names(...)`` for the options in force.
    all_optional : Mapping of str to str
        Every optional short name -> the option that makes it present (for messages).
    where : str
        ``"Class.method"``.
    spell : callable
        Maps a short name to the user's spelling.

    Raises
    ------
    ValueError
        An optional tensor is present while its option is off (naming the option to set), or
        required tensors are missing (listing them and the full expected set).
    """
    present = set(present)
    extra = sorted(present - set(expected))
    if extra:
        name = extra[0]
        raise ValueError(
            f"{where}: weights[{spell(name)!r}] is present but only used with "
            f"{all_optional.get(name, '?')}; set that option or remove the tensor"
        )
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(
            f"{where}: weights are missing {[spell(m) for m in missing]}; the "
            f"expected key set for these options is "
            f"{sorted(spell(n) for n in expected)}"
        )


def canonical_copy(value: object, name: str, where: str) -> np.ndarray:
    """Check one weight and return a private, read-only, C-contiguous float32 copy.

    Parameters
    ----------
    value : buffer
        A float32 buffer (see :func:`exactblocks._validation.check_array`).
    name : str
        The argument name, e.g. ``"weights['q_proj.weight']"``.
    where : str
        ``"Class.method"``.

    Returns
    -------
    numpy.ndarray
        A copy (editing the caller's array later has no effect), flagged read-only.

    Raises
    ------
    TypeError
        Not a float32 buffer.
    ValueError
        A NaN or infinite element (the message gives the flat index and the value).
    """
    arr = check_array(value, name, where)
    arr = np.array(arr, dtype=np.float32, order="C", copy=True)
    check_finite(arr, name, where, flat=True)
    arr.flags.writeable = False
    return arr


def fingerprint(
    class_name: str, arithmetic: str, options_repr: str, weights: Mapping[str, np.ndarray]
) -> str:
    """Return the 32-hex-digit XXH3-128 digest identifying a block.

    Parameters
    ----------
    class_name : str
        ``"TransformerBlockInference"`` or ``"Mamba2BlockInference"``.
    arithmetic : str
        ``arithmetic_version()``.
    options_repr : str
        A canonical, platform-independent spelling of the resolved options.
    weights : Mapping of str to numpy.ndarray
        Canonical weights (short names, float32 little-endian, C-contiguous).

    Returns
    -------
    str
        32 lowercase hexadecimal digits.

    Notes
    -----
    Every field is length-prefixed so that no two different inputs share a byte stream. Names
    are hashed in sorted order, each with its shape and raw bytes; float32 bytes are
    little-endian on every supported platform, so the digest is the same everywhere.
    """
    h = xxhash.xxh3_128()

    def put(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    put(b"exactblocks-fingerprint-1")
    put(class_name.encode())
    put(arithmetic.encode())
    put(options_repr.encode())
    for name in sorted(weights):
        arr = weights[name]
        put(name.encode())
        put(repr(tuple(int(s) for s in arr.shape)).encode())
        h.update(arr.nbytes.to_bytes(8, "little"))
        h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.hexdigest()
