"""The ``exactblocks serve`` subcommand: load a model, build the engine and app, run uvicorn.

What lives here: :func:`add_parser` (called by ``exactblocks.cli``), :func:`build_server`
(also used by the tests and the serving benchmark to run a real server in a thread) and
:func:`run_serve`. What does not: the engine and the routes.
"""

from __future__ import annotations

import os
import sys

__all__ = ["add_parser", "build_server", "run_serve"]


def port_number(text: str) -> int:
    """argparse type of ``--port``: an int in [0, 65535] (0 = a free port), checked before the
    model loads."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 65535]; got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 65535]; got {value}")
    return value


def _non_negative(what: str):
    """argparse type: a finite float >= 0; ``what`` names it in the message ("a number of MiB")."""

    def parse(text: str) -> float:
        import argparse
        import math

        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} >= 0; got {text!r}") from None
        if not math.isfinite(value) or value < 0:
            finite = what.replace("a number", "a finite number", 1)
            raise argparse.ArgumentTypeError(f"expected {finite} >= 0; got {text!r}")
        return value

    return parse


#: ``--prefix-cache-mb`` (MiB; 0 disables the cache) and ``--prefill-ratio``.
non_negative_mb = _non_negative("a number of MiB")
non_negative_ratio = _non_negative("a number")


def add_parser(sub, positive_int) -> None:
    """Add ``serve`` to the ``exactblocks`` subparsers."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (continuous batching, exact prefix cache)",
        description="Serve MODEL over an OpenAI-compatible HTTP API: /v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics. A seeded request gets the same "
        "tokens and logprobs, bit for bit, alone or under any load.",
    )
    p.add_argument("model", metavar="MODEL", help="anything exactblocks.load_model accepts")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="exactblocks threads (default: CPUs available)",
    )
    p.add_argument(
        "--max-batch", type=positive_int, default=8, help="requests generating at once (default: 8)"
    )
    p.add_argument(
        "--max-tokens-per-sequence",
        type=positive_int,
        default=None,
        help="prompt + completion tokens per request (default: min(4096, the model's positions))",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting for a batch row before 429 (default: 64)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=64,
        help="prompt tokens per row per step; prefix-cache boundary (default: 64)",
    )
    p.add_argument(
        "--prefill-ratio",
        type=non_negative_ratio,
        default=1.0,
        help="while requests decode, a step carries at most max(16, R x decoding requests) "
        "prompt tokens, bounding the per-token latency a prefill adds to about (1 + R) x a "
        "decode step; larger R = faster first tokens, slower others (default: 1.0)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=non_negative_mb,
        default=256.0,
        help="prefix cache budget in MiB, 0 disables it (default: 256)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("EXACTBLOCKS_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $EXACTBLOCKS_API_KEY, else none)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send (default: MODEL's file or folder name)",
    )


def build_server(
    model,
    *,
    host="127.0.0.1",
    port=8000,
    model_name="model",
    api_key=None,
    log_level="warning",
    **engine_kw,
):
    """An uvicorn ``Server`` for ``model`` (not started: ``server.run()`` or a thread).

    Parameters
    ----------
    model : exactblocks.Model
    host, port : str, int
        Port 0 picks a free one (read it from ``server.servers[0].sockets`` once started).
    model_name : str
    api_key : str or None
    log_level : str
    **engine_kw
        Passed to :class:`~exactblocks.serve.engine.Engine`.

    Returns
    -------
    uvicorn.Server
        ``server.config.app.state.engine`` is the engine. On shutdown (a signal or
        ``should_exit``) the engine stops first: a request still running gets a 503 error
        body with code ``server_shutting_down`` (streamed: a last ``error`` event).
    """
    import asyncio

    import uvicorn

    from .api import create_app
    from .engine import Engine

    engine = Engine(model, **engine_kw)
    app = create_app(engine, model_name=model_name, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # Stop the engine first: each running request then ends with a 503 body (or a
            # last error event when streamed) before uvicorn waits for its connections; it
            # would otherwise cancel them after its grace period with a bare 500.
            await asyncio.to_thread(engine.shutdown)
            await super().shutdown(sockets)

    return Server(config)


def run_serve(args) -> int:
    """Run ``exactblocks serve`` until interrupted; return the exit status."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(
            f"exactblocks serve: {exc}; install the serve extra: pip install 'exactblocks[serve]'",
            file=sys.stderr,
        )
        return 2
    from exactblocks.models.cli import _load

    model = _load(args.model, args.threads, sys.stderr)
    name = args.model_name or os.path.basename(os.path.normpath(str(args.model)))
    server = build_server(
        model,
        host=args.host,
        port=args.port,
        model_name=name,
        api_key=args.api_key,
        log_level="info",
        max_batch=args.max_batch,
        max_tokens_per_sequence=args.max_tokens_per_sequence,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        prefill_ratio=args.prefill_ratio,
        prefix_cache_mb=args.prefix_cache_mb,
    )
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown
        pass
    print("server stopped", file=sys.stderr)
    return 0
