"""Whole models: from a checkpoint to exact text.

``exactblocks.load_model(source)`` reads a Hugging Face folder, a safetensors file, a GGUF file,
a transformers model object or a state dict, picks the family from the config
(:mod:`~exactblocks.models.registry`), builds the blocks and the output head, and returns a
:class:`~exactblocks.models.model.Model`: ``forward``/``step`` from token ids to float32 logits,
bit-exact like the blocks, ``hidden_states``/``logits`` for apps, and ``generate`` on the one
generation core (:mod:`~exactblocks.models.generate`: ``SamplingParams``, the stop rules and
logprobs shared with the server and ``exactblocks.ray``; :mod:`~exactblocks.models.structured`:
``Grammar``, the constraint of constrained decoding).

A family is one file (``models/<family>.py``): its HF config mapping and its GGUF record (keys
and tensor renames), listed once in :mod:`~exactblocks.models.registry` (``FAMILIES``): llama,
mistral, qwen2, qwen3, gemma2, gemma3, olmo2, smollm3, granite, phi3, stablelm, starcoder2 and
the mixtures of experts qwen3_moe, qwen2_moe, olmoe, mixtral (decoders sharing ``_decoder``;
MoE config fields ``moe_config``), mamba2, and the hybrids nemotron_h and granitemoehybrid
(sharing ``_hybrid``). docs/adding-a-family.md shows how to add one.
"""

from .generate import GenerateOutput, Generation, GenerationStream, SamplingParams
from .loading import load_model
from .model import Model
from .registry import FAMILIES
from .state import ModelState
from .structured import Grammar, GrammarError, GrammarMatcher

__all__ = [
    "FAMILIES",
    "GenerateOutput",
    "Generation",
    "GenerationStream",
    "Grammar",
    "GrammarError",
    "GrammarMatcher",
    "Model",
    "ModelState",
    "SamplingParams",
    "load_model",
]
