"""TransformerState (the KV cache, window aware) and the state checks of Transformer calls.

What lives here: the state object made by :meth:`TransformerBlockInference.allocate_state`, its
buffers, ``keys``/``values``/``cached_tokens``/``reset``, the session claim it carries, and the
checks every call and the session's ``load_state`` run on it (counters in range, SPEC.md 5
reading rule). What does not: what both states share (``_state.py``: private construction,
read-only attributes, lock, reset, buffer checks, copying) and any arithmetic.
"""

from __future__ import annotations

import weakref

import numpy as np

from .. import _ext
from .._state import PRIVATE_TOKEN, StateBase
from .._validation import check_int, describe_type

__all__ = ["TransformerState"]


def _restore_transformer_state(
    batch_size,
    n_kv_heads,
    head_dim,
    max_tokens,
    window,
    fingerprint,
    k_cache,
    v_cache,
    row_tokens,
    rope_factors=None,
):
    """Unpickle a TransformerState (the arguments of ``TransformerState.__reduce__``; states
    pickled before longrope have no ``rope_factors``, which is then None)."""
    return TransformerState._make(
        PRIVATE_TOKEN,
        batch_size=batch_size,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=max_tokens,
        window=window,
        fingerprint=fingerprint,
        k_cache=k_cache,
        v_cache=v_cache,
        row_tokens=row_tokens,
        rope_factors=rope_factors,
    )


