"""The C++ core's folders are layers and every ``#include`` points down.

Top to bottom: bindings -> dispatch -> blocks -> ops -> simd -> math -> base. A file may
include headers of its own layer and of any layer below it, never above; nothing below
``bindings/`` includes nanobind or Python. The layer of a path is its first folder under
``csrc/``. docs/architecture.md draws the same order.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
LAYERS = ["base", "math", "simd", "ops", "blocks", "dispatch", "bindings"]  # bottom to top
RANK = {name: i for i, name in enumerate(LAYERS)}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".hpp", ".cpp", ".h"))


def layer_of(rel: str) -> str:
    return rel.split("/", 1)[0]


def test_every_source_is_in_a_layer():
    stray = [
        str(p.relative_to(CSRC))
        for p in sources()
        if layer_of(str(p.relative_to(CSRC))) not in RANK
    ]
    assert not stray, f"files outside the layer folders {LAYERS}: {stray}"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(CSRC)))
def test_includes_point_down(path):
    own = layer_of(str(path.relative_to(CSRC)))
    bad = []
    for inc in INCLUDE.findall(path.read_text()):
        first = inc.split("/", 1)[0]
        if first in ("nanobind", "Python.h") and own != "bindings":
            bad.append(f"{inc} (only bindings/ may include nanobind or Python)")
        elif first in RANK and RANK[first] > RANK[own]:
            bad.append(f"{inc} ({first} is above {own})")
    assert not bad, f"{path.relative_to(CSRC)} includes up the layer order: {bad}"


def test_the_check_catches_an_upward_include(tmp_path):
    """The parser sees the include forms the tree uses (guards the check itself)."""
    text = '#include "blocks/transformer/model.hpp"\n  #  include <vector>\n'
    assert INCLUDE.findall(text) == ["blocks/transformer/model.hpp", "vector"]
