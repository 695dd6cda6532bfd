"""EXACTBLOCKS_ISA forces a SIMD path at load, refuses an unavailable one, and every forced
path gives the same bits (issue: run-time dispatch with an override)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from exactblocks import _ext

_CODE = (
    "import numpy as np, exactblocks as eb, exactblocks.runtime as rt\n"
    "w = {k: (np.arange(np.prod(s), dtype=np.float32).reshape(s) % 7 - 3) / np.float32(40)\n"
    "     for k, s in [('input_layernorm.weight', (16,)), ('post_attention_layernorm.weight', (16,)),\n"  # noqa: E501
    "                  ('q_proj.weight', (16, 16)), ('k_proj.weight', (8, 16)), ('v_proj.weight', (8, 16)),\n"  # noqa: E501
    "                  ('o_proj.weight', (16, 16)), ('gate_proj.weight', (24, 16)),\n"
    "                  ('up_proj.weight', (24, 16)), ('down_proj.weight', (16, 24))]}\n"
    "blk = eb.TransformerBlockInference(w, n_heads=2)\n"
    "x = (np.arange(5 * 16, dtype=np.float32).reshape(1, 5, 16) % 11 - 5) / np.float32(3)\n"
    "print(rt.get_isa(), blk.forward(x).tobytes().hex())\n"
)


def run(isa):
    env = dict(os.environ, EXACTBLOCKS_ISA=isa)
    return subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True)


def test_forced_isas_agree():
    outs = {}
    for isa in _ext.core().available_isas():
        res = run(isa)
        assert res.returncode == 0, res.stderr
        got_isa, digest = res.stdout.split()
        assert got_isa == isa
        outs[isa] = digest
    assert len(set(outs.values())) == 1, outs


def test_unavailable_isa_is_refused():
    res = run("neon" if "neon" not in _ext.core().available_isas() else "avx512")
    if res.returncode == 0:
        pytest.skip("every ISA name is available here")
    assert "EXACTBLOCKS_ISA" in res.stderr and "not available" in res.stderr
    assert "ValueError" in res.stderr


def test_isa_name_is_case_insensitive():
    isa = _ext.core().available_isas()[-1]
    res = run(f" {isa.upper()} ")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == isa


def test_set_isa_name_is_case_insensitive():
    """runtime.set_isa takes the names as EXACTBLOCKS_ISA does, in any letter case."""
    from exactblocks import runtime

    saved = runtime.get_isa()
    try:
        for isa in runtime.available_isas():
            runtime.set_isa(isa.upper())
            assert runtime.get_isa() == isa
    finally:
        runtime.set_isa(saved)
    with pytest.raises(ValueError, match="name='NEON2' is not available"):
        runtime.set_isa("NEON2")
