"""Argument checks shared by every public entry point of exactblocks.

One message format for the whole package (SPEC.md 2.7): every message starts with
``where`` (``"Class.method"``) followed by ``": "``, names the argument, says what was expected
and what came. Nothing here converts a value that could change a bit: float32 buffers are read
as they are (a non-contiguous one is copied once to C order, which moves bytes only), and every
other dtype is refused.

These helpers are generic: the Transformer and the Mamba-2 blocks, their states and sessions all
use them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from . import _ext

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TRUE_MIN",
    "NonFiniteError",
    "check_array",
    "check_choice",
    "check_finite",
    "check_flag",
    "check_int",
    "check_lengths",
    "check_real",
    "check_state_buffers",
    "check_tokens",
    "describe_type",
    "format_shape",
]

# Item formats of a native little-endian binary32 buffer. exactblocks supports little-endian
# hosts only (x86-64, AArch64), so native ('f', '=f') and explicit '<f' are the same bytes.
_FLOAT32_FORMATS = frozenset({"f", "<f", "=f"})
if sys.byteorder != "little":  # pragma: no cover - no big-endian CI host exists
    _FLOAT32_FORMATS = frozenset({"<f"})

# The positive finite binary32 range: real options used as float32 must round into it.
FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028234663852886e+38
FLOAT32_TRUE_MIN = float(np.finfo(np.float32).smallest_subnormal)  # 1.401298464324817e-45

# Buffer item formats of the dtypes people most often pass by mistake, for readable messages.
_FORMAT_NAMES = {
    "d": "float64",
    "<d": "float64",
    "=d": "float64",
    ">d": "float64 (big-endian)",
    "e": "float16",
    "<e": "float16",
    "=e": "float16",
    ">e": "float16 (big-endian)",
    ">f": "float32 (big-endian)",
    "!f": "float32 (big-endian)",
    "H": "uint16",
    "<H": "uint16",
    "h": "int16",
    "b": "int8",
    "B": "uint8",
    "i": "int32",
    "<i": "int32",
    "I": "uint32",
    "l": "int64",
    "<l": "int64",
    "q": "int64",
    "<q": "int64",
    "L": "uint64",
    "Q": "uint64",
    "?": "bool",
    "g": "float128",
}


def describe_type(value: object) -> str:
    """Return the qualified type name of ``value`` for error messages.

    Parameters
    ----------
    value : object
        Any object.

    Returns
    -------
    str
        ``module.QualName`` for types outside ``builtins``, else ``QualName``.
    """
    t = type(value)
    mod = t.__module__
    return t.__qualname__ if mod == "builtins" else f"{mod}.{t.__qualname__}"


def format_shape(shape: Sequence[int]) -> str:
    """Format a shape as Python prints a tuple, e.g. ``(2, 7, 64)`` or ``(5,)``.

    Parameters
    ----------
    shape : sequence of int
        The dimensions.

    Returns
    -------
    str
        The tuple spelling of ``shape``.
    """
    return str(tuple(int(s) for s in shape))


def _dtype_name(obj: object, mv: memoryview) -> str:
    if isinstance(obj, np.ndarray):
        dt = obj.dtype
        if dt.byteorder == ">":
            return f"{dt.name} (big-endian '{dt.str}')"
        return dt.name
    return _FORMAT_NAMES.get(mv.format, f"buffer item format {mv.format!r}")


def _widening_hint(fmt: str) -> str:
    name = _FORMAT_NAMES.get(fmt, "")
    if name.startswith("float64") or name == "float128":
        return (
            "exactblocks never narrows: rounding to float32 would change values silently; "
            "convert deliberately with `a.astype(numpy.float32)` if that is what you want"
        )
    if name.startswith("float16"):
        return "widen exactly with `a.astype(numpy.float32)`"
    if name == "uint16":
        return (
            "if these are bfloat16 bits, widen exactly with "
            "`(a.astype(numpy.uint32) << 16).view(numpy.float32)`, or pass "
            "`tensor.float().numpy()` for a torch bfloat16 tensor"
        )
    if name.startswith("float32 (big-endian"):
        return "byte-swap exactly with `a.astype('<f4')`"
    return "pass float32 data (a torch tensor as `t.float().numpy()`)"


def check_array(buffer: object, name: str, where: str) -> np.ndarray:
    """Return a float32 C-contiguous NumPy view (or one-off copy) of a buffer, without rounding.

    Parameters
    ----------
    buffer : object exporting the buffer protocol
        Item format ``'f'``, ``'<f'`` or ``'=f'`` (native little-endian binary32): a NumPy
        float32 array, an ``array.array('f')``, a ``memoryview``, a ctypes float array, ...
        Its shape is the buffer's own.
    name : str
        The argument's name as the caller wrote it, e.g. ``"x"`` or
        ``"weights['q_proj.weight']"``.
    where : str
        ``"Class.method"``, the start of every message.

    Returns
    -------
    numpy.ndarray
        float32, C-contiguous, same shape as the buffer. A C-contiguous buffer is viewed in
        place (never written by exactblocks); a non-contiguous one is copied once to C order,
        which moves bytes and cannot change a bit.

    Raises
    ------
    TypeError
        ``buffer`` does not export the buffer protocol (list, None, scalar, torch tensor), or its
        item format is not float32 (float64, float16, bfloat16 bits as uint16, integers, bool,
        big-endian float32, bytes). The message names the argument, the dtype found and, where
        one exists, the exact conversion to use.

    Notes
    -----
    Follows SPEC.md 2.1: nothing is ever converted. Narrowing float64 would round silently, and
    widening (float16, bfloat16) is the caller's exact one-liner.

    Examples
    --------
    >>> import array
    >>> a = array.array('f', [1.0, 2.0, 3.0, 4.0])
    >>> check_array(memoryview(a).cast('B').cast('f', (2, 2)), 'x', 'f').shape
    (2, 2)
    """
    if isinstance(buffer, np.ndarray):
        arr = buffer
        if arr.dtype == np.float32 and arr.dtype.isnative:
            if arr.flags.c_contiguous and arr.flags.aligned:
                return arr
            return np.array(arr, dtype=np.float32, order="C", copy=True)
    try:
        mv = memoryview(buffer)
    except TypeError:
        hint = ""
        if describe_type(buffer).startswith("torch."):
            hint = " (pass a torch tensor as `t.numpy()`, after `t.float()` for bf16/fp16)"
        raise TypeError(
            f"{where}: {name} must be a float32 buffer (NumPy array, array.array('f'), "
            f"memoryview); got {describe_type(buffer)}{hint}"
        ) from None
    if mv.format not in _FLOAT32_FORMATS or mv.itemsize != 4:
        raise TypeError(
            f"{where}: {name} must have dtype float32; got {_dtype_name(buffer, mv)}; "
            f"{_widening_hint(mv.format)}"
        )
    arr = np.asarray(mv)
    if arr.dtype != np.float32:  # pragma: no cover - '<f' on a little-endian host is float32
        raise TypeError(f"{where}: {name} must have dtype float32; got {arr.dtype}")
    if not (arr.flags.c_contiguous and arr.flags.aligned):
        # A copy moves bytes only; an unaligned buffer is copied too, as native code needs
        # 4-byte aligned floats.
        arr = np.array(arr, dtype=np.float32, order="C", copy=True)
    return arr


class FormatError(ValueError):
    """A malformed file or field, found by a reader (raised by the loaders and the GGUF records).

    ``str(err)`` is ``"<where>: <detail>"``; a public call that used the reader (``load_model``)
    reports ``detail`` under its own name, read from the field, never parsed from the message.

    Attributes
    ----------
    where : str
        The reader or function that found it (``"GGUFFile"``, ``"load_gguf_model"``).
    detail : str
        What is wrong: the file, the field or tensor, what was expected and what came.
    """

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where, self.detail = where, detail

    def __reduce__(self):
        return (type(self), (self.where, self.detail))


class NonFiniteError(ValueError):
    """A non-finite value where finite ones are required (raised by :func:`check_finite`).

    Attributes
    ----------
    where : str
        The call, ``"Class.method"``.
    name : str
        The argument (``"x"``, ``"state.k_cache"``).
    index : tuple of int or None
        The element's index (None when reported by flat index: see ``flat_index``).
    flat_index : int or None
    value : float
    """

    def __init__(self, message: str, *, where: str = "", name: str = "", index=None,
                 flat_index=None, value=float("nan")):  # fmt: skip
        super().__init__(message)
        self.where, self.name, self.index = where, name, index
        self.flat_index, self.value = flat_index, value

    def __reduce__(self):
        fields = {k: getattr(self, k) for k in ("where", "name", "index", "flat_index", "value")}
        return (_rebuild_non_finite, (str(self), fields))


def _rebuild_non_finite(message: str, fields: dict) -> NonFiniteError:
    return NonFiniteError(message, **fields)


def check_finite(
    arr: np.ndarray,
    name: str,
    where: str,
    *,
    index_base: tuple = (),
    flat: bool = False,
    index_offset: tuple = (),
) -> None:
    """Raise ValueError at the first non-finite element of ``arr``.

    Parameters
    ----------
    arr : numpy.ndarray, float32
        The values to check (any shape; may be a view of a larger array).
    name : str
        The argument's name used in the message, e.g. ``"x"`` or ``"state.k_cache"``.
    where : str
        ``"Class.method"``.
    index_base : tuple of int, default=()
        Leading indices prepended to the index found in ``arr`` (``arr`` is a sub-view of
        ``name`` at these indices).
    flat : bool, default=False
        Report the flat (C-order) index instead of the multi-index; used for weights.
    index_offset : tuple of int, default=()
        Added to the leading entries of the index found in ``arr`` (``arr`` is a slice of
        ``name`` that starts at these offsets along its first axes).

    Raises
    ------
    NonFiniteError
        (A ValueError.) An element is NaN or infinite; the message gives the index and the
        value, and so do its fields.
    """
    if (
        _ext.is_loaded()
        and arr.dtype == np.float32
        and arr.flags.c_contiguous
        and arr.flags.aligned
        and arr.dtype.isnative
    ):
        k = int(_ext.core().first_nonfinite(arr))  # one pass, no temporaries (every call)
        if k < 0:
            return
    else:
        finite = np.isfinite(arr)
        if finite.all():
            return
        k = int(np.flatnonzero(~finite.ravel())[0])
    value = arr.reshape(-1)[k]
    if flat:
        raise NonFiniteError(
            f"{where}: {name} must be finite; element at flat index {k} is {float(value)!r}",
            where=where, name=name, index=None, flat_index=k, value=float(value),
        )  # fmt: skip
    local = [int(i) for i in np.unravel_index(k, arr.shape)]
    for j, off in enumerate(index_offset):
        local[j] += int(off)
    idx = tuple(int(i) for i in tuple(index_base) + tuple(local))
    raise NonFiniteError(
        f"{where}: {name}[{', '.join(str(i) for i in idx)}] must be finite; got {float(value)!r}",
        where=where, name=name, index=idx, flat_index=None, value=float(value),
    )  # fmt: skip


def fmt_int(v: int) -> str:
    """Spell an int for a message; a huge one by its size (str() of >4300 digits raises)."""
    if abs(v) >= 1 << 256:
        return f"{'-' if v < 0 else ''}an int of {abs(v).bit_length()} bits"
    return str(v)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(
    value: object,
    name: str,
    where: str,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Check an integer argument and return it as a Python int.

    Parameters
    ----------
    value : object
        Accepted: Python ``int`` or a NumPy integer. ``bool``, ``float`` (even ``4.0``) and
        ``str`` are refused.
    name : str
        Argument name for messages.
    where : str
        ``"Class.method"``.
    min_value, max_value : int or None, default=None
        Inclusive bounds.
    allow_none : bool, default=False
        Whether ``None`` is accepted (and returned).

    Returns
    -------
    int or None

    Raises
    ------
    TypeError
        Not an integer (or None when not allowed).
    ValueError
        Outside ``[min_value, max_value]``.
    """
    if value is None and allow_none:
        return None
    if not _is_int(value):
        expected = "an int or None" if allow_none else "an int"
        raise TypeError(f"{where}: {name} must be {expected}; got {describe_type(value)} {value!r}")
    v = int(value)
    if (min_value is not None and v < min_value) or (max_value is not None and v > max_value):
        if max_value is None:
            rng = f">= {min_value}"
        elif min_value is None:
            rng = f"<= {max_value}"
        else:
            rng = f"in [{min_value}, {max_value}]"
        raise ValueError(f"{where}: {name} must be {rng}; got {fmt_int(v)}")
    return v


