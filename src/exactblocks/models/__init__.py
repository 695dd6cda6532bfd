"""Whole models: from a checkpoint to exact text (issue #13).

``exactblocks.load_model(source)`` reads a Hugging Face folder, a safetensors file, a GGUF file,
a transformers model object or a state dict, picks the family from the config
(:mod:`~exactblocks.models.registry`), builds the blocks and the output head, and returns a
:class:`~exactblocks.models.model.Model`: ``forward``/``step`` from token ids to float32 logits,
bit-exact like the blocks, and ``generate``.

One small file per family maps its HF config to block options in one frozen spec:
``llama`` (SmolLM2), ``mistral``, ``qwen2``, ``qwen3`` (sharing ``_decoder``), ``mamba2``.
"""

from .generate import GenerateOutput, GenerationStream
from .loading import load_model
from .model import Model
from .registry import FAMILIES
from .state import ModelState

__all__ = ["FAMILIES", "GenerateOutput", "GenerationStream", "Model", "ModelState", "load_model"]
