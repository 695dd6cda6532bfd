"""TransformerDecodeSession: an exclusive, in-place decode handle on one TransformerState.

The session computes nothing of its own: ``step`` and ``forward`` run the block's own call path
(same checks, same bits, same state updates). Its job is the claim: while it is open, the block
refuses the state from anyone else. It also owns a scratch workspace reused by its calls, so
steps stop allocating once the buffers have their size (SPEC 6). The state keeps only a weak
reference to the session, so a dropped session releases its claim when it is garbage-collected.
What does not live here: the call path (``block.py``) and the state checks (``state.py``).
"""

from __future__ import annotations

import threading

import numpy as np

from .. import _ext
from .state import TransformerState, _check_counters, _check_readable

__all__ = ["TransformerDecodeSession"]

_CLS = "TransformerDecodeSession"
_claim_lock = threading.Lock()


class TransformerDecodeSession:
    """An open decode session of a :class:`TransformerBlockInference` on one state.

    Made only by :meth:`TransformerBlockInference.decode_session`; calling the class directly
    raises TypeError. The session works in place on the state's buffers, so the state is always
    current; ``sync_state`` and ``load_state`` exist for mojolearn compatibility.

    Attributes
    ----------
    state : TransformerState
        The claimed state (read-only attribute).
    is_open : bool
        Whether the claim is held.

    Notes
    -----
    The claim ends at :meth:`close`, at :meth:`discard`, on leaving a ``with`` block (also by an
    exception), or when the session is garbage-collected. On the CPU, a session has no effect on
    results: ``session.step(x)`` is bitwise ``block.step(x, state)`` (SPEC.md 3.1, 6).

    Examples
    --------
    >>> st = blk.allocate_state(2, 32)                          # doctest: +SKIP
    >>> with blk.decode_session(st) as sess:                    # doctest: +SKIP
    ...     y = sess.forward(prompt)
    ...     y1 = sess.step(next_token)
    """

    __slots__ = ("_block", "_state", "_is_open", "_workspace", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError(
            f"{_CLS}: sessions are made by "
            "TransformerBlockInference.decode_session(state), not by calling the "
            "class"
        )

    @classmethod
    def _open_claim(
        cls, block, state: TransformerState, where: str, workspace=None
    ) -> TransformerDecodeSession:
        self = object.__new__(cls)
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_is_open", True)
        # Scratch buffers kept across the session's calls: after the first step, steps of the
        # same batch do not allocate (SPEC 6). The workspace never affects any bit. A caller
        # that runs several sessions strictly one after another (Model.generate: the layers of
        # one model) may give them one workspace: a workspace serves one call at a time.
        if workspace is None:
            workspace = _ext.core().Workspace()
        object.__setattr__(self, "_workspace", workspace)
        with _claim_lock:
            owner = state._open_session()
            if owner is not None:
                raise ValueError(
                    f"{where}: state is claimed by an open decode session {owner!r}; close it first"
                )
            state._set_session(self)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"{_CLS}: attribute {name!r} cannot be assigned")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{_CLS}: a session cannot be pickled; pickle its state instead")

    @property
    def state(self) -> TransformerState:
        """TransformerState: The state this session works on."""
        return self._state

    @property
    def is_open(self) -> bool:
        """bool: Whether the session still holds its claim on the state."""
        return self._is_open

    def close(self) -> None:
        """Release the claim on the state (idempotent).

        Notes
        -----
        Each completed call is already in the state, so closing loses nothing.
        """
        with _claim_lock:
            if self._is_open:
                object.__setattr__(self, "_is_open", False)
                st = self._state
                ref = st._session
                if ref is not None and ref() is self:
                    st._set_session(None)

    def discard(self) -> None:
        """Close the session; nothing to roll back, every completed call is already in the state.

        Notes
        -----
        To undo tokens, lower ``state.row_tokens`` (see :class:`TransformerState`).
        """
        self.close()

    def __enter__(self) -> TransformerDecodeSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def _check_open(self, where: str) -> None:
        if not self._is_open:
            raise ValueError(
                f"{where}: session is closed (state row_tokens="
                f"{self._state.row_tokens.tolist()}); open a new one with "
                "block.decode_session(state)"
            )

    def step(self, x) -> np.ndarray:
        """Advance every row of the state by one token and return the block output.

        Parameters
        ----------
        x : buffer of shape (batch, d_model) or (batch, 1, d_model), dtype float32
            ``batch`` must equal ``state.batch_size``.

        Returns
        -------
        ndarray of shape (batch, 1, d_model), dtype float32
            Bitwise ``block.step(x, state)``.

        Raises
        ------
        ValueError
            The session is closed; or any check of :meth:`TransformerBlockInference.step`.
        TypeError
            As :meth:`TransformerBlockInference.step`.
        RuntimeError
            The state is in use by another call.
        """
        where = f"{_CLS}.step"
        self._check_open(where)
        return self._block._call(x, self._state, None, where, step=True, session=self)

    def forward(self, x, *, lengths=None) -> np.ndarray:
        """Advance each row of the state by its real tokens and return the block output.

        Parameters
        ----------
        x : buffer of shape (batch, n_tokens, d_model), dtype float32
            ``batch`` must equal ``state.batch_size``.
        lengths : None, sequence of int or 1-D integer array, default=None
            Real tokens per row, in [0, n_tokens]; padding is never read.

        Returns
        -------
        ndarray of shape (batch, n_tokens, d_model), dtype float32
            Bitwise ``block.forward(x, state, lengths=lengths)``.

        Raises
        ------
        ValueError
            The session is closed; or any check of :meth:`TransformerBlockInference.forward`.
        TypeError
            As :meth:`TransformerBlockInference.forward`.
        RuntimeError
            The state is in use by another call.
        """
        where = f"{_CLS}.forward"
        self._check_open(where)
        return self._block._call(x, self._state, lengths, where, step=False, session=self)

    def sync_state(self) -> TransformerState:
        """Return the state (always current: the session works in place).

        Returns
        -------
        TransformerState
        """
        return self._state

    def load_state(self) -> TransformerState:
        """Re-validate the state after the caller edited it, and return it.

        Checks that ``row_tokens`` are in ``[0, max_tokens]`` and that the slots the next token
        of each row would read are finite (SPEC.md 5 reading rule).

        Returns
        -------
        TransformerState

        Raises
        ------
        ValueError
            A counter out of range or a non-finite readable slot (buffer, index, value).
        RuntimeError
            The state is in use by another call.
        """
        where = f"{_CLS}.load_state"
        st = self._state
        with st._lock.claim(f"{where}: state is in use by another call"):
            start = _check_counters(st, where)
            _check_readable(
                st,
                start,
                np.ones(st.batch_size, np.int64),
                where,
                reader="read by the session's next step",
            )
        return st

    def __repr__(self) -> str:
        return (
            f"{_CLS}(open={self._is_open}, batch_size={self._state.batch_size}, "
            f"row_tokens={self._state.row_tokens.tolist()})"
        )
