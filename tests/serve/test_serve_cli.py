"""``exactblocks serve`` as a user runs it: a subprocess on ``--port 0`` (a tiny random Llama with
a tokenizer, saved with ``save_pretrained``) that prints the port it bound, called with the
official client, then stopped with SIGINT (a clean uvicorn shutdown, one line, status 130).
Its flags are checked before the model loads, and it prints the memory it will hold."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from serve_helpers import require, tiny_model


def _serving_port(proc, deadline: float) -> tuple[int, list]:
    """Read the server's lines until ``serving 'NAME' on http://HOST:PORT/v1``; its PORT."""
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the server ended before serving:\n" + "".join(lines)
        lines.append(line)
        m = re.match(r"serving '.*' on http://127\.0\.0\.1:(\d+)/v1$", line.strip())
        if m:
            return int(m.group(1)), lines
    raise AssertionError("the server did not come up:\n" + "".join(lines))


def test_serve_subcommand_answers_the_official_client(tmp_path):
    openai = require("openai", "the tests call the server with the official client")
    require("fastapi", "the server needs fastapi")
    model = tiny_model("llama", tmp_path)
    folder = model.source if isinstance(model.source, str) else str(tmp_path / "tiny_llama")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # The child starts as from a terminal: SIGINT at its default handler, not blocked.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
        "sys.argv[0] = 'exactblocks'; runpy.run_module('exactblocks', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start, "serve", folder, "--port", "0",
         "--max-batch", "2", "--threads", "1", "--model-name", "tiny", "--api-key", "k"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list = []
    try:
        # --port 0 printed ":0"; now the port the kernel gave, which answers
        port, lines = _serving_port(proc, time.monotonic() + 120)
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            assert r.status == 200
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
    out = "".join(lines) + out
    # Ctrl-C ended with status 0; now as every command: one line and 128 + SIGINT
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.rstrip().splitlines()[-1] == "exactblocks serve: interrupted", out
    # the memory line, with the model's own numbers (2 rows x its positions x KV per token)
    import exactblocks

    loaded = exactblocks.load_model(folder)
    per_token = sum(2 * b.get_params()["n_kv_heads"] * b.get_params()["head_dim"] * 4
                    for b in loaded.blocks)  # fmt: skip
    mem = [ln for ln in out.splitlines() if ln.startswith("memory: ")]
    assert len(mem) == 1, out
    assert mem[0].startswith(f"memory: state 2 rows x {loaded.max_positions} tokens x "), mem
    assert f"{per_token} B KV per token" in mem[0] or f"{per_token / 1024:.1f} KiB" in mem[0]


def _tiny_folder(tmp_path) -> str:
    model = tiny_model("llama", tmp_path)
    return model.source if isinstance(model.source, str) else str(tmp_path / "tiny_llama")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-queue", "-1"], "argument --max-queue: expected an integer >= 0, got '-1'"),
        (["--max-queue", "x"], "argument --max-queue: expected an integer >= 0, got 'x'"),
        (["--port", "70000"], "argument --port: expected an int in [0, 65535]; got 70000"),
        (["--max-batch", "0"], "argument --max-batch: expected a positive integer, got '0'"),
        (
            ["--prefix-cache-mb", "-3"],
            "argument --prefix-cache-mb: expected a finite number of MiB >= 0; got '-3'",
        ),
    ],
)
def test_flags_are_checked_before_the_model_loads(tmp_path, capsys, flags, says):
    # `--max-queue -1` was refused only after the model loaded, by the engine's message
    from exactblocks.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "no-such-model"), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"exactblocks serve: error: {says}", err
    assert "loading" not in err and "no-such-model" not in err


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys):
    require("fastapi", "the server needs fastapi")
    from exactblocks.cli import main

    folder = _tiny_folder(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", folder, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"exactblocks serve: error: --port: cannot listen on 127.0.0.1:{port}: ")
    ), err
    assert "loading" not in err


def test_max_tokens_per_sequence_beyond_the_model_names_the_flag(tmp_path, capsys):
    require("fastapi", "the server needs fastapi")
    import exactblocks
    from exactblocks.cli import main

    folder = _tiny_folder(tmp_path)
    limit = exactblocks.load_model(folder).max_positions
    flags = ["--port", "0", "--max-tokens-per-sequence", str(limit + 1)]
    assert main(["serve", folder, *flags]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"exactblocks serve: error: --max-tokens-per-sequence: {limit + 1} exceeds the "
        f"model's max_positions={limit}"
    ), last


def test_chat_template_flag_is_read_and_rendered_before_serving(tmp_path, capsys):
    require("fastapi", "the server needs fastapi")
    from exactblocks.cli import main

    folder = _tiny_folder(tmp_path)
    missing = tmp_path / "none.jinja"
    assert main(["serve", folder, "--chat-template", str(missing)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"exactblocks serve: error: --chat-template: cannot read '{missing}'")
    assert "loading" not in err  # read before the model loads
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ raise_exception('no system role here') }}", encoding="utf-8")
    assert main(["serve", folder, "--port", "0", "--chat-template", str(broken)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"exactblocks serve: error: --chat-template: '{broken}' fails to render a one-message "
        "conversation: TemplateError: no system role here"
    ), last


@pytest.mark.parametrize("family", ["llama", "mistral", "mamba2"])
def test_server_memory_is_the_state_the_engine_allocates(tmp_path, family):
    # The printed formula against the buffers a state of that size really has (mistral: a
    # sliding window keeps at most its window; mamba2: a constant state per row)
    from exactblocks.cli.serve import memory_lines, server_memory

    model = tiny_model(family, tmp_path)
    m = model.max_positions or 4096
    mem = server_memory(model, 3, m, 2.0)
    state = model.allocate_state(3, None if family == "mamba2" else m)
    buffers = ("k_cache", "v_cache", "conv_window", "h")
    held = sum(getattr(st, a).nbytes for st in state.layers for a in buffers if hasattr(st, a))
    assert mem["state_bytes"] == held
    if family == "llama":
        assert mem["kv_bytes_per_token"] * 3 * m == held
    if family == "mamba2":
        assert mem["kv_bytes_per_token"] == 0
        line = memory_lines(mem, 3, m, available=None)[0]
        assert line.startswith("memory: state 3 rows x a constant state = "), line
    assert mem["prefix_cache_bytes"] == 2 * 2**20
    assert mem["total_bytes"] == held + 2 * 2**20
    assert mem["weight_bytes"] == sum(model.weight_storage().values())
    lines = memory_lines(mem, 3, m, available=10 * mem["total_bytes"])
    shape = "a constant state = " if family == "mamba2" else f"{m} tokens x "
    assert len(lines) == 1 and lines[0].startswith(f"memory: state 3 rows x {shape}"), lines
    lines = memory_lines(mem, 3, m, available=mem["total_bytes"] - 1)
    assert len(lines) == 2 and lines[1].startswith("warning: the server may use ")
    assert "lower --max-batch, --max-tokens-per-sequence or --prefix-cache-mb" in lines[1]


def test_available_memory_reads_memavailable(tmp_path):
    from exactblocks.cli.serve import available_memory

    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n")
    assert available_memory(str(f)) == 1234 * 1024
    assert available_memory(str(tmp_path / "none")) is None
