"""Which family a checkpoint belongs to: HF ``architectures`` / ``model_type``, GGUF
``general.architecture`` -> one family module (one file per family, listed in
:data:`FAMILIES`). Anything else is refused with the name that was not recognised.

A family module provides ``ARCHITECTURES``, ``MODEL_TYPES``, ``GGUF_ARCHS``, ``DEFAULTS`` and
``spec_from_config(config) -> (spec, resolved_config)``; the spec names its tensors and builds
its layers (``_decoder.DecoderSpec``, ``mamba2.Mamba2Spec``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from . import (
    gemma2,
    gemma3,
    granite,
    granitemoehybrid,
    llama,
    mamba2,
    mistral,
    nemotron_h,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    smollm3,
    stablelm,
    starcoder2,
)

__all__ = ["FAMILIES", "family_for_config", "family_for_gguf"]

#: family name -> module, in the order they are tried.
FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "olmo2": olmo2,
    "smollm3": smollm3,
    "granite": granite,
    "phi3": phi3,
    "stablelm": stablelm,
    "starcoder2": starcoder2,
    "mamba2": mamba2,
    "nemotron_h": nemotron_h,
    "granitemoehybrid": granitemoehybrid,
}


def _supported(attr: str) -> list[str]:
    return sorted(name for fam in FAMILIES.values() for name in getattr(fam, attr))


def family_for_config(config: Mapping) -> ModuleType:
    """The family module of an HF config.

    ``architectures`` decides when present (every entry must be a supported causal-LM class of
    one family); otherwise ``model_type``. The two must agree when both are present.

    Parameters
    ----------
    config : Mapping
        HF config fields.

    Returns
    -------
    module

    Raises
    ------
    ValueError
        An architecture or model_type no family supports (the message lists those supported),
        neither field present, or the two pointing at different families.
    """
    archs = config.get("architectures")
    model_type = config.get("model_type")
    by_type = None
    if model_type is not None:
        by_type = next((f for f in FAMILIES.values() if model_type in f.MODEL_TYPES), None)
        if by_type is None:
            raise ValueError(
                f"load_model: config model_type={model_type!r} is not supported; supported: "
                f"{_supported('MODEL_TYPES')}"
            )
    if archs:
        if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"load_model: config architectures={archs!r} is not a list of str")
        fams = set()
        for arch in archs:
            fam = next((f for f in FAMILIES.values() if arch in f.ARCHITECTURES), None)
            if fam is None:
                raise ValueError(
                    f"load_model: config architectures entry {arch!r} is not supported; "
                    f"supported: {_supported('ARCHITECTURES')}"
                )
            fams.add(fam)
        if len(fams) > 1 or (by_type is not None and by_type not in fams):
            raise ValueError(
                f"load_model: config architectures={list(archs)!r} and model_type="
                f"{model_type!r} name different model families"
            )
        return fams.pop()
    if by_type is None:
        raise ValueError(
            "load_model: the config has neither 'architectures' nor 'model_type'; cannot tell "
            "the model family"
        )
    return by_type


def family_for_gguf(arch: str) -> ModuleType:
    """The family module of a GGUF ``general.architecture`` value.

    Parameters
    ----------
    arch : str

    Returns
    -------
    module

    Raises
    ------
    ValueError
        An architecture no family reads from GGUF.
    """
    for fam in FAMILIES.values():
        if arch in fam.GGUF_ARCHS:
            return fam
    raise ValueError(
        f"load_model: GGUF general.architecture={arch!r} is not supported; supported: "
        f"{_supported('GGUF_ARCHS')}"
    )
