"""Running the server: :func:`build_server` wraps the engine and the app in an uvicorn server.

Used by the ``exactblocks serve`` command (``exactblocks.cli.serve``), the tests and the serving
benchmark (which run a real server in a thread). What does not live here: the engine, the
routes, the command's flags.
"""

from __future__ import annotations

__all__ = ["build_server"]


def build_server(
    model,
    *,
    host="127.0.0.1",
    port=8000,
    model_name="model",
    api_key=None,
    log_level="warning",
    chat_template=None,
    tool_call_parser=None,
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
    chat_template : str or None
        A chat template source to render chats with instead of the model's.
    tool_call_parser : str or None
        The tool-call syntax; None reads it from the template.
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
    app = create_app(engine, model_name=model_name, api_key=api_key, chat_template=chat_template,
                     tool_call_parser=tool_call_parser)  # fmt: skip
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
