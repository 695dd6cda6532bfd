"""``python -m benchmarks.serving`` end to end without the peer (a small round of each mode),
and how it finds and starts llama.cpp's llama-server (no timing asserts)."""

from __future__ import annotations

import os
import stat

import pytest

from benchmarks import serving

pytestmark = pytest.mark.slow


def test_serving_benchmark_runs_exactblocks_alone(capsys):
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    argv = ["--peer", "none", "--clients", "1,2", "--requests", "1", "--max-tokens", "4"]
    rc = serving.main(argv + ["--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "llama.cpp peer skipped: --peer none" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| exactblocks |")]
    assert [ln.split(" | ")[1:3] for ln in rows] == [
        ["greedy", "1"],
        ["greedy", "2"],
        ["seeded", "1"],
        ["seeded", "2"],
    ]
    # tokens column: every request got its 4 tokens (SmolLM2 does not stop that early here)
    assert [int(ln.split(" | ")[3]) for ln in rows] == [4, 8, 4, 8]
    assert "command (from a clone's root" in out and "--peer none" in out


def test_llama_server_is_found_and_commanded(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    binary, why = serving.find_llama_server(None)
    assert binary is None and "no llama-server" in why
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    binary, why = serving.find_llama_server(None)
    assert binary is None  # on PATH but not executable: which() skips it
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert serving.find_llama_server(None) == (str(exe), "PATH")
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nope"))
    binary, why = serving.find_llama_server(None)
    assert binary is None and "LLAMA_SERVER=" in why and "not an executable" in why
    assert serving.find_llama_server(str(exe)) == (str(exe), "--llama-server")
    cmd = serving.llama_server_command(str(exe), "m.gguf", 8123, 2, 16)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == str(exe) and "-cb" in cmd
    assert args["-m"] == "m.gguf" and args["--host"] == "127.0.0.1" and args["--port"] == "8123"
    assert args["-t"] == args["-tb"] == "2" and args["-np"] == "16"
    assert args["-c"] == str(16 * serving.CTX_PER_SEQUENCE)