def check_real(
    value: object,
    name: str,
    where: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    allow_inf: bool = False,
    allow_none: bool = False,
    float32: bool = False,
) -> float | None:
    """Check a real option and return it as a Python float.

    Parameters
    ----------
    value : object
        Accepted: ``int``, ``float``, NumPy integer or floating. ``bool`` and ``str`` are refused.
    name : str
        Argument name for messages.
    where : str
        ``"Class.method"``.
    gt, ge : float or None, default=None
        Exclusive / inclusive lower bound.
    allow_inf : bool, default=False
        Whether ``+inf`` is accepted (NaN never is).
    allow_none : bool, default=False
        Whether ``None`` is accepted (and returned).
    float32 : bool, default=False
        The value is used in binary32 arithmetic (rounded once to float32, as C++
        ``static_cast<float>`` does): a finite value must not round to infinity (it must be
        <= ``FLOAT32_MAX`` = 3.4028234663852886e+38, up to rounding), and with ``gt=0`` it must
        not round to 0 (it must be >= about ``FLOAT32_TRUE_MIN`` = 1.4e-45). The returned value
        is still the float64 given (the fingerprint and ``get_params`` keep it).

    Returns
    -------
    float or None

    Raises
    ------
    TypeError
        Not a real number.
    ValueError
        NaN, infinite (unless allowed), an int too large for a float, out of range, or (with
        ``float32``) outside the float32 range; the message names the option, the value and the
        allowed range.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        expected = "a real number or None" if allow_none else "a real number"
        raise TypeError(f"{where}: {name} must be {expected}; got {describe_type(value)} {value!r}")
    try:
        v = float(value)
    except OverflowError:  # a Python int beyond binary64
        raise ValueError(
            f"{where}: {name} must be finite; got {fmt_int(int(value))}, too "
            f"large for a float (the largest is about 1.8e308)"
        ) from None
    if math.isnan(v) or (math.isinf(v) and not (allow_inf and v > 0)):
        raise ValueError(f"{where}: {name} must be finite; got {v!r}")
    if gt is not None and not v > gt:
        raise ValueError(f"{where}: {name} must be > {gt!r}; got {v!r}")
    if ge is not None and not v >= ge:
        raise ValueError(f"{where}: {name} must be >= {ge!r}; got {v!r}")
    if float32 and math.isfinite(v):
        with np.errstate(over="ignore"):
            f = float(np.float32(v))
        if math.isinf(f) or (gt is not None and gt >= 0.0 and f == 0.0 and v > 0.0):
            lo = f"{FLOAT32_TRUE_MIN!r}" if gt is not None and gt >= 0.0 else "0"
            raise ValueError(
                f"{where}: {name}={v!r} is used as float32 and rounds to {f!r} "
                f"there; expected a value in the float32 range [{lo}, "
                f"{FLOAT32_MAX!r}]"
            )
    return v


def check_flag(value: object, name: str, where: str) -> bool:
    """Check a flag option (``bool`` or ``numpy.bool_``) and return a Python bool.

    Parameters
    ----------
    value : object
        The flag.
    name : str
        Argument name for messages.
    where : str
        ``"Class.method"``.

    Returns
    -------
    bool

    Raises
    ------
    TypeError
        Anything else, including ``0``, ``1`` and strings.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be a bool; got {describe_type(value)} {value!r}")
    return bool(value)


