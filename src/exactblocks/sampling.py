"""Seeded token sampling and log-probabilities, shared by every generator.

What lives here: :func:`pick_token` (the next token from float32 logits: greedy, or drawn with a
``numpy.random.Generator`` after temperature, top-k and top-p), :func:`logprobs` and
:func:`token_logprobs` (log-probabilities with the library's own float32 ``exp`` and
``log1p``, the one computation every surface reports). :meth:`exactblocks.Model.generate`, the
serving engine (``exactblocks.serve``) and ``exactblocks.ray.Generate`` all use them (through
``exactblocks.models.generate``), so the same logits, options and generator state give the same
token everywhere. What does not: computing logits (``exactblocks.models``) and the text of new
tokens (:class:`exactblocks.text.Detokenizer`).

Exactness: the probabilities are built from the float32 logits with the library's own float32
``exp`` (``_core.elementwise("exp")``, the same bits on every ISA) and summed in float64 in a
fixed order, and one ``Generator.random()`` draw picks the token, so a seeded generation picks
the same tokens on every machine. The work after the checks and the draw runs in the native
core (``_core.sample_token``, csrc/ops/sample.hpp), GIL released; ``_pick_token_reference`` is
the NumPy implementation of the same steps, which the tests hold it to token for token.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import _ext

__all__ = ["logprobs", "pick_token", "token_logprobs"]

_U16 = np.uint32(0xFFFF)
_SHIFT16 = np.uint32(16)
_SHIFT31 = np.uint32(31)
_SHIFT1 = np.uint32(1)
_ONE = np.uint32(1)


def _descending_order(z: np.ndarray) -> np.ndarray:
    """Indices of float32 ``z`` by value descending, index ascending among equal values.

    The same permutation as ``np.lexsort((np.arange(z.size), -z))`` (and as
    ``np.argsort(-z, kind="stable")``), in about a tenth of the time: a least-significant-digit
    radix sort, two stable passes of NumPy's radix argsort over 16-bit halves of a 32-bit key
    that orders like the value, descending. Stability makes equal keys keep index order.
    """
    # +0.0 turns -0.0 into +0.0 (round to nearest), so the two zeros, equal as numbers, get one
    # key and fall back to index order, as in a comparison sort. No NaN reaches here.
    bits = (z + np.float32(0.0)).view(np.uint32)
    # Descending key: a value with the sign bit clear (>= +0) maps to bits ^ 0x7FFFFFFF (larger
    # value, smaller key, all below 0x80000000); a negative one keeps its bits (more negative,
    # larger magnitude bits, larger key, all at or above 0x80000001).
    key = bits ^ (((bits >> _SHIFT31) - _ONE) >> _SHIFT1)
    order = np.argsort((key & _U16).astype(np.uint16), kind="stable")
    hi = (key >> _SHIFT16).astype(np.uint16)[order]
    return order[np.argsort(hi, kind="stable")]


def _check_logits(logits) -> np.ndarray:
    if not isinstance(logits, np.ndarray):
        raise TypeError(
            f"pick_token: logits must be a numpy.ndarray of float32; got {type(logits).__name__}"
        )
    if logits.dtype != np.float32:
        raise TypeError(f"pick_token: logits has dtype {logits.dtype}; expected float32")
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(
            f"pick_token: logits has shape {logits.shape}; expected (vocab_size,) with "
            "vocab_size >= 1"
        )
    return logits


def _check_args(where, logits, temperature, rng, top_k, top_p):
    """pick_token's argument checks (its Raises), before any work: (logits, temp, top_k, top_p)."""
    logits = _check_logits(logits)
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real):
        raise TypeError(
            f"{where}: temperature must be a real number; got {type(temperature).__name__}"
        )
    temp = float(temperature)
    if not (math.isfinite(temp) and temp >= 0.0):
        raise ValueError(f"{where}: temperature={temp} must be finite and >= 0")
    if top_k is not None:
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"{where}: top_k must be an int or None; got {type(top_k).__name__}")
        top_k = int(top_k)
        if top_k < 1:
            raise ValueError(f"{where}: top_k={top_k} must be >= 1")
    if top_p is not None:
        if isinstance(top_p, (bool, np.bool_)) or not isinstance(top_p, numbers.Real):
            raise TypeError(f"{where}: top_p must be a real number or None; got "
                            f"{type(top_p).__name__}")  # fmt: skip
        top_p = float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"{where}: top_p={top_p} must be in (0, 1]")
    if temp > 0.0:
        if rng is None:
            raise ValueError(f"{where}: temperature={temp} samples: pass rng= (a Generator)")
        if not isinstance(rng, np.random.Generator):
            raise TypeError(
                f"{where}: rng must be a numpy.random.Generator; got {type(rng).__name__}"
            )
    if not np.isfinite(logits).all():
        bad = int(np.flatnonzero(~np.isfinite(logits))[0])
        raise ValueError(
            f"{where}: logits[{bad}]={logits[bad]!r} is not finite (the model's activations "
            "overflowed)"
        )
    return logits, temp, top_k, top_p


