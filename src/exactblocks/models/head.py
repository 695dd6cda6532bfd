"""The packed vocabulary matrix's rows, and the whole model's fingerprint.

What lives here: ``_HeadRows`` (an embedding read back from the output head's or a GGUF
embedding's packed rows) and ``_model_fingerprint``. What does not: the head's arithmetic
(``_core.OutputHead``, in the native core).
"""

from __future__ import annotations

import numpy as np
import xxhash


class _HeadRows:
    """The rows of a packed vocabulary matrix, as float32 on demand.

    An embedding without a float32 copy: the output head's matrix for a tied embedding
    (``_core.OutputHead``), or an untied GGUF embedding's own packed blocks
    (``_core.PackedLinear``). ``rows[ids]`` gives ``(*ids.shape, d_model)``, each row rebuilt
    by the core with the kernels' own operations, so it equals the row the matrix was packed
    from, bit for bit.
    """

    __slots__ = ("_head", "vocab_size", "d_model")

    def __init__(self, head, vocab_size: int, d_model: int):
        self._head = head
        self.vocab_size = int(vocab_size)
        self.d_model = int(d_model)

    @property
    def nbytes(self) -> int:
        """int: Bytes of the float32 matrix."""
        return self.vocab_size * self.d_model * 4

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        flat = np.ascontiguousarray(ids.reshape(-1))
        return self._head.rows(flat).reshape(*ids.shape, self.d_model)

    def chunks(self, rows: int = 2048):
        """Yield the float32 matrix a slice of ``rows`` rows at a time, in order."""
        for r0 in range(0, self.vocab_size, rows):
            yield self._head.unpack(r0, min(self.vocab_size, r0 + rows))


def _model_fingerprint(spec, blocks, head_bytes) -> str:
    """XXH3-128 of the family's spec, every block's fingerprint and the head's weights (the
    final norm, and the head and embedding matrices as float32 rows: a packed head's rows are
    rebuilt a slice at a time)."""
    h = xxhash.xxh3_128()
    for part in (b"exactblocks-model-1", repr(spec).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    for blk in blocks:
        h.update(blk.fingerprint.encode())
    for arr in head_bytes:
        h.update(arr.nbytes.to_bytes(8, "little"))
        if isinstance(arr, _HeadRows):  # the packed head's float32 rows, a slice at a time
            for chunk in arr.chunks():
                h.update(memoryview(chunk).cast("B"))
        else:
            h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.hexdigest()
