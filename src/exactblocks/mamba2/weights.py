"""The Mamba-2 weight table and the checks of a weight dict.

What lives here: :data:`TENSORS`, one row per tensor of SPEC.md 7.2 (short name, HF name, and
for the optional ones what they stand for), the spellings derived from it, the key-set check
(with the projection-bias pair rule), :func:`check_shapes`, which derives every size from the
shapes, and :func:`check_a` (A = -exp(A_log) finite). What does not: the generic name and
key-set machinery, copies and fingerprints (``_weights.py``), option checks (``config.py``),
packing (the C++ core).
"""

from __future__ import annotations

import numpy as np

from .._validation import format_shape
from .._weights import Presence, Tensor, check_key_set, expected_names, used_with

__all__ = ["HF_PREFIXES", "SHORT_TO_HF", "TENSORS", "check_a", "check_names", "check_shapes"]

_PROJ_BIAS = Presence("projection biases (HF use_bias): in_proj.bias with out_proj.bias")

# SPEC.md 7.2: short (canonical, mojolearn's) name and HF Mamba2Block.state_dict() name. In the
# short form 'norm.weight' is the gated norm; in the HF form it is the block norm. Optional
# tensors are present iff given (their sizes are then read from them); the shapes are checked
# by check_shapes, which derives every size from them.
TENSORS: tuple[Tensor, ...] = (
    Tensor("block_norm.weight", "norm.weight"),
    Tensor("in_proj.weight", "mixer.in_proj.weight"),
    Tensor("in_proj.bias", "mixer.in_proj.bias", presence=_PROJ_BIAS),
    Tensor("conv1d.weight", "mixer.conv1d.weight"),
    Tensor("conv1d.bias", "mixer.conv1d.bias", presence=Presence("a conv bias (HF use_conv_bias)")),
    Tensor("dt_bias", "mixer.dt_bias"),
    Tensor("A_log", "mixer.A_log"),
    Tensor("D", "mixer.D"),
    Tensor("norm.weight", "mixer.norm.weight"),
    Tensor("out_proj.weight", "mixer.out_proj.weight"),
    Tensor("out_proj.bias", "mixer.out_proj.bias", presence=_PROJ_BIAS),
)
SHORT_TO_HF: dict[str, str] = {t.name: t.hf for t in TENSORS}
HF_PREFIXES = ("mixer.",)
_USED_WITH = used_with(TENSORS)


def check_names(by_short: dict, o: dict, spell, where: str) -> None:
    """The short names given are exactly the block's tensors (SPEC.md 7.2): every required one,
    and projection biases as a pair. ``spell`` maps a short name to the user's spelling."""
    has_in, has_out = "in_proj.bias" in by_short, "out_proj.bias" in by_short
    if has_in != has_out:
        there, absent = (
            ("in_proj.bias", "out_proj.bias") if has_in else ("out_proj.bias", "in_proj.bias")
        )
        raise ValueError(
            f"{where}: weights[{spell(there)!r}] is present but "
            f"weights[{spell(absent)!r}] is missing; projection biases (HF "
            "use_bias) come as a pair: give both or neither"
        )
    check_key_set(by_short, expected_names(TENSORS, o, by_short), _USED_WITH, where, spell)


