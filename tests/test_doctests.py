"""The Examples sections of the public modules' docstrings run as written (numpydoc
Examples are doctests; STYLE 4)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "exactblocks._block",
    "exactblocks._options",
    "exactblocks._state",
    "exactblocks._weights",
    "exactblocks.transformer.config",
    "exactblocks.transformer.weights",
    "exactblocks.transformer.state",
    "exactblocks.transformer.session",
    "exactblocks.transformer.block",
    "exactblocks.mamba2.config",
    "exactblocks.mamba2.weights",
    "exactblocks.mamba2.state",
    "exactblocks.mamba2.block",
    "exactblocks.runtime",
    "exactblocks._validation",
    "exactblocks.loaders.gguf.reader",
    "exactblocks.loaders.gguf.quant",
    "exactblocks.models._gguf",
    "exactblocks.text.byte_level",
    "exactblocks.text.chat_template",
    "exactblocks.text.detokenizer",
    "exactblocks.text.tool_calls",
    "exactblocks.text.gguf_tokenizer",
    "exactblocks.cli",
    "exactblocks.sampling",
    "benchmarks.workloads",
    "benchmarks.checks",
    "benchmarks.timing",
    "benchmarks.report",
    "benchmarks.cli",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} doctest examples failed"
