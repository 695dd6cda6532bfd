"""The ASGI app: OpenAI-compatible routes over an :class:`~exactblocks.serve.engine.Engine`.

What lives here: :func:`create_app` (FastAPI) with ``/v1/chat/completions``,
``/v1/completions`` (with echo and prompt logprobs, batched prompts, ``n`` choices),
``/v1/embeddings``, ``/v1/models``, ``/health`` and ``/metrics`` (also under vLLM's gauge
names); the translation of typed
requests (``exactblocks.serve.protocol``) into prompt ids and
:class:`~exactblocks.serve.engine.SamplingParams`, and of engine events into OpenAI JSON and
server-sent events; OpenAI error bodies for every failure; the ``--api-key`` check. What does
not: scheduling, states, sampling (the engine), running the server (``exactblocks.serve.cli``).

The engine delivers a step's events in one burst from its loop thread; :class:`_Delivery`
puts them into each request's ``asyncio.Queue`` with one ``loop.call_soon_threadsafe`` per
burst (one event-loop wakeup per step, not one per token). A streaming client that goes away
closes the response generator, whose ``finally`` cancels the request and frees its row; a
non-streaming request polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import hmac
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..text import Detokenizer, bytes_to_unicode
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
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    error_body,
)

__all__ = ["create_app", "pooled_embeddings", "token_bytes", "token_text"]

MAX_BODY_BYTES = 4 * 2**20
MAX_STOP_STRINGS = 4
#: Most choices (``n``) per request.
MAX_N = 16
#: Most choices (prompts x ``n``) of one ``/v1/completions`` request.
MAX_CHOICES = 64
#: Most inputs of one ``/v1/embeddings`` request.
MAX_EMBEDDING_INPUTS = 256
#: Inputs run together in one ``Model.hidden_states`` call (the bits do not depend on it).
EMBEDDING_BATCH = 8
#: ``max_tokens`` of a ``/v1/completions`` request that gives none (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Threads that tokenize prompts and render chat templates, off the event loop.
TOKENIZE_THREADS = 2


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {loc!r}", param=loc, code="unknown_field")
    where = f"{loc}: " if loc else "the body: "
    return APIError(400, where + err["msg"], param=loc or None, code="invalid_value")


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


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.type, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


class _AuthAndCount:
    """Pure ASGI middleware: the API key check (all routes but /health) and status counts.

    Not ``BaseHTTPMiddleware``: that wraps ``receive``, and a waiting request could then no
    longer see its client disconnect.
    """

    def __init__(self, app, api_key: str | None, counts: Counter):
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.counts = counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path.startswith("/v1/") or path in ("/health", "/metrics") else "other"
        if route.startswith("/v1/") and route not in _ROUTES:
            route = "other"  # bounded label values, whatever paths clients send
        if self.expected is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            # the scheme name is case-insensitive (RFC 9110 11.1): "bearer KEY" is accepted
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
            if not ok:
                self.counts[(route, 401)] += 1
                err = APIError(401, "invalid or missing API key", code="invalid_api_key")
                return await _error_response(err)(scope, receive, send)
        status = [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.counts[(route, status[0])] += 1


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models")


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """Build the FastAPI app serving ``engine`` under the model id ``model_name``.

    Parameters
    ----------
    engine : Engine
        Started by the app's lifespan if it is not running, shut down with the app.
    model_name : str
        The id ``/v1/models`` lists and requests must name.
    api_key : str or None, default=None
        When set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``
        (401 otherwise).

    Returns
    -------
    fastapi.FastAPI
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)
            app.state.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="exactblocks", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    model = engine.model
    tok = model.tokenizer
    fingerprint = "fp_" + model.fingerprint[:16]
    created = int(time.time())
    http_counts: Counter = Counter()

    app.add_middleware(_AuthAndCount, api_key=api_key, counts=http_counts)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):  # pragma: no cover - a bug
        return _error_response(
            APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        )

    # -- plain routes -----------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    model_card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "exactblocks",
    }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != model_name:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        return model_card

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            _prometheus(engine.stats(), http_counts, model_name),
            media_type="text/plain; version=0.0.4",
        )

    # -- generation -------------------------------------------------------------------------
    # Tokenizing a long prompt takes seconds: it runs on a few threads of its own, never on
    # the event loop (other streams keep flowing), and a text too long to fit is refused
    # before any of it is tokenized.
    text_pool = concurrent.futures.ThreadPoolExecutor(
        TOKENIZE_THREADS, thread_name_prefix="exactblocks-tokenize"
    )
    app.state.text_pool = text_pool
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
        too_big = APIError(413, f"the body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_big  # refused before reading it
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise too_big
            parts.append(part)
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

    def params_of(body, n_prompt, max_tokens, logprobs, top, prompt_param) -> SamplingParams:
        """The request's SamplingParams: the body's fields, checked by the generation core."""
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
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
        try:
            for index, (ids, params, plp, only) in enumerate(jobs):
                handles.append(engine.submit(ids, params, delivery.sink(events, index),
                                             prompt_logprobs=plp, prefill_only=only))  # fmt: skip
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

    def token_str(i: int) -> str:
        return str(i) if tok is None else token_text(tok, i)

    def chat_lp(ev: TokenEvent) -> dict:
        def one(i, lp):
            s = token_str(i)
            raw = list(s.encode("utf-8")) if tok is None else token_bytes(tok, i)
            return {"token": s, "logprob": lp, "bytes": raw}

        top = [one(i, lp) for i, lp in (ev.top_logprobs or [])]
        return {**one(ev.token, ev.logprob), "top_logprobs": top}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def stream(request, handles, events, make_chunk, include_usage, n, heads=()):
        """Server-sent events of a request's choices; unfinished ones are cancelled on exit.

        ``make_chunk(index, text, events, finish_reason, prompt_event=None)`` builds a chunk.
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
                        yield sse(make_chunk(index, ev.text, [ev], None))
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
                    yield sse(make_chunk(index, ev.tail, last, ev.finish_reason))
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatCompletionRequest)
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both")
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        await refuse_if_too_long(sum(len(m["content"].encode("utf-8")) for m in messages),
                                 "messages")  # fmt: skip
        try:
            ids = await off_loop(_render_chat, tok, messages)
        except Exception as exc:
            raise APIError(
                400, f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        max_tokens = body.max_tokens or body.max_completion_tokens
        params = params_of(
            body, len(ids), max_tokens, body.logprobs, body.top_logprobs or 0, "messages"
        )
        n = body.n or 1
        handles, events = await submit([(ids, p, None, False) for p in choices_of(body, params)])
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        base = {"id": rid, "created": now, "model": model_name, "system_fingerprint": fingerprint}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(index, text, evs, finish, prompt=None):
                delta = {"content": text} if text or finish is None else {}
                evs = [e for e in evs if e is not None and finish is None]  # no stop token
                lp = {"content": [chat_lp(e) for e in evs]} if body.logprobs and evs else None
                out = {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [
                        {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                    ],
                }
                if include_usage:
                    out["usage"] = None
                return out

            heads = []
            for index in range(n):
                head = chunk(index, "", [], None)
                head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                heads.append(head)
            return await stream(request, handles, events, chunk, include_usage, n, heads)

        done = await collect(request, handles, events)
        return {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": c["fin"].text},
                    "logprobs": (
                        {"content": [chat_lp(e) for e in c["toks"]]} if body.logprobs else None
                    ),
                    "finish_reason": c["fin"].finish_reason,
                }
                for index, c in enumerate(done)
            ],
            "usage": usage([c["fin"] for c in done], n),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; at most "
                f"{MAX_CHOICES} per request",
                param="prompt",
                code="invalid_value",
            )
        id_lists = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(prompt, str):
                if tok is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", param=where)
                await refuse_if_too_long(len(prompt.encode("utf-8")), where)
                ids = await off_loop(_encode, tok, prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise APIError(400, f"the {where.replace('.', ' ')} is empty", param=where)
            if any(i < 0 or i >= model.vocab_size for i in ids):
                raise APIError(400, f"a token id is outside [0, {model.vocab_size})", param=where)
            id_lists.append(ids)
        k = body.logprobs
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        only = max_tokens == 0
        plp = k if body.echo and k is not None else None
        jobs = []
        for i, ids in enumerate(id_lists):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            params = params_of(body, len(ids), max_tokens, k is not None, k or 0, where)
            jobs += [(ids, p, plp, only) for p in choices_of(body, params)]
        echoes = []
        if body.echo:
            echoes = [await off_loop(_prompt_text, tok, ids) for ids in id_lists]
        handles, events = await submit(jobs)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        base = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "system_fingerprint": fingerprint,
        }

        def legacy_lp(evs, shift=0, out=None):
            out = out or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for e in evs:
                out["tokens"].append(token_str(e.token))
                out["token_logprobs"].append(e.logprob)
                out["top_logprobs"].append({token_str(i): lp for i, lp in e.top_logprobs or []})
                out["text_offset"].append(e.text_offset + shift)
            return out

        def prompt_lp(index, pev: PromptEvent) -> dict:
            ids = id_lists[index // n]
            offsets = echoes[index // n][1]
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for j, (t, (lp, top)) in enumerate(zip(ids, pev.logprobs)):
                out["tokens"].append(token_str(t))
                out["token_logprobs"].append(lp)
                first = j == 0
                out["top_logprobs"].append(
                    None if first else {token_str(i): v for i, v in top or []}
                )
                out["text_offset"].append(offsets[j])
            return out

        def echo_text(index) -> str:
            return echoes[index // n][0] if body.echo else ""

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(index, text, evs, finish, prompt=None):
                if prompt is not None:  # the echo, with the prompt's logprobs
                    text, lp = echo_text(index), prompt_lp(index, prompt)
                else:
                    shift = len(echo_text(index))
                    lp = legacy_lp(evs, shift) if k is not None and evs else None
                out = {
                    **base,
                    "choices": [
                        {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
                    ],
                }
                if include_usage:
                    out["usage"] = None
                return out

            heads = []
            if body.echo and plp is None:  # the echo first (with logprobs: once they are in)
                heads = [chunk(index, echo_text(index), [], None) for index in range(len(jobs))]
            return await stream(request, handles, events, chunk, include_usage, n, heads)

        done = await collect(request, handles, events)
        choices = []
        for index, c in enumerate(done):
            fin, lp = c["fin"], None
            toks = c["toks"] + ([fin.stop_token] if fin.stop_token is not None else [])
            if k is not None:
                head = prompt_lp(index, c["prompt"]) if body.echo else None
                lp = legacy_lp(toks, len(echo_text(index)), head)
            choices.append(
                {
                    "index": index,
                    "text": echo_text(index) + fin.text,
                    "logprobs": lp,
                    "finish_reason": fin.finish_reason,
                }
            )
        return {**base, "choices": choices, "usage": usage([c["fin"] for c in done], n)}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse(request, EmbeddingRequest)
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise APIError(400, "the input is empty", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(
                400,
                f"{len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
                param="input",
            )
        cap = engine.max_tokens_per_sequence
        id_lists = []
        for i, item in enumerate(inputs):
            where = "input" if len(inputs) == 1 else f"input.{i}"
            if isinstance(item, str):
                if tok is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", param=where)
                await refuse_if_too_long(len(item.encode("utf-8")), where)
                ids = await off_loop(_encode, tok, item)
            else:
                ids = list(item)
            if not ids:
                raise APIError(400, f"the {where.replace('.', ' ')} is empty", param=where)
            if len(ids) > cap:
                raise APIError(
                    400,
                    f"the {where.replace('.', ' ')} has {len(ids)} tokens; this server embeds "
                    f"at most {cap}",
                    param=where,
                    code="context_length_exceeded",
                )
            if any(t < 0 or t >= model.vocab_size for t in ids):
                raise APIError(400, f"a token id is outside [0, {model.vocab_size})", param=where)
            id_lists.append(ids)
        try:
            vectors = await asyncio.to_thread(pooled_embeddings, model, id_lists, body.pooling)
        except Exception as exc:  # non-finite activations, memory
            raise APIError(500, f"{type(exc).__name__}: {exc}", type="server_error") from None
        data = []
        for i, vec in enumerate(vectors):
            if body.encoding_format == "base64":
                emb = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
            else:
                emb = vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n_tokens = sum(len(ids) for ids in id_lists)
        return {
            "object": "list",
            "data": data,
            "model": model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    return app


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tok, i: int) -> list[int]:
    """The UTF-8 bytes of token ``i``: a byte-level BPE token's own bytes, else its text's.

    Parameters
    ----------
    tok : tokenizer
        ``decode``, and ``id_to_token`` for a byte-level BPE.
    i : int

    Returns
    -------
    list of int
    """
    spelled = getattr(tok, "id_to_token", None)
    if spelled is not None:
        s = spelled(i)
        if all(c in _BYTE_OF for c in s):
            return [_BYTE_OF[c] for c in s]
    return list(tok.decode([i]).encode("utf-8"))


def token_text(tok, i: int) -> str:
    """Token ``i`` as the logprobs report it: its text, or, for a token that is not whole
    UTF-8 (a part of a character), its bytes spelled ``bytes:\\xe2\\x80`` as OpenAI does, so
    two such tokens never share a ``top_logprobs`` key.

    Parameters
    ----------
    tok : tokenizer
    i : int

    Returns
    -------
    str
    """
    text = tok.decode([i])
    if "\ufffd" in text:
        raw = bytes(token_bytes(tok, i))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def pooled_embeddings(model, id_lists: list, pooling: str = "last") -> list:
    """One embedding per token-id list: the final hidden states (after the final norm), pooled.

    Parameters
    ----------
    model : exactblocks.Model
    id_lists : list of list of int
        Non-empty, within the model's positions.
    pooling : {"last", "mean"}, default="last"
        ``"last"``: the state of the last token. ``"mean"``: the mean over the tokens, summed
        position by position in float64 and rounded once to float32.

    Returns
    -------
    list of ndarray of shape (d_model,), float32
        Each the bits of its list run alone (``Model.hidden_states`` is batch-invariant and
        the pooling reads only the list's own positions).
    """
    if pooling not in ("last", "mean"):
        raise ValueError(f"pooling={pooling!r}; expected 'last' or 'mean'")
    out = []
    for start in range(0, len(id_lists), EMBEDDING_BATCH):
        group = id_lists[start : start + EMBEDDING_BATCH]
        lens = np.array([len(ids) for ids in group], np.int64)
        ids = np.zeros((len(group), int(lens.max())), np.int64)
        for r, row in enumerate(group):
            ids[r, : len(row)] = row
        hidden = model.hidden_states(ids, lengths=lens)
        for r, n in enumerate(lens.tolist()):
            if pooling == "last":
                out.append(hidden[r, n - 1].copy())
            else:
                acc = np.zeros(hidden.shape[2], np.float64)
                for t in range(n):  # one fixed order: position by position
                    acc += hidden[r, t]
                out.append((acc / n).astype(np.float32))
    return out


def _prompt_text(tok, ids: list) -> tuple[str, list[int]]:
    """A prompt's text as its tokens decode, and each token's offset in it (characters).

    The offsets follow the generation core's rule: a token starts where the text of the
    tokens before it ends, counting only whole characters.
    """
    if tok is None:
        return "", [0] * len(ids)
    detok = Detokenizer(tok)
    offsets = []
    for t in ids:
        offsets.append(detok.decoded_len)
        detok.push(int(t))
    detok.finish()
    return detok.text, offsets


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text))


def _render_chat(tok, messages: list) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


#: vLLM's gauge names (what inference gateways route on) -> the engine's stats key and help.
VLLM_GAUGES = {
    "vllm:num_requests_running": ("running", "Requests in a row of the batch (generating)."),
    "vllm:num_requests_waiting": ("waiting", "Requests waiting for a row."),
    "vllm:gpu_cache_usage_perc": (
        "kv_cache_usage",
        "KV-cache use as a fraction 0..1: positions held by running requests over all rows' "
        "positions (a CPU server: the name is vLLM's).",
    ),
}


def _prometheus(stats: dict, http_counts: Counter, model_name: str = "") -> str:
    """Prometheus text exposition of the engine's stats, the HTTP status counts, and the
    gauges under vLLM's names (labelled ``model_name`` as vLLM labels them)."""
    gauges = {"running", "waiting", "max_batch", "prefix_cache_bytes", "prefix_cache_entries",
              "kv_cache_usage"}  # fmt: skip
    lines = []
    for key in sorted(stats):
        name = f"exactblocks_{key}"
        kind = "gauge" if key in gauges else "counter"
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"
        lines += [f"# TYPE {name} {kind}", f"{name} {float(stats[key])!r}"]
    lines.append("# TYPE exactblocks_http_responses_total counter")
    for (route, status), n in sorted(http_counts.items()):
        lines.append(f'exactblocks_http_responses_total{{route="{route}",code="{status}"}} {n}')
    label = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    for name, (key, help_text) in VLLM_GAUGES.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                  f'{name}{{model_name="{label}"}} {float(stats[key])!r}']  # fmt: skip
    return "\n".join(lines) + "\n"
