"""Process-wide runtime settings: thread count, arithmetic version, ISA path.

The thread count only changes speed: internal parallelism splits independent output elements
and never a reduction, so outputs are bitwise the same for every value (SPEC.md 2.6, 3.1).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import warnings

from . import _ext
from ._validation import _fmt_int, check_int, describe_type

__all__ = [
    "arithmetic_version",
    "available_isas",
    "get_isa",
    "get_num_threads",
    "set_isa",
    "set_num_threads",
    "usable_cpus",
]

_ENV_THREADS = "EXACTBLOCKS_NUM_THREADS"
_ENV_OMP = "OMP_NUM_THREADS"
# Upper bound of the thread count: far above any CPU count exactblocks can use, and well inside
# the C++ int the core stores it in.
MAX_NUM_THREADS = 4096
_lock = threading.Lock()


def usable_cpus() -> int:
    """Return the CPUs this process may run on (its affinity mask), at least 1, at most 4096.

    Returns
    -------
    int
        ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where there is no affinity mask).
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity masks
        n = os.cpu_count() or 1
    return min(max(1, n), MAX_NUM_THREADS)


def _count(n: int, noun: str) -> str:
    """``"1 CPU"``, ``"2 CPUs"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _warn_outside(message: str) -> None:
    """A RuntimeWarning attributed to the first frame outside the exactblocks package: the
    user's ``import exactblocks`` line, or their call, not a line of exactblocks itself."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(0), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back  # the import machinery: warnings skips these frames too
            continue
        if not name.startswith(package):
            break
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level if frame is not None else 1)


