"""How samples are taken: the samplers, the interleaved rounds and the per-call measurement.

Here: :class:`Measurement`, the number of rounds (:func:`n_repeats`), the decode loop
(:func:`run_decode`), the prefill and decode sample functions and :func:`time_interleaved`,
which takes one sample of every peer per round so that a slow spell of a shared machine hits
every peer alike. Not here: what is checked before timing, or what the peers are.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .numpy_peer import NumpyPeer

__all__ = [
    "MEASURE_BUDGET_S",
    "MIN_REPEATS",
    "Measurement",
    "decode_sampler",
    "median",
    "n_repeats",
    "prefill_sampler",
    "run_decode",
    "time_interleaved",
]

MEASURE_BUDGET_S = 4.0  # default repeats shrink so that one measurement takes about this long
MIN_REPEATS = 3


def median(xs: Sequence[float]) -> float:
    """Median of ``xs`` as a float; NaN when empty.

    Examples
    --------
    >>> median([3.0, 1.0, 2.0]), median([])
    (2.0, nan)
    """
    return float(statistics.median(xs)) if xs else math.nan


@dataclass
class Measurement:
    """Timing of one (workload, case, peer).

    Attributes
    ----------
    seconds : float
        Median seconds per call (per step for decode).
    tokens : int
        Real tokens per call (``B`` for a decode step).
    samples : list of float
        Every timed sample, seconds.
    cpu_util : float
        Process CPU time / wall time over the samples (about the threads kept busy).
    """

    seconds: float
    tokens: int
    samples: list = field(default_factory=list)
    cpu_util: float = math.nan

    @property
    def tokens_per_s(self) -> float:
        """Real tokens per second."""
        return self.tokens / self.seconds

    def as_dict(self) -> dict:
        """JSON-ready dict with the derived rates."""
        d = asdict(self)
        d.update(
            ms_per_call=1e3 * self.seconds,
            ms_per_token=1e3 * self.seconds / self.tokens,
            tokens_per_s=self.tokens_per_s,
        )
        return d


def n_repeats(t_warm: float, opts: dict) -> int:
    """Rounds of one measurement.

    Parameters
    ----------
    t_warm : float
        Seconds of one untimed (warm-up) sample.
    opts : dict
        ``{"repeats": int, "repeats_explicit": bool}`` of the run.

    Returns
    -------
    int
        ``opts["repeats"]`` when given explicitly; else as many as fit in
        ``MEASURE_BUDGET_S``, between ``min(MIN_REPEATS, repeats)`` and ``repeats``.

    Examples
    --------
    >>> n_repeats(2.0, {"repeats": 5, "repeats_explicit": False})
    3
    >>> n_repeats(2.0, {"repeats": 5, "repeats_explicit": True})
    5
    """
    if opts["repeats_explicit"]:
        return opts["repeats"]
    fit = int(MEASURE_BUDGET_S / max(t_warm, 1e-9))
    return max(min(MIN_REPEATS, opts["repeats"]), min(opts["repeats"], fit))


def run_decode(peer, snap, xs: np.ndarray, warm: int = 0) -> tuple[np.ndarray, list[float], float]:
    """Decode ``len(xs)`` consecutive steps from a copy of ``snap``.

    Parameters
    ----------
    peer : peer adapter
        See :mod:`benchmarks.peers`.
    snap : state
        The peer's state to start from; it is cloned (untimed), never advanced.
    xs : ndarray of shape (K, B, d), float32
        The tokens of the K steps.
    warm : int, default=0
        Steps at the start that are run but not timed.

    Returns
    -------
    outputs : ndarray of shape (K, B, d), float32
    times : list of float
        Seconds of each step from step ``warm`` on.
    cpu : float
        This process's CPU seconds over those steps.
    """
    st = peer.clone(snap)
    outs, times, cpu = [], [], 0.0
    for t in range(xs.shape[0]):
        fn = peer.make_step(st, xs[t])
        c0, t0 = time.process_time(), time.perf_counter()
        y = fn()
        dt = time.perf_counter() - t0
        if t >= warm:
            times.append(dt)
            cpu += time.process_time() - c0
        outs.append(np.array(y, dtype=np.float32, copy=True))
    return np.stack(outs), times, cpu


def prefill_sampler(fn):
    """One untimed, then one timed prefill call.

    Parameters
    ----------
    fn : callable
        The prefill call (a peer's ``make_prefill``).

    Returns
    -------
    callable
        ``sample() -> ([seconds], cpu seconds)`` for :func:`time_interleaved`.

    Notes
    -----
    The untimed call first, as for decode (:func:`decode_sampler`): right after another peer
    has run (mojolearn most of all), the next ~0.1 s of any peer's calls run up to 1.3x slower
    (measured: a SmolLM2 layer's prefill takes 22 instead of 17 ms for its first few calls).
    Each peer is thus timed warm, as when it serves requests back to back."""

    def sample():
        fn()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return [time.perf_counter() - t0], time.process_time() - c0

    return sample


def decode_sampler(peer, snap, xs: np.ndarray, warm: int):
    """``len(xs)`` consecutive decode steps from a copy of ``snap``, the first ``warm`` untimed.

    Parameters
    ----------
    peer, snap, xs, warm
        As for :func:`run_decode`.

    Returns
    -------
    callable
        ``sample() -> (seconds of each timed step, their cpu seconds)``.

    Notes
    -----
    The steady state of a decode loop is what a serving loop sees, so the first steps are not
    counted: the peer timed just before (and the state copy) has evicted this peer's weights
    from the caches, and a decode step, unlike a prefill, is short enough for that refill to
    dominate it. Measured on the SmolLM2 layer at B=8 (benchmarks/decode_steps.py: each step's
    median over 7 repeats), our steps took 1.05, 0.75, 0.68, 0.64, 0.67, 0.59, then about
    0.57 ms; torch sdpa's 2.5, 2.3, 2.0, 2.1, then about 1.85 ms. Every peer is timed alike."""

    def sample():
        _, times, cpu = run_decode(peer, snap, xs, warm)
        return times, cpu

    return sample


def time_interleaved(jobs: dict, opts: dict, rec, workload: str, case: str) -> dict:
    """Time every peer of one case in rounds.

    Each round takes one sample of each peer in turn (after a short pause that lets the
    previous peer's worker threads go idle), so all peers see the same machine. Every peer gets
    the same number of rounds, the least any peer's budget allows (at least MIN_REPEATS); a
    peer that fails is reported, not fatal (exactblocks' failure is raised).

    Parameters
    ----------
    jobs : dict
        ``{peer: (sample function, warm-up seconds, tokens per call)}``.
    opts : dict
        The run's repeats (see :func:`n_repeats`).
    rec : benchmarks.checks.Recorder
        Gets a failed check ("runs") for a peer that raises, a note for NumPy.
    workload, case : str
        For those records.

    Returns
    -------
    dict
        ``{peer: Measurement or "error: <exception type>"}``.
    """
    if not jobs:
        return {}
    n = min(n_repeats(t_w, opts) for _, t_w, _ in jobs.values())
    samples = {p: [] for p in jobs}
    cpu = {p: 0.0 for p in jobs}
    out: dict = {}
    for _ in range(n):
        for pname, (sample, _, _) in jobs.items():
            if pname in out:
                continue
            time.sleep(0.05)
            try:
                ts, c = sample()
            except Exception as exc:  # noqa: BLE001
                if pname == "exactblocks":
                    raise
                if pname == NumpyPeer.name:  # the ceiling is context, not a check
                    rec.note(f"{workload} {case}: NumPy matmuls not measured: {exc}")
                else:
                    rec.check(workload, case, pname, "runs", False, repr(exc))
                out[pname] = f"error: {type(exc).__name__}"
                continue
            samples[pname] += ts
            cpu[pname] += c
    for pname, (_, _, tokens) in jobs.items():
        if pname not in out:
            out[pname] = Measurement(
                median(samples[pname]), tokens, samples[pname], cpu[pname] / sum(samples[pname])
            )
    return out
