"""GGUF tensors -> numbers: dequantisation to float32, or the blocks kept as they are, and
llama.cpp's q/k row order undone.

What lives here: :func:`dequantize` (one tensor -> float32, or a
:class:`~exactblocks._weights.QuantizedMatrix` over the file's blocks for the types the core
packs directly) and :func:`unpermute_qk`. What does not: reading the file (:mod:`.reader`),
which tensor is which (the family files in ``exactblocks.models``).
"""

from __future__ import annotations

import numpy as np

from exactblocks._validation import FormatError

from .reader import _GGML_F32, _GGML_NAMES, _LeanTensor

__all__ = ["DIRECT_TYPES", "check_type", "dequantize", "unpermute_qk"]

# ggml types the core packs directly (exactblocks._weights.QuantizedMatrix): Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (ops/gemm/format.hpp GgmlType: Q4_1/Q4_K as 4-bit codes, Q5_1/Q5_K
# as 5-bit codes in bytes, Q6_K as int8 codes with a scale per 16, the rest as int8 codes).
# Others (F16, BF16, Q2_K, Q3_K, IQ*, ...) are dequantised by gguf to float32.
DIRECT_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: GGUF row order -> HF row order.

    llama.cpp's ``convert_hf_to_gguf.py`` reorders the rows of q_proj and k_proj inside each head
    so that each RoPE pair is adjacent (its RoPE is the interleaved form). Inside a head of
    ``hd`` rows, HF row ``i*(hd/2) + j`` (half i in {0, 1}, j < hd/2) is stored at GGUF row
    ``2*j + i``. This is the inverse, the same as transformers' GGUF loader
    (``_reverse_permute_weights``). A pure reordering of rows: no value changes.

    A :class:`~exactblocks._weights.QuantizedMatrix` has its block rows reordered (a row's
    blocks move with it).

    Parameters
    ----------
    w : ndarray of shape (n_heads * head_dim, d_in), or QuantizedMatrix
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
    from exactblocks._weights import QuantizedMatrix

    if isinstance(w, QuantizedMatrix):
        return QuantizedMatrix(w.ggml_type, unpermute_qk(w.blocks, n_heads), w.shape)
    rows = w.shape[0]
    if n_heads < 1 or rows % n_heads or (rows // n_heads) % 2:
        raise FormatError(
            "unpermute_qk",
            f"w has {rows} rows, which do not split into n_heads={n_heads} heads of even size",
        )
    hd = rows // n_heads
    grouped = w.reshape(n_heads, hd // 2, 2, *w.shape[1:])  # (head, j, i, ...): GGUF row 2*j + i
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(w.shape))


def _type_code(tensor) -> int:
    # (a GGUFFile tensor's type code is read without importing gguf)
    return tensor.ggml_type if isinstance(tensor, _LeanTensor) else int(tensor.tensor_type)


def check_type(tensor, where: str) -> None:
    """Refuse a tensor whose type :func:`dequantize` cannot turn into numbers (the integer
    types I8/I16/I32/I64, F64, or a block type the ``gguf`` package does not dequantise),
    before any tensor is read.

    Parameters
    ----------
    tensor : a GGUFFile tensor or gguf.ReaderTensor
    where : str
        The caller, for the message.

    Raises
    ------
    FormatError
        Naming the tensor, its type and the accepted types.
    """
    kind = _type_code(tensor)
    if kind in DIRECT_TYPES or kind in (0, 1, 30):  # F32, F16, BF16: no gguf import
        return
    import gguf
    from gguf.quants import _type_traits

    try:
        qtype = gguf.GGMLQuantizationType(kind)
    except ValueError:
        qtype = None
    if qtype is not None and qtype in _type_traits:
        return
    accepted = sorted({"F32", "F16"} | {t.name for t in _type_traits})
    name = _GGML_NAMES.get(kind) or (qtype.name if qtype is not None else kind)
    raise FormatError(
        where,
        f"tensor {tensor.name!r} has type {name}, which holds no weights the loader can "
        f"read (expected one of {', '.join(accepted)})",
    )


def dequantize(tensor, direct: bool = False):
    """One GGUF tensor -> float32 array of shape reversed(ne).

    Parameters
    ----------
    tensor : a GGUFFile tensor or gguf.ReaderTensor
    direct : bool, default=False

    Returns
    -------
    ndarray or QuantizedMatrix

    Notes
    -----
    Without ``direct``: owned (not a view of the file). With ``direct``: a 2-D tensor (or a 3-D
    stack of experts, llama.cpp's ``ffn_*_exps``) of a type the core packs straight from its
    blocks (:data:`DIRECT_TYPES`) is returned as a
    :class:`~exactblocks._weights.QuantizedMatrix` over the file's memory map (nothing is
    dequantised or copied), and an F32 tensor as a read-only view of the map (its consumer
    copies what it keeps).
    """
    expect = tuple(int(n) for n in reversed(list(tensor.shape)))
    kind = _type_code(tensor)
    if direct and len(expect) in (2, 3) and kind in DIRECT_TYPES:
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
