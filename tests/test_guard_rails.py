"""The CI guard rails agree with each other.

- .pre-commit-config.yaml pins the same ruff and clang-format versions as .ci/run, and runs
  the same three style gates;
- .ci/run runs the type checker, and tools/typecheck.py counts mypy's errors as mypy reports
  them, against a baseline file that holds one count.

mypy itself is not run here (a minute or two): .ci/run and the pre-commit ``typecheck`` hook
run it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()
PRE_COMMIT = (ROOT / ".pre-commit-config.yaml").read_text()


def _typecheck():
    spec = importlib.util.spec_from_file_location("_eb_typecheck", ROOT / "tools" / "typecheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tool", ["ruff", "clang-format", "mypy"])
def test_pre_commit_pins_the_versions_ci_installs(tool):
    ci = set(re.findall(rf"\b{tool}==([0-9][\w.]*)", CI))
    assert len(ci) == 1, f".ci/run pins {tool} {sorted(ci)}"
    if tool == "mypy":  # the pre-commit hook runs in the developer's environment
        assert "python tools/typecheck.py" in CI
        return
    hooks = set(re.findall(rf"\b{tool}==([0-9][\w.]*)", PRE_COMMIT))
    assert hooks == ci, f"{tool}: .pre-commit-config.yaml pins {hooks}, .ci/run {ci}"


def test_pre_commit_runs_the_ci_style_gates():
    for command in ("ruff check", "ruff format --check", "clang-format --dry-run --Werror"):
        assert command in CI, command
        assert f"entry: {command}" in PRE_COMMIT, command


def test_typecheck_counts_error_lines_only():
    tc = _typecheck()
    out = (
        "src/exactblocks/a.py:3: error: Name 'x' is not defined  [name-defined]\n"
        "src/exactblocks/a.py:3: note: See https://mypy.rtfd.io\n"
        "src/exactblocks/b.py:10: error: Incompatible types  [assignment]\n"
    )
    assert tc.count_errors(out) == 2
    assert tc.count_errors("") == 0


def test_typecheck_baseline_is_one_count(tmp_path):
    tc = _typecheck()
    assert tc.read_baseline() >= 0
    bad = tmp_path / "baseline.txt"
    bad.write_text("about 300\n")
    with pytest.raises(ValueError, match="one non-negative integer"):
        tc.read_baseline(bad)
