"""The whole-model part of the benchmark: the llama.cpp peer (``llama-bench``) and the report.

The model workloads themselves take minutes (``python -m benchmarks --workloads
smollm2-model,gemma3-model``) and are not run here. This file checks how a ``llama-bench``
program is found and why it is skipped, one real ``llama-bench`` run when one is installed
(skipped otherwise: llama.cpp is not a Python dependency), and the model table and targets the
report prints from run_model's results (ratios are peer time / exactblocks time).
"""

from __future__ import annotations

import stat

import pytest

from benchmarks.llama_cpp_peer import LlamaBench, find_llama_bench
from benchmarks.report import LLAMA_CPP_ARITHMETIC, model_table, targets_table
from benchmarks.timing import Measurement


def test_find_llama_bench_explains_a_skip(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    path, why = find_llama_bench()
    assert path is None and "--llama-bench PATH" in why
    plain = tmp_path / "not-executable"
    plain.write_text("")
    path, why = find_llama_bench(str(plain))
    assert path is None and why.startswith("--llama-bench=") and "not an executable" in why
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "missing"))
    path, why = find_llama_bench()
    assert path is None and why.startswith("$LLAMA_BENCH=")
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.delenv("LLAMA_BENCH")
    assert find_llama_bench() == (str(exe), "PATH")
    assert find_llama_bench(str(exe)) == (str(exe), "--llama-bench")


def test_real_llama_bench_times_prefill_and_decode():
    """With a real llama-bench (``$LLAMA_BENCH`` or on PATH) and the SmolLM2 GGUF."""
    exe, why = find_llama_bench()
    if exe is None:
        pytest.skip(f"llama.cpp not available: {why}")
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        path = default_smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    lb = LlamaBench(exe, path, 1)
    assert lb.prefill(8) > 0
    assert lb.decode(2, 8) > 0
    assert lb.info["n_threads"] == 1 and "Q4_1" in lb.info["model_type"]


def _side(prefill_s: float, step_s: float, tokens: int) -> dict:
    return {
        "prefill": Measurement(prefill_s, tokens, [prefill_s]).as_dict(),
        "decode": Measurement(step_s, 1, [step_s]).as_dict(),
    }


def test_model_table_and_targets_give_peer_over_exactblocks_ratios():
    models = {
        "smollm2-model": {
            "label": "SmolLM2-135M-Instruct (Q4_1 GGUF)",
            "prompt_tokens": 100,
            "new_tokens": 16,
            "exactblocks": _side(0.1, 0.005, 100),
            "hf_generate": _side(0.2, 0.03, 100),
            "hf_attn_implementation": "sdpa",
            "llama_cpp": _side(0.4, 0.0075, 100),
        },
        "gemma3-model": {
            "label": "Gemma 3 270M (Q4_K_M GGUF)",
            "prompt_tokens": 90,
            "new_tokens": 16,
            "exactblocks": _side(0.2, 0.01, 90),
            "llama_cpp": _side(0.3, 0.01, 90),
        },
    }
    table = model_table(models).splitlines()
    assert "llama.cpp prefill tok/s" in table[0] and "HF generate (sdpa) prefill tok/s" in table[0]
    assert len(table) == 4
    assert "| 1,000 | 5.00 |" in table[2] and "4.00x | 1.50x |" in table[2]
    assert "| - | - | - | - |" in table[3] and "1.50x | 1.00x |" in table[3]
    targets = targets_table([], models, None)
    assert "vs llama.cpp 250.0 tok/s (4.00x; target >= 3x)" in targets
    assert "vs llama.cpp 7.5 ms/token (1.50x; target >= 1.5x)" in targets
    assert "| Gemma 3 270M model decode (greedy, 16 tokens) |" in targets
    assert "8-bit quantised activations" in LLAMA_CPP_ARITHMETIC
