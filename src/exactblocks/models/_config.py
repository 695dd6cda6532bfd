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
    "ROPE_KEYS",
    "ConfigFieldError",
    "ConfigReader",
    "decode_json_floats",
]


class ConfigFieldError(ValueError):
    """A config field's value refused, kept as its parts so a loader can name the field as its
    file states it (``config.json``'s key, or the GGUF key an HF field was read from).

    ``str(err)`` is ``"load_model: " + err.render()``: the fields named ``config field 'key'``.

    Parameters
    ----------
    text : str
        The message with ``{0}``, ``{1}``, ... where each field is shown as ``name=value``.
    fields : sequence of (str, str, object)
        Per placeholder: the HF config key (``"rope_theta"``), how it is shown when the config
        is the file's own (``"rope_scaling['rope_theta']"``), and its value. The root field
        comes first.

    Attributes
    ----------
    text : str
    fields : tuple of (str, str, object)
    """

    def __init__(self, text: str, fields):
        self.text, self.fields = text, tuple(fields)
        super().__init__("load_model: " + self.render())

    def render(self, label=None) -> str:
        """The message with each field shown as ``label(key, shown)=value``.

        Parameters
        ----------
        label : callable or None, default=None
            ``(key, shown) -> str``; None = ``config field <shown>``.

        Returns
        -------
        str
        """
        if label is None:
            label = lambda key, shown: f"config field {shown}"  # noqa: E731
        return self.text.format(*(f"{label(k, s)}={v!r}" for k, s, v in self.fields))

    def __reduce__(self):
        return (type(self), (self.text, self.fields))


#: Keys whose presence changes the weights' meaning in a way no family implements.
REFUSED_KEYS = ("quantization_config",)

