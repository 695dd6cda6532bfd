"""Facts about the machine and the software, for the report and ``bench.json``.

Here: the CPU model, the load average, how busy other processes keep the CPUs, package
versions and which BLAS NumPy loaded (and its kernel). Not here: anything timed. The CPU-busy
reading is the benchmark's own copy of the one ``exactblocks demo`` prints (the library's is
private).
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np

__all__ = [
    "blas_info",
    "cpu_busy",
    "cpu_model",
    "cpu_ticks",
    "loadavg",
    "other_cpu_share",
    "package_version",
]


def cpu_ticks() -> tuple[float, float, float] | None:
    """Busy seconds of all CPUs, this process's CPU seconds and the wall clock, now.

    Returns
    -------
    (float, float, float) or None
        All CPUs' busy seconds from ``/proc/stat`` (everything but idle and iowait), this
        process's user + system seconds, ``time.perf_counter()``; None without ``/proc/stat``.
    """
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    t = os.times()
    return busy, t.user + t.system, time.perf_counter()


def other_cpu_share(t0, t1) -> float | None:
    """Fraction of all CPUs that other processes kept busy between two :func:`cpu_ticks`.

    Parameters
    ----------
    t0, t1 : tuple or None
        Two readings of :func:`cpu_ticks`, ``t0`` first.

    Returns
    -------
    float or None
        Other processes' busy CPU seconds / (CPUs available * wall seconds), at least 0;
        None when a reading is missing or no time passed.
    """
    if t0 is None or t1 is None or t1[2] <= t0[2]:
        return None
    n_cpu = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    other = (t1[0] - t0[0]) - (t1[1] - t0[1])
    return max(0.0, other) / (n_cpu * (t1[2] - t0[2]))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (2 decimals), or None where unavailable."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


def cpu_busy(seconds: float = 0.5) -> float | None:
    """Fraction of all CPUs that other processes keep busy, measured while this one sleeps.

    Parameters
    ----------
    seconds : float, default=0.5
        How long to sleep and watch.

    Returns
    -------
    float or None
        Busy share (user + system + steal) of all CPUs, 3 decimals; None without
        ``/proc/stat``.
    """
    t0 = cpu_ticks()
    time.sleep(seconds)
    share = other_cpu_share(t0, cpu_ticks())  # we sleep: everything busy is someone else
    return None if share is None else round(share, 3)


def package_version(module: str) -> str | None:
    """Installed version of a distribution (e.g. ``"torch"``), or None when unknown."""
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - any lookup failure means "unknown"
        return None


def blas_info() -> list[dict]:
    """Which BLAS NumPy loaded and the kernel it picked (threadpoolctl when installed).

    Returns
    -------
    list of dict
        threadpoolctl's BLAS entries without file paths; without threadpoolctl one dict with
        the BLAS name and version from ``np.show_config`` and the OpenBLAS kernel name read
        through ctypes (best effort).
    """
    try:
        import threadpoolctl

        return [
            {k: v for k, v in d.items() if k != "filepath"}
            for d in threadpoolctl.threadpool_info()
            if d.get("user_api") == "blas"
        ]
    except ImportError:
        pass
    info: dict = {"note": "threadpoolctl not installed; kernel read through ctypes"}
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info.update(name=cfg.get("name"), version=cfg.get("version"))
    except Exception:  # noqa: BLE001 - older NumPy: no dict mode
        pass
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln}
        for path in sorted(libs):
            lib = ctypes.CDLL(path)
            for sym in (
                "openblas_get_corename",
                "openblas_get_corename64_",
                "scipy_openblas_get_corename64_",
                "scipy_openblas_get_corename",
            ):
                fn = getattr(lib, sym, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    info["architecture"] = fn().decode()
                    break
    except Exception:  # noqa: BLE001 - best effort only
        pass
    return [info]
