"""AddressSanitizer + UndefinedBehaviorSanitizer runs (issue #16 finding 8), marked ``sanitize``
(deselect locally with ``-m "not sanitize"``).

1. tests/cpp/digest_main.cpp built natively with ``-fsanitize=address,undefined
   -fno-sanitize-recover=all`` (the sources and flags of the NEON cross test's
   ``build_digest``) and run with ``--quick``: every kernel table, ragged block forwards with
   carried state, GEMMs and elementwise sweeps, 1 and 2 threads. Any report fails the test.
2. The extension itself built the same way into a temporary directory, and a bounded subset of
   the API and robustness tests run against it in a subprocess with
   ``LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"``
   (libstdc++ too: else ASan cannot find the real ``__cxa_throw`` and aborts on the first C++
   exception) and ``ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1`` (Python itself
   is not instrumented and leaks by design; the tests that ask for absurd sizes expect a
   MemoryError, not an abort). Reports go to log files (pytest captures fd 2), which must hold
   no error.

Both need g++ with libasan/libubsan (Debian: g++); without them the tests skip locally and fail
under CI.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sanitize

ROOT = Path(__file__).resolve().parents[2]
SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# -O1 after the build's -O3: the sanitized builds compile about twice as fast, and the
# sanitizers see the same code paths.
SAN_COMPILE = ["-O1", "-g1", *SAN]
SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:allocator_may_return_null=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer", "SUMMARY: ")


def _in_ci():
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def _need(ok, msg):
    if not ok:
        if _in_ci():
            pytest.fail(f"CI is set, so the sanitizer test may not skip: {msg}")
        pytest.skip(msg)


def _print_file_name(cxx, name):
    res = subprocess.run(
        [cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=60
    )
    return res.stdout.strip()


def _sanitizer_runtime():
    _need(sys.platform.startswith("linux"), "the sanitizer runs are Linux-only")
    _need(platform.machine() in ("x86_64", "AMD64", "aarch64"), platform.machine())
    gxx = shutil.which("g++")
    _need(gxx is not None, "g++ not found (Debian: apt-get install g++)")
    libs = [_print_file_name(gxx, "libasan.so"), _print_file_name(gxx, "libstdc++.so")]
    for lib in libs:
        _need(os.path.isabs(lib) and os.path.exists(lib), f"{lib!r} not found")
    return gxx, " ".join(libs)


def _clean(res, what):
    text = res.stdout + res.stderr
    found = [r for r in REPORTS if r in text]
    assert res.returncode == 0 and not found, (
        f"{what}: exit {res.returncode}, reports {found}\n{text[-6000:]}"
    )


def _load_cross():
    path = ROOT / "tests" / "cross" / "test_neon_cross.py"
    spec = importlib.util.spec_from_file_location("_eb_cross_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_digest_under_asan_ubsan(tmp_path):
    gxx, _ = _sanitizer_runtime()
    cross = _load_cross()
    arch = "aarch64" if platform.machine() == "aarch64" else "x86_64"
    exe = cross.build_digest(gxx, arch, tmp_path, static=False, extra=SAN_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "EXACTBLOCKS_ISA"}
    env.update(SAN_ENV)
    env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=0", "detect_leaks=1")
    res = subprocess.run(
        [str(exe), "--quick"], capture_output=True, text=True, timeout=600, env=env
    )
    _clean(res, "digest_main --quick under ASan+UBSan")
    assert res.stdout.strip(), "the digest printed nothing"


# The API and robustness tests run against the sanitized extension: every entry point, every
# argument error path, interrupts, snapshots and threads. Subprocess-heavy tests (real
# sub-interpreters under ASan are slow) and the slow/fuzz/sanitize marks are left out.
API_SUBSET = [
    "tests/api/test_transformer_api.py",
    "tests/api/test_mamba2_api.py",
    "tests/robust/test_interrupts.py",
    "tests/robust/test_snapshots.py",
]


def test_extension_under_asan_ubsan(tmp_path):
    _, preload = _sanitizer_runtime()
    _need(shutil.which("cmake") is not None, "cmake not found")
    text = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)
    build = tmp_path / "build"
    flags = " ".join(SAN_COMPILE)
    configure = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(build),
        *(["-G", "Ninja"] if shutil.which("ninja") else []),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DSKBUILD_PROJECT_VERSION={version}",
        f"-DCMAKE_CXX_FLAGS={flags}",
        f"-DCMAKE_C_FLAGS={flags}",
        # Release's own -O3 would come after the flags above and double the build time
        "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
        "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
        f"-DCMAKE_SHARED_LINKER_FLAGS={' '.join(SAN)}",
        f"-DCMAKE_MODULE_LINKER_FLAGS={' '.join(SAN)}",
    ]
    res = subprocess.run(configure, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = subprocess.run(
        ["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (so,) = build.glob("_core*.so")

    # The package's Python files with the sanitized extension beside them.
    pkg = tmp_path / "pkg"
    shutil.copytree(
        ROOT / "src" / "exactblocks",
        pkg / "exactblocks",
        ignore=shutil.ignore_patterns("_core*.so", "__pycache__"),
    )
    shutil.copy2(so, pkg / "exactblocks")
    env = {k: v for k, v in os.environ.items() if k not in ("EXACTBLOCKS_ISA", "PYTHONPATH")}
    logs = tmp_path / "logs"
    logs.mkdir()
    env.update(SAN_ENV)
    env["ASAN_OPTIONS"] += f":log_path={logs / 'asan'}"
    env["UBSAN_OPTIONS"] += f":log_path={logs / 'ubsan'}"
    env["LD_PRELOAD"] = preload
    env["PYTHONPATH"] = os.pathsep.join([str(pkg), str(ROOT / "tests"), str(ROOT)])
    probe = subprocess.run(
        [sys.executable, "-c", "import exactblocks._core as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    _clean(probe, "importing the sanitized extension")
    assert probe.stdout.strip().startswith(str(pkg)), probe.stdout
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "--capture=sys",
            "--rootdir",
            str(ROOT),
            "-c",
            str(ROOT / "pyproject.toml"),
            "-m",
            "not slow and not fuzz and not sanitize",
            "-k",
            "not subprocess and not env and not storm",
            *API_SUBSET,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    reports = "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.iterdir()))
    found = [r for r in REPORTS if r in reports]
    assert not found, f"sanitizer reports {found}:\n{reports[-6000:]}"
    _clean(res, "API tests against the ASan+UBSan extension")
