"""CLI faults of issue #16 finding 6: a closed stdout pipe ends the command quietly, and error
lines name the command and the argument, never an internal function."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from robust_helpers import TESTS

from exactblocks.cli import main

_FLOOD = """
import sys
import exactblocks.cli as cli

def flood(*args, **kwargs):
    for i in range(200000):
        print("line", i)
    return 0

cli.run_demo = flood
sys.exit(cli.main(["demo"]))
"""


@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
def test_closed_pipe_ends_quietly():
    # `exactblocks demo | head -1` printed a BrokenPipeError traceback.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    res = subprocess.run(
        f"{sys.executable!s} -c '{_FLOOD}' | head -1; echo \"status ${{PIPESTATUS[0]}}\"",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.stdout.splitlines() == ["line 0", "status 141"], res.stdout
    assert res.stderr == "", res.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
def test_demo_into_head_ends_quietly():
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    res = subprocess.run(
        f"{sys.executable!s} -m exactblocks demo --max-new-tokens 8 | head -1; "
        'echo "status ${PIPESTATUS[0]}"',
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = res.stdout.splitlines()
    assert lines[0].startswith("exactblocks ") and " demo: " in lines[0], lines
    assert lines[1] == "status 141", lines
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--gguf", "{tmp}"], "exactblocks demo: error: --gguf: '{tmp}' is not a file"),
        (
            ["demo", "--gguf", "{tmp}/missing.gguf"],
            "exactblocks demo: error: --gguf: '{tmp}/missing.gguf' does not exist",
        ),
        (
            ["demo", "--gguf", "{tmp}/bad.gguf"],
            "exactblocks demo: error: --gguf: cannot load '{tmp}/bad.gguf' as a Llama GGUF model",
        ),
        (
            ["run", "{tmp}/missing", "--prompt", "hi"],
            "exactblocks run: error: MODEL: '{tmp}/missing' does not exist",
        ),
        (["run", "{tmp}/bad.gguf", "--prompt", "hi"], "exactblocks run: error: MODEL: "),
        (["chat", "{tmp}"], "exactblocks chat: error: MODEL: config file "),
    ],
)
def test_errors_name_the_command_and_argument(tmp_path, capsys, argv, says):
    pytest.importorskip("gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    tmp = str(tmp_path)
    assert main([a.format(tmp=tmp) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(says.format(tmp=tmp)), err
    for internal in ("open_gguf", "load_model", "run_demo", "load_gguf"):
        assert internal not in err, err
