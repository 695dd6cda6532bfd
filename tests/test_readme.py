"""The README's Python examples run as written (each ```python block, in order)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md[python block {i}]", "exec"), {"__name__": "__readme__"})
