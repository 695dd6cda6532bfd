"""Reading a Hugging Face config mapping: typed fields, class defaults, RoPE, refusals.

What lives here: the helpers every family file uses to turn a config (``config.json`` as a
dict, a ``PretrainedConfig.to_dict()``, or the GGUF loader's dict) into the values of its one
frozen spec, with errors that name the field, its value and what is accepted. What does not:
which fields a family reads (the family files).

Fields a file omits take the HF class's own default, exactly as transformers does when it
builds the config object from the same file; each family lists those defaults (transformers
5.23.0 source) next to its spec. Keys no family reads are ignored, as transformers ignores
them, except the keys in :data:`REFUSED_KEYS`, which change what the weights mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "REFUSED_KEYS",
    "ConfigReader",
    "decode_json_floats",
]

#: Keys whose presence changes the weights' meaning in a way no family implements.
REFUSED_KEYS = ("quantization_config",)


def decode_json_floats(value: Any) -> Any:
    """Undo transformers 5's JSON spelling of non-finite floats (``{"__float__": "Infinity"}``).

    Parameters
    ----------
    value : object
        A value read from ``config.json``.

    Returns
    -------
    object
        The same structure with every ``{"__float__": s}`` replaced by ``float(s)``.
    """
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: decode_json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_floats(v) for v in value]
    return value


class ConfigReader:
    """Typed access to one config mapping, with the family's class defaults.

    Parameters
    ----------
    config : Mapping
        The config as given (HF field names).
    defaults : Mapping
        The HF config class's defaults for the fields the family reads (used only when the
        mapping lacks the field, as transformers does).
    family : str
        For messages: ``"llama"``, ...

    Attributes
    ----------
    resolved : dict
        ``config`` with the defaults filled in: what the model is built from (``model.config``).
    """

    def __init__(self, config: Mapping, defaults: Mapping, family: str):
        self.family = family
        self.raw = dict(config)
        self.resolved = {**dict(defaults), **decode_json_floats(self.raw)}
        for key in REFUSED_KEYS:
            if self.resolved.get(key) is not None:
                raise ValueError(
                    f"load_model: config field {key!r} is set; quantised checkpoints are not "
                    f"supported by the {family} family (only float32/bf16/fp16 weights or GGUF)"
                )

    def _fail(self, key: str, value: Any, expected: str):
        shown = key if "[" in key or " " in key else repr(key)  # rope_parameters['rope_type']
        raise ValueError(
            f"load_model: config field {shown}={value!r} is not supported by the {self.family} "
            f"family (expected {expected})"
        )

    def get(self, key: str) -> Any:
        """The value of ``key`` (the file's or the class default); KeyError-free for known keys."""
        if key not in self.resolved:
            raise ValueError(
                f"load_model: the config has no field {key!r}, and the {self.family} family "
                "has no HF default for it"
            )
        return self.resolved[key]

    def int(self, key: str, *, minimum: int = 1, allow_none: bool = False) -> int | None:
        """An integer field >= ``minimum`` (bool refused); None only with ``allow_none``."""
        v = self.get(key)
        if v is None and allow_none:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self._fail(key, v, f"an integer >= {minimum}" + (" or null" if allow_none else ""))
        return int(v)

    def float(self, key: str, *, positive: bool = True) -> float:
        """A finite real field (> 0 with ``positive``); bool refused."""
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self._fail(key, v, "a finite number")
        if positive and v <= 0:
            self._fail(key, v, "a number > 0")
        return float(v)

    def bool(self, key: str) -> bool:
        """A boolean field."""
        v = self.get(key)
        if not isinstance(v, bool):
            self._fail(key, v, "true or false")
        return v

    def choice(self, key: str, allowed: Mapping) -> Any:
        """Map the field's value through ``allowed`` (value -> result); others refused."""
        v = self.get(key)
        if not isinstance(v, (str, int, float, type(None))) or v not in allowed:
            self._fail(key, v, "one of " + ", ".join(repr(a) for a in allowed))
        return allowed[v]

    def equals(self, key: str, expected: Any, why: str) -> None:
        """Refuse a field whose value differs from ``expected`` (a feature not implemented)."""
        if key in self.resolved and self.resolved[key] != expected:
            self._fail(key, self.resolved[key], f"{expected!r}: {why}")

    def rope(self, default_theta: float) -> tuple[float, dict | None]:
        """RoPE base and the scaling dict for the block, from ``rope_parameters`` or legacy keys.

        transformers 5 keeps both in ``rope_parameters`` (``{"rope_type", "rope_theta", ...}``);
        files written by 4.x have ``rope_theta`` and ``rope_scaling`` at the top level, which
        transformers 5 folds into ``rope_parameters`` the same way as here.

        Returns
        -------
        rope_theta : float
        scaling : dict or None
            None for ``rope_type == "default"``; else the dict for
            ``TransformerBlockInference(rope_scaling=...)`` (``linear`` or ``llama3``).

        Raises
        ------
        ValueError
            Another rope type (``dynamic``, ``yarn``, ``longrope``, ...), a partial rotary
            factor, or a malformed entry; the message names the field.
        """
        rp = self.raw.get("rope_parameters")
        if rp is None:
            legacy = self.raw.get("rope_scaling")
            rp = dict(legacy) if isinstance(legacy, Mapping) else {"rope_type": "default"}
            if "rope_theta" in self.raw or "rope_theta" not in rp:
                rp["rope_theta"] = self.raw.get("rope_theta", default_theta)
            field = "rope_scaling"
        else:
            field = "rope_parameters"
            if not isinstance(rp, Mapping):
                self._fail(field, rp, "a mapping")
            rp = dict(rp)
            rp.setdefault("rope_theta", self.raw.get("rope_theta", default_theta))
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype not in ("default", "linear", "llama3"):
            self._fail(f"{field}['rope_type']", rtype, "'default', 'linear' or 'llama3'")
        theta = rp["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            self._fail(f"{field}['rope_theta']", theta, "a number > 0")
        prf = rp.get("partial_rotary_factor", self.raw.get("partial_rotary_factor", 1.0))
        if prf != 1.0:
            self._fail("partial_rotary_factor", prf, "1.0: partial RoPE is not a feature of it")
        if rtype == "default":
            return float(theta), None
        scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = rtype
        known = {
            "linear": {"rope_type", "factor"},
            "llama3": {
                "rope_type",
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            },
        }[rtype]
        extra = sorted(set(scaling) - known - {"partial_rotary_factor"})
        if extra:
            self._fail(f"{field} keys {extra}", rtype, f"only {sorted(known)} for {rtype!r}")
        scaling.pop("partial_rotary_factor", None)
        return float(theta), scaling

    def token_ids(self, key: str) -> tuple[int, ...]:
        """``eos_token_id``-style field: int, list of int or null -> tuple of int."""
        v = self.resolved.get(key)
        if v is None:
            return ()
        vals = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(i, bool) or not isinstance(i, int) for i in vals):
            self._fail(key, v, "an integer, a list of integers or null")
        return tuple(int(i) for i in vals)