def check_choice(
    value: object,
    name: str,
    where: str,
    choices: Sequence[str],
    *,
    allow_none: bool = False,
    note: str = "",
) -> str | None:
    """Check a string option against its exact lowercase spellings.

    Parameters
    ----------
    value : object
        The option.
    name : str
        Argument name for messages.
    where : str
        ``"Class.method"``.
    choices : sequence of str
        The accepted spellings.
    allow_none : bool, default=False
        Whether ``None`` is accepted (and returned).
    note : str, default=""
        Extra text appended to the ValueError message.

    Returns
    -------
    str or None

    Raises
    ------
    TypeError
        Not a string (nor None when allowed).
    ValueError
        Another string; the message lists the accepted values.
    """
    accepted = ([None] if allow_none else []) + list(choices)
    listing = ", ".join(repr(c) for c in accepted)
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: {name} must be a str (one of {listing}); got "
            f"{describe_type(value)} {value!r}"
        )
    if value not in choices:
        raise ValueError(
            f"{where}: {name}={value!r} is not supported; accepted values: {listing}{note}"
        )
    return value


def check_state_buffers(buffers: Sequence[tuple[str, object, tuple, object]], where: str) -> None:
    """Check that a state's buffers are still what the native core may read and write in place.

    A state's arrays may be edited in place (contents), but NumPy also lets a caller reshape an
    array in place (``a.shape = ...``), retype it (``a.dtype = ...``), make it read-only
    (``a.flags.writeable = False``) or, through ``object.__setattr__``, swap in another array.
    Any of these would make the native call fail after it has written part of the state, or read
    the wrong slots. Every call re-checks the buffers before anything is computed or written.

    Parameters
    ----------
    buffers : sequence of (name, array, shape, dtype)
        ``name`` as the message spells it (``"state.k_cache"``), the array, the exact shape and
        the exact dtype (``numpy.float32`` or ``numpy.int64``, native byte order) it must have.
    where : str
        ``"Class.method"``.

    Raises
    ------
    ValueError
        A buffer is not a NumPy array, or has another dtype or shape, or is not C-contiguous,
        aligned and writable; or two buffers share memory. The message names the buffer, what
        was expected and what came.
    """

    def expected(dt, shape) -> str:  # built only for an error: this runs on every decode step
        return (
            f"a writable, C-contiguous {dt.name} array of shape {format_shape(shape)} "
            "(its contents may be edited in place; it must not be reshaped, retyped, "
            "made read-only or replaced)"
        )

    # Fast path (every decode step): each buffer an intact ndarray that owns its memory, and no
    # two the same object. Arrays that own their allocations cannot share memory, so the
    # overlap test is needed only when a buffer is a view or was swapped for another one.
    owners = True
    for _, buf, shape, dtype in buffers:
        if type(buf) is not np.ndarray or buf.dtype != dtype or buf.shape != tuple(shape):
            break
        f = buf.flags
        if not (f.c_contiguous and f.aligned and f.writeable and buf.dtype.isnative):
            break
        owners = owners and f.owndata
    else:
        if owners and len({id(b) for _, b, _, _ in buffers}) == len(buffers):
            return
    for name, buf, shape, dtype in buffers:
        dt = np.dtype(dtype)
        if not isinstance(buf, np.ndarray):
            raise ValueError(
                f"{where}: {name} must be {expected(dt, shape)}; got {describe_type(buf)}"
            )
        problems = []
        if buf.dtype != dt or not buf.dtype.isnative:
            problems.append(
                f"dtype {buf.dtype.str!r}"
                if buf.dtype.name == dt.name
                else f"dtype {buf.dtype.name}"
            )
        if buf.shape != tuple(shape):
            problems.append(f"shape {format_shape(buf.shape)}")
        if not (buf.flags.c_contiguous and buf.flags.aligned):
            problems.append("a non-C-contiguous or unaligned layout")
        if not buf.flags.writeable:
            problems.append("a read-only array")
        if problems:
            raise ValueError(
                f"{where}: {name} must be {expected(dt, shape)}; got {', '.join(problems)}"
            )
    for i, (name_a, a, _, _) in enumerate(buffers):
        for name_b, b, _, _ in buffers[i + 1 :]:
            # Both are C-contiguous, so overlapping address ranges means shared bytes.
            if np.may_share_memory(a, b):
                raise ValueError(
                    f"{where}: {name_a} and {name_b} share memory; each state "
                    "buffer must be its own array"
                )


