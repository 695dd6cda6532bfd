"""Whole models: from a checkpoint to exact text (issue #13).

``exactblocks.load_model(source)`` reads a Hugging Face folder, a safetensors file, a GGUF file,
a transformers model object or a state dict, picks the family from the config
(:mod:`~exactblocks.models.registry`), builds the blocks and the output head, and returns a
:class:`~exactblocks.models.base.Model`: ``forward``/``step`` from token ids to float32 logits,
bit-exact like the blocks, and ``generate``.

One small file per family maps its HF config to block options in one frozen spec:
``llama`` (SmolLM2), ``mistral``, ``qwen2``, ``qwen3`` (sharing ``_decoder``), ``mamba2``.
"""

from .base import GenerateOutput, GenerationStream, Model, ModelState
from .loading import load_model
from .registry import FAMILIES

__all__ = ["FAMILIES", "GenerateOutput", "GenerationStream", "Model", "ModelState", "load_model"]