def pick_token(logits, *, temperature, rng=None, top_k=None, top_p=None) -> int:
    """Return the next token: the argmax of ``logits``, or a seeded draw from them.

    Parameters
    ----------
    logits : ndarray of shape (vocab_size,), dtype float32
        One position's logits; every value finite. Never written.
    temperature : float
        0 = greedy (argmax, the lowest id on ties); > 0 samples from
        ``softmax(logits / temperature)``.
    rng : numpy.random.Generator or None, default=None
        The generator to draw from (one ``rng.random()`` per sampled token); required when
        temperature > 0, not touched when it is 0.
    top_k : int or None, default=None
        Keep the tokens whose scaled logit is >= the k-th largest (ties kept; HF
        ``TopKLogitsWarper``). None keeps all. Sampling only.
    top_p : float or None, default=None
        In (0, 1]: keep the most probable tokens whose cumulative probability before them is
        < top_p (at least one; HF ``TopPLogitsWarper``). None or 1 keeps all. Sampling only.

    Returns
    -------
    int
        A token id in ``[0, vocab_size)``.

    Raises
    ------
    TypeError
        ``logits`` not a float32 ndarray; ``temperature``, ``top_k`` or ``top_p`` not a
        number of the right kind (bool refused); ``rng`` not a ``numpy.random.Generator``.
    ValueError
        ``logits`` not 1-D or empty, or holding a non-finite value (its index and value: the
        model's activations overflowed); temperature < 0 or non-finite, top_k < 1, top_p
        outside (0, 1]; ``rng`` missing while temperature > 0; a temperature so small that
        ``logits / temperature`` overflows float32 (use 0 for greedy). Nothing is drawn then.

    Notes
    -----
    The token is defined by these steps (what ``Model.generate`` documents):

    1. ``z = logits / float32(temperature)`` in float32 (``z = logits`` when it is 1).
    2. ``order``: the ids by z descending, then id ascending (-0.0 and +0.0 are equal).
    3. top_k: keep the entries of ``order`` whose z is >= the z of its k-th entry.
    4. ``e[j] = exp(z[order[j]] - z[order[0]])`` with the library's float32 exp, widened to
       float64; ``c[j] = e[0] + ... + e[j]``, summed left to right in float64.
    5. top_p < 1: keep the first ``n`` entries, ``n`` = the number of j with
       ``c[j - 1] < top_p * c[-1]`` (``c[-1]`` before it is 0.0 for j = 0), at least 1.
    6. ``u = rng.random() * c[n - 1]``; the token is ``order[i]`` for the first i with
       ``c[i] > u`` (``i = n - 1`` if none).

    Cost: O(vocab_size) in the native core (``_core.sample_token``, csrc/ops/sample.hpp, GIL
    released, so rows sampled on parallel threads run in parallel): ``order`` comes from a
    stable least-significant-digit radix sort of a 32-bit key that orders like z (three
    passes), the exps from the ISA's vectorised ``exp`` (the same bits as the scalar one), and
    the exps of entries more than 110 below ``z[order[0]]`` (exactly +0) are not computed.
    The overflow check runs first, on ``max(logits) / float32(temperature)`` (the division
    never decreases, so that is ``z[order[0]]``), then the one draw, then the native steps.
    The full order of the kept tokens is still needed: a float64 addition
    rounds, a rounding (ties to even above all) depends on the last bit of the running sum and
    so on every earlier term, and ``c[-1]`` scales ``u`` and the top_p threshold. Only terms
    below half an ulp of ``e[0]`` could be left out, and at temperatures near 1 real models
    have almost none.

    Examples
    --------
    >>> import numpy as np
    >>> logits = np.array([1.0, 3.0, 3.0, -2.0], dtype=np.float32)
    >>> pick_token(logits, temperature=0.0)  # argmax, the lowest id on ties
    1
    >>> a = pick_token(logits, temperature=0.8, top_p=0.9, rng=np.random.default_rng(7))
    >>> a == pick_token(logits, temperature=0.8, top_p=0.9, rng=np.random.default_rng(7))
    True
    >>> pick_token(logits, temperature=1.0, top_k=1, rng=np.random.default_rng(0))  # ties kept
    2
    """
    logits, temp, top_k, top_p = _check_args("pick_token", logits, temperature, rng, top_k, top_p)
    if temp == 0.0:
        return int(np.argmax(logits))  # the first maximum: the lowest id on ties
    # z[order[0]] is the largest z, and x -> fl(x / t) never decreases, so it is
    # fl(max(logits) / t): the overflow is refused here, before the draw.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        top = logits.max() if temp == 1.0 else logits.max() / np.float32(temp)
    if not math.isfinite(top):
        raise ValueError(_overflow_message(temp))
    k = 0 if top_k is None or top_k >= logits.size else top_k
    p = 1.0 if top_p is None else top_p
    r = rng.random()
    return int(_ext.core().sample_token(np.ascontiguousarray(logits), temp, k, p, r))


