"""Argument checks and config helpers of the model calls.

What lives here: the int/real/token-id checks of ``Model`` calls (``_check_int``,
``_check_real``, ``_as_ids``) and the config helpers ``load_model`` uses (``_eos_from``,
``_frozen_json``). What does not: the sampling checks (``SamplingParams`` in
``exactblocks.models.generate``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np


def _check_int(value, name: str, where: str, *, minimum: int = 0, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int; got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{where}: {name}={value} must be >= {minimum}")
    return value


def _check_real(value, name: str, where: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a real number; got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name}={value} must be finite")
    return value


def _as_ids(ids, where: str, name: str = "ids") -> np.ndarray:
    """Token ids as an int64 array (no float, no bool: a silently truncated id is a bug)."""
    arr = np.asarray(ids)
    if arr.dtype == object or arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # [] or [[]]: an empty list has no dtype
            return arr.astype(np.int64)
        raise TypeError(
            f"{where}: {name} must hold integers (token ids); got dtype {arr.dtype}"
            + (" (bool is not an id)" if arr.dtype == bool else "")
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        at = tuple(int(i) for i in np.unravel_index(int(arr.argmax()), arr.shape))
        raise ValueError(f"{where}: {name}{list(at)}={int(arr[at])} is not a token id")
    return arr.astype(np.int64, copy=False)


# -- the model ----------------------------------------------------------------------------------


def _prompt_ids(prompt, tokenizer, vocab_size: int, where: str) -> list[int]:
    """The token ids of a ``generate`` prompt: text encoded with ``tokenizer``, or 1-D ids.

    Raises
    ------
    TypeError
        Text without a tokenizer, or ids that are not integers.
    ValueError
        An empty prompt, ids not 1-D, or an id outside ``[0, vocab_size)`` (named with its
        position).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError(f"{where}: a text prompt needs a tokenizer; this model has none")
        prompt_ids = list(tokenizer.encode(prompt))
    else:
        arr = _as_ids(prompt, where, "prompt")
        if arr.ndim != 1:
            raise ValueError(f"{where}: prompt ids must be 1-D; got shape {arr.shape}")
        prompt_ids = arr.tolist()
    if not prompt_ids:
        raise ValueError(f"{where}: the prompt is empty")
    ids = np.asarray(prompt_ids, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        what = "the encoded prompt" if isinstance(prompt, str) else "prompt"
        raise ValueError(
            f"{where}: {what}[{i}]={int(ids[i])} is outside the vocabulary [0, {vocab_size})"
        )
    return prompt_ids


def _eos_from(config: Mapping, generation_config: Mapping | None,
              gen_where: str = "generation_config.json",
              vocab_size: int | None = None) -> tuple[int, ...]:  # fmt: skip
    """Default stop ids: generation_config.json's eos_token_id, else the config's (as HF).

    A value that is not an id, a list of ids or null is refused (ValueError naming the field
    and the file it is in), never dropped; so is an id outside ``[0, vocab_size)`` when the
    vocabulary size is given. Both files' values are checked, the one used and the other."""
    from ._config import ConfigFieldError

    found = None
    for src, where in ((generation_config or {}, gen_where), (config, None)):
        v = src.get("eos_token_id")
        if v is None:
            continue
        vals = v if isinstance(v, (list, tuple)) else [v]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vals):
            expected = "an integer >= 0, a list of them or null"
            what = "is not a token id"
        elif vocab_size is not None and not all(i < vocab_size for i in vals):
            expected = f"token ids in [0, {vocab_size}): the model's vocabulary"
            what = "is outside the vocabulary"
        else:
            found = tuple(int(i) for i in vals) if found is None else found
            continue
        if where is None:
            raise ConfigFieldError(
                "{0} " + what + " (expected " + expected + ")",
                [("eos_token_id", "'eos_token_id'", v)],
            )
        raise ValueError(
            f"load_model: {where} field 'eos_token_id'={v!r} {what} (expected {expected})"
        )
    return () if found is None else found


def _frozen_json(value: Any) -> Any:
    """A deep copy of a JSON-like config with tuples for lists (for MappingProxyType views)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen_json(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen_json(v) for v in value)
    return value
