"""Shutting a real server down while requests run: each client gets an OpenAI-style error (503,
``server_shutting_down``), not a bare 500 or a cut connection. Called with the official
``openai`` client against uvicorn on a free loopback port and the real SmolLM2 model."""

from __future__ import annotations

import threading
import time

import pytest
from serve_helpers import live_server, require

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press begins"  # greedy: 120+ tokens before any EOS


def test_shutdown_mid_request_answers_503_and_a_last_error_event(smol):
    openai = require("openai", "the test calls the server with the official client")
    out: dict = {}
    with live_server(smol, max_batch=2, max_tokens_per_sequence=512) as srv:
        client = srv.client()
        args = dict(model="smollm2", prompt=PROMPT, max_tokens=480, temperature=0.0)
        streamed: list = []

        def plain():
            try:
                out["plain"] = client.completions.create(**args)
            except Exception as exc:  # the assertions below say which
                out["plain"] = exc

        def stream():
            try:
                for chunk in client.completions.create(stream=True, **args):
                    streamed.extend(c.text for c in chunk.choices)
                out["stream"] = "ended without an error"
            except Exception as exc:
                out["stream"] = exc

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while srv.metric("exactblocks_generation_tokens_total") < 10 or len(streamed) < 4:
            assert time.monotonic() < deadline, "the requests did not start generating"
            time.sleep(0.02)
        assert srv.engine.stats()["running"] == 2  # both still generating (480 tokens each)
        srv.stop()
        for t in threads:
            t.join(60)

    plain_err = out["plain"]
    assert isinstance(plain_err, openai.APIStatusError), repr(plain_err)
    assert plain_err.status_code == 503
    assert plain_err.response.headers["retry-after"] == "1"
    body = plain_err.response.json()["error"]
    assert body["code"] == "server_shutting_down"
    assert body["type"] == "server_error"
    assert "shutting down" in body["message"]

    stream_err = out["stream"]  # the client raises on the stream's last event, an error body
    assert isinstance(stream_err, openai.APIError), repr(stream_err)
    assert not isinstance(stream_err, openai.APIConnectionError), repr(stream_err)
    assert stream_err.body["code"] == "server_shutting_down"
    assert "shutting down" in stream_err.message
    assert "".join(streamed).startswith(" with the invention of the printing press")
