"""docs/mamba2-backward.md's Python examples run as written (each ```python block, in order)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "mamba2-backward.md"


def test_doc_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/mamba2-backward.md has no python example"
    scope = {"__name__": "__doc_example__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"mamba2-backward.md[python block {i}]", "exec"), scope)
