"""``exactblocks.loaders`` reads file formats only: no module of it imports the blocks or the
models (at the top or inside a function), so nothing there can build a block or depend on a
family, and no import cycle can run through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LOADERS = Path(__file__).resolve().parents[2] / "src" / "exactblocks" / "loaders"
FORBIDDEN = ("exactblocks.transformer", "exactblocks.mamba2", "exactblocks.models")
# names the package root re-exports from the blocks
BLOCK_NAMES = {"TransformerBlockInference", "Mamba2BlockInference", "load_model"}


def imports(path: Path):
    """(module, names) of every import in the file, relative ones resolved."""
    package = "exactblocks." + ".".join(path.relative_to(LOADERS.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.rsplit(".", 1)[0] + ".__init__"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield module, tuple(a.name for a in node.names)


@pytest.mark.parametrize("path", sorted(LOADERS.rglob("*.py")), ids=lambda p: p.name)
def test_loaders_import_no_block_and_no_model(path):
    bad = []
    for module, names in imports(path):
        if module.startswith(FORBIDDEN):
            bad.append(module)
        elif module == "exactblocks" and BLOCK_NAMES & set(names):
            bad.append(f"exactblocks.{sorted(BLOCK_NAMES & set(names))}")
    assert not bad, f"{path.relative_to(LOADERS)} imports {bad}"


def test_the_check_sees_relative_and_function_imports(tmp_path):
    probe = LOADERS / "gguf" / "quant.py"
    found = dict(imports(probe))
    assert "exactblocks.loaders.gguf.reader" in found  # ``from .reader import ...``
    assert "exactblocks._weights" in found  # inside a function
