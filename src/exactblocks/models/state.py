"""The caller-owned state of a whole model: every layer's state in one object.

What lives here: :class:`ModelState` (made by ``Model.allocate_state``; its native lock, undo
log and the rows a failed call on another thread left inconsistent). What does not: the
model's calls (``exactblocks.models.model``).
"""

from __future__ import annotations

import numpy as np

from .._weights import LazyFingerprint, fingerprint_value

__all__ = ["ModelState"]

# The token that makes a ModelState (or a Model) from inside the package only.
_PRIVATE = object()


# -- states -----------------------------------------------------------------------------------


class ModelState:
    """Every layer's state of one :class:`Model` for a batch of sequences.

    Made only by :meth:`Model.allocate_state`; calling the class raises TypeError. Caller-owned:
    the model keeps nothing between calls, so one model serves any number of states.

    Attributes
    ----------
    layers : tuple
        One state per block, in order (``TransformerState`` or ``Mamba2State``); their buffers
        are the KV caches / conv windows and SSM states themselves.
    batch_size : int
    max_tokens : int or None
        Positions each row may hold (None for a Mamba-2 model: its state has a constant size).
    fingerprint : str
        The allocating model's fingerprint; another model refuses the state.

    Notes
    -----
    The state serves one call at a time through a native lock (RuntimeError when busy). A call
    made on the main thread (the one where signal handlers raise) is atomic over all layers and
    the head (SPEC.md 2.5): it completes, or it raises and every layer's buffers and counters
    are exactly as before, whatever the failure (KeyboardInterrupt or an exception raised by a
    signal handler at any point, a non-finite value arising in a late layer, a MemoryError).
    For that each layer saves what it overwrites into the state's undo log (the call's new K/V
    slots, a copy of each advancing Mamba-2 row's conv window and SSM state), which the lock's
    transaction rolls back or forgets when the call ends. On another thread nothing can be
    raised into a call between bytecodes, so nothing is saved there; if such a call fails
    after the first layer has written (only a non-finite value arising in a later layer or a
    MemoryError can cause that), the rows it advanced are marked inconsistent and refused until
    :meth:`reset` clears them. ``copy.copy`` / ``copy.deepcopy`` and pickling copy every buffer
    under the lock; taken while another thread's call runs, they wait for it (SPEC.md 2.6).
    """

    __slots__ = ("layers", "batch_size", "max_tokens", "_fingerprint", "_lock", "_undo", "_broken")

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "ModelState: states are made by Model.allocate_state(batch_size, max_tokens), not "
            "by calling the class"
        )

    @classmethod
    def _make(cls, token, layers, batch_size, max_tokens, fingerprint, broken=()):
        if token is not _PRIVATE:
            raise TypeError("ModelState: states are made by Model.allocate_state")
        from exactblocks import _ext

        core = _ext.core()
        self = object.__new__(cls)
        s = object.__setattr__
        s(self, "layers", tuple(layers))
        s(self, "batch_size", int(batch_size))
        s(self, "max_tokens", None if max_tokens is None else int(max_tokens))
        if not isinstance(fingerprint, LazyFingerprint):  # the model's object, or a str
            fingerprint = str(fingerprint)
        s(self, "_fingerprint", fingerprint)
        # `with _lock.transaction(msg, _undo):` a model call (RuntimeError when busy; rolls the
        # layers back on any exception); `with _lock.claim(msg):` reset; `with _lock.hold(...)`
        # snapshots. Entered and left natively: no exception can leak the lock.
        s(self, "_lock", core.StateLock())
        s(self, "_undo", core.UndoLog())
        s(self, "_broken", set(broken))  # rows left inconsistent by a failed call (see Notes)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"ModelState: attribute {name!r} cannot be assigned")

    @property
    def fingerprint(self) -> str:
        """str: The allocating model's fingerprint (32 hexadecimal digits)."""
        return fingerprint_value(self._fingerprint)

    @property
    def row_tokens(self) -> np.ndarray:
        """ndarray of shape (batch_size,), int64: positions held per row (a copy)."""
        return np.array(self.layers[0].row_tokens, dtype=np.int64, copy=True)

    def reset(self, rows=None) -> None:
        """Empty rows (all by default) of every layer's state, freeing their batch slots.

        Parameters
        ----------
        rows : None, int or sequence of int, default=None
            Rows to clear; None = all.

        Raises
        ------
        TypeError, ValueError
            As the layers' ``reset`` (a row outside [0, batch_size)); nothing changes then.
        RuntimeError
            The state (or one of its layers) is in use by a call; or some rows are given of a
            state that a call of another thread held when the process forked.

        Notes
        -----
        Every layer's rows are zeroed in one native step: an exception (Ctrl-C) leaves all
        layers reset or none. A reset of every row also makes usable again a state that a call
        of another thread held when the process forked (its contents were undefined in the
        child; SPEC.md 2.6).
        """
        from exactblocks import _ext
        from exactblocks._state import check_rows

        where = "ModelState.reset"
        idx = np.array(check_rows(rows, self.batch_size, where), dtype=np.int64)
        busy = f"{where}: the state is in use by another call"
        # a reset of every row also makes a state held by a call at a fork usable (SPEC 2.6)
        all_rows = len(set(idx.tolist())) == self.batch_size
        with self._lock.reset_claim(busy, all_rows):
            layers = []
            for st in self.layers:
                st._check_buffers(where)
                a, b = (getattr(st, name) for name in st._BUFFERS)
                layers.append((st._lock, a, b, st.row_tokens))
            _ext.core().reset_layers(layers, idx, busy)
            self._broken.difference_update(int(r) for r in idx)

    def _copy_layers(self, where: str) -> tuple:
        """Copies of every layer and the inconsistent rows, taken under the state's lock (a
        running call of another thread finishes first; RuntimeError when this thread's own call
        holds it)."""
        import copy

        from exactblocks._state import SNAPSHOT_TIMEOUT

        with self._lock.hold(where, SNAPSHOT_TIMEOUT):
            return tuple(copy.copy(st) for st in self.layers), sorted(self._broken)

    def __reduce__(self):
        layers, broken = self._copy_layers("ModelState (pickle or copy)")
        return (
            _restore_model_state,
            (layers, self.batch_size, self.max_tokens, self.fingerprint, broken),
        )

    def __copy__(self):
        layers, broken = self._copy_layers("ModelState (copy)")
        # the model's own fingerprint object: the copy is recognised by identity, and a
        # fingerprint not yet computed stays so
        return ModelState._make(
            _PRIVATE, layers, self.batch_size, self.max_tokens, self._fingerprint, broken
        )

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __repr__(self) -> str:
        return (
            f"ModelState(batch_size={self.batch_size}, max_tokens={self.max_tokens}, "
            f"layers={len(self.layers)}, row_tokens={self.row_tokens.tolist()})"
        )


def _restore_model_state(layers, batch_size, max_tokens, fingerprint, broken=()):
    return ModelState._make(_PRIVATE, layers, batch_size, max_tokens, fingerprint, broken)
