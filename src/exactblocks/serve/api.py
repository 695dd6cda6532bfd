"""The ASGI app: OpenAI-compatible routes over an :class:`~exactblocks.serve.engine.Engine`.

What lives here: :func:`create_app` (FastAPI) with ``/v1/models``, ``/health`` and
``/metrics`` (also under vLLM's gauge names), the routes of ``exactblocks.serve.completions``
(``/v1/chat/completions``, ``/v1/completions``) and ``exactblocks.serve.embeddings``
(``/v1/embeddings``); OpenAI error bodies for every failure; the ``--api-key`` check and the
HTTP status counts (one pure ASGI middleware). ``token_bytes``, ``token_text``
(``exactblocks.serve.echo``) and ``pooled_embeddings`` are re-exported here. What does not:
what the routes share (``exactblocks.serve.handling``: typed requests of
``exactblocks.serve.protocol`` into prompt ids and
:class:`~exactblocks.serve.engine.SamplingParams`, engine events into OpenAI JSON and
server-sent events), scheduling, states, sampling (the engine), running the server
(``exactblocks.serve.cli``).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import completions, embeddings
from .echo import token_bytes, token_text
from .embeddings import pooled_embeddings
from .engine import Engine
from .handling import shared
from .protocol import APIError, error_body
from .tools import ToolSupport

__all__ = ["create_app", "pooled_embeddings", "token_bytes", "token_text"]


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


def create_app(
    engine: Engine,
    *,
    model_name: str,
    api_key: str | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
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
    chat_template : str or None, default=None
        A chat template source to render every chat with instead of the model's (a template
        that renders tools, for a model whose own does not).
    tool_call_parser : str or None, default=None
        The tool-call syntax (``exactblocks.text.TOOL_CALL_PARSERS``); None reads it from the
        template's text.

    Returns
    -------
    fastapi.FastAPI

    Raises
    ------
    ValueError
        ``chat_template`` fails to render a one-message conversation; an unknown
        ``tool_call_parser``.
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
        # an engine of several replicas (exactblocks.ray's fleet) reads their reports first
        # and labels the gauges per replica
        refresh = getattr(engine, "refresh", None)
        if refresh is not None:
            await refresh()
        per_replica = getattr(engine, "replica_stats", None)
        text = _prometheus(engine.stats(), http_counts, model_name,
                           None if per_replica is None else per_replica())  # fmt: skip
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # -- generation and embeddings ----------------------------------------------------------
    tok = model.tokenizer
    if chat_template is not None and tok is not None:
        try:  # rendered once now: a template that cannot render is refused before serving
            tok.apply_chat_template(
                [{"role": "user", "content": "Hello"}],
                add_generation_prompt=True,
                chat_template=chat_template,
            )
        except Exception as exc:
            raise ValueError(
                "create_app: the chat_template fails to render a one-message conversation: "
                f"{type(exc).__name__}: {exc}"
            ) from None
    tools = ToolSupport(tok, chat_template, tool_call_parser)
    h = shared(engine, model_name)
    app.state.text_pool = h.text_pool
    app.state.tools = tools
    completions.add_routes(app, h, model_name, fingerprint, tools)
    embeddings.add_routes(app, h, model_name)
    return app


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


#: Per-replica counters of a fleet's ``/metrics`` -> the engine's stats key and help.
REPLICA_COUNTERS = {
    "exactblocks_replica_requests_submitted_total": ("requests_submitted", "Requests taken."),
    "exactblocks_replica_prefix_cache_hits_total": ("prefix_cache_hits", "Prefix-cache hits."),
    "exactblocks_replica_generation_tokens_total": ("generation_tokens_total",
                                                   "Tokens generated."),
}  # fmt: skip


def _prometheus(stats: dict, http_counts: Counter, model_name: str = "",
                per_replica: dict | None = None) -> str:  # fmt: skip
    """Prometheus text exposition of the engine's stats, the HTTP status counts, and the
    gauges under vLLM's names (labelled ``model_name`` as vLLM labels them). With
    ``per_replica`` (``{replica: stats}``, a fleet), the vLLM gauges have one sample per
    replica (labelled ``replica`` too) and :data:`REPLICA_COUNTERS` are added."""
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
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        if per_replica is None:
            lines.append(f'{name}{{model_name="{label}"}} {float(stats[key])!r}')
            continue
        for replica, rep in sorted(per_replica.items()):
            lines.append(f'{name}{{model_name="{label}",replica="{replica}"}} '
                         f"{float(rep.get(key, 0))!r}")  # fmt: skip
    for name, (key, help_text) in REPLICA_COUNTERS.items() if per_replica else ():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        for replica, rep in sorted(per_replica.items()):
            lines.append(f'{name}{{model_name="{label}",replica="{replica}"}} '
                         f"{float(rep.get(key, 0))!r}")  # fmt: skip
    return "\n".join(lines) + "\n"
