"""The continuous-batching engine: one loop thread, one ModelState, requests in, tokens out.

What lives here: :class:`Engine` (its loop thread, admission, the bounded queue, chunked
prefill interleaved with decode steps in one ragged ``Model.forward`` call, prefix caching,
cancellation, metrics). What does not: the request bookkeeping (``exactblocks.serve.request``:
:class:`FinishEvent`, :class:`PromptEvent`, :class:`RequestHandle` and the errors ``submit``
raises, re-exported here), the prompt-logprobs step (``exactblocks.serve.scoring``), how a
request samples, stops and emits its tokens (``exactblocks.models.generate``: the
:class:`SamplingParams`, ``Generation`` and :class:`TokenEvent` re-exported here, the same as
``Model.generate`` and ``exactblocks.ray`` use), HTTP, JSON and the OpenAI formats
(``exactblocks.serve.api`` / ``protocol``); the engine knows nothing of them.

Batch invariance: a row's logits never depend on the other rows, its slot, the chunk split or
the thread count (SPEC.md 3.1), a prefix-cache hit restores the exact bits of a recompute, and
each request samples from its own ``numpy.random.Generator(PCG64(seed))`` with
``Model.generate``'s generation core. So a request
with a seed gets the same tokens and logprobs, bit for bit, alone or among any others.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import math
import threading
import time
from collections.abc import Callable

import numpy as np

from exactblocks.models.generate import SamplingParams, TokenEvent, plan_step
from exactblocks.runtime import get_num_threads
from exactblocks.sampling import logprobs

from .prefix_cache import PrefixCache, clear_row, restore_row, snapshot_row
from .request import (
    SHUTTING_DOWN,
    EngineClosed,
    FinishEvent,
    PromptEvent,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    _Seq,
)
from .scoring import forward_scored, prompt_view, restore_scores, score_prompt

__all__ = [
    "Engine",
    "EngineClosed",
    "FinishEvent",
    "PromptEvent",
    "PromptTooLong",
    "QueueFull",
    "RequestHandle",
    "SamplingParams",
    "TokenEvent",
    "check_sizes",
    "prepare_request",
]

DEFAULT_MAX_TOKENS_PER_SEQUENCE = 4096
#: Prompt tokens a step may always carry beside decoding rows (prefill never starves).
MIN_PREFILL_TOKENS = 16
#: Threads computing the grammar masks of constrained rows beside the forward pass.
MASK_THREADS = 2
#: Logits of every position the prompt-logprob rows of one step may carry, in bytes.
SCORED_LOGITS_BYTES = 64 * 2**20


def check_sizes(cap: int, n_prompt: int, max_tokens: int | None) -> int:
    """:meth:`Engine.check` for a server of ``cap`` tokens per sequence (any engine's check).

    Parameters
    ----------
    cap : int
        Tokens per sequence (prompt + completion).
    n_prompt : int
    max_tokens : int or None

    Returns
    -------
    int
        The max_tokens to use (None = all the room left).

    Raises
    ------
    PromptTooLong, ValueError
        As :meth:`Engine.check`.
    """
    if n_prompt < 1:
        raise ValueError("the prompt is empty")
    if n_prompt >= cap + (max_tokens == 0):
        raise PromptTooLong(
            f"the prompt has {n_prompt} tokens; this server holds at most {cap} tokens per "
            "sequence (prompt + completion)"
        )
    if max_tokens is None:
        return cap - n_prompt
    if n_prompt + max_tokens > cap:
        raise ValueError(
            f"max_tokens={max_tokens} with a prompt of {n_prompt} tokens exceeds the "
            f"{cap} tokens per sequence of this server (at most {cap - n_prompt})"
        )
    return max_tokens


def prepare_request(model, cap: int, prompt_ids, params: SamplingParams, *,
                    prompt_logprobs=None, prefill_only=False, resume=()):  # fmt: skip
    """Every check of :meth:`Engine.submit`, before anything is queued (any engine's).

    Parameters
    ----------
    model : exactblocks.Model or an object with ``vocab_size`` and ``generation``
    cap : int
        Tokens per sequence.
    prompt_ids, params, prompt_logprobs, prefill_only, resume
        As :meth:`Engine.submit`.

    Returns
    -------
    tuple
        ``(ids, resume, generation)``: the prompt as an int64 array, the resumed tokens as a
        list of int, and the request's :class:`~exactblocks.models.generate.Generation`.

    Raises
    ------
    PromptTooLong, ValueError
        As :meth:`Engine.submit`.
    """
    ids = np.asarray(list(prompt_ids), dtype=np.int64)
    check_sizes(cap, len(ids), 0 if prefill_only else params.max_tokens)
    if prompt_logprobs is not None and not (
        isinstance(prompt_logprobs, int) and 0 <= prompt_logprobs <= 20
    ):
        raise ValueError(f"prompt_logprobs={prompt_logprobs!r} must be None or an int in [0, 20]")
    vocab = model.vocab_size
    if ids.ndim != 1 or ((ids < 0) | (ids >= vocab)).any():
        raise ValueError(f"a prompt token id is outside the vocabulary [0, {vocab})")
    resume = [int(t) for t in resume]
    if resume and (prompt_logprobs is not None or prefill_only):
        raise ValueError("resume cannot be combined with prompt_logprobs or prefill_only")
    try:
        gen = model.generation(ids.tolist(), params, where="Engine.submit", resume=resume)
    except TypeError as exc:  # stop strings without a tokenizer: a bad request
        raise ValueError(str(exc)) from None
    return ids, resume, gen


class Engine:
    """Continuous batching over one :class:`exactblocks.ModelState` of ``max_batch`` rows.

    Parameters
    ----------
    model : exactblocks.Model
    max_batch : int, default=8
        Rows of the state: requests generating at once.
    max_tokens_per_sequence : int or None, default=None
        Positions per row (prompt + completion); None = min(4096, model.max_positions).
    max_queue : int, default=64
        Requests waiting for a row; one more raises :class:`QueueFull`.
    prefill_chunk : int, default=64
        Prompt tokens per row per step, and the prefix cache's boundary spacing.
    prefill_budget : int or None, default=None
        Prompt tokens per step over all rows while no row decodes (None =
        ``2 * prefill_chunk``).
    prefill_ratio : float, default=1.0
        While rows decode, a step carries at most ``max(MIN_PREFILL_TOKENS, prefill_ratio *
        decoding rows)`` prompt tokens (and never more than ``prefill_budget``). A step's cost
        grows about linearly with the tokens it carries once a batch is large, so a step with
        prompt chunks then costs at most about ``1 + prefill_ratio`` times a decode step: the
        bound on the per-token latency of running requests that a long or a burst of prompts
        can cause. Larger = faster time to first token, slower tokens for the others; 0 = only
        ``MIN_PREFILL_TOKENS`` (16) prompt tokens per step beside decodes.
    prefix_cache_mb : float, default=256
        Budget of the prefix cache (0 disables it).
    sample_threads : int or None, default=None
        Threads that pick the tokens of a step's rows when some sample (temperature > 0);
        None = ``exactblocks.get_num_threads()`` when the engine starts; 1 = the loop thread
        alone. The tokens do not depend on it.

    Raises
    ------
    ValueError
        ``max_batch``, ``prefill_chunk`` or ``prefill_budget`` < 1, ``max_queue`` < 0,
        ``prefill_ratio`` negative or not finite, ``max_tokens_per_sequence`` beyond the
        model's positions.

    Notes
    -----
    One loop thread owns the state. Each step: admit waiting requests into free rows
    (restoring their longest cached prefix), run one ragged ``forward`` with every row's
    next chunk (a prompt chunk or one decode token; idle rows have length 0), save prefix
    boundaries, sample the rows whose prompt is done, free finished rows, then deliver the
    step's events in one burst. Prompt chunks take the rows in round-robin order within the
    step's prompt-token allowance (``prefill_budget``, or the ``prefill_ratio`` bound while
    rows decode); chunks end at multiples of ``prefill_chunk``, where the prefix cache saves
    its boundaries. Events are delivered by calling the request's sink from the loop thread:
    it must be quick and must not block (e.g. ``loop.call_soon_threadsafe``). A constrained
    request's (``params.grammar``) next token mask is computed on ``MASK_THREADS`` threads of
    the engine's while the next forward pass runs; its pick waits only for what is left.
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        max_tokens_per_sequence: int | None = None,
        max_queue: int = 64,
        prefill_chunk: int = 64,
        prefill_budget: int | None = None,
        prefill_ratio: float = 1.0,
        prefix_cache_mb: float = 256,
        sample_threads: int | None = None,
    ):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError(
                f"Engine: max_batch={max_batch} and prefill_chunk={prefill_chunk} must be >= 1, "
                f"max_queue={max_queue} >= 0"
            )
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError(f"Engine: prefill_budget={prefill_budget} must be >= 1 or None")
        if sample_threads is not None and sample_threads < 1:
            raise ValueError(f"Engine: sample_threads={sample_threads} must be >= 1 or None")
        if not (math.isfinite(prefill_ratio) and prefill_ratio >= 0):
            raise ValueError(f"Engine: prefill_ratio={prefill_ratio!r} must be finite and >= 0")
        self.model = model
        limit = model.max_positions
        cap = max_tokens_per_sequence or DEFAULT_MAX_TOKENS_PER_SEQUENCE
        if limit is not None:
            cap = min(cap, limit) if max_tokens_per_sequence is None else cap
            if cap > limit:
                raise ValueError(
                    f"max_tokens_per_sequence={cap} exceeds the model's max_positions={limit}"
                )
        self.max_tokens_per_sequence = int(cap)
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_budget = int(prefill_budget or 2 * prefill_chunk)
        self.prefill_ratio = float(prefill_ratio)
        self.state = model.allocate_state(
            self.max_batch, None if model.family == "mamba2" else self.max_tokens_per_sequence
        )
        self.cache = PrefixCache(int(prefix_cache_mb * 2**20))
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._incoming: collections.deque[_Seq] = collections.deque()
        self._cancelled: set[RequestHandle] = set()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._rows: list[_Seq | None] = [None] * self.max_batch
        self._turn = 0
        self._outbox: list[tuple[_Seq, object]] = []  # events of this iteration, in order
        self._burst_hooks: list[Callable[[], None]] = []
        self.sample_threads = sample_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._mask_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counters = collections.Counter()
        # counts (ints) and float seconds; a key starts at 0 on its first +=, as in a Counter
        self.sums: collections.defaultdict[str, float] = collections.defaultdict(int)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the loop thread (idempotent); return self."""
        if self._thread is None:
            workers = self.sample_threads
            if workers is None:
                workers = get_num_threads()
            if workers > 1:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    workers, thread_name_prefix="exactblocks-sample"
                )
            # grammar masks of constrained rows, computed while the forward pass runs (its
            # threads are created on first use: none without constrained requests)
            self._mask_pool = concurrent.futures.ThreadPoolExecutor(
                MASK_THREADS, thread_name_prefix="exactblocks-grammar"
            )
            self._thread = threading.Thread(target=self._loop, name="exactblocks-engine")
            self._thread.daemon = True
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every unfinished request gets a FinishEvent("abort")."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False)
            self._mask_pool = None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------
    def check(self, n_prompt: int, max_tokens: int | None) -> int:
        """Validate sizes; return the max_tokens to use (None = all the room left).

        ``max_tokens=0`` (a prompt scored, nothing generated) needs only room for the prompt.

        Raises
        ------
        PromptTooLong
            The prompt leaves no room for one new token (for ``max_tokens=0``: it exceeds
            the sequence).
        ValueError
            An empty prompt, or prompt + max_tokens beyond ``max_tokens_per_sequence``.
        """
        return check_sizes(self.max_tokens_per_sequence, n_prompt, max_tokens)

    def submit(
        self,
        prompt_ids,
        params: SamplingParams,
        sink: Callable | None = None,
        *,
        prompt_logprobs: int | None = None,
        prefill_only: bool = False,
        resume=(),
    ) -> RequestHandle:
        """Queue a request; return its handle.

        Parameters
        ----------
        prompt_ids : sequence of int
        params : SamplingParams
        sink : callable or None
            Called from the loop thread with each event (a :class:`PromptEvent` first when
            asked for, the TokenEvents, then the FinishEvent); None = collect them in the
            handle (:meth:`RequestHandle.events`).
        prompt_logprobs : int or None, default=None
            None: no prompt logprobs. An int in [0, 20]: send a :class:`PromptEvent` with
            every prompt token's logprob and that many alternatives once the prompt is in.
            Its bits do not depend on the batch, the chunk split or the prefix cache: the
            prompt's chunks run with the logits of every position, and only a cached prefix
            whose entries hold the scores of a request that asked for them is restored
            (each entry's next token is scored from its stored last logits).
        prefill_only : bool, default=False
            True: run the prompt and finish (reason ``"length"``) without generating
            (``max_tokens=0``; ``params.max_tokens`` is then not used).
        resume : sequence of int, default=()
            The tokens an earlier run of this same request (same prompt and params, a seed
            given when sampling) already sent, to continue it elsewhere (a replica lost
            mid-stream): the row runs ``prompt_ids + resume``, the generator skips the draws
            they consumed, and the events sent are exactly those the uninterrupted run sends
            after them (its FinishEvent counts them as completion tokens). Not with
            ``prompt_logprobs`` or ``prefill_only``.

        Raises
        ------
        QueueFull
            ``max_queue`` requests already wait for a row.
        PromptTooLong, ValueError
            As :meth:`check`; an id outside the vocabulary; stop strings without a tokenizer,
            a stop id outside the vocabulary.
        EngineClosed
        """
        ids, resume, gen = prepare_request(
            self.model, self.max_tokens_per_sequence, prompt_ids, params,
            prompt_logprobs=prompt_logprobs, prefill_only=prefill_only, resume=resume,
        )  # fmt: skip
        handle = RequestHandle(self, next(self._ids), ids.tolist(), params, sink)
        n_prompt = len(ids)
        if resume:
            ids = np.concatenate([ids, np.asarray(resume, dtype=np.int64)])
        seq = _Seq(handle=handle, ids=ids, gen=gen, prompt_top=prompt_logprobs,
                   prefill_only=bool(prefill_only), n_prompt=n_prompt)  # fmt: skip
        if prompt_logprobs is not None:
            seq.prompt_lps = [(None, None)]
        with self._cond:
            if self._stop:
                raise EngineClosed("the engine is shut down")
            if len(self._waiting) + len(self._incoming) >= self.max_queue + self._free_rows():
                self.counters["rejected"] += 1
                raise QueueFull(
                    f"{self.max_queue} requests are already waiting; retry later", retry_after=1
                )
            self._incoming.append(seq)
            self.counters["submitted"] += 1
            self._cond.notify_all()
        return handle

    def add_burst_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` from the loop thread after each burst of events is delivered.

        A burst is the events of one loop iteration (one step), passed to the sinks back to
        back; a consumer can buffer in its sinks and wake its own thread once per burst from
        the hook. The hook must be quick and must not block; if it raises, the requests of
        the burst are cancelled (their consumer is gone).
        """
        self._burst_hooks.append(hook)

    def _free_rows(self) -> int:
        return sum(1 for s in self._rows if s is None)

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            if handle.finished is None:
                self._cancelled.add(handle)
                self._cond.notify_all()

    # -- introspection ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the loop thread runs (False before ``start`` and after a failure)."""
        return self._thread is not None and self._thread.is_alive()

    def cached_prefixes(self) -> list[np.ndarray]:
        """The token ids of every prefix the cache holds (int64 arrays), least recent first.

        A snapshot taken from any thread (a router's view of where a prefix is cached); the
        cache may change right after.
        """
        return [np.frombuffer(k, dtype=np.int64) for k in self.cache.keys()]

    def stats(self) -> dict:
        """A snapshot of gauges and counters (for /metrics).

        ``kv_cache_usage`` is the fraction (0..1) of the state's positions that running
        requests hold: their tokens (prompt in + generated) over ``max_batch *
        max_tokens_per_sequence``.
        """
        with self._cond:
            waiting = len(self._waiting) + len(self._incoming)
        # a row holds its prompt and resumed tokens (both in pos) and the tokens generated since
        held = sum(s.pos + len(s.gen.ids) - (len(s.ids) - s.n_prompt)
                   for s in list(self._rows) if s is not None)  # fmt: skip
        return {
            "running": self.max_batch - self._free_rows(),
            "waiting": waiting,
            "kv_cache_usage": held / (self.max_batch * self.max_tokens_per_sequence),
            "max_batch": self.max_batch,
            "prefix_cache_bytes": self.cache.nbytes,
            "prefix_cache_entries": len(self.cache),
            "prefix_cache_hits": self.cache.hits,
            "prefix_cache_misses": self.cache.misses,
            "prefix_cache_evictions": self.cache.evictions,
            **{f"requests_{k}": v for k, v in self.counters.items()},
            **dict(self.sums),
        }

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._stop
                        or self._incoming
                        or self._cancelled
                        or self._waiting
                        or any(s is not None for s in self._rows)
                    ):
                        self._cond.wait()
                    if self._stop:
                        break
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
                    cancelled, self._cancelled = self._cancelled, set()
                self._drop(cancelled)
                self._admit()
                self._step()
                self._flush()
        except BaseException as exc:  # pragma: no cover - a bug: fail every request loudly
            self._fail_all(f"engine loop failed: {type(exc).__name__}: {exc}")
            raise
        self._fail_all(SHUTTING_DOWN, reason="abort")

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._cond:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            self._stop = True
        for seq in list(self._waiting):
            self._finish(seq, reason, error=message)
        self._waiting.clear()
        for seq in self._rows:
            if seq is not None:
                self._finish(seq, reason, error=message)
        self._flush()

    def _drop(self, cancelled: set) -> None:
        if not cancelled:
            return
        for seq in [s for s in self._waiting if s.handle in cancelled]:
            self._waiting.remove(seq)
            self._finish(seq, "abort")
        for seq in self._rows:
            if seq is not None and seq.handle in cancelled:
                self._finish(seq, "abort")

    def _admit(self) -> None:
        for row in range(self.max_batch):
            if not self._waiting:
                return
            if self._rows[row] is not None:
                continue
            seq = self._waiting.popleft()
            seq.row = row
            self._rows[row] = seq
            self._prefetch_mask(seq)  # the first mask, beside the prompt's prefill
            clear_row(self.state, row)
            # prompt logprobs: only a prefix whose entries hold its scores is restored
            entry = self.cache.lookup(seq.ids, scored=seq.prompt_top is not None)
            if entry is not None:
                restore_row(self.state, row, entry)
                seq.pos = seq.cached = entry.end
                seq.parent = entry
                if seq.prompt_lps is not None:
                    restore_scores(seq, entry)
                if entry.end == len(seq.ids):
                    self._prompt_done(seq, entry.logits)
            self.sums["prompt_tokens_total"] += len(seq.ids)
            self.sums["cached_tokens_total"] += seq.cached

    def _prompt_done(self, seq: _Seq, last_logits: np.ndarray) -> None:
        """The whole prompt is in the row: send its logprobs, then finish or sample next."""
        if seq.prompt_lps is not None:
            self._emit(seq, PromptEvent(prompt_view(seq)))
        if seq.prefill_only:
            self._finish(seq, "length")
        else:
            seq.logits = last_logits

    def _step(self) -> None:
        B = self.max_batch
        decoding = sum(1 for s in self._rows if s is not None and s.next_token is not None)
        self._turn = (self._turn + 1) % B  # prefill budget shared round-robin over the rows
        plan = [
            None
            if seq is None or seq.logits is not None
            else (seq.next_token is not None, len(seq.ids) - seq.pos, seq.pos)
            for seq in self._rows
        ]
        lens = plan_step(plan, chunk=self.prefill_chunk, budget=self.prefill_allowance(decoding),
                         turn=self._turn)  # fmt: skip
        chunk = self.prefill_chunk
        if lens.any():
            ids = np.zeros((B, int(lens.max())), np.int64)
            for row in np.flatnonzero(lens):
                seq = self._rows[row]
                n = int(lens[row])
                if seq.next_token is not None:
                    ids[row, 0] = seq.next_token
                else:
                    ids[row, :n] = seq.ids[seq.pos : seq.pos + n]
            scored = [
                r
                for r in np.flatnonzero(lens)
                if self._rows[r].prompt_top is not None and self._rows[r].next_token is None
            ]
            every = None
            t0 = time.perf_counter()
            try:
                # (B, vocab_size): each row's last position is all that is sampled or cached
                if scored:  # a prompt's logprobs: every position (the same bits per row)
                    lens, every, logits = forward_scored(
                        self.model, self.state, ids, lens, scored, SCORED_LOGITS_BYTES
                    )
                elif (lens == 1).all():  # every row decodes: step (same bits, less overhead)
                    logits = self.model.step(ids[:, 0], self.state)[:, 0]
                else:
                    logits = self.model.forward(ids, self.state, lengths=lens, logits="last")
            except Exception as exc:  # non-finite activations: fail the rows of this call
                self.state.reset([int(r) for r in np.flatnonzero(lens)])  # others untouched
                for row in np.flatnonzero(lens):
                    self._finish(self._rows[row], "error", error=f"{type(exc).__name__}: {exc}")
                return
            self.sums["step_seconds_total"] += time.perf_counter() - t0
            self.sums["steps_total"] += 1
            self.sums["step_tokens_total"] += int(lens.sum())
            for row in np.flatnonzero(lens):
                seq, n = self._rows[row], int(lens[row])
                if seq.next_token is not None:
                    seq.next_token = None
                    seq.logits = logits[row]
                    continue
                if every is not None and seq.prompt_top is not None:
                    score_prompt(seq, every[row, :n])
                seq.pos += n
                if seq.pos % chunk == 0 or seq.pos == len(seq.ids):
                    self._save(seq, logits[row])
                if seq.pos == len(seq.ids):
                    self._prompt_done(seq, logits[row])
        ready = [seq for seq in self._rows if seq is not None and seq.logits is not None]
        for seq, pick in zip(ready, self._pick_all(ready)):
            self._sample(seq, pick)

    def prefill_allowance(self, decoding: int) -> int:
        """Prompt tokens the next step may carry when ``decoding`` rows decode in it.

        Parameters
        ----------
        decoding : int
            Rows that feed one decode token in the step, >= 0.

        Returns
        -------
        int
            ``prefill_budget`` when ``decoding`` is 0, else ``min(prefill_budget,
            max(MIN_PREFILL_TOKENS, floor(prefill_ratio * decoding)))``.
        """
        if decoding <= 0:
            return self.prefill_budget
        share = max(MIN_PREFILL_TOKENS, int(self.prefill_ratio * decoding))
        return min(self.prefill_budget, share)

    def _save(self, seq: _Seq, last_logits: np.ndarray) -> None:
        if not seq.chain_ok or self.cache.max_bytes <= 0:
            return
        prefix = seq.ids[: seq.pos]
        entry = self.cache.get(prefix)
        if entry is None:
            start = 0 if seq.parent is None else seq.parent.end
            layers = snapshot_row(self.state, seq.row, start, seq.pos)
            entry = self.cache.insert(prefix, seq.parent, layers, last_logits)
        if entry is None:
            seq.chain_ok = False
        elif entry.scores is None and seq.prompt_lps is not None:
            # tokens start+1 .. end-1 (the one at end is predicted from entry.logits)
            self.cache.add_scores(entry, seq.prompt_lps[entry.start + 1 : entry.end])
        seq.parent = entry

    @staticmethod
    def _pick(seq: _Seq):
        """The row's next token, or the ValueError pick_token raised (non-finite logits)."""
        try:
            return seq.gen.pick(seq.logits)
        except ValueError as exc:
            return exc

    def _pick_all(self, ready: list) -> list:
        """The picks of the rows ready to sample, in their order.

        Seeded sampling sorts the whole vocabulary (about 1.5 ms a row for 49152 tokens),
        mostly in calls that release the GIL (NumPy's sort, the library's exp), while the
        model's threads wait for the tokens: the rows are then picked on a pool of as many
        threads as the library uses. Each row draws from its own generator and nothing else,
        so the tokens do not depend on this.
        """
        if (
            self._pool is None
            or len(ready) < 2
            or all(s.handle.params.temperature == 0 for s in ready)
        ):
            return [self._pick(seq) for seq in ready]
        return list(self._pool.map(self._pick, ready))

    def _sample(self, seq: _Seq, token) -> None:
        logits, seq.logits = seq.logits, None
        if isinstance(token, ValueError):
            self._finish(seq, "error", error=str(token))
            return
        if seq.handle.first_token is None:
            seq.handle.first_token = time.perf_counter()
            self.sums["time_to_first_token_seconds_total"] += (
                seq.handle.first_token - seq.handle.submitted
            )
        gen = seq.gen
        if token in gen.stop_ids and gen.params.logprobs:
            lp, top = logprobs(logits, token, gen.params.top_logprobs)
            top = None if top is None else [(i, float(v)) for i, v in top]
            seq.stop_token = TokenEvent(int(token), "", float(lp), top, 0)
        try:
            events, _ = gen.accept(token, logits)
        except ValueError as exc:  # a grammar's matcher refused the token: fail this row only
            self._finish(seq, "error", error=str(exc))
            return
        if token not in gen.stop_ids:
            self.sums["generation_tokens_total"] += 1
        for ev in events:
            self._emit(seq, ev)
        if gen.finished:
            self._finish(seq, gen.finish_reason)
        else:
            seq.next_token = token
            self._prefetch_mask(seq)  # the next mask, beside the next forward pass

    def _prefetch_mask(self, seq: _Seq) -> None:
        """A constrained row's next mask starts on the mask threads: it depends only on the
        row's tokens so far, and the step's forward pass (GIL released) runs meanwhile."""
        if seq.gen.matcher is not None and self._mask_pool is not None:
            seq.gen.matcher.prefetch(self._mask_pool)

    def _emit(self, seq: _Seq, ev) -> None:
        self._outbox.append((seq, ev))

    def _flush(self) -> None:
        """Deliver the events of this loop iteration, in order: one burst per step, so a
        consumer that wakes an event loop per burst (``exactblocks.serve.api``) wakes once."""
        out, self._outbox = self._outbox, []
        for seq, ev in out:
            try:
                seq.handle._sink(ev)
            except Exception:  # a consumer gone (closed event loop): the request is abandoned
                self._abandon(seq.handle)
        if not out:
            return
        for hook in self._burst_hooks:
            try:
                hook()
            except Exception:  # the consumer is gone: so are the requests it was told of
                for seq, _ in out:
                    self._abandon(seq.handle)

    def _abandon(self, handle: RequestHandle) -> None:
        if handle.finished is None:
            with self._cond:
                self._cancelled.add(handle)

    def _finish(self, seq: _Seq, reason: str, error: str | None = None) -> None:
        tail = ""
        if reason in ("stop", "length"):
            held, tail = seq.gen.close()
            for ev in held:
                self._emit(seq, ev)
        text = seq.gen.text or ""
        if seq.stop_token is not None:
            seq.stop_token.text_offset = len(text)
        if seq.row >= 0 and self._rows[seq.row] is seq:
            self._rows[seq.row] = None
            clear_row(self.state, seq.row)
        seq.handle.finished = time.perf_counter()
        self.counters[reason] += 1
        if seq.gen.matcher is not None:  # constrained decoding: what its masks cost
            self.sums["grammar_mask_seconds_total"] += seq.gen.matcher.mask_seconds
            self.sums["grammar_masks_total"] += seq.gen.matcher.masks
            self.sums["grammar_mask_wait_seconds_total"] += seq.gen.matcher.wait_seconds
        with self._cond:
            self._cancelled.discard(seq.handle)
        self._emit(
            seq,
            FinishEvent(
                reason,
                text=text,
                tail=tail,
                prompt_tokens=seq.n_prompt,
                completion_tokens=len(seq.gen.ids),
                cached_tokens=seq.cached,
                error=error,
                stop_token=seq.stop_token,
            ),
        )
