"""``exactblocks run`` / ``chat`` with a bad MODEL or bad flags: one line, no traceback.

A usage error (a flag's value, an unknown flag, a MODEL that does not exist) exits 2 and is
found before anything loads; a model that exists but cannot be loaded (a folder without
config.json, a file that is not GGUF, a broken config) exits 1. The last line on stderr is
``exactblocks <command>: error: <argument>: <message>`` naming the file and the field, and
names no internal function.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest

from exactblocks.cli import main


def _setup(tmp_path, tiny):
    folder, _ = tiny("llama")
    good = str(tmp_path / "good")
    shutil.copytree(folder, good)
    (tmp_path / "empty").mkdir()
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "fake.safetensors").write_bytes(b"\x01\x02")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    (tmp_path / "st").mkdir()
    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "st" / "config.json")
    (tmp_path / "st" / "w.safetensors").write_bytes(b"\x01\x02")
    bad = tmp_path / "badcfg"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = "64"
    (bad / "config.json").write_text(json.dumps(cfg))
    return good


T = "{tmp}"
# (argv, exit status, the last line starts with, and contains)
CASES = [
    (["run", f"{T}/missing", "--prompt", "x"], 2, "run: error: MODEL: ", "does not exist"),
    (["chat", f"{T}/missing.gguf"], 2, "chat: error: MODEL: ", "does not exist"),
    (["run", f"{T}/empty", "--prompt", "x"], 1, "run: error: MODEL: ", "config.json"),
    (["chat", f"{T}/empty"], 1, "chat: error: MODEL: ", "config.json"),
    (["run", f"{T}/fake.gguf", "--prompt", "x"], 1, "run: error: MODEL: ", "not a GGUF file"),
    (["chat", f"{T}/fake.gguf"], 1, "chat: error: MODEL: ", "not a GGUF file"),
    (["run", f"{T}/fake.safetensors", "--prompt", "x"], 1, "run: error: MODEL: ",
     "config.json"),
    (["run", f"{T}/st/w.safetensors", "--prompt", "x"], 1, "run: error: MODEL: ", "8-byte"),
    (["run", f"{T}/weights.bin", "--prompt", "x"], 1, "run: error: MODEL: ", "weights.bin"),
    (["run", f"{T}/badcfg", "--prompt", "x"], 1, "run: error: MODEL: ", "'hidden_size'='64'"),
    (["run", f"{T}/good"], 2, "run: error: ", "--prompt"),
    (["run", f"{T}/good", "--prompt", "x", "--max-new-tokens", "0"], 2, "run: error: ",
     "--max-new-tokens"),
    (["run", f"{T}/good", "--prompt", "x", "--max-new-tokens", "ten"], 2, "run: error: ",
     "--max-new-tokens"),
    (["run", f"{T}/good", "--prompt", "x", "--temperature", "-1"], 2, "run: error: ",
     "--temperature"),
    (["run", f"{T}/good", "--prompt", "x", "--temperature", "inf"], 2, "run: error: ",
     "--temperature"),
    (["run", f"{T}/good", "--prompt", "x", "--top-p", "5"], 2, "run: error: ", "--top-p"),
    (["run", f"{T}/good", "--prompt", "x", "--top-p", "nan"], 2, "run: error: ", "--top-p"),
    (["run", f"{T}/good", "--prompt", "x", "--top-p", "0"], 2, "run: error: ", "--top-p"),
    (["run", f"{T}/good", "--prompt", "x", "--top-k", "0"], 2, "run: error: ", "--top-k"),
    (["run", f"{T}/good", "--prompt", "x", "--seed", "-1"], 2, "run: error: ", "--seed"),
    (["run", f"{T}/good", "--prompt", "x", "--seed", "x"], 2, "run: error: ", "--seed"),
    (["run", f"{T}/good", "--prompt", "x", "--threads", "0"], 2, "run: error: ", "--threads"),
    (["run", f"{T}/good", "--prompt", "x", "--bogus"], 2, "", "--bogus"),
    (["chat", f"{T}/good", "--top-p", "2"], 2, "chat: error: ", "--top-p"),
    (["chat", f"{T}/good", "--seed", "-3"], 2, "chat: error: ", "--seed"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "status", "starts", "says"), CASES, ids=lambda v: str(v)[:60])
def test_a_bad_model_or_flag_is_one_line(tiny, tmp_path, capsys, monkeypatch, argv, status,
                                         starts, says):  # fmt: skip
    _setup(tmp_path, tiny)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    argv = [a.replace(T, str(tmp_path)) for a in argv]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        got = exc.code
    err = capsys.readouterr().err
    assert got == status, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("exactblocks " + starts) or (not starts and "error:" in last), last
    assert says in last, last
    for internal in ("load_model", "SafetensorsSource", "GGUFFile", "generate:", "Sampler"):
        assert internal not in last, last
    if status == 2 and "MODEL" not in starts:
        assert "loading " not in err, err  # a flag is checked before the model loads


def test_the_good_copy_runs(tiny, tmp_path, capsys):
    good = _setup(tmp_path, tiny)
    assert main(["run", good, "--prompt", "x", "--max-new-tokens", "1"]) == 0
    assert os.path.isdir(good)
