"""CLI faults: a closed stdout pipe ends the command quietly, and error
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
    ("argv", "status", "says"),
    [
        (["demo", "--gguf", "{tmp}"], 2, "exactblocks demo: error: --gguf: '{tmp}' is not a file"),
        (
            ["demo", "--gguf", "{tmp}/missing.gguf"],
            2,
            "exactblocks demo: error: --gguf: '{tmp}/missing.gguf' does not exist",
        ),
        (
            ["demo", "--gguf", "{tmp}/bad.gguf"],
            2,
            "exactblocks demo: error: --gguf: cannot load '{tmp}/bad.gguf' as a Llama GGUF model",
        ),
        (
            ["run", "{tmp}/missing", "--prompt", "hi"],
            2,
            "exactblocks run: error: MODEL: '{tmp}/missing' does not exist",
        ),
        (  # MODEL exists but does not load: 1
            ["run", "{tmp}/bad.gguf", "--prompt", "hi"],
            1,
            "exactblocks run: error: MODEL: cannot read '{tmp}/bad.gguf' as a GGUF model: "
            "'{tmp}/bad.gguf' is not a GGUF file",
        ),
        (["chat", "{tmp}"], 1, "exactblocks chat: error: MODEL: config file "),
    ],
)
def test_errors_name_the_command_and_argument(tmp_path, capsys, argv, status, says):
    pytest.importorskip("gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    tmp = str(tmp_path)
    assert main([a.format(tmp=tmp) for a in argv]) == status
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(says.format(tmp=tmp)), err
    for internal in ("open_gguf", "load_model", "run_demo", "load_gguf", "GGUFFile"):
        assert internal not in err, err


def _signal_state(pid: int) -> str:
    """The child's blocked, ignored and caught signal masks (/proc), for a failure message."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(ln.strip() for ln in f if ln.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError:
        return "?"


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["run", "{gguf}", "--prompt", "Tell me a long story.", "--max-new-tokens", "2000"],
        ["demo", "--max-new-tokens", "2000"],
    ],
)
def test_ctrl_c_prints_one_line_and_exits_130(argv):
    # Ctrl-C during `exactblocks run` or `demo` printed a whole traceback; it
    # prints one line on stderr and the status of a tool killed by SIGINT.
    import signal
    import time

    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        gguf = default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    # The child starts as from a terminal: SIGINT at its default, not blocked. In the whole
    # suite (never alone) the children of this process started with SIGINT ignored or blocked,
    # so the signal was lost; the failure message shows the child's masks if it happens again.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
        "sys.argv[0] = 'exactblocks'; runpy.run_module('exactblocks', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start, *(a.format(gguf=gguf) for a in argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout.read(1), "no output before the interrupt"  # it is generating
        time.sleep(0.3)
        sig = _signal_state(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # pragma: no cover - a hang: the timeout above failed the test
            proc.kill()
            proc.wait()
    text = err.decode(errors="replace")
    assert proc.returncode == 130, (sig, text[-3000:])
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1] == f"exactblocks {argv[0]}: interrupted", text[-3000:]


def test_threads_above_the_cpus_is_a_note_of_the_command(tmp_path, capsys):
    # `demo --threads 999` warned with a RuntimeWarning pointing at cli.py
    import warnings

    from exactblocks.runtime import usable_cpus

    cpus = usable_cpus()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = main(["demo", "--threads", "999", "--gguf", str(tmp_path / "missing.gguf")])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    plural = "" if cpus == 1 else "s"
    assert err[0] == (
        f"exactblocks demo: --threads 999 exceeds the {cpus} CPU{plural} usable by this "
        f"process; using {cpus} thread{plural}"
    ), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_out_of_memory_loading_is_an_error_line():
    # load_model's MemoryError (here: the GGUF cannot be mapped) is the command's error line
    from robust_helpers import run_python

    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        gguf = default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    code = f"""
        import os, resource, sys
        from exactblocks.cli import main

        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (50 << 20), resource.RLIM_INFINITY))
        sys.exit(main(["run", {gguf!r}, "--prompt", "hi"]))
    """
    res = run_python(code, timeout=120)
    assert res.returncode == 1, res.stderr[-3000:]  # MODEL exists but does not load
    last = res.stderr.strip().splitlines()[-1]
    assert last == f"exactblocks run: error: MODEL: out of memory while reading {gguf!r}", last


def test_the_cli_is_an_app_on_public_names():
    # `models/cli.py` was an app inside the core, and `serve/cli.py` imported
    # `exactblocks.models.cli._load`: the commands now live in one app package, `exactblocks.cli`,
    # which imports only public names of the library (relative imports stay inside it).
    import ast
    import pathlib

    import exactblocks.cli as package

    root = pathlib.Path(package.__file__).parent
    src = root.parent
    assert not (src / "models" / "cli.py").exists()
    allowed = (
        "exactblocks",
        "exactblocks.models",
        "exactblocks.ray",
        "exactblocks.runtime",
        "exactblocks.serve",
    )
    legacy: set[tuple[str, str, str]] = set()
    bad = []
    for path in sorted(root.glob("*.py")) + [src / "serve" / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                mod = node.module or ""
                for alias in node.names:
                    if (path.name, mod, alias.name) in legacy:
                        continue
                    if not mod.startswith("exactblocks"):
                        continue
                    public = mod in allowed or mod.startswith("exactblocks.serve.")
                    if alias.name.startswith("_") or not public:
                        bad.append(f"{path.name}: from {mod} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("exactblocks") and alias.name not in allowed:
                        bad.append(f"{path.name}: import {alias.name}")
    assert not bad, bad
    from exactblocks.serve.cli import build_server  # the server runner stays in the serve app

    assert callable(build_server)
