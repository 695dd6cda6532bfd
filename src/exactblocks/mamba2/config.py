"""Mamba-2 options: the option table, every option check, and the typed core config.

What lives here: :data:`OPTIONS`, one :class:`~exactblocks._options.Option` per keyword option
of :class:`Mamba2BlockInference` (default, check, property doc line, the ``_core.Mamba2Config``
field it fills), and :func:`core_config`, the one place that fills ``_core.Mamba2Config``. What
does not: weight names and shapes, and the sizes they give (``weights.py``; ``n_groups`` must
also divide them), the block (``block.py``), arithmetic (``csrc/blocks/mamba2/``).

Adding an option: one :class:`Option` in :data:`OPTIONS`, the C++ field and op that use it, the
class docstring, tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

from .._options import Option, check_all, fill_fields
from .._validation import check_int, check_real, describe_type

__all__ = ["OPTIONS", "check_options", "core_config"]

_MAX_INT_OPTION = 1 << 24  # n_groups (it must also divide n_heads, the length of A_log)


def _check_dt_limit(value, name: str, where: str) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise TypeError(
            f"{where}: dt_limit must be a tuple or list of two reals (lo, hi); got "
            f"{describe_type(value)} {value!r}"
        )
    if len(value) != 2:
        raise ValueError(
            f"{where}: dt_limit must hold exactly two reals (lo, hi); got "
            f"{len(value)} entries {tuple(value)!r}"
        )
    lo = check_real(value[0], "dt_limit[0]", where, ge=0.0, float32=True)
    hi = check_real(value[1], "dt_limit[1]", where, ge=0.0, allow_inf=True, float32=True)
    if lo > hi:
        raise ValueError(
            f"{where}: dt_limit=({lo!r}, {hi!r}) needs lo <= hi (allowed: "
            "0 <= lo <= hi, lo finite, hi finite or inf, finite entries <= "
            "3.4028234663852886e+38, the largest float32)"
        )
    return (lo, hi)


OPTIONS: tuple[Option, ...] = (
    Option(
        "dt_limit",
        (0.0, math.inf),
        _check_dt_limit,
        "tuple of two float: dt clamp (lo, hi).",
        field=("dt_min", "dt_max"),
        canonical=lambda v: (float(v[0]), float(v[1])),
    ),
    Option(
        "n_groups",
        1,
        partial(check_int, min_value=1, max_value=_MAX_INT_OPTION),
        "int: B/C groups.",
        field="n_groups",
        canonical=int,
    ),
    Option(
        "norm_eps",
        1e-05,
        partial(check_real, gt=0.0, float32=True),
        "float: Norm epsilon.",
        field="norm_eps",
        canonical=float,
    ),
)


def check_options(raw: Mapping, where: str) -> dict:
    """Check every keyword option; return the values in force."""
    return check_all(OPTIONS, raw, where)


def core_config(core_mod, opts: Mapping, sizes: Mapping):
    """Return the ``_core.Mamba2Config`` of these options in force and weight sizes.

    The only place a Mamba2Config is filled: every option's field(s) from :data:`OPTIONS`, plus
    the sizes only the weights give.
    """
    cfg = core_mod.Mamba2Config()
    for k in (
        "d_model",
        "d_inner",
        "n_heads",
        "head_dim",
        "d_state",
        "conv_dim",
        "conv_kernel",
        "conv_bias",
        "proj_bias",
    ):
        setattr(cfg, k, sizes[k])
    fill_fields(OPTIONS, cfg, opts, core_mod)
    return cfg
