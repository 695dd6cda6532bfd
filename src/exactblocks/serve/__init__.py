"""``exactblocks serve``: an OpenAI-compatible server with continuous batching, exact prefix
caching and batch-invariant answers.

Layout: ``engine`` (the loop thread, scheduling, sampling; knows nothing of HTTP),
``prefix_cache`` (saved row states keyed by token ids), ``protocol`` (typed request bodies,
OpenAI error body), ``api`` (the FastAPI app factory :func:`create_app`), ``cli``
(``build_server``: the engine and the app in an uvicorn server; the ``exactblocks serve``
command itself is ``exactblocks.cli.serve``). The engine needs only NumPy; ``api`` and ``cli``
need the ``serve`` extra (fastapi, uvicorn).
"""

from .engine import (
    Engine,
    EngineClosed,
    FinishEvent,
    PromptEvent,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)

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
    "create_app",
]


def __getattr__(name):
    if name == "create_app":  # imports fastapi: only when asked for
        from .api import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
