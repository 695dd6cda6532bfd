"""Lazy loader of the compiled extension ``exactblocks._core``.

``import exactblocks`` works without the extension (documentation, ``isinstance`` checks,
argument errors). The extension is imported on first use; at that moment its version must equal
the Python package's, and the thread count chosen in :mod:`exactblocks.runtime` is handed to it.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

__all__ = ["core", "is_loaded"]

_lock = threading.Lock()
_core: ModuleType | None = None
_on_load: list = []


def _register_on_load(fn) -> None:
    """Run ``fn(core_module)`` once the extension is loaded (at once if it already is)."""
    with _lock:
        if _core is None:
            _on_load.append(fn)
            return
    fn(_core)


def is_loaded() -> bool:
    """Return whether ``exactblocks._core`` has been imported.

    Returns
    -------
    bool
    """
    return _core is not None


def core() -> ModuleType:
    """Return the compiled extension module, importing it on first use.

    Returns
    -------
    module
        ``exactblocks._core``.

    Raises
    ------
    ImportError
        The extension is not built (the message says how to build it), or its ``__version__``
        differs from ``exactblocks.__version__`` (a stale build: rebuild it).
    """
    global _core
    mod = _core
    if mod is not None:
        return mod
    with _lock:
        if _core is None:
            from . import __version__

            try:
                mod = importlib.import_module("exactblocks._core")
            except ImportError as exc:
                raise ImportError(
                    "exactblocks: the compiled extension exactblocks._core is not available "
                    f"({exc}). Build and install it with `pip install .` from the source tree "
                    "(needs a C++17 compiler, CMake and nanobind), or for development "
                    "`pip install --no-build-isolation -Ceditable.rebuild=true -Cbuild-dir=build "
                    "-ve .`"
                ) from exc
            ext_version = getattr(mod, "__version__", None)
            if ext_version != __version__:
                raise ImportError(
                    f"exactblocks: the compiled extension exactblocks._core has version "
                    f"{ext_version!r} but the Python package is {__version__!r}; rebuild the "
                    "extension (`pip install .`) so both come from the same source"
                )
            for fn in _on_load:
                fn(mod)
            _on_load.clear()
            _core = mod
    return _core