def _env_threads(name: str) -> int | None:
    """The thread count a variable asks for, or None (unset, empty, or invalid: warned).

    ``OMP_NUM_THREADS`` may be a comma-separated list (one count per nesting level, OpenMP);
    its first entry is used.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.strip().split(",")[0].strip() if name == _ENV_OMP else raw.strip()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if 1 <= n <= MAX_NUM_THREADS:
        return n
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    _warn_outside(
        f"exactblocks: {name}={shown!r} is not an integer in [1, {MAX_NUM_THREADS}]; ignored"
    )
    return None


def _default_num_threads() -> int:
    """Threads at import: ``EXACTBLOCKS_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the usable
    CPUs; a value above the usable CPUs is capped to them (RuntimeWarning)."""
    cpus = usable_cpus()
    for name in (_ENV_THREADS, _ENV_OMP):
        n = _env_threads(name)
        if n is None:
            continue
        if n > cpus:
            _warn_outside(
                f"exactblocks: {name}={n} exceeds the {_count(cpus, 'CPU')} usable by this "
                f"process (its affinity mask); using {_count(cpus, 'thread')}"
            )
            return cpus
        return n
    return cpus


_num_threads = _default_num_threads()


def _push_threads(core_module) -> None:
    core_module.set_num_threads(_num_threads)


_ext._register_on_load(_push_threads)


def _set_threads(n: int) -> None:
    global _num_threads
    with _lock:
        _num_threads = n
        if _ext.is_loaded():
            _ext.core().set_num_threads(n)


def _register_threadpoolctl(core_module) -> None:
    """Make ``threadpoolctl`` see and limit exactblocks' threads, when it is installed.

    ``threadpool_info()`` then lists ``{'user_api': 'exactblocks', 'internal_api':
    'exactblocks', ...}`` and ``with threadpool_limits(1): ...`` runs exactblocks' calls on one
    thread (a limit above the usable CPUs is capped silently, as a limit). threadpoolctl finds
    the controller through the extension's exported ``exactblocks_get_num_threads`` symbol.
    """
    try:
        if importlib.util.find_spec("threadpoolctl") is None:
            return
        import threadpoolctl
    except Exception:  # pragma: no cover - a broken threadpoolctl must not break exactblocks
        return
    base, register = (
        getattr(threadpoolctl, "LibController", None),
        getattr(threadpoolctl, "register", None),
    )
    if base is None or register is None:  # pragma: no cover - threadpoolctl < 3.5
        return

    class ExactblocksController(base):
        """threadpoolctl's controller of exactblocks' thread count (runtime.set_num_threads)."""

        user_api = "exactblocks"
        internal_api = "exactblocks"
        filename_prefixes = ("_core",)
        check_symbols = ("exactblocks_get_num_threads",)

        def get_num_threads(self):
            return get_num_threads()

        def set_num_threads(self, num_threads):
            _set_threads(min(max(1, int(num_threads)), usable_cpus()))

        def get_version(self):
            from . import __version__

            return __version__

    register(ExactblocksController)


_ext._register_on_load(_register_threadpoolctl)


def _apply_isa_env(core_module) -> None:
    """Honour ``EXACTBLOCKS_ISA`` when the extension loads.

    Paths: scalar, avx2, avx512 on x86-64; scalar, neon on AArch64.

    An ISA the CPU or the build lacks is refused: the first use of the extension raises
    ValueError naming the environment variable, its value and the available paths (nothing
    silently falls back, so a test that forces a path really runs it). ``load_model`` loads
    the extension before it opens a file, so this is never reported as a broken file.
    """
    raw = os.environ.get("EXACTBLOCKS_ISA", "")
    name = raw.strip().lower()  # "AVX2" and " avx2 " name the avx2 path too
    if not name:
        return
    avail = [str(s) for s in core_module.available_isas()]
    if name not in avail:
        raise ValueError(
            f"exactblocks: the environment variable EXACTBLOCKS_ISA={raw!r} is not available on "
            f"this CPU or build; available: {avail} (unset it to use the best one, or set one "
            "of those)"
        )
    core_module.set_isa(name)


_ext._register_on_load(_apply_isa_env)


def set_num_threads(n: int) -> None:
    """Set the number of worker threads used by later calls.

    Parameters
    ----------
    n : int
        Threads, >= 1 (Python int or NumPy integer). A value above the CPUs usable by the
        process (:func:`usable_cpus`, its affinity mask), however large, is capped to them with
        a RuntimeWarning: more threads than CPUs only adds overhead.

    Raises
    ------
    TypeError
        ``n`` is not an int (bool and float are refused).
    ValueError
        ``n < 1``.

    Warns
    -----
    RuntimeWarning
        ``n`` exceeds the usable CPUs; the CPU count is used instead.

    Notes
    -----
    Outputs never depend on ``n`` (SPEC.md 3.1): work is split over independent output rows,
    tokens, heads or features, and no reduction is split across threads. With threadpoolctl
    installed, ``threadpoolctl.threadpool_limits`` controls the same setting.

    Examples
    --------
    >>> import exactblocks
    >>> old = exactblocks.get_num_threads()
    >>> exactblocks.set_num_threads(1)
    >>> exactblocks.get_num_threads()
    1
    >>> exactblocks.set_num_threads(old)
    """
    v = check_int(n, "n", "exactblocks.set_num_threads", min_value=1)
    cpus = usable_cpus()
    if v > cpus:
        warnings.warn(
            f"exactblocks.set_num_threads: n={_fmt_int(v)} exceeds the {_count(cpus, 'CPU')} "
            f"usable by this process (its affinity mask); using {_count(cpus, 'thread')}",
            RuntimeWarning,
            stacklevel=2,
        )
        v = cpus
    _set_threads(v)


def get_num_threads() -> int:
    """Return the number of worker threads used by calls.

    Returns
    -------
    int
        The value last set by :func:`set_num_threads` (or threadpoolctl); by default
        ``EXACTBLOCKS_NUM_THREADS``, else ``OMP_NUM_THREADS`` (its first entry), else the CPUs
        in the process's affinity mask, read at import and capped to those CPUs.
    """
    return _num_threads


def arithmetic_version() -> str:
    """Return the name of the arithmetic compiled into the extension.

    Returns
    -------
    str
        For example ``"fp32-identical-1"``. Bits are promised equal only between runs with the
        same value; any change of a summation order, elementary function or op order changes it.
        It enters every block fingerprint, so states computed with another arithmetic are refused.

    Raises
    ------
    ImportError
        The compiled extension is missing or its version differs from the package's.
    """
    return str(_ext.core().arithmetic_version())


def available_isas() -> list[str]:
    """Return the SIMD paths this CPU and build can run, e.g. ``['scalar', 'avx2']``.

    Returns
    -------
    list of str
        Always contains ``'scalar'``. Every path gives the same bits (SPEC.md 3.1).
    """
    return [str(s) for s in _ext.core().available_isas()]


def get_isa() -> str:
    """Return the SIMD path in use (``'scalar'``, ``'avx2'``, ``'avx512'`` or ``'neon'``).

    Returns
    -------
    str
    """
    return str(_ext.core().get_isa())


def set_isa(name: str) -> None:
    """Force a SIMD path for later calls; for testing (outputs do not depend on it).

    Parameters
    ----------
    name : str
        One of :func:`available_isas` (any letter case, as ``EXACTBLOCKS_ISA``).

    Raises
    ------
    TypeError
        ``name`` is not a str.
    ValueError
        The path is not available on this CPU or build.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"exactblocks.runtime.set_isa: name must be a str; got {describe_type(name)}"
        )
    avail = available_isas()
    if name.lower() not in avail:  # case-insensitive, as EXACTBLOCKS_ISA
        raise ValueError(
            f"exactblocks.runtime.set_isa: name={name!r} is not available; available: {avail}"
        )
    _ext.core().set_isa(name.lower())
