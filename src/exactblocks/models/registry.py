"""Which family a checkpoint belongs to: HF ``architectures`` / ``model_type``, GGUF
``general.architecture`` -> one family module (one file per family, listed in
:data:`FAMILIES`). Anything else is refused with the name that was not recognised.

A family module provides ``ARCHITECTURES``, ``MODEL_TYPES``, ``DEFAULTS``,
``spec_from_config(config) -> (spec, resolved_config)`` and ``GGUF`` (its
:class:`~exactblocks.models._gguf.GGUFArch` record, or None; ``GGUF_EXPERTS`` where llama.cpp
writes the family as another architecture with experts, Mixtral as ``llama``); the spec names
its tensors and
builds its layers (``_decoder.DecoderSpec``, ``mamba2.Mamba2Spec``). docs/adding-a-family.md
says how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

from ._gguf import GGUFArch

__all__ = [
    "FAMILIES",
    "GGUF_ARCHITECTURES",
    "GGUF_EXPERT_FORMS",
    "family_for_config",
    "gguf_arch",
]

#: family name -> module, in the order they are tried (the one list of families).
FAMILIES: dict[str, ModuleType] = {
    name: importlib.import_module(f"{__package__}.{name}")
    for name in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen2_moe",
        "olmoe",
        "mixtral",
        "gemma2",
        "gemma3",
        "olmo2",
        "smollm3",
        "granite",
        "phi3",
        "stablelm",
        "starcoder2",
        "mamba2",
        "nemotron_h",
        "granitemoehybrid",
    )
}

#: GGUF ``general.architecture`` -> the :class:`~exactblocks.models._gguf.GGUFArch` record of
#: the family that reads it (each family's ``GGUF``; None where llama.cpp writes the family
#: under another architecture, as Mistral under ``llama``).
GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    fam.GGUF.arch: fam.GGUF for fam in FAMILIES.values() if fam.GGUF is not None
}


#: GGUF ``general.architecture`` -> the record of a file of it that states
#: ``<arch>.expert_count`` >= 1, where that is another family: each family's ``GGUF_EXPERTS``
#: (``llama`` -> Mixtral: llama.cpp's converter writes Mixtral as llama with experts).
GGUF_EXPERT_FORMS: dict[str, GGUFArch] = {
    fam.GGUF_EXPERTS.arch: fam.GGUF_EXPERTS
    for fam in FAMILIES.values()
    if getattr(fam, "GGUF_EXPERTS", None) is not None
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


def gguf_arch(arch, reader=None) -> GGUFArch:
    """The record that reads a GGUF of ``general.architecture == arch``.

    Parameters
    ----------
    arch : str or None
        The file's ``general.architecture`` (None when it states none).
    reader : GGUFFile or gguf.GGUFReader or None, default=None
        The file: one stating ``<arch>.expert_count`` as an integer >= 1 is read by the
        architecture's :data:`GGUF_EXPERT_FORMS` record when it has one (any other value is
        left to the dense record's reader, which refuses it by name).

    Returns
    -------
    GGUFArch

    Raises
    ------
    ValueError
        An architecture no family reads (the message lists those supported).
    """
    entry = GGUF_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if entry is None:
        raise ValueError(
            f"load_gguf_model: general.architecture={arch!r} is not supported; supported: "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )
    moe = GGUF_EXPERT_FORMS.get(arch)
    if moe is not None and reader is not None:
        from exactblocks.loaders.gguf import gguf_field

        n = gguf_field(reader, f"{arch}.expert_count", 0)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return moe
    return entry
