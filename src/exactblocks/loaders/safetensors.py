"""safetensors files -> float32 NumPy arrays, memory-mapped, widened exactly.

What lives here: :class:`SafetensorsSource`, the tensors of one ``model.safetensors`` file or of
a sharded checkpoint (``model.safetensors.index.json``) as ``save_pretrained`` writes them,
read lazily: the headers are parsed and checked against the file sizes at open, a tensor's
bytes are read (memory-mapped) only when :meth:`SafetensorsSource.get` asks for it. What does
not: which tensors a model needs (``exactblocks.models``).

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
(offsets relative to the byte after the header) plus an optional ``"__metadata__"``, then the
data. The ``safetensors`` package's NumPy reader has no bfloat16 type and copies each tensor;
this reader maps the file once and widens in NumPy:

- F32: a read-only view of the memory map (no copy);
- BF16: ``uint32(bits) << 16`` viewed as float32 (exact: bfloat16 is float32's top half);
- F16: ``astype(float32)`` (exact: every binary16 value is a binary32 value).

Any other dtype is refused with the tensor's name (integer tensors are not model weights here).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["SafetensorsSource", "read_header"]

_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
_KNOWN_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
                 "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"}  # fmt: skip
_MAX_HEADER = 100 * 2**20  # the format's own limit on the header (100 MB)


def _is_count(value) -> bool:
    """A JSON integer >= 0 (not a float such as 2.5 or 2.0, not a bool)."""
    return type(value) is int and value >= 0


def read_header(path: str) -> tuple[dict, int]:
    """Parse and check the header of one safetensors file.

    Parameters
    ----------
    path : str
        The file.

    Returns
    -------
    tensors : dict
        name -> ``{"dtype": str, "shape": tuple of int, "begin": int, "end": int}`` with
        absolute byte offsets in the file (``__metadata__`` dropped).
    size : int
        The file size in bytes.

    Raises
    ------
    FileNotFoundError
        If ``path`` is not a file.
    ValueError
        If the file is shorter than its header says, the header is not the format's JSON, a
        ``__metadata__`` is not a map of strings to strings, a
        tensor's shape or offsets are not non-negative integers, its offsets do not match its
        dtype and shape, its bytes lie past the end of the file (a truncated download), or two
        tensors' bytes overlap: the message names the file and the tensor.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"safetensors: {path!r} is not a file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"safetensors: {path!r} has {size} bytes, fewer than the 8-byte header"
            )
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"safetensors: {path!r} announces a {n}-byte header but holds {size} bytes "
                "(truncated, or not a safetensors file)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"safetensors: the header of {path!r} is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"safetensors: the header of {path!r} is not a JSON object")
    base = 8 + n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        shown = repr(meta)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ValueError(
            f"safetensors: {path!r}: __metadata__={shown} is not a map of strings to strings "
            "(the format's metadata)"
        )
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError):
            raise ValueError(
                f"safetensors: {path!r}: the header entry of tensor {name!r} lacks dtype, shape "
                "or data_offsets"
            ) from None
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(
                f"safetensors: {path!r}: tensor {name!r} has data_offsets {offsets!r}; "
                "expected two non-negative integers [begin, end]"
            )
        begin, end = offsets
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ValueError(
                f"safetensors: {path!r}: tensor {name!r} has shape {shape!r}; expected a list "
                "of non-negative integers"
            )
        if not (_is_count(begin) and _is_count(end)):
            raise ValueError(
                f"safetensors: {path!r}: tensor {name!r} has data_offsets {[begin, end]!r}; "
                "expected two non-negative integers"
            )
        if end < begin:
            raise ValueError(
                f"safetensors: {path!r}: tensor {name!r} has data_offsets {[begin, end]!r}; "
                "expected [begin, end] with end >= begin"
            )
        shape = tuple(shape)
        if dtype not in _KNOWN_DTYPES:
            raise ValueError(f"safetensors: {path!r}: tensor {name!r} has unknown dtype {dtype!r}")
        count = math.prod(shape)  # Python ints: no wrap-around for absurd dims
        width = _ITEMSIZE.get(dtype)
        if width is not None and end - begin != count * width:
            raise ValueError(
                f"safetensors: {path!r}: tensor {name!r} ({dtype}, shape {shape}) spans "
                f"{end - begin} bytes; expected {count * width}"
            )
        if base + end > size:
            raise ValueError(
                f"safetensors: {path!r} is truncated: tensor {name!r} needs bytes "
                f"[{base + begin}, {base + end}) but the file has {size}"
            )
        out[name] = {"dtype": dtype, "shape": shape, "begin": base + begin, "end": base + end}
    # two tensors may not share bytes (an empty tensor holds none, so it overlaps nothing)
    spans = sorted((t["begin"], t["end"], name) for name, t in out.items() if t["end"] > t["begin"])
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise ValueError(
                f"safetensors: {path!r}: the data of tensors {a!r} and {b!r} overlap (bytes "
                f"[{begin_b}, {end_a}) belong to both)"
            )
    return out, size


