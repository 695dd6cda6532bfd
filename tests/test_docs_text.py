"""docs/text.md's Python examples run as written (each ```python block, in order, one
namespace), as the README's do."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "text.md"


def test_text_doc_python_blocks_run():
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2
    namespace = {"__name__": "__docs_text__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/text.md[python block {i}]", "exec"), namespace)
