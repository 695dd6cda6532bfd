"""Fixtures of the robustness tests (issue #16); helpers live in robust_helpers.py."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def core():
    """The compiled extension (an error under CI when missing, a skip locally)."""
    from exactblocks import _ext

    if os.environ.get("CI"):
        return _ext.core()
    try:
        return _ext.core()
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"exactblocks._core is not built: {exc}")