class SafetensorsSource(Mapping):
    """The tensors of one or several safetensors files, as float32 arrays on demand.

    A read-only mapping name -> float32 ndarray; the header is read at construction, the data
    at each lookup. ``shape(name)`` and ``dtype(name)`` answer without reading data.

    Parameters
    ----------
    files : sequence of str
        The files (one, or every shard of a checkpoint). A tensor name present in two files is
        refused.

    Raises
    ------
    FileNotFoundError
        A file is missing.
    ValueError
        A header is malformed, a file is truncated, or two files hold the same tensor name.

    Notes
    -----
    ``source[name]`` returns a C-contiguous float32 array of the tensor's shape: for F32 a
    read-only view of the file's memory map (valid while the array lives), for BF16/F16 a fresh
    exact widening. Other dtypes raise ValueError naming the tensor.
    """

    def __init__(self, files):
        self.files = [os.fspath(f) for f in files]
        self._index: dict[str, tuple[str, dict]] = {}
        self._maps: dict[str, np.memmap] = {}
        for path in self.files:
            tensors, _ = read_header(path)
            for name, info in tensors.items():
                if name in self._index:
                    raise ValueError(
                        f"safetensors: tensor {name!r} is in both {self._index[name][0]!r} and "
                        f"{path!r}"
                    )
                self._index[name] = (path, info)

    @classmethod
    def from_folder(cls, folder: str) -> SafetensorsSource:
        """The checkpoint of a ``save_pretrained`` folder.

        Parameters
        ----------
        folder : str
            Holds ``model.safetensors``, or ``model.safetensors.index.json`` and its shards.

        Returns
        -------
        SafetensorsSource

        Raises
        ------
        FileNotFoundError
            Neither file exists (the message lists what the folder holds), or a shard named by
            the index is missing.
        ValueError
            The index is not the format's JSON, or a shard holds other tensors than the index
            says.
        """
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"safetensors: {index!r} is not a safetensors index ({type(exc).__name__}: "
                    f"{exc})"
                ) from None
            plain = isinstance(weight_map, dict) and all(
                isinstance(k, str) and isinstance(v, str) and v and os.path.basename(v) == v
                for k, v in weight_map.items()
            )
            if not plain:
                shown = repr(weight_map)
                raise ValueError(
                    f"safetensors: {index!r}: weight_map="
                    f"{shown if len(shown) <= 80 else shown[:77] + '...'} is not a mapping of "
                    "tensor names to shard file names in the folder"
                )
            files = sorted(set(weight_map.values()))
            paths = [os.path.join(folder, f) for f in files]
            for p in paths:
                if not os.path.isfile(p):
                    raise FileNotFoundError(
                        f"safetensors: shard {p!r} named by {index!r} is missing"
                    )
            src = cls(paths)
            for name, file in weight_map.items():
                got = src._index.get(name)
                if got is None or os.path.basename(got[0]) != file:
                    raise ValueError(
                        f"safetensors: {index!r} places tensor {name!r} in {file!r}, but "
                        + ("no shard holds it" if got is None else f"it is in {got[0]!r}")
                    )
            extra = sorted(set(src._index) - set(weight_map))
            if extra:
                raise ValueError(f"safetensors: shards hold tensors {extra} missing from {index!r}")
            return src
        if os.path.isfile(single):
            return cls([single])
        held = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        raise FileNotFoundError(
            f"safetensors: {folder!r} holds neither model.safetensors nor "
            f"model.safetensors.index.json (it holds {held})"
        )

    def __getitem__(self, name: str) -> np.ndarray:
        path, info = self._index[name]
        dtype = info["dtype"]
        if dtype not in _ITEMSIZE:
            raise ValueError(
                f"safetensors: tensor {name!r} in {path!r} has dtype {dtype}; model weights must "
                "be F32, BF16 or F16"
            )
        mm = self._maps.get(path)
        if mm is None:
            mm = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        raw = mm[info["begin"] : info["end"]]
        shape = info["shape"]
        if dtype == "F32":
            return raw.view("<f4").reshape(shape)
        if dtype == "F16":
            return raw.view("<f2").astype(np.float32).reshape(shape)
        bits = raw.view("<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(shape)

    def release(self) -> None:
        """Drop the mapped files' pages from this process's resident set (``MADV_DONTNEED``).

        The maps are read-only: a later read faults the pages in again from the page cache.
        The model builder calls it after each layer is packed.
        """
        from .gguf import release_map

        for mm in self._maps.values():
            release_map(mm)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def shape(self, name: str) -> tuple:
        """Shape of tensor ``name`` (tuple of int), from the header."""
        return self._index[name][1]["shape"]

    def dtype(self, name: str) -> str:
        """safetensors dtype of tensor ``name`` (``'F32'``, ``'BF16'``, ...), from the header."""
        return self._index[name][1]["dtype"]

    def where(self, name: str) -> str:
        """Path of the file holding tensor ``name``."""
        return self._index[name][0]

    def __repr__(self) -> str:
        return f"SafetensorsSource({len(self)} tensors in {len(self.files)} file(s))"
