"""Mamba2State (conv window and SSM state per row) and the state checks of Mamba-2 calls.

What lives here: the state object made by :meth:`Mamba2BlockInference.allocate_state`, its
buffers (plain NumPy arrays, writable in place, attributes not rebindable), ``reset``, and the
checks every call runs on it (counters, and the finiteness of what the call reads, naming the
first bad element). What does not: what both states share (``_state.py``: private
construction, read-only attributes, lock, reset, buffer checks, copying) and any arithmetic.
"""

from __future__ import annotations

import numpy as np

from .. import _ext
from .._state import PRIVATE_TOKEN, StateBase
from .._validation import check_finite, describe_type

__all__ = ["Mamba2State"]

_INT64_MAX = (1 << 63) - 1


def _restore_mamba2_state(
    batch_size,
    n_heads,
    head_dim,
    d_state,
    n_groups,
    conv_dim,
    conv_kernel,
    fingerprint,
    conv_window,
    h,
    row_tokens,
):
    """Unpickle a Mamba2State (the arguments of ``Mamba2State.__reduce__``)."""
    return Mamba2State._make(
        PRIVATE_TOKEN,
        batch_size=batch_size,
        n_heads=n_heads,
        head_dim=head_dim,
        d_state=d_state,
        n_groups=n_groups,
        conv_dim=conv_dim,
        conv_kernel=conv_kernel,
        fingerprint=fingerprint,
        conv_window=conv_window,
        h=h,
        row_tokens=row_tokens,
    )


