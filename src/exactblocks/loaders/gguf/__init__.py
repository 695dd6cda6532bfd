"""GGUF files: reading them (:mod:`.reader`) and turning their tensors into numbers
(:mod:`.quant`).

This package reads the format only: which tensor is which layer's weight, and what the
metadata means for a model, is each family's (``exactblocks.models``); ``exactblocks.load_model``
puts the two together.
"""

from __future__ import annotations

from .quant import DIRECT_TYPES, check_type, dequantize, unpermute_qk
from .reader import (
    SMOLLM2_GGUF_NAME,
    SMOLLM2_INSTALL_COMMAND,
    GGUFFile,
    default_smollm2_path,
    gguf_field,
    open_gguf,
    release_map,
)

__all__ = [
    "DIRECT_TYPES",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_INSTALL_COMMAND",
    "GGUFFile",
    "check_type",
    "default_smollm2_path",
    "dequantize",
    "gguf_field",
    "open_gguf",
    "release_map",
    "unpermute_qk",
]