def check_lengths(lengths: object, batch: int, n_tokens: int, where: str) -> np.ndarray:
    """Check the ``lengths`` of a ragged call and return them as int64 of shape (batch,).

    Parameters
    ----------
    lengths : None, sequence of int or 1-D integer array
        Real tokens per row, each in ``[0, n_tokens]``; ``None`` means every row is full.
    batch : int
        Rows in the call (B).
    n_tokens : int
        Tokens per row in the call (L).
    where : str
        ``"Class.method"``.

    Returns
    -------
    numpy.ndarray of shape (batch,), dtype int64
        A fresh array (``n_tokens`` everywhere when ``lengths`` is None).

    Raises
    ------
    TypeError
        A scalar, str, bytes, mapping or set; a float or bool array; an entry that is bool,
        float (even integral) or str.
    ValueError
        Not 1-D, a count different from ``batch``, or an entry outside ``[0, n_tokens]`` (the
        message names ``lengths[i]`` and its value).

    Notes
    -----
    SPEC.md 9: padding ``x[b, lengths[b]:]`` is never read and its output is exactly +0.0.
    """
    if lengths is None:
        full = np.empty(batch, dtype=np.int64)
        full.fill(n_tokens)
        return full
    if isinstance(lengths, np.ndarray):
        if lengths.ndim == 0:
            raise TypeError(
                f"{where}: lengths must be None, a sequence of ints or a 1-D integer "
                f"array; got a 0-d array (a scalar)"
            )
        if lengths.dtype.kind not in "iu":
            raise TypeError(
                f"{where}: lengths must hold integers; got an array of dtype {lengths.dtype}"
            )
        if lengths.ndim != 1:
            raise ValueError(
                f"{where}: lengths must be 1-D with {batch} entries; got shape "
                f"{format_shape(lengths.shape)}"
            )
        entries = [int(v) for v in lengths.tolist()]
    elif isinstance(lengths, (str, bytes, bytearray, Mapping)) or not isinstance(lengths, Sequence):
        raise TypeError(
            f"{where}: lengths must be None, a sequence of ints or a 1-D integer "
            f"array; got {describe_type(lengths)}"
        )
    else:
        entries = []
        for i, v in enumerate(lengths):
            entries.append(check_int(v, f"lengths[{i}]", where))
    if len(entries) != batch:
        raise ValueError(
            f"{where}: lengths has {len(entries)} entries; expected one per row of x, batch={batch}"
        )
    for i, v in enumerate(entries):
        if not 0 <= v <= n_tokens:
            raise ValueError(f"{where}: lengths[{i}]={v} is outside [0, n_tokens={n_tokens}]")
    return np.array(entries, dtype=np.int64)


