"""AddressSanitizer + UndefinedBehaviorSanitizer runs, marked ``sanitize`` (deselect locally with
``-m "not sanitize"``).

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

Each build is made once and reused: it lives in ``build/sanitize/<name>-<key>/``, where the key
hashes everything the build reads (every file under csrc/ and tests/cpp/, CMakeLists.txt,
pyproject.toml, the flags, the compiler's version, the Python executable). A run whose sources
are unchanged reuses the binaries of the previous run; a change to any of them builds afresh,
once, and drops the stale directory.
"""

from __future__ import annotations

import hashlib
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
CACHE = ROOT / "build" / "sanitize"


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


def _build_key(cxx, *extra):
    """A hash of everything a sanitized build reads, so that a cached build is reused only
    when it would be rebuilt identically."""
    h = hashlib.sha256()
    files = [ROOT / "CMakeLists.txt", ROOT / "pyproject.toml"]
    for top in ("csrc", "tests/cpp"):
        files += [p for p in (ROOT / top).rglob("*") if p.is_file()]
    for path in sorted(files):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    for part in (version.stdout, sys.executable, *SAN_COMPILE, *SAN, *extra):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _cached_build(name, key, build):
    """The directory ``build/sanitize/<name>-<key>``, made by ``build(tmp_dir)`` on a miss.

    A build is moved into place only once it succeeded, so an interrupted or failed build is
    never reused; older directories of the same name are removed.
    """
    final = CACHE / f"{name}-{key}"
    if (final / "done").exists():
        return final
    for old in CACHE.glob(f"{name}-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = CACHE / f"{name}-{key}.tmp"
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / "done").write_text("ok\n")
    tmp.rename(final)
    return final


@pytest.fixture(scope="session")
def sanitized_digest():
    """tests/cpp/digest_main.cpp built with the sanitizers (once, cached under build/)."""
    gxx, _ = _sanitizer_runtime()
    cross = _load_cross()
    arch = "aarch64" if platform.machine() == "aarch64" else "x86_64"

    def build(out):
        cross.build_digest(gxx, arch, out, static=False, extra=SAN_COMPILE)

    return _cached_build("digest", _build_key(gxx, arch), build) / "digest"


@pytest.fixture(scope="session")
def sanitized_extension():
    """The extension ``_core*.so`` built with the sanitizers (once, cached under build/)."""
    gxx, _ = _sanitizer_runtime()
    _need(shutil.which("cmake") is not None, "cmake not found")
    text = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)
    flags = " ".join(SAN_COMPILE)

    def build(out):
        build_dir = out / "cmake"
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
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
            ["cmake", "--build", str(build_dir), "-j", "2"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        (so,) = build_dir.glob("_core*.so")
        shutil.copy2(so, out)
        shutil.rmtree(build_dir)  # the objects are not needed again: keep only the .so

    (so,) = _cached_build("extension", _build_key(gxx, version), build).glob("_core*.so")
    return so


def _load_cross():
    path = ROOT / "tests" / "cross" / "test_neon_cross.py"
    spec = importlib.util.spec_from_file_location("_eb_cross_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_digest_under_asan_ubsan(sanitized_digest):
    exe = sanitized_digest
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


def test_extension_under_asan_ubsan(sanitized_extension, tmp_path):
    _, preload = _sanitizer_runtime()
    so = sanitized_extension

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
