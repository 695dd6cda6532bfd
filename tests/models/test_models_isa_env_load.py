"""An unavailable EXACTBLOCKS_ISA is reported as such by load_model, not as a broken file.

Before, ``load_model("m.gguf")`` with ``EXACTBLOCKS_ISA=neon`` on x86-64 said "cannot read
'm.gguf' as a GGUF model", sending the user to a file that is fine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from models_helpers import make_hf_model
from test_models_gguf import write_gguf

from exactblocks import runtime


def test_load_model_reports_the_unavailable_isa(tmp_path):
    missing = next(
        (i for i in ("neon", "avx512", "avx2") if i not in runtime.available_isas()), None
    )
    if missing is None:
        pytest.skip("every ISA name is available here")
    path = str(tmp_path / "m.gguf")
    write_gguf(make_hf_model("qwen2"), "qwen2", path)
    code = (
        "import warnings, exactblocks\n"
        "warnings.simplefilter('ignore')\n"
        f"exactblocks.load_model({path!r})\n"
    )
    env = dict(os.environ, EXACTBLOCKS_ISA=missing)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: exactblocks: the environment variable "), res.stderr
    assert f"EXACTBLOCKS_ISA={missing!r} is not available" in last and "available: [" in last
    assert "cannot read" not in res.stderr and "m.gguf" not in last
    # the same file loads once the variable names an available path
    env["EXACTBLOCKS_ISA"] = runtime.available_isas()[0]
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