class TransformerState(StateBase):
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
    rope_factors : {'short', 'long'} or None
        The longrope factor set every call with this state rotates with, fixed by
        ``allocate_state``: 'long' when ``max_tokens`` > the block's
        ``rope_scaling['original_max_position_embeddings']``, else 'short'; None when the block
        has no longrope. HF picks the set by the current sequence length instead, so the two
        agree whenever a sequence stays on one side of that switch (SPEC.md 4.4).

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

    States pickle (buffers, counters and fingerprint) and copy under the state's lock, as do
    ``keys`` and ``values``: taken during another thread's call, they wait for it (SPEC.md
    2.6). A restored state works with any block of the same fingerprint.

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
        "rope_factors",
        "_session",
    )
    _MADE_BY = "TransformerBlockInference.allocate_state(batch_size, max_tokens)"
    _BUFFERS = ("k_cache", "v_cache")
    _ASSIGN_HINT = "write into the arrays instead (e.g. state.row_tokens[:] = 0)"
    _SETTABLE = ("cached_tokens",)
    _PICKLED = (
        "batch_size",
        "n_kv_heads",
        "head_dim",
        "max_tokens",
        "window",
        "fingerprint",
        "k_cache",
        "v_cache",
        "row_tokens",
        "rope_factors",
    )
    _restore = staticmethod(_restore_transformer_state)

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
        rope_factors=None,
    ):
        capacity = min(window, max_tokens) if window > 0 else max_tokens
        self = cls._new(
            token,
            fingerprint,
            row_tokens,
            batch_size=batch_size,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            max_tokens=max_tokens,
            window=window,
            capacity=capacity,
        )
        if rope_factors not in (None, "short", "long"):
            raise ValueError(f"TransformerState: bad rope_factors {rope_factors!r}")
        object.__setattr__(self, "rope_factors", rope_factors)
        shape = (self.batch_size, self.n_kv_heads, self.capacity, self.head_dim)
        object.__setattr__(self, "k_cache", self._buffer(k_cache, shape, np.float32))
        object.__setattr__(self, "v_cache", self._buffer(v_cache, shape, np.float32))
        object.__setattr__(self, "_session", None)
        return self

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
        with self._lock.claim(
            f"{where}: state is in use by another call (a state serves one "
            "call at a time); assign cached_tokens after it returns"
        ):
            self._check_buffers(where)
            self.row_tokens[:] = v

    def _buffer_shapes(self) -> dict:
        shape = (self.batch_size, self.n_kv_heads, self.capacity, self.head_dim)
        return {"k_cache": shape, "v_cache": shape}

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
        with self._snapshot(where):  # a running call of another thread finishes first
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
            The state is in use by a running call; or some rows are given of a state that a
            call of another thread held when the process forked (a reset of every row makes
            it usable again, SPEC.md 2.6).
        """
        self._reset(rows, "TransformerState.reset")

    def __repr__(self) -> str:
        return (
            f"TransformerState(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, max_tokens={self.max_tokens}, window={self.window}, "
            f"capacity={self.capacity}, row_tokens={self.row_tokens.tolist()}"
            + ("" if self.rope_factors is None else f", rope_factors={self.rope_factors!r}")
            + ")"
        )

    # -- used by the block and the session ----------------------------------------------------
    def _open_session(self):
        ref = self._session
        sess = ref() if ref is not None else None
        return sess if sess is not None and sess.is_open else None

    def _set_session(self, session) -> None:
        object.__setattr__(self, "_session", None if session is None else weakref.ref(session))


def _state_type_error(where: str, state) -> TypeError:
    return TypeError(
        f"{where}: state must be a TransformerState from this block's "
        f"allocate_state(); got {describe_type(state)}"
    )


def _check_counters(state: TransformerState, where: str) -> np.ndarray:
    """Re-check the state's buffers, then return a copy of row_tokens, each in [0, max_tokens].

    Called (under the state's lock) before anything is computed or written, by every block call
    and by the session's ``load_state``.
    """
    state._check_buffers(where)
    rt = np.array(state.row_tokens, dtype=np.int64, copy=True)
    for b, n in enumerate(rt.tolist()):
        if not 0 <= n <= state.max_tokens:
            raise ValueError(
                f"{where}: state.row_tokens[{b}]={n} is outside [0, max_tokens={state.max_tokens}]"
            )
    return rt


def _check_readable(
    state: TransformerState,
    start: np.ndarray,
    lens: np.ndarray,
    where: str,
    reader: str = "read by this call",
) -> None:
    """SPEC.md 5 reading rule: slots of positions j0 .. q0-1 of every advancing row are finite.

    The error names the first non-finite element in (row, k_cache then v_cache, KV head,
    position) order, whatever the thread count and whether the window wraps the ring.
    ``reader`` completes the message ("read by this call", or the session's next step).
    """
    w, cap = state.window, state.capacity
    spans, first_pos = [], []  # (b, a, e) slot ranges; position held by slot a of each
    for b in range(state.batch_size):
        q0 = int(start[b])
        if lens[b] == 0 or q0 == 0:
            continue
        j0 = max(0, q0 - w + 1) if w > 0 else 0
        s0 = j0 % cap
        count = q0 - j0
        spans.append((b, s0, min(cap, s0 + count)))
        first_pos.append(j0)
        if s0 + count > cap:
            spans.append((b, 0, s0 + count - cap))
            first_pos.append(j0 + cap - s0)
    if not spans:
        return
    span_arr = np.array(spans, dtype=np.int64)
    core = _ext.core()
    hits = []  # the first bad element in (row, buffer, span) order, as the rows are read
    for k, buf_name in enumerate(("k_cache", "v_cache")):
        hit = core.first_nonfinite_spans(getattr(state, buf_name), span_arr)
        if hit is not None:
            i, g, slot, dd = (int(v) for v in hit)
            hits.append((spans[i][0], k, i, buf_name, g, slot, dd))
    if hits:
        b, _, i, buf_name, g, slot, dd = min(hits)
        pos = first_pos[i] + (slot - spans[i][1])
        buf = getattr(state, buf_name)
        raise ValueError(
            f"{where}: state.{buf_name}[{b}, {g}, {slot}, {dd}] (row {b}, position "
            f"{pos}, {reader}) must be finite; got {float(buf[b, g, slot, dd])!r}"
        )
