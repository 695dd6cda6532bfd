"""Fixtures of the bitwise invariance tests (SPEC.md 3.1, 9): puts ``tests/`` on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
