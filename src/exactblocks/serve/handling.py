"""What the OpenAI routes share: request bodies in, engine requests out, events back.

What lives here: :func:`shared` (per app: reading and checking a body, the tokenizer threads,
the refusal of a text too long to fit, the :class:`~exactblocks.serve.engine.SamplingParams`
of a body and of its ``n`` choices, one engine request per choice, collecting or streaming
their events as server-sent events, usage), :class:`_Delivery`, and the OpenAI errors these
raise. What does not: the routes and their response shapes (``exactblocks.serve.completions``,
``echo``, ``embeddings``), the app and its middleware (``exactblocks.serve.api``).

The engine delivers a step's events in one burst from its loop thread; :class:`_Delivery`
puts them into each request's ``asyncio.Queue`` with one ``loop.call_soon_threadsafe`` per
burst (one event-loop wakeup per step, not one per token). A streaming client that goes away
closes the response generator, whose ``finally`` cancels the request and frees its row; a
non-streaming request polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from exactblocks.text import ll_tokenizer

from .engine import (
    SHUTTING_DOWN,
    Engine,
    EngineClosed,
    FinishEvent,
    PromptEvent,
    PromptTooLong,
    QueueFull,
    SamplingParams,
    TokenEvent,
)
from .protocol import APIError, error_body
from .structured import grammar_of_response_format, grammar_or_400

MAX_BODY_BYTES = 4 * 2**20
#: A body over MAX_BODY_BYTES is read and discarded up to this many bytes before the 413 is
#: sent (a client still sending when the server closes sees a reset, not the answer); past it
#: the connection is closed unread.
DRAIN_BODY_BYTES = 64 * 2**20
MAX_STOP_STRINGS = 4
#: Most choices (``n``) per request.
MAX_N = 16
#: Threads that tokenize prompts and render chat templates, off the event loop.
TOKENIZE_THREADS = 2


def _field_path(loc) -> tuple:
    """A pydantic error location without its union member tags: the JSON path of the field."""
    return tuple(p for p in loc if not _union_tag(p))


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    err = errors[0]
    if err.get("loc", ())[:1] == ("stop",):  # one message for the str | list[str] union
        got = next(e["input"] for e in errors if e.get("loc", ()) == ("stop", "str"))
        shown = json.dumps(got)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return APIError(
            400,
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings; got {shown}",
            param="stop",
            code="invalid_value",
        )
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    # A value that fails a union (a message's content, a prompt) fails every member: report
    # the member that got furthest into it, at its JSON path, or, when it fails them all at
    # the top (a number where a string or an array goes), every type it could have been.
    top = err.get("loc", ())[:1]
    same = [e for e in errors if e.get("loc", ())[:1] == top]
    deepest = max(len(_field_path(e.get("loc", ()))) for e in same)
    at = [e for e in same if len(_field_path(e.get("loc", ()))) == deepest]
    err = at[0]
    path = _field_path(err.get("loc", ()))
    loc = ".".join(str(p) for p in path)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {loc!r}", param=loc, code="unknown_field")
    msg = err["msg"]
    if err["type"] == "value_error":  # a validator's own message, without pydantic's lead
        msg = msg.removeprefix("Value error, ")
    elif err["type"] == "finite_number":
        msg = f"must be finite; got {json.dumps(err.get('input'))}"  # NaN or Infinity
    elif len(at) > 1 and all(e["type"].endswith("_type") for e in at):
        kinds = dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in at)
        got = json.dumps(err.get("input"))
        got = got if len(got) <= 40 else got[:37] + "..."
        msg = f"Input should be {' or '.join(kinds)}; got {got}"
    where = f"{loc}: " if loc else "the body: "
    return APIError(400, where + msg, param=loc or None, code="invalid_value")


def _union_tag(part) -> bool:
    """Whether a pydantic error location part names a union member, not a field."""
    if isinstance(part, int):
        return False
    return part in ("str", "int", "float", "bool", "dict", "list") or not part.isidentifier() \
        or part[:1].isupper()  # fmt: skip


def _shutting_down(message: str = SHUTTING_DOWN) -> APIError:
    """503 for a request the server could not finish because it is shutting down."""
    return APIError(
        503,
        message,
        type="server_error",
        code="server_shutting_down",
        headers={"Retry-After": "1"},
    )


class _Delivery:
    """Engine events to the requests' asyncio queues: one event-loop wakeup per step.

    A request's sink (called by the engine's loop thread) only buffers its events; after each
    burst (one step's events) the engine calls :meth:`kick`, which schedules one
    :meth:`_drain` on the event loop, putting every buffered event into its queue in order.
    One ``call_soon_threadsafe`` per step instead of one per token: fewer self-pipe writes and
    fewer switches of the GIL between the engine thread and the event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list = []
        self.scheduled = False

    def sink(self, events: asyncio.Queue, index: int = 0):
        """The engine sink of one request whose events go to ``events`` as ``(index, ev)``."""

        def put(ev):
            with self.lock:
                self.pending.append((events, (index, ev)))

        return put

    def kick(self) -> None:
        """Engine burst hook: schedule a drain if events wait and none is scheduled.

        Raises RuntimeError when the loop is closed (the engine then abandons the burst's
        requests).
        """
        with self.lock:
            if self.scheduled or not self.pending:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will read these events
            with self.lock:
                self.scheduled = False
                self.pending.clear()
            raise

    def _drain(self) -> None:
        with self.lock:
            items, self.pending, self.scheduled = self.pending, [], False
        for events, ev in items:
            events.put_nowait(ev)


def shared(engine: Engine, model_name: str) -> SimpleNamespace:
    """The helpers the routes of one app share, over ``engine`` serving ``model_name``.

    Returns a namespace of ``engine``, ``model``, ``tok``, ``text_pool`` (the app's lifespan
    shuts it down), ``off_loop``, ``refuse_if_too_long``, ``parse``, ``grammar_of``, ``params_of``,
    ``choices_of``, ``submit``, ``collect``, ``usage`` and ``stream``.
    """
    model = engine.model
    tok = model.tokenizer

    # Tokenizing a long prompt takes seconds: it runs on a few threads of its own, never on
    # the event loop (other streams keep flowing), and a text too long to fit is refused
    # before any of it is tokenized.
    text_pool = concurrent.futures.ThreadPoolExecutor(
        TOKENIZE_THREADS, thread_name_prefix="exactblocks-tokenize"
    )
    max_token_bytes: list = []  # the longest token's UTF-8 bytes, computed on first need

    def longest_token_bytes() -> int:
        if not max_token_bytes:
            n = 1
            for i in range(model.vocab_size):
                n = max(n, len(tok.decode([i]).encode("utf-8")))
            max_token_bytes.append(n)
        return max_token_bytes[0]

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(text_pool, fn, *args)

    async def refuse_if_too_long(text_bytes: int, param: str) -> None:
        """A text of ``text_bytes`` UTF-8 bytes needs at least text_bytes / (the longest
        token's bytes) tokens: refuse it unread when that cannot fit a sequence."""
        cap = engine.max_tokens_per_sequence
        if text_bytes < cap:
            return  # fewer bytes than positions: it may fit (tokenize to know)
        least = text_bytes // await off_loop(longest_token_bytes)
        if least >= cap:
            raise APIError(
                400,
                f"the {param} has {text_bytes} bytes of text, at least {least} tokens; this "
                f"server holds at most {cap} tokens per sequence (prompt + completion)",
                param=param,
                code="context_length_exceeded",
            )

    async def parse(request: Request, cls):
        declared = request.headers.get("content-length", "")
        over = declared.isdigit() and int(declared) > MAX_BODY_BYTES  # refused unparsed
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if over or size > MAX_BODY_BYTES:
                # read and discarded, so the client gets to read the 413 (up to a bound:
                # past it the connection is closed unread)
                over, parts = True, []
                if size > DRAIN_BODY_BYTES:
                    break
                continue
            parts.append(part)
        if over:
            raise APIError(
                413,
                f"the body exceeds {MAX_BODY_BYTES} bytes (4 MiB), the most this server reads",
                code="body_too_large",
                headers={"Connection": "close"},
            )
        raw = b"".join(parts)
        try:
            body = cls.model_validate_json(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        n = getattr(body, "n", None)
        if n is not None and not 1 <= n <= MAX_N:
            raise APIError(400, f"n={n} must be in [1, {MAX_N}]", param="n", code="invalid_value")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name, None) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported")
        return body

    async def grammar_of(body):
        """The grammar of the body's ``response_format`` (None: unconstrained), compiled and
        checked off the event loop, before anything is queued (400 naming the field)."""
        rf = getattr(body, "response_format", None)
        if rf is None:
            return None
        grammar = await off_loop(grammar_of_response_format, rf)
        if grammar is not None:
            if tok is None or not model.eos_token_ids:
                raise APIError(400, "response_format needs a model with a tokenizer and an "
                               "end token", param="response_format",
                               code="unsupported")  # fmt: skip
            # the model's llguidance tokenizer: built once (about 0.3 s), then cached; a
            # grammar that cannot start a generation with it is refused here (400)
            await off_loop(ll_tokenizer, tok, model.vocab_size, model.eos_token_ids)
            await off_loop(grammar_or_400, lambda: grammar.check(tok, model.vocab_size,
                           model.eos_token_ids), "response_format")  # fmt: skip
        return grammar

    def params_of(body, n_prompt, max_tokens, logprobs, top, prompt_param,
                  grammar=None) -> SamplingParams:  # fmt: skip
        """The request's SamplingParams: the body's fields, checked by the generation core.

        ``grammar``: the :class:`~exactblocks.models.Grammar` its tokens follow (from
        :func:`grammar_of`, or a ``tools`` route's :func:`~exactblocks.serve.structured.
        grammar_or_400`); None = unconstrained."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(
                400,
                f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                param="stop",
                code="invalid_value",
            )
        for i, s in enumerate(stop):
            if not s:
                where = "stop" if isinstance(body.stop, str) else f"stop[{i}]"
                raise APIError(
                    400,
                    f"{where} is an empty string; stop strings must be non-empty",
                    param="stop",
                    code="invalid_value",
                )
        try:
            n_new = engine.check(n_prompt, max_tokens)
        except PromptTooLong as exc:
            # 400, as OpenAI answers it (the official client raises BadRequestError)
            raise APIError(
                400, str(exc), param=prompt_param, code="context_length_exceeded"
            ) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens", code="invalid_value") from None
        try:
            return SamplingParams(
                max_tokens=max(n_new, 1),  # 0 (prefill only) is the engine's prefill_only
                temperature=1.0 if body.temperature is None else float(body.temperature),
                top_k=body.top_k,
                top_p=None if body.top_p is None else float(body.top_p),
                seed=body.seed,
                stop=tuple(stop),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                top_logprobs=top,
                grammar=grammar,
            )
        except (TypeError, ValueError) as exc:  # (the body's types already hold)
            raise APIError(400, str(exc), code="invalid_value") from None

    deliveries: dict = {}  # event loop -> its _Delivery (one loop under uvicorn)

    async def submit(jobs):
        """Submit one engine request per choice; return (handles, queue of (index, event)).

        ``jobs``: one ``(ids, params, prompt_logprobs, prefill_only)`` per choice, in index
        order. When one cannot be queued, those already queued are cancelled.
        """
        loop = asyncio.get_running_loop()
        delivery = deliveries.get(loop)
        if delivery is None:
            delivery = deliveries[loop] = _Delivery(loop)
            engine.add_burst_hook(delivery.kick)
        events: asyncio.Queue = asyncio.Queue()
        handles: list = []
        # an engine whose submission is remote (exactblocks.ray's fleet) answers it awaited,
        # with the same errors
        asubmit = getattr(engine, "asubmit", None)
        try:
            for index, (ids, params, plp, only) in enumerate(jobs):
                sink = delivery.sink(events, index)
                if asubmit is not None:
                    handles.append(await asubmit(ids, params, sink, prompt_logprobs=plp,
                                                 prefill_only=only))  # fmt: skip
                else:
                    handles.append(engine.submit(ids, params, sink, prompt_logprobs=plp,
                                                 prefill_only=only))  # fmt: skip
        except QueueFull as exc:
            for h in handles:
                h.cancel()
            raise APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(exc.retry_after)},
            ) from None
        except EngineClosed:
            for h in handles:
                h.cancel()
            raise _shutting_down() from None
        except ValueError as exc:
            for h in handles:
                h.cancel()
            raise APIError(400, str(exc), code="invalid_value") from None
        return handles, events

    async def collect(request: Request, handles, events) -> list[dict]:
        """Wait for every choice; return per index ``{"prompt", "toks", "fin"}``."""
        out = [{"prompt": None, "toks": [], "fin": None} for _ in handles]
        left = len(handles)
        checked = time.monotonic()
        try:
            while left:
                try:
                    item = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    item = None
                if time.monotonic() - checked >= 0.5:  # the client may have gone away
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected")
                if item is None:
                    continue
                index, ev = item
                if isinstance(ev, FinishEvent):
                    if ev.finish_reason == "abort":  # only a shutdown ends a live request so
                        raise _shutting_down(ev.error or SHUTTING_DOWN)
                    if ev.finish_reason == "error":
                        raise APIError(500, ev.error or ev.finish_reason, type="server_error")
                    out[index]["fin"] = ev
                    left -= 1
                elif isinstance(ev, PromptEvent):
                    out[index]["prompt"] = ev
                else:
                    out[index]["toks"].append(ev)
            return out
        finally:
            for h in handles:
                if h.finished is None:
                    h.cancel()

    def usage(fins: list, n: int) -> dict:
        """Usage of a request's choices: each prompt counted once (``n`` choices each)."""
        prompt = sum(f.prompt_tokens for f in fins[::n])
        done = sum(f.completion_tokens for f in fins)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in fins[::n])},
        }

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def stream(request, handles, events, make_chunk, include_usage, n, heads=()):
        """Server-sent events of a request's choices; unfinished ones are cancelled on exit.

        ``make_chunk(index, text, events, finish_reason, prompt_event=None)`` builds a chunk,
        or a list of chunks (none: nothing to send yet) for a token or a finish; called with
        ``("", [], None)`` it returns one chunk (the usage chunk's base).
        """

        async def gen() -> AsyncIterator[str]:
            fins: list = [None] * len(handles)
            left = len(handles)
            try:
                for head in heads:
                    yield sse(head)
                while left:
                    index, ev = await events.get()
                    if isinstance(ev, PromptEvent):
                        yield sse(make_chunk(index, None, [], None, ev))
                        continue
                    if isinstance(ev, TokenEvent):
                        for c in _chunks(make_chunk(index, ev.text, [ev], None)):
                            yield sse(c)
                        continue
                    if ev.finish_reason in ("error", "abort"):
                        # the status line is sent: a last event carries the error instead
                        if ev.finish_reason == "abort":
                            err = _shutting_down(ev.error or SHUTTING_DOWN)
                        else:
                            err = APIError(500, ev.error or "error", type="server_error")
                        yield sse(error_body(err.message, err.type, err.param, err.code))
                        return
                    fins[index] = ev
                    left -= 1
                    last = [ev.stop_token] if ev.stop_token is not None else []
                    for c in _chunks(make_chunk(index, ev.tail, last, ev.finish_reason)):
                        yield sse(c)
                if include_usage:
                    last = make_chunk(0, "", [], None)
                    last["choices"] = []
                    last["usage"] = usage(fins, n)
                    yield sse(last)
                yield "data: [DONE]\n\n"
            finally:
                for h in handles:
                    if h.finished is None:
                        h.cancel()

        return StreamingResponse(
            gen(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def choices_of(body, params: SamplingParams) -> list[SamplingParams]:
        """The n choices' params: choice j samples with seed + j (no seed: fresh draws)."""
        n = body.n or 1
        if params.seed is None:
            return [params] * n
        return [dataclasses.replace(params, seed=params.seed + j) for j in range(n)]

    return SimpleNamespace(
        engine=engine,
        model=model,
        tok=tok,
        text_pool=text_pool,
        off_loop=off_loop,
        refuse_if_too_long=refuse_if_too_long,
        parse=parse,
        grammar_of=grammar_of,
        params_of=params_of,
        choices_of=choices_of,
        submit=submit,
        collect=collect,
        usage=usage,
        stream=stream,
    )


def _chunks(made) -> list:
    """``make_chunk``'s answer as a list of chunks."""
    return made if isinstance(made, list) else [made]


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text))