#: RoPE types the blocks compute exactly as HF ``ROPE_INIT_FUNCTIONS`` does, and the keys of
#: each (``rope_theta`` and ``partial_rotary_factor`` are read separately).
ROPE_KEYS = {
    "default": {"rope_type"},
    "linear": {"rope_type", "factor"},
    "llama3": {
        "rope_type",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
    "yarn": {
        "rope_type",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
    "longrope": {
        "rope_type",
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "factor",
        "attention_factor",
    },
}


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


def _rope_kind(d) -> Any:
    """A RoPE dict without its base (``rope_theta``) and with ``type`` spelled ``rope_type``:
    what two spellings of one RoPE setting have in common."""
    if not isinstance(d, Mapping):
        return d
    out = {k: v for k, v in d.items() if k not in ("rope_theta", "type")}
    out.setdefault("rope_type", d.get("type", "default"))
    return out


def _params_shown(d: Mapping) -> str:
    """``d`` without ``rope_theta``, for a message."""
    return repr({k: v for k, v in d.items() if k != "rope_theta"})


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

    def _fail(self, key: str, value: Any, expected: str, *, base: str | None = None):
        """Refuse ``key=value``; ``base`` is the plain HF key of a nested one (``rope_theta``
        for ``rope_scaling['rope_theta']``)."""
        shown = key if "[" in key or " " in key else repr(key)  # rope_parameters['rope_type']
        expected = expected.replace("{", "{{").replace("}", "}}")
        raise ConfigFieldError(
            f"{{0}} is not supported by the {self.family} family (expected {expected})",
            [(base or key, shown, value)],
        )

    def get(self, key: str) -> Any:
        """The value of ``key`` (the file's or the class default); KeyError-free for known keys."""
        if key not in self.resolved:
            raise ValueError(
                f"load_model: the config has no field {key!r}, and the {self.family} family "
                "has no HF default for it"
            )
        return self.resolved[key]

    def integer(self, key: str, *, minimum: int = 1, allow_none: bool = False) -> int | None:
        """An integer field >= ``minimum`` (bool refused); None only with ``allow_none``."""
        v = self.get(key)
        if v is None and allow_none:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self._fail(key, v, f"an integer >= {minimum}" + (" or null" if allow_none else ""))
        return int(v)

    def number(self, key: str, *, positive: bool = True) -> float:
        """A finite real field (> 0 with ``positive``); bool refused."""
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self._fail(key, v, "a finite number")
        if positive and v <= 0:
            self._fail(key, v, "a number > 0")
        return float(v)

    def flag(self, key: str) -> bool:
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

    def rope(
        self,
        default_theta: float,
        *,
        partial: bool = False,
        default_partial: float = 1.0,
        params: Mapping | None = None,
        field: str | None = None,
    ) -> tuple[float, dict | None, float]:
        """RoPE base, the scaling dict for the block and the partial rotary factor.

        transformers 5 keeps them in ``rope_parameters`` (``{"rope_type", "rope_theta", ...}``);
        files written by 4.x have ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``
        at the top level, which transformers 5 folds into ``rope_parameters`` the same way as
        here.

        Parameters
        ----------
        default_theta : float
            The base when the file states none (the config class's ``default_theta``).
        partial : bool, default=False
            Whether the family rotates only ``int(head_dim * partial_rotary_factor)`` dims
            (StableLM, Phi-3); otherwise a factor other than 1 is refused.
        default_partial : float, default=1.0
            The factor when the file states none (StableLM's config sets 0.25).
        params : Mapping or None, default=None
            One layer type's entry of a nested ``rope_parameters`` (Gemma 3), used instead of
            the top-level fields; ``field`` names it in messages.
        field : str or None, default=None

        Returns
        -------
        rope_theta : float
        scaling : dict or None
            None for ``rope_type == "default"``; else the HF dict for
            ``TransformerBlockInference(rope_scaling=...)`` (without ``rope_theta`` and
            ``partial_rotary_factor``).
        partial_rotary_factor : float

        Raises
        ------
        ValueError
            A rope type the blocks do not compute (``dynamic``, ...), an unexpected key, a
            partial rotary factor the family does not have, or a malformed entry; the message
            names the field.
        """
        if params is not None:
            rp = dict(params)
            rp.setdefault("rope_theta", default_theta)
        else:
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
                legacy = self.raw.get("rope_scaling")
                if legacy is not None and _rope_kind(legacy) != _rope_kind(rp):
                    # transformers folds rope_scaling into rope_parameters, overriding it: a
                    # file that states both differently is ambiguous, never silently one
                    self._fail(
                        "rope_scaling",
                        legacy,
                        f"null or the same as rope_parameters={_params_shown(rp)}",
                    )
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype not in ROPE_KEYS:
            self._fail(f"{field}['rope_type']", rtype, "one of " + ", ".join(map(repr, ROPE_KEYS)),
                       base=field)  # fmt: skip
        theta = rp["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            self._fail(f"{field}['rope_theta']", theta, "a number > 0", base="rope_theta")
        prf = rp.get("partial_rotary_factor")
        if prf is None:
            prf = self.raw.get("partial_rotary_factor", default_partial)
        if prf is None:
            prf = 1.0
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            self._fail("partial_rotary_factor", prf, "a number in (0, 1]")
        if prf != 1.0 and not partial:
            self._fail("partial_rotary_factor", prf, "1.0: partial RoPE is not a feature of it")
        if rtype == "default":  # HF's default init reads rope_theta and the factor only
            return float(theta), None, float(prf)
        scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = rtype
        scaling.pop("partial_rotary_factor", None)
        if rtype in ("llama3", "yarn", "longrope"):
            # HF standardize_rope_params: a top-level original_max_position_embeddings (Phi-3
            # keeps it there) wins over the dict's; else the dict's, else max_position_embeddings
            top = self.resolved.get("original_max_position_embeddings")
            if params is None and top is not None:
                scaling["original_max_position_embeddings"] = top
            elif scaling.get("original_max_position_embeddings") is None:
                scaling["original_max_position_embeddings"] = self.get("max_position_embeddings")
        if rtype in ("yarn", "longrope") and scaling.get("factor") is None:
            # HF _compute_{yarn,longrope}_parameters: max_position_embeddings / original
            scaling["factor"] = (
                self.get("max_position_embeddings") / scaling["original_max_position_embeddings"]
            )
        known = ROPE_KEYS[rtype]
        extra = sorted(set(scaling) - known)
        if extra:
            self._fail(f"{field} keys {extra}", rtype, f"only {sorted(known)} for {rtype!r}")
        return float(theta), scaling, float(prf)

    def token_ids(self, key: str) -> tuple[int, ...]:
        """``eos_token_id``-style field: int, list of int or null -> tuple of int."""
        v = self.resolved.get(key)
        if v is None:
            return ()
        vals = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(i, bool) or not isinstance(i, int) for i in vals):
            self._fail(key, v, "an integer, a list of integers or null")
        return tuple(int(i) for i in vals)