def check_tokens(x: object, d_model: int, where: str, *, step: bool = False) -> np.ndarray:
    """Check the token input of a block call and return it as float32 (batch, n_tokens, d_model).

    Parameters
    ----------
    x : buffer of shape (batch, n_tokens, d_model), or (batch, d_model) / (batch, 1, d_model)
        when ``step`` is True; float32 (see :func:`check_array`).
    d_model : int
        The block's residual width.
    where : str
        ``"Class.method"``.
    step : bool, default=False
        A one-token call: 2-D input gets a unit token axis, and n_tokens must be 1.

    Returns
    -------
    numpy.ndarray of shape (batch, n_tokens, d_model), dtype float32
        C-contiguous (viewed in place, or copied once when the buffer is not C-contiguous).

    Raises
    ------
    TypeError
        ``x`` is not a float32 buffer.
    ValueError
        Wrong rank, n_tokens != 1 in a step, last axis != d_model, or batch / n_tokens == 0;
        the message gives the shape got and the shape expected.
    """
    xa = check_array(x, "x", where)
    got_shape, got_ndim = xa.shape, xa.ndim
    if step:
        if xa.ndim == 2:
            xa = xa.reshape(xa.shape[0], 1, xa.shape[1])
        elif xa.ndim != 3 or xa.shape[1] != 1:
            raise ValueError(
                f"{where}: x has shape {format_shape(xa.shape)}; expected "
                f"(batch, d_model) = (batch, {d_model}) or (batch, 1, d_model)"
            )
    elif xa.ndim != 3:
        raise ValueError(
            f"{where}: x has shape {format_shape(xa.shape)}; expected 3-D "
            f"(batch, n_tokens, d_model) = (batch, n_tokens, {d_model})"
        )
    bsz, n_tok, dx = xa.shape
    if dx != d_model or bsz < 1 or n_tok < 1:
        expected = (
            f"(batch, d_model) = (>=1, {d_model})"
            if got_ndim == 2
            else f"(batch, n_tokens, d_model) = (>=1, >=1, {d_model})"
        )
        raise ValueError(f"{where}: x has shape {format_shape(got_shape)}; expected {expected}")
    return xa
