"""What both state classes share: private construction, read-only attributes, the lock, reset,
buffer checks, copying.

A block holds only weights and options; everything a sequence accumulates lives in a state
object made by the block's ``allocate_state``. States expose their buffers as plain NumPy arrays
(readable and writable in place, attributes not rebindable), carry the fingerprint of the block
that made them, and serve one call at a time (a per-state lock). What lives here:
:class:`StateBase` and the private token that only ``allocate_state`` and unpickling pass. What
does not: a particular state's buffers, ``repr`` and call-time checks
(``transformer/state.py``, ``mamba2/state.py``), and any arithmetic.
"""

from __future__ import annotations

import numpy as np

from . import _ext
from ._validation import check_int, check_state_buffers
from ._weights import LazyFingerprint, fingerprint_value

__all__ = ["SNAPSHOT_TIMEOUT", "StateBase"]

# Passed by the blocks' allocate_state (and unpickling) only; any other construction raises.
PRIVATE_TOKEN = object()

# Seconds a snapshot (pickle, copy, keys, values) waits for a running call of another thread to
# finish before it raises RuntimeError (SPEC.md 2.6).
SNAPSHOT_TIMEOUT = 60.0


class StateBase:
    """Base of TransformerState and Mamba2State (no public members of its own).

    A subclass sets ``_MADE_BY`` (the allocating call, for messages), ``_BUFFERS`` (its float32
    buffers besides ``row_tokens``), ``_ASSIGN_HINT`` (the end of the can't-assign message),
    ``_PICKLED`` (the attributes passed, in order, to its ``_restore`` staticmethod) and
    ``_buffer_shapes()``.
    """

    __slots__ = ("row_tokens", "_fingerprint", "_lock", "__weakref__")
    _MADE_BY = ""
    _BUFFERS: tuple[str, ...] = ()
    _ASSIGN_HINT = ""
    _SETTABLE: tuple[str, ...] = ()  # attributes whose property setter may be used
    _PICKLED: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        raise TypeError(
            f"{type(self).__name__}: states are made by {self._MADE_BY}, not by calling the class"
        )

    # -- construction (allocate_state and unpickling only) ------------------------------------
    @classmethod
    def _new(cls, token, fingerprint, row_tokens=None, **ints):
        """Return a state with its lock, ``row_tokens``, fingerprint and the given int attributes
        (``batch_size`` among them); the subclass then sets its buffers. ``fingerprint`` is a
        str (unpickling) or the allocating block's
        :class:`~exactblocks._weights.LazyFingerprint`, kept as it is so that the block
        recognises its state without computing the digest."""
        if token is not PRIVATE_TOKEN:
            raise TypeError(f"{cls.__name__}: states are made by {cls._MADE_BY}")
        self = object.__new__(cls)
        for name, v in ints.items():
            object.__setattr__(self, name, int(v))
        object.__setattr__(
            self, "row_tokens", cls._buffer(row_tokens, (self.batch_size,), np.int64)
        )
        if not isinstance(fingerprint, LazyFingerprint):
            fingerprint = str(fingerprint)
        object.__setattr__(self, "_fingerprint", fingerprint)
        # The native lock: `with state._lock.claim(msg)` (calls, reset: refuse when busy) and
        # `with state._lock.hold(where, timeout)` (snapshots: wait, bounded). Its __enter__ and
        # __exit__ are native, so no exception raised by a signal handler can leak it.
        object.__setattr__(self, "_lock", _ext.core().StateLock())
        return self

    @staticmethod
    def _buffer(value, shape: tuple, dtype) -> np.ndarray:
        """Zeros of ``shape``, or a private C-contiguous copy of ``value`` reshaped to it."""
        if value is None:
            return np.zeros(shape, dtype)
        return np.array(value, dtype=dtype, order="C", copy=True).reshape(shape)

    def _buffer_shapes(self) -> dict:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """str: Fingerprint of the allocating block (32 hexadecimal digits)."""
        return fingerprint_value(self._fingerprint)

    # -- read-only attributes -----------------------------------------------------------------
    def __setattr__(self, name, value):
        if name in self._SETTABLE:
            object.__setattr__(self, name, value)  # the property's setter
            return
        raise AttributeError(
            f"{type(self).__name__}: attribute {name!r} cannot be assigned; {self._ASSIGN_HINT}"
        )

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__}: attribute {name!r} cannot be deleted")

    # -- pickling and copying -----------------------------------------------------------------
    def _snapshot(self, where: str):
        """``with self._snapshot(where):`` the state's lock, waiting up to SNAPSHOT_TIMEOUT
        seconds for a running call of another thread (RuntimeError naming ``where`` then, or at
        once when this thread itself is inside a call on the state)."""
        return self._lock.hold(where, SNAPSHOT_TIMEOUT)

    def _snapshot_args(self, *, pickling: bool) -> tuple:
        # Copies taken under the lock: the pickler reads what __reduce__ returns after it
        # returns, and a call of another thread must not write into it meanwhile. A copy in
        # this process keeps the fingerprint object (nothing computed); a pickle holds its str.
        with self._snapshot(f"{type(self).__name__} (pickle or copy)"):
            return tuple(
                np.array(v, copy=True) if isinstance(v, np.ndarray) else v
                for v in (
                    getattr(self, "_fingerprint" if n == "fingerprint" and not pickling else n)
                    for n in self._PICKLED
                )
            )

    def __reduce__(self):
        return (type(self)._restore, self._snapshot_args(pickling=True))

    def __copy__(self):
        return type(self)._restore(*self._snapshot_args(pickling=False))

    def __deepcopy__(self, memo):
        return self.__copy__()

    # -- checks and reset ---------------------------------------------------------------------
    def _check_buffers(self, where: str) -> None:
        """Raise ValueError unless every buffer and row_tokens is intact (see
        :func:`exactblocks._validation.check_state_buffers`)."""
        check_state_buffers(
            [
                (f"state.{name}", getattr(self, name), shape, np.float32)
                for name, shape in self._buffer_shapes().items()
            ]
            + [("state.row_tokens", self.row_tokens, (self.batch_size,), np.int64)],
            where,
        )

    def _reset(self, rows, where: str) -> None:
        """A state's ``reset``: zero the buffers and ``row_tokens`` of ``rows`` (all when None),
        under the state's lock and after re-checking its buffers, in one native step; nothing
        is written when a check fails or an exception interrupts it."""
        idx = np.array(check_rows(rows, self.batch_size, where), dtype=np.int64)
        # a reset of every row also makes a state held by a call at a fork usable (SPEC 2.6)
        all_rows = len(set(idx.tolist())) == self.batch_size
        with self._lock.reset_claim(f"{where}: state is in use by another call", all_rows):
            self._check_buffers(where)
            a, b = (getattr(self, name) for name in self._BUFFERS)
            # One native step: an interrupt cannot leave some buffers zeroed and others not.
            _ext.core().reset_rows(a, b, self.row_tokens, idx)


def check_rows(rows, batch: int, where: str) -> list[int]:
    """``reset``'s ``rows`` argument as a list of row indices in [0, batch)."""
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
