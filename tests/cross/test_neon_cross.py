"""The NEON path builds with a cross compiler and gives the bits of every x86-64 path (issue:
"The NEON path at least compiles in CI with a cross compiler; run its tests under user-mode
emulation if Debian's packages make that practical").

tests/cpp/digest_main.cpp (no Python) is built twice from the C++ sources: natively with g++
(scalar, avx2, avx512 kernel tables) and with aarch64-linux-gnu-g++ -static (scalar, neon),
which then runs under qemu-aarch64 user-mode emulation. Each binary prints one
``<isa> <digest>`` line per kernel table the CPU has; the digest covers ragged Transformer and
Mamba-2 forwards with carried state, the L16 reductions, a packed GEMM, the norms and
elementwise sweeps. Every line of both binaries must carry the same digest (SPEC 3.1).

The compile flags are read from CMakeLists.txt (EB_NUMERIC_FLAGS, EB_FLAGS_<isa>), so the
test builds what the package builds: dropping -ffp-contract=off there, for one, makes GCC
for AArch64 fuse a*b+c and this test fail.

Debian packages: g++-aarch64-linux-gnu qemu-user (.ci/run installs them when run as root).
Without them the test skips, except under CI (env CI set and not "0"/"false"), where it fails.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
# digest_main.cpp and the files of its cases (digest_blocks.cpp, digest_stack.cpp, ...)
DIGEST_SOURCES = sorted((ROOT / "tests" / "cpp").glob("digest*.cpp"))
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
# ISAs compiled per architecture (the EB_ISA_LIST branches of CMakeLists.txt).
ISAS = {"x86_64": ["scalar", "avx2", "avx512"], "aarch64": ["scalar", "neon"]}
COMPILE_TIMEOUT = 300  # seconds per translation unit
RUN_TIMEOUT = 120  # seconds per binary (qemu is ~10x slower than native)


def in_ci():
    """Whether the test runs under CI.

    Returns
    -------
    bool
        True when the environment variable ``CI`` is set to anything but "", "0" or "false"
        (case-insensitive); CI runners (GitHub Actions, the one running .ci/run) set ``CI=true``.
    """
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def need_tool(name, package):
    """Return the path of an executable, or skip the test (fail it under CI) without it.

    Parameters
    ----------
    name : str
        Executable looked up on PATH.
    package : str
        Debian package that provides it, named in the message.

    Returns
    -------
    str
        Absolute path of the executable.
    """
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not found on PATH (Debian: apt-get install {package})"
        if in_ci():
            pytest.fail(f"CI is set, so the cross test may not skip: {msg}")
        pytest.skip(msg)
    return path


def cmake_flags():
    """Compile flag lists defined with ``set(NAME ...)`` in CMakeLists.txt.

    Returns
    -------
    dict of str to list of str
        ``EB_NUMERIC_FLAGS`` and every ``EB_FLAGS_<isa>``, each split on whitespace
        (``""`` gives an empty list).
    """
    text = (ROOT / "CMakeLists.txt").read_text()
    out = {}
    for name, body in re.findall(r"set\((EB_NUMERIC_FLAGS|EB_FLAGS_\w+)\s+([^)]*)\)", text):
        out[name] = [f for f in body.split() if f != '""']
    return out


def core_sources():
    """The C++ sources of the core without the Python bindings and the per-ISA kernel file.

    Returns
    -------
    list of pathlib.Path
        Every ``csrc/**/*.cpp`` except ``csrc/bindings/`` and the per-ISA
        ``csrc/dispatch/kernels_isa.cpp``, sorted.
    """
    return sorted(
        p
        for p in CSRC.rglob("*.cpp")
        if p.parent.name != "bindings" and p.name != "kernels_isa.cpp"
    )


def build_digest(cxx, arch, out_dir, static, extra=()):
    """Compile and link tests/cpp/digest*.cpp with every kernel table of ``arch``.

    Parameters
    ----------
    cxx : str
        C++ compiler (``g++`` or ``aarch64-linux-gnu-g++``).
    arch : {"x86_64", "aarch64"}
        Target architecture; selects the ISAs from ``ISAS`` and their CMake flags.
    out_dir : pathlib.Path
        Directory for the objects and the binary.
    static : bool
        Link statically (needed to run the aarch64 binary under qemu without a sysroot).
    extra : sequence of str, default=()
        Flags added last to every compile and to the link (tests/robust/test_sanitize.py: the
        sanitizers and their optimisation level).

    Returns
    -------
    pathlib.Path
        The linked executable.
    """
    flags = cmake_flags()
    assert "EB_NUMERIC_FLAGS" in flags and "-ffp-contract=off" in flags["EB_NUMERIC_FLAGS"], flags
    base = [
        cxx,
        "-std=c++17",
        "-O3",
        "-DNDEBUG",
        "-pthread",
        *flags["EB_NUMERIC_FLAGS"],
        f"-I{CSRC}",
    ]
    tail = list(extra)
    have = [f"-DEB_HAVE_{isa.upper()}=1" for isa in ISAS[arch]]
    jobs = []
    for isa in ISAS[arch]:
        assert f"EB_FLAGS_{isa}" in flags, f"CMakeLists.txt defines no EB_FLAGS_{isa}"
        obj = out_dir / f"kernels_{isa}.o"
        jobs.append(
            (
                base
                + [
                    f"-DEB_ISA_{isa}=1",
                    f"-DEB_ISA_NAME=isa_{isa}",
                    *flags[f"EB_FLAGS_{isa}"],
                    "-c",
                    str(CSRC / "dispatch" / "kernels_isa.cpp"),
                    "-o",
                    str(obj),
                    *tail,
                ],
                obj,
            )
        )
    for src in [*DIGEST_SOURCES, *core_sources()]:
        obj = out_dir / f"{src.parent.name}_{src.stem}.o"
        jobs.append((base + have + ["-c", str(src), "-o", str(obj), *tail], obj))

    def compile_one(job):
        res = subprocess.run(job[0], capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
        assert res.returncode == 0, f"{' '.join(job[0])}\n{res.stderr[-4000:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:  # the machine has 2 cores
        list(pool.map(compile_one, jobs))
    exe = out_dir / "digest"
    link = [
        cxx,
        "-pthread",
        *(["-static"] if static else []),
        *(str(o) for _, o in jobs),
        "-o",
        str(exe),
        *tail,
    ]
    res = subprocess.run(link, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    assert res.returncode == 0, f"{' '.join(link)}\n{res.stderr[-4000:]}"
    return exe


def run_digest(cmd):
    """Run a digest binary and parse its ``<isa> <digest>`` lines.

    Parameters
    ----------
    cmd : list of str
        Command line (the binary, possibly behind qemu-aarch64).

    Returns
    -------
    digests : dict of str to str
        ISA name -> 16 hex digit digest, in the order printed.
    detail : str
        The binary's stderr: one ``# <isa> <case> <digest>`` line per case.
    """
    env = {k: v for k, v in os.environ.items() if k != "EXACTBLOCKS_ISA"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}\n{res.stderr[-6000:]}"
    out = {}
    for line in res.stdout.splitlines():
        isa, digest = line.split()
        assert re.fullmatch(r"[0-9a-f]{16}", digest), line
        out[isa] = digest
    return out, res.stderr


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    """Build and run both digest binaries once for the module.

    Returns
    -------
    dict
        ``{"native": (digests, stderr), "aarch64": (digests, stderr)}``, digests mapping
        ISA name -> hex digest.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the cross test runs on an x86-64 host, this is {platform.machine()}")
    gxx = need_tool("g++", "g++")
    cross = need_tool(CROSS_CXX, "g++-aarch64-linux-gnu")
    qemu = need_tool(QEMU, "qemu-user")
    native_dir = tmp_path_factory.mktemp("digest_x86_64")
    cross_dir = tmp_path_factory.mktemp("digest_aarch64")
    native = build_digest(gxx, "x86_64", native_dir, static=False)
    arm = build_digest(cross, "aarch64", cross_dir, static=True)
    return {
        "native": run_digest([str(native)]),
        "aarch64": run_digest([qemu, str(arm)]),
        "objects": {("x86_64", isa): native_dir / f"kernels_{isa}.o" for isa in ISAS["x86_64"]}
        | {("aarch64", isa): cross_dir / f"kernels_{isa}.o" for isa in ISAS["aarch64"]},
    }


