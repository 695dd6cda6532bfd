"""Every ```python block of README.md, CONTRIBUTING.md and docs/*.md runs as written.

The blocks of one page run in order in one fresh interpreter, sharing one namespace (a page
reads as one session), from a temporary working directory; their own asserts check what they
claim. A block may be left out only with a stated reason, on the line just before it::

    <!-- docs-test: skip (needs a multi-node Ray cluster) -->

and a page whose run is long (a real model, a Ray cluster) is marked ``slow`` by a line
anywhere in it::

    <!-- docs-test: slow (starts Ray and loads SmolLM2-135M) -->
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "CONTRIBUTING.md"],
    key=lambda p: str(p),
)
PAGES = [p for p in PAGES if p.exists()]
TIMEOUT = 1200  # seconds per page: the slowest starts Ray and generates with a real model

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*docs-test:\s*(skip|slow)\s*(.*?)-->")

# Runs in the fresh interpreter: exec each block in order in one namespace; a traceback names
# the page, the block and its line in the page.
_RUNNER = """
import json, sys
blocks = json.load(sys.stdin)
ns = {"__name__": "__docs__"}
for name, first_line, code in blocks:
    exec(compile("\\n" * (first_line - 1) + code, name, "exec"), ns)
print("docs-ok", len(blocks))
"""


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """The ```python blocks of a page.

    Parameters
    ----------
    text : str
        The page's Markdown.

    Returns
    -------
    list of (int, str, str or None)
        Each block's first code line (1-based), its code, and the reason it is skipped (None
        when it runs).

    Raises
    ------
    ValueError
        A skip mark without a reason in parentheses.
    """
    out = []
    for m in _BLOCK.finditer(text):
        first_line = text.count("\n", 0, m.start(1)) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        reason = None
        if mark and mark.group(1) == "skip":
            reason = mark.group(2).strip()
            if not re.fullmatch(r"\(.+\)", reason):
                raise ValueError(
                    f"a docs-test skip mark needs a reason in parentheses, got {before!r}"
                )
        out.append((first_line, m.group(1), reason))
    return out


def _slow_reason(text: str) -> str | None:
    for mark in _MARK.finditer(text):
        if mark.group(1) == "slow":
            return mark.group(2).strip()
    return None


def _params():
    for page in PAGES:
        text = page.read_text()
        if not python_blocks(text):
            continue
        marks = [pytest.mark.slow] if _slow_reason(text) else []
        yield pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


def test_skip_marks_need_a_reason():
    assert python_blocks("<!-- docs-test: skip (needs a cluster) -->\n```python\nx\n```\n") == [
        (3, "x\n", "(needs a cluster)")
    ]
    with pytest.raises(ValueError, match="needs a reason"):
        python_blocks("<!-- docs-test: skip -->\n```python\nx\n```\n")
    assert python_blocks("```python\ny = 1\n```\n") == [(2, "y = 1\n", None)]


@pytest.mark.parametrize("page", list(_params()))
def test_page_python_blocks_run(page, tmp_path):
    text = page.read_text()
    name = str(page.relative_to(ROOT))
    blocks = [
        (f"{name} (python block {i}, line {line})", line, code)
        for i, (line, code, reason) in enumerate(python_blocks(text))
        if reason is None
    ]
    reasons = sorted({r for _, _, r in python_blocks(text) if r is not None})
    if not blocks and reasons:  # each block needs a live service: said, with the test that runs it
        pytest.skip(f"{name}: every python block is skipped: {'; '.join(reasons)}")
    assert blocks, f"{name}: no python block"
    env = dict(os.environ)
    # the page runs from a temporary directory: a relative PYTHONPATH entry (PYTHONPATH=src for
    # a build in place) is made absolute
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in paths)
    res = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0 and f"docs-ok {len(blocks)}" in res.stdout, (
        f"{name}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    )