class Mamba2State(StateBase):
    """Conv window and SSM state of one :class:`Mamba2BlockInference` for a batch of sequences.

    Made only by :meth:`Mamba2BlockInference.allocate_state`; calling the class directly raises
    TypeError. The buffers are exactly HF's ``Mamba2Cache`` of one layer (``conv_states``,
    ``ssm_states``), always current after each call, with a constant size whatever the number
    of tokens consumed.

    Attributes
    ----------
    batch_size : int
        Rows (B).
    n_heads, head_dim, d_state, n_groups, conv_dim, conv_kernel : int
        Sizes of the allocating block (read-only).
    conv_window : ndarray of shape (batch_size, conv_dim, conv_kernel), dtype float32
        The last ``conv_kernel`` pre-conv xBC vectors of each row, oldest in column 0, newest
        in column ``conv_kernel - 1`` (HF ``conv_states`` layout); the next token reads columns
        ``1 .. conv_kernel - 1``. All +0.0 in a fresh state.
    h : ndarray of shape (batch_size, n_heads, head_dim, d_state), dtype float32
        The SSM state after each row's last token (HF ``ssm_states`` layout).
    row_tokens : ndarray of shape (batch_size,), dtype int64
        Tokens consumed per row; bookkeeping only (the math never reads it), must stay >= 0.
    fingerprint : str
        Fingerprint of the allocating block; a block refuses a state with another fingerprint.

    Notes
    -----
    Contents of ``conv_window``, ``h`` and ``row_tokens`` may be read and written in place
    (``state.h[b] = h0`` supplies an initial state, HF ``initial_states``, at any point of a
    sequence); the attributes themselves cannot be rebound (AttributeError). A call checks
    what it reads of every row it advances (``lengths[b] > 0``) for finiteness:
    ``conv_window[b, :, 1:]`` and ``h[b]``. Column 0 is never read (it leaves the window
    unread) and idle rows are left untouched. Every call (and ``reset``) first re-checks that
    the three arrays keep their dtype and shape, are C-contiguous and writable and share no
    memory (ValueError before anything is written otherwise). A state serves one call at a
    time; a second concurrent call raises RuntimeError. States pickle and deep-copy under the
    state's lock (a copy taken during another thread's call waits for it, SPEC.md 2.6); a
    restored state works with any block of the same fingerprint.

    Examples
    --------
    >>> st = blk.allocate_state(2)                              # doctest: +SKIP
    >>> y = blk.forward(x, st); st.row_tokens                  # doctest: +SKIP
    array([5, 5])
    """

    __slots__ = (
        "batch_size",
        "n_heads",
        "head_dim",
        "d_state",
        "n_groups",
        "conv_dim",
        "conv_kernel",
        "conv_window",
        "h",
    )
    _MADE_BY = "Mamba2BlockInference.allocate_state(batch_size)"
    _BUFFERS = ("conv_window", "h")
    _ASSIGN_HINT = "write into the arrays instead (e.g. state.h[0] = h0, state.row_tokens[:] = 0)"
    _PICKLED = (
        "batch_size",
        "n_heads",
        "head_dim",
        "d_state",
        "n_groups",
        "conv_dim",
        "conv_kernel",
        "fingerprint",
        "conv_window",
        "h",
        "row_tokens",
    )
    _restore = staticmethod(_restore_mamba2_state)

    @classmethod
    def _make(
        cls,
        token,
        *,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        conv_dim: int,
        conv_kernel: int,
        fingerprint: str,
        conv_window=None,
        h=None,
        row_tokens=None,
    ):
        self = cls._new(
            token,
            fingerprint,
            row_tokens,
            batch_size=batch_size,
            n_heads=n_heads,
            head_dim=head_dim,
            d_state=d_state,
            n_groups=n_groups,
            conv_dim=conv_dim,
            conv_kernel=conv_kernel,
        )
        shapes = self._buffer_shapes()
        object.__setattr__(
            self, "conv_window", self._buffer(conv_window, shapes["conv_window"], np.float32)
        )
        object.__setattr__(self, "h", self._buffer(h, shapes["h"], np.float32))
        return self

    def _buffer_shapes(self) -> dict:
        b = self.batch_size
        return {
            "conv_window": (b, self.conv_dim, self.conv_kernel),
            "h": (b, self.n_heads, self.head_dim, self.d_state),
        }

    def reset(self, rows=None) -> None:
        """Zero ``conv_window`` and ``h`` of the given rows and set their ``row_tokens`` to 0.

        Mutates the state; for reusing a batch slot in continuous batching (a row that has been
        reset continues exactly like a fresh sequence).

        Parameters
        ----------
        rows : None, int or sequence of int, default=None
            The rows to clear (all rows when None).

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
        self._reset(rows, "Mamba2State.reset")

    def __repr__(self) -> str:
        return (
            f"Mamba2State(batch_size={self.batch_size}, n_heads={self.n_heads}, "
            f"head_dim={self.head_dim}, d_state={self.d_state}, n_groups={self.n_groups}, "
            f"conv_dim={self.conv_dim}, conv_kernel={self.conv_kernel}, "
            f"row_tokens={self.row_tokens.tolist()})"
        )


def _state_type_error(where: str, state) -> TypeError:
    return TypeError(
        f"{where}: state must be a Mamba2State from this block's "
        f"allocate_state(batch_size); got {describe_type(state)}"
    )


def _check_counters(state: Mamba2State, lens: np.ndarray, where: str) -> np.ndarray:
    """Re-check the state's buffers, then return a copy of row_tokens, each >= 0 and with room
    for this call's tokens in int64 (called under the state's lock, before anything is
    written)."""
    state._check_buffers(where)  # dtype, shape, C order, writable, no aliasing
    start = np.array(state.row_tokens, dtype=np.int64, copy=True)
    for b in range(start.shape[0]):
        held, n = int(start[b]), int(lens[b])
        if held < 0:
            raise ValueError(f"{where}: state.row_tokens[{b}]={held} must be >= 0")
        if n and held > _INT64_MAX - n:
            raise ValueError(f"{where}: state.row_tokens[{b}]={held} + {n} tokens overflows int64")
    return start


def _check_finite(state: Mamba2State, lens: np.ndarray, where: str) -> None:
    """SPEC 2.4: what a call reads of each advancing row must be finite: ``conv_window[b, :,
    1:]`` (the first token's conv reads columns 1 .. K-1; column 0, the oldest input, leaves
    the window unread) and ``h[b]``. One native pass over all advancing rows of each buffer;
    only when it sees a NaN/inf somewhere (column 0 included) does the exact per-row check run,
    which names the first offending element (rows in order, conv_window before h) or finds
    that only column 0 holds one."""
    rows = np.flatnonzero(np.asarray(lens) > 0).astype(np.int64)
    if rows.size == 0:
        return
    core = _ext.core()
    if (
        core.first_nonfinite_rows(state.conv_window, rows) is None
        and core.first_nonfinite_rows(state.h, rows) is None
    ):
        return
    for b in rows.tolist():
        cols = state.conv_window[b, :, 1:]
        if cols.size:
            check_finite(cols, "state.conv_window", where, index_base=(b,), index_offset=(0, 1))
        check_finite(state.h[b], "state.h", where, index_base=(b,))
