"""``pip wheel .`` builds a wheel, and the wheel installed in a fresh venv runs the command.

The build runs without build isolation (scikit-build-core and nanobind come from the test
environment, so nothing is downloaded) and reuses the clone's CMake build folder, so a second
run only relinks. The fresh venv sees the test environment's packages through a ``.pth`` file
placed after its own site-packages: the installed wheel, not the clone's ``src/``, is what runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_pip_wheel_builds_a_wheel_that_runs_the_command(tmp_path):
    pytest.importorskip("scikit_build_core", reason="the build backend builds the wheel")
    pytest.importorskip("nanobind", reason="the extension is built with nanobind")
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "-w", str(dist), "--no-deps",
         "--no-build-isolation", "-q"],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("exactblocks-*.whl")

    env_dir = tmp_path / "venv"
    # with its own pip (ensurepip: bundled, offline), so the console script lands in its bin/
    # (another environment's pip driven with --python placed it elsewhere in CI)
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    # numpy, xxhash, ... from this environment, after the venv's own site-packages. Written
    # only after the install: with it in place, pip would see an exactblocks already installed
    # in the test environment (CI installs the package there) and install nothing.
    Path(site, "zz_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = env_dir / "bin" / "exactblocks"
    assert script.is_file(), f"pip put no console script in {script.parent}: {install.stdout}"
    res = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for command in ("demo", "run", "chat", "models", "serve"):
        assert f"    {command} " in res.stdout, res.stdout
    where = subprocess.run(
        [str(py), "-c", "import exactblocks; print(exactblocks.__file__); "
         "print(exactblocks.arithmetic_version())"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr[-3000:]
    path, version = where.stdout.split()
    assert path.startswith(site) and version == "fp32-identical-1", where.stdout
