"""Caller-owned states: TransformerState (KV cache, window aware).

A block holds only weights and options; everything a sequence accumulates lives in a state
object made by the block's ``allocate_state``. States expose their buffers as plain NumPy arrays
(readable and writable in place, attributes not rebindable), carry the fingerprint of the block
that made them, and serve one call at a time (a per-state lock). Arithmetic never happens here.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from ._validation import check_int, check_state_buffers, describe_type

__all__ = ["TransformerState"]

# Passed by the blocks' allocate_state only; direct construction of a state raises TypeError.
_PRIVATE = object()


class TransformerState:
    """KV cache of one :class:`TransformerBlockInference` for a batch of sequences.

    Made only by :meth:`TransformerBlockInference.allocate_state`; calling the class directly
    raises TypeError. Position ``p`` of row ``b`` lives in slot ``p % capacity`` of that row.

    Attributes
    ----------
    batch_size : int
        Rows (B).
    n_kv_heads : int
        K/V heads of the block.
    head_dim : int
        Width of one head.
    max_tokens : int
        Positions each row may hold, ``<= max_positions`` of the block.
    window : int
        The block's sliding window (0 = none).
    capacity : int
        Cache slots per row: ``max_tokens`` without a window, ``min(window, max_tokens)`` with
        one (a ring).
    k_cache, v_cache : ndarray of shape (batch_size, n_kv_heads, capacity, head_dim), float32
        Keys (after k_norm and RoPE, as HF caches them) and values. Contents may be read and
        written; the attributes cannot be rebound. Without a window the layout is one layer of
        HF's ``DynamicCache``, (B, KV, S, HD).
    row_tokens : ndarray of shape (batch_size,), int64
        Positions held per row; the next token of row ``b`` gets position ``row_tokens[b]``.
        Writable (lowering it rolls back, see Notes). Checked at every call to be in
        ``[0, max_tokens]``.
    fingerprint : str
        Fingerprint of the allocating block; a block refuses a state with another fingerprint.

    Notes
    -----
    Reading rule (SPEC.md 5): a call at position ``q`` of row ``b`` reads the slots of positions
    ``max(0, q - window + 1) .. q - 1`` (``0 .. q - 1`` without a window); those must be finite
    and nothing else is read. Rollback by lowering ``row_tokens[b]`` is exact without a window;
    with a window it is exact only while the slots needed still hold their positions.

    Every call (and ``reset``, ``keys``, ``values``, ``cached_tokens``) first re-checks that
    ``k_cache``, ``v_cache`` and ``row_tokens`` still have their dtype and shape, are
    C-contiguous and writable, and share no memory; an array reshaped, retyped or made
    read-only in place is refused with ValueError before anything is written.

    States pickle (buffers, counters and fingerprint); a restored state works with any block of
    the same fingerprint.

    Examples
    --------
    >>> st = blk.allocate_state(2, 16)                          # doctest: +SKIP
    >>> y = blk.forward(x, st); st.row_tokens                  # doctest: +SKIP
    array([5, 5])
    """

    __slots__ = (
        "batch_size",
        "n_kv_heads",
        "head_dim",
        "max_tokens",
        "window",
        "capacity",
        "k_cache",
        "v_cache",
        "row_tokens",
        "fingerprint",
        "_lock",
        "_session",
        "__weakref__",
    )

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "TransformerState: states are made by "
            "TransformerBlockInference.allocate_state(batch_size, max_tokens), not "
            "by calling the class"
        )

    @classmethod
    def _make(
        cls,
        token,
        *,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        window: int,
        fingerprint: str,
        k_cache=None,
        v_cache=None,
        row_tokens=None,
    ):
        if token is not _PRIVATE:
            raise TypeError(
                "TransformerState: states are made by "
                "TransformerBlockInference.allocate_state(batch_size, max_tokens)"
            )
        self = object.__new__(cls)
        capacity = min(window, max_tokens) if window > 0 else max_tokens
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        s = object.__setattr__
        s(self, "batch_size", int(batch_size))
        s(self, "n_kv_heads", int(n_kv_heads))
        s(self, "head_dim", int(head_dim))
        s(self, "max_tokens", int(max_tokens))
        s(self, "window", int(window))
        s(self, "capacity", int(capacity))
        s(
            self,
            "k_cache",
            np.zeros(shape, np.float32)
            if k_cache is None
            else np.array(k_cache, dtype=np.float32, order="C", copy=True).reshape(shape),
        )
        s(
            self,
            "v_cache",
            np.zeros(shape, np.float32)
            if v_cache is None
            else np.array(v_cache, dtype=np.float32, order="C", copy=True).reshape(shape),
        )
        s(
            self,
            "row_tokens",
            np.zeros(batch_size, np.int64)
            if row_tokens is None
            else np.array(row_tokens, dtype=np.int64, copy=True).reshape(batch_size),
        )
        s(self, "fingerprint", str(fingerprint))
        s(self, "_lock", threading.Lock())
        s(self, "_session", None)
        return self

    def __setattr__(self, name, value):
        if name == "cached_tokens":
            object.__setattr__(self, name, value)  # the property's setter
            return
        raise AttributeError(
            f"TransformerState: attribute {name!r} cannot be assigned; "
            "write into the arrays instead (e.g. state.row_tokens[:] = 0)"
        )

    def __delattr__(self, name):
        raise AttributeError(f"TransformerState: attribute {name!r} cannot be deleted")

    # -- pickling ---------------------------------------------------------------------------
    def __reduce__(self):
        return (
            _restore_transformer_state,
            (
                self.batch_size,
                self.n_kv_heads,
                self.head_dim,
                self.max_tokens,
                self.window,
                self.fingerprint,
                self.k_cache,
                self.v_cache,
                self.row_tokens,
            ),
        )

    def __copy__(self):
        fn, args = self.__reduce__()
        return fn(*args)

    def __deepcopy__(self, memo):
        return self.__copy__()

    # -- counters ---------------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        """int: The common value of ``row_tokens``; assigning an int sets every row.

        Reading it while rows differ raises ValueError (read ``row_tokens`` instead). Assigning
        checks an int in ``[0, max_tokens]`` (TypeError / ValueError) and, like :meth:`reset`,
        raises RuntimeError while a call is using the state (nothing is written then).
        """
        self._check_buffers("TransformerState.cached_tokens")
        rt = self.row_tokens
        if rt.size and not (rt == rt[0]).all():
            raise ValueError(
                "TransformerState.cached_tokens: rows hold different numbers of "
                f"positions {rt.tolist()}; read state.row_tokens instead"
            )
        return int(rt[0]) if rt.size else 0

    @cached_tokens.setter
    def cached_tokens(self, value) -> None:
        where = "TransformerState.cached_tokens"
        v = check_int(value, "cached_tokens", where, min_value=0, max_value=self.max_tokens)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{where}: state is in use by another call (a state serves one "
                "call at a time); assign cached_tokens after it returns"
            )
        try:
            self._check_buffers(where)
            self.row_tokens[:] = v
        finally:
            self._lock.release()

    def _check_buffers(self, where: str) -> None:
        """Raise ValueError unless k_cache, v_cache and row_tokens are intact (see
        :func:`exactblocks._validation.check_state_buffers`)."""
        shape = (self.batch_size, self.n_kv_heads, self.capacity, self.head_dim)
        check_state_buffers(
            [
                ("state.k_cache", self.k_cache, shape, np.float32),
                ("state.v_cache", self.v_cache, shape, np.float32),
                ("state.row_tokens", self.row_tokens, (self.batch_size,), np.int64),
            ],
            where,
        )

    def _held(self, where: str, row) -> tuple[list[int], int]:
        rows = (
            list(range(self.batch_size))
            if row is None
            else [check_int(row, "row", where, min_value=0, max_value=self.batch_size - 1)]
        )
        counts = []
        for b in rows:
            n = int(self.row_tokens[b])
            if not 0 <= n <= self.max_tokens:
                raise ValueError(
                    f"{where}: state.row_tokens[{b}]={n} is outside "
                    f"[0, max_tokens={self.max_tokens}]"
                )
            counts.append(n)
        if row is None and len(set(counts)) > 1:
            raise ValueError(
                f"{where}: rows hold different numbers of positions "
                f"{counts}; pass row=b to read one row"
            )
        return rows, (counts[0] if counts else 0)

    def _gather(self, name: str, where: str, row) -> np.ndarray:
        self._check_buffers(where)
        buf = getattr(self, name)
        rows, n = self._held(where, row)
        start = max(0, n - self.capacity)
        slots = np.arange(start, n, dtype=np.int64) % self.capacity
        if row is None:
            return np.ascontiguousarray(buf[:, :, slots, :])
        return np.ascontiguousarray(buf[rows[0]][:, slots, :])

    def keys(self, row: int | None = None) -> np.ndarray:
        """Return a copy of the held keys in increasing position order.

        Parameters
        ----------
        row : int or None, default=None
            One row ``b`` in ``[0, batch_size)``, or all rows (which must hold equal counts).

        Returns
        -------
        ndarray, float32
            For a row holding ``n`` positions, positions ``max(0, n - capacity) .. n - 1``
            (ring aware): shape ``(n_kv_heads, held, head_dim)`` for ``row=b``,
            ``(batch_size, n_kv_heads, held, head_dim)`` for ``row=None``. A fresh array.

        Raises
        ------
        TypeError
            ``row`` is not an int or None.
        ValueError
            ``row`` out of range, ``row_tokens`` out of ``[0, max_tokens]``, ``row=None``
            while rows hold different counts, or a state buffer reshaped, retyped or made
            read-only in place.
        """
        return self._gather("k_cache", "TransformerState.keys", row)

    def values(self, row: int | None = None) -> np.ndarray:
        """Return a copy of the held values in increasing position order.

        Parameters
        ----------
        row : int or None, default=None
            As in :meth:`keys`.

        Returns
        -------
        ndarray, float32
            As in :meth:`keys`, from ``v_cache``.

        Raises
        ------
        TypeError
            ``row`` is not an int or None.
        ValueError
            As in :meth:`keys`.
        """
        return self._gather("v_cache", "TransformerState.values", row)

    def reset(self, rows=None) -> None:
        """Zero the cache of the given rows and set their ``row_tokens`` to 0 (mutates the state).

        Parameters
        ----------
        rows : None, int or sequence of int, default=None
            The rows to clear (all rows when None); for reusing a batch slot in continuous
            batching.

        Raises
        ------
        TypeError
            ``rows`` is not None, an int or a sequence of ints.
        ValueError
            A row outside ``[0, batch_size)``, or a state buffer reshaped, retyped or made
            read-only in place (nothing is written then).
        RuntimeError
            The state is in use by a running call.
        """
        _reset_rows(self, rows, "TransformerState.reset", ("k_cache", "v_cache"))

    def __repr__(self) -> str:
        return (
            f"TransformerState(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, max_tokens={self.max_tokens}, window={self.window}, "
            f"capacity={self.capacity}, row_tokens={self.row_tokens.tolist()})"
        )

    # -- used by the block and the session ----------------------------------------------------
    def _open_session(self):
        ref = self._session
        sess = ref() if ref is not None else None
        return sess if sess is not None and sess.is_open else None

    def _set_session(self, session) -> None:
        object.__setattr__(self, "_session", None if session is None else weakref.ref(session))


def _reset_rows(state, rows, where: str, buffers: tuple) -> None:
    """A state's ``reset``: zero the named buffers and ``row_tokens`` of ``rows`` (all when
    None), under the state's lock and after re-checking its buffers; nothing is written when a
    check fails."""
    idx = _check_rows(rows, state.batch_size, where)
    if not state._lock.acquire(blocking=False):
        raise RuntimeError(f"{where}: state is in use by another call")
    try:
        state._check_buffers(where)
        for name in buffers:
            getattr(state, name)[idx] = 0.0
        state.row_tokens[idx] = 0
    finally:
        state._lock.release()


def _check_rows(rows, batch: int, where: str) -> list[int]:
    if rows is None:
        return list(range(batch))
    if isinstance(rows, np.ndarray):
        if rows.dtype.kind not in "iu" or rows.ndim > 1:
            raise TypeError(
                f"{where}: rows must be an int or a sequence of ints; got an array of "
                f"dtype {rows.dtype} and shape {rows.shape}"
            )
        items = rows.reshape(-1).tolist()
    elif isinstance(rows, (list, tuple, range)):
        items = list(rows)
    else:
        return [check_int(rows, "rows", where, min_value=0, max_value=batch - 1)]
    return [
        check_int(r, f"rows[{i}]", where, min_value=0, max_value=batch - 1)
        for i, r in enumerate(items)
    ]


def _restore_transformer_state(
    batch_size, n_kv_heads, head_dim, max_tokens, window, fingerprint, k_cache, v_cache, row_tokens
):
    return TransformerState._make(
        _PRIVATE,
        batch_size=batch_size,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=max_tokens,
        window=window,
        fingerprint=fingerprint,
        k_cache=k_cache,
        v_cache=v_cache,
        row_tokens=row_tokens,
    )


def _state_type_error(where: str, state) -> TypeError:
    return TypeError(
        f"{where}: state must be a TransformerState from this block's "
        f"allocate_state(); got {describe_type(state)}"
    )
