"""Whole models: from a checkpoint to exact text.

``exactblocks.load_model(source)`` reads a Hugging Face folder, a safetensors file, a GGUF file,
a transformers model object or a state dict, picks the family from the config
(:mod:`~exactblocks.models.registry`), builds the blocks and the output head, and returns a
:class:`~exactblocks.models.model.Model`: ``forward``/``step`` from token ids to float32 logits,
bit-exact like the blocks, ``hidden_states``/``logits`` for apps, and ``generate`` on the one
generation core (:mod:`~exactblocks.models.generate`: ``SamplingParams``, the stop rules and
logprobs shared with the server and ``exactblocks.ray``).

One small file per family maps its HF config to block options in one frozen spec:
``llama`` (SmolLM2), ``mistral``, ``qwen2``, ``qwen3`` (sharing ``_decoder``), ``mamba2``.
"""

from .generate import GenerateOutput, Generation, GenerationStream, SamplingParams
from .loading import load_model
from .model import Model
from .registry import FAMILIES
from .state import ModelState

__all__ = [
    "FAMILIES",
    "GenerateOutput",
    "Generation",
    "GenerationStream",
    "Model",
    "ModelState",
    "SamplingParams",
    "load_model",
]
