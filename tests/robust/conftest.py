"""Fixtures of the robustness tests; helpers live in robust_helpers.py."""

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


@pytest.fixture(scope="session")
def tiny_hybrid_folder(tmp_path_factory):
    """A tiny Nemotron-H model folder (d_model 64; Mamba-2, attention and MLP layers)."""
    from robust_helpers import save_hybrid_model

    folder = str(tmp_path_factory.mktemp("tiny_hybrid"))
    return save_hybrid_model(folder, hidden=64, heads=4, head_dim=16, state=16, max_positions=4096)


@pytest.fixture(scope="session")
def hybrid_folder(tmp_path_factory):
    """A small Nemotron-H model folder (d_model 256) whose long prefills take seconds."""
    from robust_helpers import save_hybrid_model

    folder = str(tmp_path_factory.mktemp("hybrid"))
    return save_hybrid_model(folder, hidden=256, heads=4, head_dim=64, state=64, max_positions=4096)


@pytest.fixture(scope="session")
def long_run_folder(tmp_path_factory):
    """A small Nemotron-H model folder whose first eight layers form one run of
    transformer layers (attention and MLP), which a model call runs in one native call."""
    from robust_helpers import save_hybrid_model

    folder = str(tmp_path_factory.mktemp("long_run"))
    return save_hybrid_model(folder, hidden=256, heads=4, head_dim=64, state=64,
                             max_positions=4096, pattern="*-*-*-*-M")  # fmt: skip