def _overflow_message(temp: float) -> str:
    return (
        f"pick_token: temperature={temp} is too small for these logits: logits / temperature "
        "overflows float32 (use temperature=0 for greedy)"
    )


def _pick_token_reference(logits, *, temperature, rng=None, top_k=None, top_p=None) -> int:
    """:func:`pick_token` computed with NumPy, step by step as its Notes: the tests' twin.

    The same arguments, checks, token and generator use as :func:`pick_token`, whose native
    ``_core.sample_token`` must return the same token for every input (tests/unit/
    test_sampling.py). The order is a radix sort (two stable NumPy argsort passes over 16-bit
    halves of the key), top_k selects the k-th value with ``numpy.partition`` and orders only
    the kept tokens. Parameters, Returns and Raises as :func:`pick_token`.
    """
    logits, temp, top_k, top_p = _check_args("pick_token", logits, temperature, rng, top_k, top_p)
    if temp == 0.0:
        return int(np.argmax(logits))  # the first maximum: the lowest id on ties
    with np.errstate(over="ignore"):  # an overflow is refused below, with its reason
        z = logits if temp == 1.0 else logits / np.float32(temp)
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, z.size - top_k)[z.size - top_k]  # the k-th largest value
        kept = np.flatnonzero(z >= kth)  # ascending ids, ties at the k-th value included
        order = kept[_descending_order(z[kept])]
    else:
        order = _descending_order(z)
    zs = z[order]
    if not math.isfinite(zs[0]):
        raise ValueError(_overflow_message(temp))
    with np.errstate(over="ignore"):  # -3e38 - 3e38 = -inf, whose exp is +0: exact
        e = _ext.core().elementwise("exp", zs - zs[0]).astype(np.float64)
    cum = np.cumsum(e)  # sequential float64 sums, in the order above
    if top_p is not None and top_p < 1.0:
        # c[j-1] < top_p * c[-1] for j = 0 (0.0 < a positive threshold) and for each j >= 1
        n_keep = 1 + int(np.count_nonzero(cum[:-1] < top_p * cum[-1]))
        cum = cum[:n_keep]
    u = rng.random() * cum[-1]
    i = min(int(np.searchsorted(cum, u, side="right")), cum.size - 1)
    return int(order[i])


def _log_sum_exp(row: np.ndarray, elementwise) -> tuple[np.float32, np.float32]:
    """``(max z, log sum exp(z - max z))`` of one float32 row, in the library's arithmetic."""
    top = row.max()  # exact in any order
    with np.errstate(over="ignore"):
        e = elementwise("exp", np.ascontiguousarray(row - top))
    s = np.float32(np.cumsum(e.astype(np.float64))[-1])  # sequential float64 sum, >= 1
    lse = elementwise("log1p", np.asarray([s - np.float32(1.0)], np.float32))[0]
    return top, lse


