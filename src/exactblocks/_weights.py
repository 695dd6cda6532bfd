"""What both blocks do with weights: table rows, name resolution, key sets, copies, fingerprints.

What lives here: the :class:`Tensor` / :class:`Presence` records a block's weight table is made
of, the generic checks of a user's weight dict (its type, short or HF spelling, unknown, mixed,
missing or unexpected names), the canonical float32 copy of each tensor with its finiteness
check, :class:`QuantizedMatrix` (a projection matrix handed over as GGUF blocks),
:class:`ResidentWeights` (what a built block keeps: small tensors as float32, projection matrices
only in the core's packed form, rebuilt on demand) and the block fingerprint (XXH3-128). What
does not: a particular block's table and shape checks (``transformer/weights.py``,
``mamba2/weights.py``), option checks, and any arithmetic (the C++ core packs the weights).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

from ._validation import check_array, check_finite, describe_type

__all__ = [
    "LazyFingerprint",
    "Presence",
    "QuantizedMatrix",
    "ResidentWeights",
    "Tensor",
    "canonical_copy",
    "check_key_set",
    "check_weight",
    "expected_names",
    "fingerprint",
    "fingerprint_value",
    "packed_layout",
    "resolve_names",
    "same_fingerprint",
    "used_with",
]


@dataclass(frozen=True)
class Presence:
    """When an optional tensor is part of a block's key set.

    Parameters
    ----------
    used_with : str
        What makes the tensor present, for messages (``"qkv_bias=True"``).
    test : callable or None, default=None
        ``test(options in force) -> bool``; None = optional whatever the options (present iff
        given, as Mamba-2's ``conv1d.bias``).
    """

    used_with: str
    test: Callable[[Mapping], bool] | None = None


@dataclass(frozen=True)
class Tensor:
    """One row of a block's weight table.

    Parameters
    ----------
    name : str
        Short (canonical) name, e.g. ``"q_proj.weight"``.
    hf : str
        The HF ``state_dict()`` name of the same tensor.
    shape : tuple of str, default=()
        Symbols of its expected shape, resolved by the block's shape check (empty when that
        check spells the shape out itself).
    presence : Presence or None, default=None
        None = always present.
    """

    name: str
    hf: str
    shape: tuple[str, ...] = ()
    presence: Presence | None = None


def expected_names(table: Iterable[Tensor], opts: Mapping, present: Iterable[str]) -> list[str]:
    """Return the short names a weight dict must hold for these options (SPEC.md 4.2, 7.2).

    Parameters
    ----------
    table : iterable of Tensor
        The block's weight table.
    opts : Mapping
        The options in force (what each ``Presence.test`` reads).
    present : iterable of str
        The short names given (an option-free optional tensor is expected iff given).

    Returns
    -------
    list of str
        In table order.
    """
    present = set(present)
    out = []
    for t in table:
        p = t.presence
        if p is None or (t.name in present if p.test is None else p.test(opts)):
            out.append(t.name)
    return out


def used_with(table: Iterable[Tensor]) -> dict[str, str]:
    """Return ``{short name: what makes it present}`` for every optional tensor of a table."""
    return {t.name: t.presence.used_with for t in table if t.presence is not None}


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
    present: Iterable[str], expected: Iterable[str], all_optional: Mapping, where: str, spell
) -> None:
    """Compare the present short names with the expected set (SPEC.md 4.2).

    Parameters
    ----------
    present : iterable of str
        Short names given (already known to be valid names).
    expected : iterable of str
        :func:`expected_names` for the options in force.
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
    present, expected = set(present), set(expected)
    extra = sorted(present - expected)
    if extra:
        name = extra[0]
        raise ValueError(
            f"{where}: weights[{spell(name)!r}] is present but only used with "
            f"{all_optional.get(name, '?')}; set that option or remove the tensor"
        )
    missing = sorted(expected - present)
    if missing:
        raise ValueError(
            f"{where}: weights are missing {[spell(m) for m in missing]}; the "
            f"expected key set for these options is "
            f"{sorted(spell(n) for n in expected)}"
        )


