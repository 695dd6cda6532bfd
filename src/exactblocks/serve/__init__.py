"""``exactblocks serve``: an OpenAI-compatible server with continuous batching, exact prefix
caching and batch-invariant answers.

Layout: ``engine`` (the loop thread, scheduling, sampling; knows nothing of HTTP), ``request``
(its events, request handles and errors), ``scoring`` (its prompt-logprobs step),
``prefix_cache`` (saved row states keyed by token ids), ``protocol`` (typed request bodies,
OpenAI error body), ``api`` (the FastAPI app factory :func:`create_app`, the plain routes, the
API key check), ``handling`` (what the routes share: body checks, submission, collecting and
streaming events), ``completions`` (``/v1/chat/completions``, ``/v1/completions``),
``tools`` (tool calling on chat: the request's tools checked, the history rendered, the calls
in OpenAI's shapes), ``echo`` (logprobs and echo in the OpenAI shapes), ``embeddings``
(``/v1/embeddings``), ``cli`` (``build_server``: the engine and the app in an uvicorn server;
the ``exactblocks serve`` command itself is ``exactblocks.cli.serve``). ``engine``,
``request``, ``scoring``, ``prefix_cache`` and ``echo`` need only NumPy; the others need the
``serve`` extra (fastapi, uvicorn; llguidance for ``tool_choice`` "required" or a named
function).
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
    check_sizes,
    prepare_request,
)
from .tools import TOOL_CALL_PARSERS

__all__ = [
    "Engine",
    "EngineClosed",
    "FinishEvent",
    "PromptEvent",
    "PromptTooLong",
    "QueueFull",
    "RequestHandle",
    "SamplingParams",
    "TOOL_CALL_PARSERS",
    "TokenEvent",
    "check_sizes",
    "create_app",
    "prepare_request",
]


def __getattr__(name):
    if name == "create_app":  # imports fastapi: only when asked for
        from .api import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
