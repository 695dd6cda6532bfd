"""The engine's request bookkeeping: what ``Engine.submit`` raises, the events a request gets,
its :class:`RequestHandle`, and the engine-side state of one request (``_Seq``).

What lives here: :class:`QueueFull`, :class:`PromptTooLong`, :class:`EngineClosed`,
:class:`FinishEvent`, :class:`PromptEvent`, :class:`RequestHandle`, ``_Seq`` and
``SHUTTING_DOWN``; all re-exported by ``exactblocks.serve.engine``. What does not: the loop
thread, scheduling and sampling (``exactblocks.serve.engine``). NumPy only, no HTTP.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from exactblocks.models.generate import Generation, TokenEvent

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "EngineClosed",
    "FinishEvent",
    "PromptEvent",
    "PromptTooLong",
    "QueueFull",
    "RequestHandle",
]

#: The error of the FinishEvent("abort") every unfinished request gets at shutdown.
SHUTTING_DOWN = "the server is shutting down"


class QueueFull(RuntimeError):
    """The waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class PromptTooLong(ValueError):
    """The prompt does not fit a sequence (``max_tokens_per_sequence`` or the model's)."""


class EngineClosed(RuntimeError):
    """The engine is shut down."""


@dataclass
class FinishEvent:
    """The last event of a request.

    Attributes
    ----------
    finish_reason : str
        ``"stop"`` (a stop token or string), ``"length"`` (max_tokens), ``"abort"``
        (cancelled) or ``"error"``.
    text : str
        The whole completion text (cut before a stop string).
    tail : str
        Text not yet released by a TokenEvent (held for stop strings).
    prompt_tokens, completion_tokens, cached_tokens : int
        Usage; ``cached_tokens`` were restored from the prefix cache.
    error : str or None
    stop_token : TokenEvent or None
        With logprobs, the stop token that ended the generation (never emitted, not in
        ``text``): its id and logprobs, ``text_offset`` the length of the text.
    """

    finish_reason: str
    text: str = ""
    tail: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    stop_token: TokenEvent | None = None
    n_prompt: int = 0  # the request's own prompt tokens (ids also holds resumed ones)


@dataclass
class PromptEvent:
    """The logprobs of a request's prompt, sent once its prefill is done (when asked for).

    Attributes
    ----------
    logprobs : list of tuple
        One ``(logprob, top)`` per prompt token: ``logprob`` the float32 value of
        ``log softmax(logits)[token]`` at the position before it (None for the first token,
        which nothing predicts), ``top`` None (the first token, or ``top_logprobs=0``) or a
        list of ``(id, logprob)`` by logprob descending then id ascending
        (:func:`exactblocks.sampling.logprobs`).
    """

    logprobs: list


class RequestHandle:
    """A submitted request: its events arrive through the ``sink`` given to ``submit``.

    Without a sink, events queue here and :meth:`events` iterates them (blocking).

    Attributes
    ----------
    id : int
    prompt_ids : list of int
    params : SamplingParams
    submitted, first_token, finished : float or None
        ``time.perf_counter()`` stamps.
    """

    def __init__(self, engine: Engine, rid: int, prompt_ids, params, sink):
        self.id = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self._engine = engine
        self._queue: queue.Queue | None = None
        if sink is None:
            self._queue = queue.Queue()
            sink = self._queue.put
        self._sink = sink
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self.finished: float | None = None

    def cancel(self) -> None:
        """Stop the request (a client went away); its row is freed at the next step."""
        self._engine._cancel(self)

    def events(self, timeout: float | None = None) -> Iterator:
        """Yield TokenEvents, then the FinishEvent (only for handles made without a sink)."""
        if self._queue is None:
            raise RuntimeError("RequestHandle.events: this request delivers to its own sink")
        while True:
            ev = self._queue.get(timeout=timeout)
            yield ev
            if isinstance(ev, FinishEvent):
                return

    def result(self, timeout: float | None = None) -> tuple[list[TokenEvent], FinishEvent]:
        """Wait for the end; return (token events, finish event)."""
        toks = []
        for ev in self.events(timeout):
            if isinstance(ev, FinishEvent):
                return toks, ev
            toks.append(ev)
        raise AssertionError("unreachable")


@dataclass(eq=False)
class _Seq:
    """Engine-side state of one request (touched by the loop thread only)."""

    handle: RequestHandle
    ids: np.ndarray  # prompt, int64
    gen: Generation  # sampling, stop rules and the events it emits
    row: int = -1
    pos: int = 0  # prompt tokens in the row
    cached: int = 0
    parent: object = None  # prefix-cache entry of the last boundary
    chain_ok: bool = True
    logits: np.ndarray | None = None  # ready to sample
    next_token: int | None = None  # to feed at the next step
    prompt_top: int | None = None  # top_logprobs of the prompt's logprobs; None = not asked
    prompt_lps: list | None = None  # (logprob, top) per prompt token so far
    prefill_only: bool = False  # max_tokens=0: finish once the prompt is in
    stop_token: TokenEvent | None = None
    n_prompt: int = 0  # the request's own prompt tokens (ids also holds resumed ones)
