"""The benchmark's Mamba-2 backward row runs and checks itself (tiny shapes, no timing asserts):
exactblocks' backward is deterministic and agrees with torch autograd of HF's block (when torch
imports), and the report table shows every column."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

HAS_TORCH = (
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("transformers") is not None
)


def test_backward_row_quick():
    from benchmarks.backward_run import backward_table, run_mamba2_backward
    from benchmarks.checks import Recorder
    from benchmarks.timing import Measurement
    from benchmarks.workloads import QUICK_LAYERS, QUICK_SHAPES

    if not HAS_TORCH:
        pytest.skip("torch and transformers are needed for the torch peer")
    rec = Recorder(verbose=False)
    sh = replace(QUICK_SHAPES, prefill_len=40)
    opts = {"repeats": 2, "repeats_explicit": True}
    res = run_mamba2_backward(QUICK_LAYERS["mamba2-layer"], sh, {"torch_error": None}, opts, rec)
    assert rec.checks and all(c["ok"] for c in rec.checks), rec.checks
    for peer in ("exactblocks_backward", "exactblocks_forward", "torch_autograd"):
        assert isinstance(res[peer], Measurement), (peer, res[peer])
        assert res[peer].tokens == 40 and len(res[peer].samples) == 2
    table = backward_table(res, "mamba2 (tiny)")
    assert "backward / forward" in table and "vs torch" in table and "L=40" in table