def token_logprobs(logits, targets) -> np.ndarray:
    """Log-probabilities of ``targets`` under ``logits``, the same bits on every CPU.

    ``log_softmax(z)[t] = (z[t] - max z) - log1p(float32(S) - 1)`` with
    ``S = sum(exp(z - max z))``: the library's float32 ``exp`` and ``log1p`` (identical on every
    ISA) and a sequential float64 sum (``S >= 1``, so ``log S = log1p(S - 1)``), every other
    step a correctly rounded float32 operation.

    Parameters
    ----------
    logits : array-like of shape (n, vocab_size), float32
    targets : array-like of shape (n,), int
        One token id per row of ``logits``.

    Returns
    -------
    ndarray of shape (n,), float32

    Raises
    ------
    ValueError
        Mismatched shapes, or a target outside the vocabulary.

    Examples
    --------
    >>> import numpy as np
    >>> z = np.array([[0.0, 0.0]], np.float32)
    >>> float(token_logprobs(z, [1])[0]) == float(np.float32(-np.log(2.0)))
    True
    """
    logits = np.asarray(logits, np.float32)
    targets = np.asarray(targets, np.int64)
    if logits.ndim != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(
            f"token_logprobs: logits {logits.shape} and targets {targets.shape} do not match; "
            "expected (n, vocab) and (n,)"
        )
    bad = np.flatnonzero((targets < 0) | (targets >= logits.shape[1]))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"token_logprobs: targets[{i}]={int(targets[i])} is outside the vocabulary "
            f"[0, {logits.shape[1]})"
        )
    elementwise = _ext.core().elementwise
    out = np.empty(len(targets), np.float32)
    for i, t in enumerate(targets.tolist()):
        row = logits[i]
        top, lse = _log_sum_exp(row, elementwise)
        out[i] = (row[t] - top) - lse
    return out


def logprobs(logits, token: int, top_logprobs: int = 0):
    """The logprob of ``token`` and the ``top_logprobs`` most likely tokens of one position.

    Parameters
    ----------
    logits : ndarray of shape (vocab_size,), float32
    token : int
        In ``[0, vocab_size)``.
    top_logprobs : int, default=0
        Alternatives to list, >= 0 (0 = none); at most ``vocab_size`` are listed (every
        token when ``top_logprobs >= vocab_size``).

    Returns
    -------
    tuple
        ``(logprob, top)``: ``logprob`` a numpy.float32 (the bits of :func:`token_logprobs`),
        ``top`` None when ``top_logprobs`` is 0, else a list of ``(id, numpy.float32)`` by
        logit descending, then id ascending.

    Raises
    ------
    TypeError
        ``token`` or ``top_logprobs`` not an int (bool refused).
    ValueError
        ``logits`` not one non-empty row, ``token`` outside the vocabulary, ``top_logprobs``
        negative.
    """
    row = np.ascontiguousarray(logits, dtype=np.float32)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"logprobs: logits has shape {row.shape}; expected (vocab_size,)")
    for name, v in (("token", token), ("top_logprobs", top_logprobs)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"logprobs: {name} must be an int; got {type(v).__name__}")
    if not 0 <= token < row.size:
        raise ValueError(f"logprobs: token={int(token)} is outside the vocabulary [0, {row.size})")
    if top_logprobs < 0:
        raise ValueError(f"logprobs: top_logprobs={int(top_logprobs)} must be >= 0")
    top_z, lse = _log_sum_exp(row, _ext.core().elementwise)
    lp = (row[int(token)] - top_z) - lse
    top = None
    k = int(top_logprobs)
    if k:
        cand = np.argpartition(-row, k - 1)[:k] if k < row.size else np.arange(row.size)
        kth = row[cand].min()
        cand = np.flatnonzero(row >= kth)  # ties at the k-th value: lowest ids first
        cand = cand[np.lexsort((cand, -row[cand]))][:k]
        top = [(int(i), (row[i] - top_z) - lse) for i in cand]
    return lp, top