def check_shapes(arrs: dict, o: dict, spell, where: str) -> dict:
    """Derive every size from the weight shapes (SPEC.md 7.2) and check every shape."""

    def name(n):
        return f"weights[{spell(n)!r}]"

    def rank(n, r):
        a = arrs[n]
        if a.ndim != r:
            raise ValueError(f"{where}: {name(n)} must be {r}-D; got shape {format_shape(a.shape)}")
        return a.shape

    def expect(n, exp, src):
        got = arrs[n].shape
        if got != exp:
            raise ValueError(
                f"{where}: {name(n)} has shape {format_shape(got)}; expected "
                f"{format_shape(exp)}: {src}"
            )

    (d,) = rank("block_norm.weight", 1)
    if d < 1:
        raise ValueError(
            f"{where}: {name('block_norm.weight')} is empty; its length is "
            "d_model, which must be >= 1"
        )
    d_src = f"d_model={d} (length of {name('block_norm.weight')})"

    out_r, d_inner = rank("out_proj.weight", 2)
    if out_r != d:
        raise ValueError(
            f"{where}: {name('out_proj.weight')} has shape "
            f"{format_shape((out_r, d_inner))}; expected {d} rows: {d_src}"
        )
    if d_inner < 1:
        raise ValueError(
            f"{where}: {name('out_proj.weight')} has 0 columns; its columns give "
            "d_inner, which must be >= 1"
        )
    di_src = f"d_inner={d_inner} (columns of {name('out_proj.weight')})"
    (gn,) = rank("norm.weight", 1)
    if gn != d_inner:
        raise ValueError(
            f"{where}: {name('norm.weight')} (the gated norm) has length {gn}; "
            f"expected {d_inner}: {di_src}"
        )

    (n_heads,) = rank("A_log", 1)
    if n_heads < 1:
        raise ValueError(
            f"{where}: {name('A_log')} is empty; its length is n_heads, which must be >= 1"
        )
    nh_src = f"n_heads={n_heads} (length of {name('A_log')})"
    for n in ("D", "dt_bias"):
        rank(n, 1)
        expect(n, (n_heads,), nh_src)
    if d_inner % n_heads:
        raise ValueError(
            f"{where}: d_inner={d_inner} (columns of {name('out_proj.weight')}) is "
            f"not divisible by n_heads={n_heads} (length of {name('A_log')}); "
            "head_dim = d_inner / n_heads must be exact"
        )
    head_dim = d_inner // n_heads

    cw = arrs["conv1d.weight"]
    if cw.ndim == 3 and cw.shape[1] == 1:
        conv_dim, kernel = cw.shape[0], cw.shape[2]
    elif cw.ndim == 2:
        conv_dim, kernel = cw.shape
    else:
        raise ValueError(
            f"{where}: {name('conv1d.weight')} has shape {format_shape(cw.shape)}; "
            "expected (conv_dim, 1, conv_kernel) or (conv_dim, conv_kernel)"
        )
    if kernel < 1:
        raise ValueError(
            f"{where}: {name('conv1d.weight')} has shape {format_shape(cw.shape)}; "
            "its last axis is conv_kernel, which must be >= 1"
        )
    n_groups = o["n_groups"]
    bc = conv_dim - d_inner
    if bc <= 0 or bc % (2 * n_groups):
        raise ValueError(
            f"{where}: conv_dim={conv_dim} (rows of {name('conv1d.weight')}) minus "
            f"d_inner={d_inner} (columns of {name('out_proj.weight')}) is {bc}; it must be "
            f"2*n_groups*d_state, a positive multiple of 2*n_groups={2 * n_groups} "
            f"(n_groups={n_groups})"
        )
    d_state = bc // (2 * n_groups)
    if n_heads % n_groups:
        raise ValueError(
            f"{where}: n_groups={n_groups} does not divide n_heads={n_heads} "
            f"(length of {name('A_log')})"
        )
    cd_src = f"conv_dim={conv_dim} (rows of {name('conv1d.weight')})"

    n_in = d_inner + conv_dim + n_heads
    rank("in_proj.weight", 2)
    expect(
        "in_proj.weight",
        (n_in, d),
        f"rows = d_inner + conv_dim + n_heads = {d_inner} + {conv_dim} + {n_heads} "
        f"(z | xBC | dt; {di_src}, {cd_src}, {nh_src}); columns = {d_src}",
    )
    if "in_proj.bias" in arrs:
        rank("in_proj.bias", 1)
        expect(
            "in_proj.bias",
            (n_in,),
            f"d_inner + conv_dim + n_heads = {d_inner} + "
            f"{conv_dim} + {n_heads} ({di_src}, {cd_src}, {nh_src})",
        )
    if "out_proj.bias" in arrs:
        rank("out_proj.bias", 1)
        expect("out_proj.bias", (d,), d_src)
    if "conv1d.bias" in arrs:
        rank("conv1d.bias", 1)
        expect("conv1d.bias", (conv_dim,), cd_src)
    return {
        "d_model": d,
        "d_inner": d_inner,
        "n_heads": n_heads,
        "head_dim": head_dim,
        "d_state": d_state,
        "n_groups": n_groups,
        "conv_dim": conv_dim,
        "conv_kernel": kernel,
        "conv_bias": "conv1d.bias" in arrs,
        "proj_bias": "in_proj.bias" in arrs,
    }


def check_a(core_mod, a_log: np.ndarray, spell, where: str) -> None:
    """SPEC.md 7.2: A = -exp(A_log) (the library's exp) must be finite."""
    e = np.asarray(core_mod.elementwise("exp", np.ascontiguousarray(a_log, np.float32)))
    bad = np.flatnonzero(~np.isfinite(e))
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            f"{where}: weights[{spell('A_log')!r}] gives a non-finite "
            f"A = -exp(A_log) at flat index {k}: A_log={float(a_log[k])!r}, "
            f"A={-float(e[k])!r} (exp overflows float32 above about 88.72)"
        )