class QuantizedMatrix:
    """A weight matrix as GGUF blocks, handed to a block or the output head unconverted.

    The core packs the blocks straight into its compact format (``ops/gemm/pack.cpp``
    ``pack_sources``) and keeps no reference to them; the float32 values it computes from are,
    bit for bit, those of ``gguf.quants.dequantize`` (:meth:`dequantize`). Accepted for the
    projection matrices of a block (``*proj.weight``), an MoE block's stacked experts
    (``experts.gate_up_proj``, ``experts.down_proj``: 3-D, one matrix per expert, packed one
    by one) and the output head; anywhere else a float32 array is needed.

    Parameters
    ----------
    ggml_type : int
        ``gguf.GGMLQuantizationType`` value: Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8),
        Q4_K (12), Q5_K (13) or Q6_K (14).
    blocks : ndarray of uint8, shape (rows, row_bytes) or (experts * rows, row_bytes)
        The tensor's bytes as the file stores them (a read-only memory-map view is fine: it is
        read while the core packs and not kept); a stack holds expert e's rows at
        ``[e * rows, (e + 1) * rows)`` (llama.cpp's ``ffn_*_exps`` layout).
    shape : tuple of int
        ``(rows, cols)`` in torch's [out, in] layout, or ``(experts, rows, cols)`` for a stack;
        cols a multiple of the type's block size.

    Raises
    ------
    ValueError
        An unsupported type, or blocks of the wrong size for the shape.
    """

    __slots__ = ("ggml_type", "blocks", "shape")

    def __init__(self, ggml_type: int, blocks: np.ndarray, shape: tuple):
        from . import _ext

        core = _ext.core()
        bs, ts = core.gguf_block_layout(int(ggml_type))
        if len(shape) not in (2, 3):
            raise ValueError(
                f"QuantizedMatrix: shape {tuple(shape)} is neither (rows, cols) nor "
                "(experts, rows, cols)"
            )
        dims = tuple(int(s) for s in shape)
        rows, cols = math.prod(dims[:-1]), dims[-1]
        if bs == 0:
            raise ValueError(f"QuantizedMatrix: GGUF type {ggml_type} is not read directly")
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, -1)
        if cols % bs or blocks.shape[1] != cols // bs * ts:
            raise ValueError(
                f"QuantizedMatrix: {blocks.shape[1]} bytes per row do not hold {cols} weights of "
                f"GGUF type {ggml_type} ({bs} weights in {ts} bytes per block)"
            )
        self.ggml_type = int(ggml_type)
        self.blocks = blocks
        self.shape = dims

    ndim = property(lambda self: len(self.shape), doc="int: 2, or 3 for a stack of experts.")
    dtype = property(lambda self: np.dtype(np.float32), doc="numpy.dtype: float32 (the values).")

    @property
    def nbytes(self) -> int:
        """int: Bytes of the float32 values (as an ndarray's ``nbytes``)."""
        return math.prod(self.shape) * 4

    def core_arg(self) -> tuple:
        """``(ggml_type, blocks)``: the form the core's constructors take."""
        return (self.ggml_type, self.blocks)

    def dequantize(self, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows ``r0:r1`` as float32, ``gguf.quants.dequantize``'s values bit for bit.

        Parameters
        ----------
        r0, r1 : int
            Row range of the blocks' rows (a stack's experts one after the other);
            ``r1=None`` means all rows.

        Returns
        -------
        ndarray, float32, fresh
            Of :attr:`shape` when every row is asked for, else of shape (r1 - r0, cols).
        """
        from . import _ext

        whole = r0 == 0 and r1 is None
        r1 = self.blocks.shape[0] if r1 is None else r1
        out = _ext.core().dequantize_gguf(self.ggml_type, self.blocks[r0:r1])
        return out.reshape(self.shape if whole else (r1 - r0, self.shape[-1]))

    def check_finite(self, name: str, where: str) -> None:
        """Raise ValueError, as :func:`canonical_copy` does, if a value is NaN or infinite.

        Every value is finite iff every binary16 scale of the blocks is (a finite scale times
        a code, plus a finite offset, stays far inside float32's range); only a bad tensor is
        dequantised, to name the first bad element.
        """
        _, ts = _ext_layout(self.ggml_type)
        raw = self.blocks.reshape(-1, ts)
        first, count = _SCALES[self.ggml_type]
        scales = np.ascontiguousarray(raw[:, first : first + 2 * count]).view(np.float16)
        if np.isfinite(scales).all():
            return
        check_finite(self.dequantize(), name, where, flat=True)


# Where each block keeps its binary16 scales: ggml type -> (first byte, count). Q4_1, Q5_1: d, m;
# Q4_K, Q5_K: d, dmin (then the 6-bit sub-block scales, which are finite integers); Q6_K: d
# after ql, qh and the int8 sub-block scales (llama.cpp ggml-common.h block_q6_K).
_SCALES = {
    2: (0, 1),
    3: (0, 2),
    6: (0, 1),
    7: (0, 2),
    8: (0, 1),
    12: (0, 2),
    13: (0, 2),
    14: (208, 1),
}


def _ext_layout(ggml_type: int) -> tuple:
    from . import _ext

    return tuple(_ext.core().gguf_block_layout(int(ggml_type)))


class ResidentWeights(Mapping):
    """What a built block keeps of its weights: the mapping ``impl.weights``.

    Small tensors (norms, biases, conv and SSM parameters) are kept as read-only float32
    arrays; each projection matrix lives only in the core's packed form and is rebuilt on
    access with the kernels' own operations (``core.unpack``), so a lookup returns the weights
    the block was built from, bit for bit, without the block holding a float32 copy.

    Parameters
    ----------
    small : dict of str to ndarray
        The tensors kept as they are.
    layout : dict of str to (str or tuple of str, int, int, tuple)
        Packed tensors: name -> (packed matrix, first row, end row, shape); a tuple of packed
        matrices means the same rows of each, concatenated (an MoE block's stacked experts).
    core : object
        The compiled block (``unpack(matrix, r0, r1)``).
    """

    __slots__ = ("_small", "_layout", "_core")

    def __init__(self, small: dict, layout: dict, core):
        self._small = small
        self._layout = layout
        self._core = core

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._small.get(name)
        if arr is not None:
            return arr
        matrix, r0, r1, shape = self._layout[name]
        if isinstance(matrix, tuple):
            out = np.concatenate([self._core.unpack(m, r0, r1) for m in matrix]).reshape(shape)
        else:
            out = self._core.unpack(matrix, r0, r1).reshape(shape)
        out.flags.writeable = False
        return out

    def __iter__(self):
        yield from self._small
        yield from self._layout

    def __len__(self) -> int:
        return len(self._small) + len(self._layout)

    def __contains__(self, name) -> bool:
        return name in self._small or name in self._layout


def packed_layout(groups, arrs: Mapping) -> dict:
    """Where each projection matrix lives in the core: name -> (packed matrix, r0, r1).

    Parameters
    ----------
    groups : sequence of (str, sequence of str)
        Each packed matrix (its ``weight_storage`` name) and the tensors stacked into it, in
        order; tensors absent from ``arrs`` are skipped (an ungated MLP has no gate).
    arrs : Mapping of str to array-like
        The block's weights (their ``shape[0]`` is the rows each takes).

    Returns
    -------
    dict
    """
    out = {}
    for matrix, names in groups:
        r = 0
        for n in names:
            if n in arrs:
                rows = int(arrs[n].shape[0])
                out[n] = (matrix, r, r + rows)
                r += rows
    return out


def check_weight(value: object, name: str, where: str):
    """:func:`exactblocks._validation.check_array`, passing a :class:`QuantizedMatrix` through
    (its type and sizes were checked when it was made; the name is checked by
    :func:`canonical_copy`)."""
    if isinstance(value, QuantizedMatrix):
        return value
    return check_array(value, name, where)


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
    numpy.ndarray or QuantizedMatrix
        A copy (editing the caller's array later has no effect), flagged read-only; a
        :class:`QuantizedMatrix` (a projection matrix only) is checked and returned as it is.

    Raises
    ------
    TypeError
        Not a float32 buffer.
    ValueError
        A NaN or infinite element (the message gives the flat index and the value).
    """
    if isinstance(value, QuantizedMatrix):  # immutable blocks, packed by the core, not kept
        stack = name.endswith(("experts.gate_up_proj']", "experts.down_proj']"))
        if not (name.endswith("proj.weight']") and value.ndim == 2 or stack and value.ndim == 3):
            raise TypeError(
                f"{where}: {name} is GGUF blocks (QuantizedMatrix of shape {value.shape}); only "
                "projection matrices (2-D) and stacked experts (3-D) may be given so, this "
                "tensor must be a float32 array"
            )
        value.check_finite(name, where)
        return value
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


class LazyFingerprint:
    """A fingerprint computed the first time it is read, then kept.

    Building a block or a model from GGUF blocks would otherwise dequantise every weight only
    to hash it: for SmolLM2-135M about 0.45 s, half of the load time, for a value that only
    pickling, ``repr``-style inspection and a state of *another* block or model ever need.
    States hold their block's (or model's) ``LazyFingerprint`` object itself, so the check
    that a state belongs to a block is an identity test and computes nothing
    (:func:`same_fingerprint`); the digest is computed only when a string is asked for.

    Parameters
    ----------
    compute : callable
        ``compute() -> str``, called at most once (under a lock: concurrent first reads wait
        for the one computation) and then dropped, with everything it referenced.

    Notes
    -----
    The value is the same whenever it is computed: ``compute`` reads what the block or model
    keeps (the packed weights, rebuilt bit for bit), never something the caller can change.
    """

    __slots__ = ("_value", "_compute", "_lock")

    def __init__(self, compute: Callable[[], str]):
        self._value: str | None = None
        self._compute = compute
        self._lock = threading.Lock()

    @property
    def value(self) -> str:
        """str: The 32 hexadecimal digits (computed on the first read)."""
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = str(self._compute())
                    self._compute = None
                value = self._value
        return value

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"LazyFingerprint({self._value or 'not computed yet'})"


def fingerprint_value(fp) -> str:
    """The string of a fingerprint given as a str or a :class:`LazyFingerprint`."""
    return fp.value if isinstance(fp, LazyFingerprint) else str(fp)


def same_fingerprint(a, b) -> bool:
    """Whether two fingerprints (str or :class:`LazyFingerprint`) are equal.

    The same object is equal without computing anything (a state checked against the block
    that allocated it); otherwise both digests are compared.
    """
    return a is b or fingerprint_value(a) == fingerprint_value(b)