VEC_TYPE = {"scalar": "VecScalar", "avx2": "VecAvx2", "avx512": "VecAvx512", "neon": "VecNeon"}


def test_isa_objects_share_no_code(digests):
    """Each ISA's kernels_isa.o defines external symbols only in its own namespace (isa_<name>)
    or as templates over its own vector type. Anything else (an inline function left out of
    line, a std::vector member) is emitted by several ISA objects under one name, and the
    linker keeps one copy for all ISAs: AVX-512 code could then run on the scalar path
    (SIGILL on a CPU without AVX-512). See csrc/math/abi.hpp."""
    allowed = {"DW.ref.__gxx_personality_v0"}  # the C++ EH personality pointer, data only
    bad = {}
    for (arch, isa), obj in digests["objects"].items():
        nm = shutil.which("aarch64-linux-gnu-nm" if arch == "aarch64" else "nm")
        if nm is None:
            pkg = "binutils" + ("-aarch64-linux-gnu" if arch == "aarch64" else "")
            msg = f"no nm for {arch} (Debian: {pkg})"
            if in_ci():
                pytest.fail(msg)
            pytest.skip(msg)
        res = subprocess.run(
            [nm, "-C", "--defined-only", "--extern-only", str(obj)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        for line in res.stdout.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) < 3:
                continue
            name = parts[2]
            if f"isa_{isa}" in name or VEC_TYPE[isa] in name or name in allowed:
                continue
            bad.setdefault(f"{arch}/{isa}", []).append(name)
    assert not bad, bad


def test_aarch64_has_neon(digests):
    got, _ = digests["aarch64"]
    assert list(got) == ["scalar", "neon"], got


def cpu_flags():
    """The feature flags of the first CPU in /proc/cpuinfo (empty set when unreadable).

    Returns
    -------
    set of str
        Flags such as ``"avx2"``, ``"fma"``, ``"avx512f"``.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(m.group(1).split()) if m else set()


def test_native_isas(digests):
    got, _ = digests["native"]
    flags = cpu_flags()
    if not flags:
        pytest.skip("/proc/cpuinfo has no flags line")
    expect = ["scalar"]
    if {"avx2", "fma"} <= flags:
        expect.append("avx2")
        if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
            expect.append("avx512")
    assert list(got) == expect, (
        got,
        sorted(flags & {"avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"}),
    )


def test_all_isas_and_architectures_agree(digests):
    native, native_err = digests["native"]
    arm, arm_err = digests["aarch64"]
    lines = {f"x86_64/{k}": v for k, v in native.items()}
    lines.update({f"aarch64/{k}": v for k, v in arm.items()})
    assert len(set(lines.values())) == 1, (
        f"digests differ: {lines}\n--- x86_64 cases ---\n{native_err}\n"
        f"--- aarch64 cases ---\n{arm_err}"
    )
