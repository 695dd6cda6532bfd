"""Output checks and the run's record of them.

Here: the peer agreement tolerance :data:`ROW_RTOL`, the comparisons (bit for bit, per-row
relative error, where two arrays first differ) and :class:`Recorder`, which collects every
check and note of a run and logs them. Not here: which outputs are compared (the run modules)
and what a failed check does to the timings (a failed peer or case is not timed: the run
modules decide).
"""

from __future__ import annotations

import math
import sys

import numpy as np

__all__ = ["ROW_RTOL", "Recorder", "bits_equal", "first_diff", "row_rel_err"]

#: Peer agreement tolerance: per row ``||y_peer - y_eb||_2 / ||y_eb||_2`` (SPEC.md 4.6, 7.5).
#: Read at check time (``checks.ROW_RTOL``), so a test may lower it.
ROW_RTOL = 2e-4


def row_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Largest per-row relative error ``||got - want||_2 / ||want||_2`` (float64 sums).

    Parameters
    ----------
    got, want : ndarray of shape (..., d), float32
        Rows along the last axis.

    Returns
    -------
    float
        Max over rows; ``inf`` when shapes differ or ``got`` is not finite.
    """
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return math.inf
    num = np.linalg.norm((got - want).reshape(-1, want.shape[-1]), axis=1)
    den = np.linalg.norm(want.reshape(-1, want.shape[-1]), axis=1)
    return float((num / np.maximum(den, 1e-30)).max()) if num.size else 0.0


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 arrays have the same shape and the same bits (``-0.0 != +0.0``).

    Parameters
    ----------
    a, b : array_like of float32

    Returns
    -------
    bool

    Examples
    --------
    >>> bits_equal(np.zeros(2, np.float32), np.array([0.0, -0.0], np.float32))
    False
    """
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def first_diff(a: np.ndarray, b: np.ndarray) -> str:
    """Where two float32 arrays first differ, for a failed check's detail.

    Parameters
    ----------
    a, b : ndarray of float32
        Arrays that are not bit for bit equal (:func:`bits_equal` is False).

    Returns
    -------
    str
        The first differing index (C order) and both values, or the two shapes.

    Examples
    --------
    >>> first_diff(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    'shape (2, 3) vs (3, 2)'
    """
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    idx = tuple(int(i) for i in np.argwhere(a.view(np.uint32) != b.view(np.uint32))[0])
    return f"first difference at {idx}: {a[idx]!r} vs {b[idx]!r}"


class Recorder:
    """Collects the checks and notes of one run.

    Parameters
    ----------
    verbose : bool
        Log every check, note and progress line on stderr.

    Attributes
    ----------
    checks : list of dict
        One dict per check: workload, case, peer, what, ok, detail.
    notes : list of str
        Notes for the report, each once, in the order made.
    """

    def __init__(self, verbose: bool):
        self.checks: list[dict] = []
        self.notes: list[str] = []
        self.verbose = verbose

    def check(self, workload: str, case: str, peer: str, what: str, ok: bool, detail: str) -> bool:
        """Record one check and return ``ok`` (as a bool).

        Parameters
        ----------
        workload, case, peer : str
            What was checked (``case`` is ``"-"`` for a peer that failed to run at all).
        what : str
            The claim checked, as the report states it.
        ok : bool
            Whether it held.
        detail : str
            Evidence: "equal", the largest error, or the first difference.

        Returns
        -------
        bool
        """
        self.checks.append(
            dict(workload=workload, case=case, peer=peer, what=what, ok=bool(ok), detail=detail)
        )
        self.log(f"  check {'ok  ' if ok else 'FAIL'} {workload} {case} {peer}: {what} ({detail})")
        return bool(ok)

    def note(self, text: str) -> None:
        """Record a note for the report (once) and log it."""
        if text not in self.notes:
            self.notes.append(text)
        self.log(f"  note: {text}")

    def log(self, text: str) -> None:
        """Print ``text`` on stderr when verbose."""
        if self.verbose:
            print(text, file=sys.stderr, flush=True)
