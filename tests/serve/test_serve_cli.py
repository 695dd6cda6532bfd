"""``exactblocks serve`` as a user runs it: a subprocess on a free loopback port (a tiny random
Llama with a tokenizer, saved with ``save_pretrained``), called with the official client, then
stopped with SIGINT (a clean uvicorn shutdown)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from serve_helpers import require, tiny_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subcommand_answers_the_official_client(tmp_path):
    openai = require("openai", "the tests call the server with the official client")
    require("fastapi", "the server needs fastapi")
    model = tiny_model("llama", tmp_path)
    folder = model.source if isinstance(model.source, str) else str(tmp_path / "tiny_llama")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "exactblocks", "serve", folder, "--port", str(port),
         "--max-batch", "2", "--threads", "1", "--model-name", "tiny", "--api-key", "k"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                               max_retries=0)  # fmt: skip
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5, seed=3
        )
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        assert r.system_fingerprint.startswith("fp_")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hung shutdown
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
