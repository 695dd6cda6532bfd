"""Caller-owned state of a Mamba-2 block: Mamba2State (conv window and SSM state per row).

What lives here: the state object made by :meth:`Mamba2BlockInference.allocate_state`, its
buffers (plain NumPy arrays, writable in place, attributes not rebindable), its fingerprint,
``reset`` and pickling. What does not: any arithmetic, and the call-time checks of the buffers
(``mamba2.py``). The lock and the private constructor token follow ``TransformerState``
(``state.py``).
"""

from __future__ import annotations

import threading

import numpy as np

from ._validation import check_state_buffers, describe_type
from .state import _PRIVATE, _reset_rows

__all__ = ["Mamba2State"]

_MADE_BY = "Mamba2BlockInference.allocate_state(batch_size)"


class Mamba2State:
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
    time; a second concurrent call raises RuntimeError. States pickle and deep-copy; a restored
    state works with any block of the same fingerprint.

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
        "row_tokens",
        "fingerprint",
        "_lock",
        "__weakref__",
    )

    def __init__(self, *args, **kwargs):
        raise TypeError(f"Mamba2State: states are made by {_MADE_BY}, not by calling the class")

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
        if token is not _PRIVATE:
            raise TypeError(f"Mamba2State: states are made by {_MADE_BY}")
        self = object.__new__(cls)
        cw_shape = (batch_size, conv_dim, conv_kernel)
        h_shape = (batch_size, n_heads, head_dim, d_state)
        s = object.__setattr__
        for name, v in (
            ("batch_size", batch_size),
            ("n_heads", n_heads),
            ("head_dim", head_dim),
            ("d_state", d_state),
            ("n_groups", n_groups),
            ("conv_dim", conv_dim),
            ("conv_kernel", conv_kernel),
        ):
            s(self, name, int(v))
        s(
            self,
            "conv_window",
            np.zeros(cw_shape, np.float32)
            if conv_window is None
            else np.array(conv_window, dtype=np.float32, order="C", copy=True).reshape(cw_shape),
        )
        s(
            self,
            "h",
            np.zeros(h_shape, np.float32)
            if h is None
            else np.array(h, dtype=np.float32, order="C", copy=True).reshape(h_shape),
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
        return self

    def __setattr__(self, name, value):
        raise AttributeError(
            f"Mamba2State: attribute {name!r} cannot be assigned; write into "
            "the arrays instead (e.g. state.h[0] = h0, state.row_tokens[:] = 0)"
        )

    def __delattr__(self, name):
        raise AttributeError(f"Mamba2State: attribute {name!r} cannot be deleted")

    # -- pickling ---------------------------------------------------------------------------
    def __reduce__(self):
        return (
            _restore_mamba2_state,
            (
                self.batch_size,
                self.n_heads,
                self.head_dim,
                self.d_state,
                self.n_groups,
                self.conv_dim,
                self.conv_kernel,
                self.fingerprint,
                self.conv_window,
                self.h,
                self.row_tokens,
            ),
        )

    def __copy__(self):
        fn, args = self.__reduce__()
        return fn(*args)

    def __deepcopy__(self, memo):
        return self.__copy__()

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
            The state is in use by a running call.
        """
        _reset_rows(self, rows, "Mamba2State.reset", ("conv_window", "h"))

    def _check_buffers(self, where: str) -> None:
        """Raise ValueError unless conv_window, h and row_tokens are intact (see
        :func:`exactblocks._validation.check_state_buffers`)."""
        b = self.batch_size
        check_state_buffers(
            [
                (
                    "state.conv_window",
                    self.conv_window,
                    (b, self.conv_dim, self.conv_kernel),
                    np.float32,
                ),
                ("state.h", self.h, (b, self.n_heads, self.head_dim, self.d_state), np.float32),
                ("state.row_tokens", self.row_tokens, (b,), np.int64),
            ],
            where,
        )

    def __repr__(self) -> str:
        return (
            f"Mamba2State(batch_size={self.batch_size}, n_heads={self.n_heads}, "
            f"head_dim={self.head_dim}, d_state={self.d_state}, n_groups={self.n_groups}, "
            f"conv_dim={self.conv_dim}, conv_kernel={self.conv_kernel}, "
            f"row_tokens={self.row_tokens.tolist()})"
        )


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
    return Mamba2State._make(
        _PRIVATE,
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


def _mamba2_state_type_error(where: str, state) -> TypeError:
    return TypeError(
        f"{where}: state must be a Mamba2State from this block's "
        f"allocate_state(batch_size); got {describe_type(state)}"
    )
