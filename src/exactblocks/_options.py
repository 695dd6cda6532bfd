"""Option tables: one :class:`Option` per keyword option of a block, and what derives from them.

What lives here: the :class:`Option` record (name, default, check, doc line, typed-config field)
and the generic code that turns a table into the block's constructor (a real signature, so
``help()`` and ``inspect.signature`` list every option with its default and Python itself raises
TypeError for a positional or unknown option), its read-only properties, the checked values,
the values ``get_params`` returns, the options' spelling inside the fingerprint, and the fields
of the typed ``_core`` config they fill. What does not: any particular option (the tables are in
``transformer/config.py`` and ``mamba2/config.py``) and checks that need the weights.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUIRED", "Option", "install"]


class _Required:
    """Default of an option that must be given (shown by no default in the signature)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


def _same(value):
    return value


def _canonical(value):
    """Default fingerprint spelling: floats as Python floats, everything else as is."""
    return float(value) if isinstance(value, float) else value


@dataclass(frozen=True)
class Option:
    """One keyword option of a block.

    Parameters
    ----------
    name : str
        Keyword name (also the read-only property and the ``get_params`` key).
    default : object
        Default value, or :data:`REQUIRED`.
    check : callable
        ``check(value, name, where) -> checked value``, the calling convention of the
        ``_validation`` checks (``functools.partial`` supplies their ranges): type and range
        checks of this option alone, messages starting with ``where``. Checks that involve
        other options or the weights belong to the block's ``config.py``.
    doc : str
        Docstring of the read-only property, ``"type: What it is."``.
    field : str, tuple of str or None, default=None
        The field(s) of the typed ``_core`` config this option fills; None when it fills none
        (or the block's config function fills it from other values).
    to_core : callable or None, default=None
        ``to_core(value in force, core module) -> field value`` (a tuple for several fields);
        None copies the value as is.
    stage : int, default=0
        Options are checked stage by stage, in table order within a stage, so that the first
        error of a call with several bad options stays the same.
    public : callable or None, default=None
        Value in force -> value the property and ``get_params`` return (a copy of a mutable
        value); None returns it as is.
    canonical : callable or None, default=None
        Value in force -> its platform-independent spelling inside the fingerprint; None spells
        floats as Python floats and everything else as is.
    """

    name: str
    default: object
    check: Callable[..., object]
    doc: str
    field: str | tuple[str, ...] | None = None
    to_core: Callable[[object, Any], object] | None = None
    stage: int = 0
    public: Callable[[object], object] | None = None
    canonical: Callable[[object], object] | None = None


def defaults(table: Sequence[Option]) -> dict:
    """Return ``{name: default}`` in table order (None for a required option)."""
    return {o.name: (None if o.default is REQUIRED else o.default) for o in table}


def check_all(table: Sequence[Option], raw: Mapping, where: str) -> dict:
    """Run every option's own check (stage by stage); return the values in table order."""
    by_stage = sorted(table, key=lambda o: o.stage)
    done = {o.name: o.check(raw[o.name], o.name, where) for o in by_stage}
    return {o.name: done[o.name] for o in table}


def public_values(table: Sequence[Option], opts: Mapping) -> dict:
    """Return the options in force as ``get_params`` shows them (mutable values copied)."""
    return {o.name: (o.public or _same)(opts[o.name]) for o in table}


def options_repr(table: Sequence[Option], opts: Mapping) -> str:
    """Canonical, platform-independent spelling of the options in force (for the fingerprint)."""
    return repr(tuple((o.name, (o.canonical or _canonical)(opts[o.name])) for o in table))


def fill_fields(table: Sequence[Option], cfg, opts: Mapping, core_mod) -> None:
    """Set the typed-config field(s) of every option that has one."""
    for o in table:
        if o.field is None:
            continue
        value = opts[o.name] if o.to_core is None else o.to_core(opts[o.name], core_mod)
        if isinstance(o.field, tuple):
            for f, v in zip(o.field, value, strict=True):
                setattr(cfg, f, v)
        else:
            setattr(cfg, o.field, value)


def _make_init(cls_name: str, module: str, table: Sequence[Option], init: Callable):
    """Build ``__init__(self, weights, *, <every option>)`` with a real signature.

    The function is compiled from its parameter list (as :mod:`dataclasses` does), so Python's
    own argument handling applies: a positional option, an unknown keyword or a missing
    required option raises Python's usual TypeError naming ``Class.__init__()``.
    """
    params, items = [], []
    for o in table:
        if not o.name.isidentifier() or keyword.iskeyword(o.name) or o.name[0] == "_":
            raise ValueError(f"option name {o.name!r} is not a public identifier")
        if o.name in ("self", "weights"):
            raise ValueError(f"option name {o.name!r} is taken by the constructor")
        params.append(o.name if o.default is REQUIRED else f"{o.name}=_defaults[{o.name!r}]")
        items.append(f"{o.name!r}: {o.name}")
    src = (
        f"def __init__(self, weights, *, {', '.join(params)}):\n"
        f"    _init(self, weights, {{{', '.join(items)}}}, _where)\n"
    )
    ns = {
        "_defaults": {o.name: o.default for o in table},
        "_init": init,
        "_where": f"{cls_name}.__init__",
    }
    exec(compile(src, f"<{cls_name}.__init__>", "exec"), ns)
    fn = ns["__init__"]
    fn.__qualname__ = f"{cls_name}.__init__"
    fn.__module__ = module
    return fn


def _property(option: Option) -> property:
    name, public = option.name, option.public or _same
    return property(lambda self: public(self._impl.opts[name]), doc=option.doc)


def install(cls: type, table: Sequence[Option]) -> type:
    """Give a block class its table-derived members.

    Sets ``cls._options`` (the table), ``cls._defaults`` (:func:`defaults`), ``cls.__init__``
    (see :func:`_make_init`; it calls ``cls._init(self, weights, raw_options, where)``) and one
    read-only property per option. Returns ``cls``.
    """
    cls._options = tuple(table)
    cls._defaults = defaults(table)
    cls.__init__ = _make_init(cls.__name__, cls.__module__, table, cls._init)
    for o in table:
        setattr(cls, o.name, _property(o))
    return cls
