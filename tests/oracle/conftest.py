"""Fixtures of the Hugging Face oracle tests (SPEC.md 4.6).

- Pins torch to 2 intra-op threads for every oracle test (the machine has 2 cores, shared).
- ``eb`` gives the ``exactblocks`` package. Locally a missing build skips the tests that need
  it (with the reason); under CI (``CI`` set) a missing or broken build is an error, so an
  oracle test can never pass by being skipped there.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

TORCH_THREADS = 2


def require(module: str, why: str):
    """Import `module`; skip the calling test/module locally if it is missing, fail under CI.

    Parameters
    ----------
    module : str
        Module name, e.g. ``"torch"``.
    why : str
        Skip reason shown locally.

    Returns
    -------
    module
    """
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"{why}: {exc}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _torch_two_threads():
    """Every oracle test runs torch with 2 intra-op threads (restored afterwards)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def eb():
    """The ``exactblocks`` package (skipped locally when not built; an error under CI)."""
    return require("exactblocks", "exactblocks (with its compiled _core) is not importable")
