"""Mamba2BlockInference: one Mamba-2 block (norm, mixer, residual), bit-exact on the CPU.

What lives here: every option and weight check of SPEC.md 7 and 10 (both weight spellings,
every size derived from the shapes), the resolved configuration handed to the C++ core, the
fingerprint, and the call path shared by ``forward`` and ``step`` (all checks first, then one
core call with the GIL released, then the counters). What does not: arithmetic
(``csrc/core/mamba2_impl.hpp``; A = -exp(A_log) is computed there with the library's exp) and
the state object (``mamba2_state.py``).
"""

from __future__ import annotations

import math
import sys

import numpy as np

from . import _ext
from ._block import BlockCommon
from ._validation import (
    check_array,
    check_finite,
    check_int,
    check_real,
    describe_type,
    format_shape,
)
from .mamba2_state import Mamba2State, _mamba2_state_type_error
from .state import _PRIVATE
from .weights import canonical_copy, check_key_set, fingerprint, resolve_names

__all__ = ["Mamba2BlockInference"]

_CLS = "Mamba2BlockInference"

# SPEC.md 7.2: short (canonical, mojolearn's) name -> HF Mamba2Block.state_dict() name. In the
# short form 'norm.weight' is the gated norm; in the HF form it is the block norm.
MAMBA2_SHORT_TO_HF: dict[str, str] = {
    "block_norm.weight": "norm.weight",
    "in_proj.weight": "mixer.in_proj.weight",
    "in_proj.bias": "mixer.in_proj.bias",
    "conv1d.weight": "mixer.conv1d.weight",
    "conv1d.bias": "mixer.conv1d.bias",
    "dt_bias": "mixer.dt_bias",
    "A_log": "mixer.A_log",
    "D": "mixer.D",
    "norm.weight": "mixer.norm.weight",
    "out_proj.weight": "mixer.out_proj.weight",
    "out_proj.bias": "mixer.out_proj.bias",
}
MAMBA2_HF_PREFIXES = ("mixer.",)
_REQUIRED = (
    "block_norm.weight",
    "in_proj.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
)
_OPTIONAL = {
    "conv1d.bias": "a conv bias (HF use_conv_bias)",
    "in_proj.bias": "projection biases (HF use_bias): in_proj.bias with out_proj.bias",
    "out_proj.bias": "projection biases (HF use_bias): in_proj.bias with out_proj.bias",
}

_DEFAULTS = {"dt_limit": (0.0, math.inf), "n_groups": 1, "norm_eps": 1e-05}
_OPTION_NAMES = tuple(_DEFAULTS)
_INT64_MAX = (1 << 63) - 1
_MAX_INT_OPTION = 1 << 24  # n_groups (it must also divide n_heads, the length of A_log)
_MAX_BATCH = 1 << 62  # allocate_state's batch_size; memory is the real limit


class _Impl:
    """Everything one configuration needs; swapped as a whole by ``set_params``."""

    __slots__ = ("raw", "opts", "sizes", "weights", "fingerprint", "core")


# --------------------------------------------------------------------------------------------
# option and weight checks
# --------------------------------------------------------------------------------------------


def _check_dt_limit(value, where: str) -> tuple[float, float]:
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


def _check_options(raw: dict, where: str) -> dict:
    return {
        "dt_limit": _check_dt_limit(raw["dt_limit"], where),
        "n_groups": check_int(
            raw["n_groups"], "n_groups", where, min_value=1, max_value=_MAX_INT_OPTION
        ),
        "norm_eps": check_real(raw["norm_eps"], "norm_eps", where, gt=0.0, float32=True),
    }


def _check_shapes(arrs: dict, o: dict, spell, where: str) -> dict:
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


def _check_a(core_mod, a_log: np.ndarray, spell, where: str) -> None:
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


def _options_repr(opts: dict) -> str:
    """Canonical, platform-independent spelling of the resolved options (for the fingerprint)."""
    lo, hi = opts["dt_limit"]
    return repr(
        (
            ("dt_limit", (float(lo), float(hi))),
            ("n_groups", int(opts["n_groups"])),
            ("norm_eps", float(opts["norm_eps"])),
        )
    )


def _build(raw: dict, where: str, weights=None, canonical=None) -> _Impl:
    """Check everything, copy the weights, build the core. Nothing observable changes on error."""
    o = _check_options(raw, where)
    if canonical is None:
        by_short, user_key, hf_form = resolve_names(
            weights, where, MAMBA2_SHORT_TO_HF, MAMBA2_HF_PREFIXES
        )
    else:
        by_short, user_key, hf_form = canonical, {k: k for k in canonical}, False

    def spell(n):  # the name as the user spelled it (or would have, for a missing tensor)
        return user_key.get(n, MAMBA2_SHORT_TO_HF[n] if hf_form else n)

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
    expected = {n: "always" for n in _REQUIRED}
    for n in _OPTIONAL:
        if n in by_short:
            expected[n] = "optional"
    check_key_set(by_short, expected, _OPTIONAL, where, spell)

    arrs = {n: check_array(v, f"weights[{spell(n)!r}]", where) for n, v in by_short.items()}
    sizes = _check_shapes(arrs, o, spell, where)
    core_mod = _ext.core()
    if canonical is None:
        weights_c = {}
        for n, a in arrs.items():
            c = canonical_copy(a, f"weights[{spell(n)!r}]", where)
            if n == "conv1d.weight" and c.ndim == 3:
                c = c.reshape(sizes["conv_dim"], sizes["conv_kernel"])  # a read-only view
            weights_c[n] = c
    else:
        weights_c = canonical  # already private, read-only, 2-D conv, checked finite
    _check_a(core_mod, weights_c["A_log"], spell, where)

    lo, hi = o["dt_limit"]
    cfg = {
        k: sizes[k]
        for k in (
            "d_model",
            "d_inner",
            "n_heads",
            "head_dim",
            "d_state",
            "n_groups",
            "conv_dim",
            "conv_kernel",
            "conv_bias",
            "proj_bias",
        )
    }
    cfg.update(norm_eps=o["norm_eps"], dt_min=lo, dt_max=hi)
    impl = _Impl()
    impl.raw = dict(raw)
    impl.opts = o
    impl.sizes = sizes
    impl.weights = weights_c
    impl.fingerprint = fingerprint(
        _CLS, str(core_mod.arithmetic_version()), _options_repr(o), weights_c
    )
    typed = core_mod.Mamba2Config()
    for k, v in cfg.items():
        setattr(typed, k, v)
    impl.core = core_mod.Mamba2Core(typed, weights_c)
    return impl


# --------------------------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------------------------


def _check_state_finite(state: Mamba2State, lens: np.ndarray, where: str) -> None:
    """SPEC 2.4: what a call reads of each advancing row must be finite: ``conv_window[b, :,
    1:]`` (the first token's conv reads columns 1 .. K-1; column 0, the oldest input, leaves
    the window unread) and ``h[b]``. One native pass over all advancing rows of each buffer;
    only when it sees a NaN/inf somewhere (column 0 included) does the exact per-row check run,
    which names the first offending element (rows in order, conv_window before h) or finds
    that only column 0 holds one."""
    rows = np.flatnonzero(np.asarray(lens) > 0).astype(np.int64)
    if rows.size == 0:
        return
    core = _ext.core()
    if (
        core.first_nonfinite_rows(state.conv_window, rows) is None
        and core.first_nonfinite_rows(state.h, rows) is None
    ):
        return
    for b in rows.tolist():
        cols = state.conv_window[b, :, 1:]
        if cols.size:
            check_finite(cols, "state.conv_window", where, index_base=(b,), index_offset=(0, 1))
        check_finite(state.h[b], "state.h", where, index_base=(b,))


class Mamba2BlockInference(BlockCommon):
    """One Mamba-2 block (RMSNorm, Mamba-2 mixer, residual), bit-exact float32 on the CPU.

    Computes HF ``Mamba2Block.forward`` (transformers 5.x: ``norm``, ``mixer``, residual) in its
    recurrent form for every call shape, with a fixed sequence of binary32 operations per output
    element (SPEC.md 3, 7.3), so that ``step`` == ``forward`` == any chunk split, a ragged row
    == that row alone, and 1 thread == N threads == every SIMD path, bit for bit.

    Parameters
    ----------
    weights : Mapping of str to float32 buffer
        In torch's [out, in] layout, with the short names or the HF names (the keys of
        ``Mamba2Block.state_dict()``; a dict is in HF form iff some key starts with
        ``'mixer.'``, and then ``'norm.weight'`` is the block norm). With
        d = d_model, N_in = d_inner + conv_dim + n_heads:
        ``block_norm.weight`` (d,); ``in_proj.weight`` (N_in, d) [``in_proj.bias`` (N_in,)];
        ``conv1d.weight`` (conv_dim, 1, K) or (conv_dim, K) [``conv1d.bias`` (conv_dim,)];
        ``dt_bias``, ``A_log``, ``D`` (n_heads,); ``norm.weight`` (d_inner,), the gated norm;
        ``out_proj.weight`` (d, d_inner) [``out_proj.bias`` (d,), present iff in_proj.bias].
        Every size is derived from these shapes: d from block_norm.weight, d_inner from
        out_proj.weight columns, n_heads from A_log, head_dim = d_inner / n_heads (exact),
        conv_dim and K from conv1d.weight, d_state = (conv_dim - d_inner) / (2 * n_groups).
        Arrays are copied (editing them later has no effect) and never written.
    dt_limit : tuple or list of two float, default=(0.0, inf)
        ``(lo, hi)`` with ``0 <= lo <= hi``, lo finite, hi finite or inf; dt is clamped to it
        (HF ``time_step_limit``). The entries are used as float32 (rounded once): a finite entry
        must not round to inf there, i.e. be <= 3.4028234663852886e+38 (the largest float32),
        so ``hi=1e39`` is refused while ``hi=inf`` is accepted; a tiny ``lo`` may round to 0.
    n_groups : int, default=1
        B/C groups (HF ``n_groups``), in [1, 2**24], dividing n_heads and the B/C width.
    norm_eps : float, default=1e-05
        Epsilon of both norms (HF ``layer_norm_epsilon``), > 0, used as float32: it must round
        to a positive finite float32, i.e. lie in about [1.4e-45, 3.4028235e38].

    Attributes
    ----------
    d_model, d_inner, n_heads, head_dim, d_state, n_groups, conv_dim, conv_kernel : int
        Resolved sizes (read-only).
    dt_limit : tuple of two float
        ``(lo, hi)`` in force.
    norm_eps : float
        Epsilon in force.
    conv_bias, proj_bias : bool
        Whether ``conv1d.bias`` and the projection biases are present.
    fingerprint : str
        32 lowercase hex digits (XXH3-128) over the class, ``arithmetic_version()``, the
        resolved options and the weight bytes (short names, conv weight as (conv_dim, K), so
        both spellings give the same value); states carry it.

    Raises
    ------
    TypeError
        ``weights`` not a Mapping, a key not a str, a weight not a float32 buffer (the message
        gives the exact widening where one exists), an option of the wrong type, a positional or
        unknown option.
    ValueError
        Missing, unknown or mixed-spelling weight names; one projection bias without the other;
        a wrong shape or inconsistent sizes (tensors, shapes and where each number came from);
        a NaN or infinite weight (tensor, flat index, value); an A_log whose A = -exp(A_log) is
        not finite; an option out of range; n_groups not dividing n_heads or the B/C width.
    ImportError
        The compiled extension is missing or of another version.

    See Also
    --------
    Mamba2State

    Notes
    -----
    For row b and each real token t (SPEC.md 7.3; HF ``Mamba2Mixer.torch_forward``, 5.x):
    ``hn = RMSNorm(x)``; ``z | u | dt_raw = W_in hn (+ b_in)``; causal depthwise conv of u over
    the last K tokens (the state's ``conv_window`` before the row's first token), then SiLU;
    ``xs | B | C`` split; ``dt = clamp(softplus(dt_raw + dt_bias), lo, hi)``;
    ``h = h * exp(dt * A) + (dt * B) * xs`` with ``A = -exp(A_log)``;
    ``y = sum_n h * C + xs * D``; gated RMSNorm per group of ``y * silu(z)``;
    ``out = x + W_out o (+ b_out)``. The scan is token-sequential in every call (no chunked
    SSD), so HF's ``chunk_size`` has no counterpart. Agreement with HF float32 (torch fallback
    kernels) is within rtol = atol = 2e-4 at test sizes; bit equality with PyTorch is not
    promised. HF's cached decode skips ``time_step_limit``; exactblocks always clamps.

    References
    ----------
    .. [1] Dao and Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
       Through Structured State Space Duality", arXiv:2405.21060.

    Examples
    --------
    >>> import numpy as np, exactblocks
    >>> rng = np.random.default_rng(0)
    >>> d, di, nh, ns, K = 16, 32, 4, 8, 4
    >>> cd = di + 2 * ns
    >>> def r(*s): return (0.1 * rng.standard_normal(s)).astype(np.float32)
    >>> w = {'block_norm.weight': 1 + r(d), 'in_proj.weight': r(di + cd + nh, d),
    ...      'conv1d.weight': r(cd, 1, K), 'conv1d.bias': r(cd), 'dt_bias': r(nh),
    ...      'A_log': r(nh), 'D': 1 + r(nh), 'norm.weight': 1 + r(di),
    ...      'out_proj.weight': r(d, di)}
    >>> blk = exactblocks.Mamba2BlockInference(w)
    >>> blk.head_dim, blk.d_state, blk.conv_kernel
    (8, 8, 4)
    >>> x = r(1, 5, d)
    >>> st = blk.allocate_state(1)
    >>> y = np.concatenate([blk.step(x[:, t], st) for t in range(5)], axis=1)
    >>> bool((y.view(np.uint32) == blk.forward(x).view(np.uint32)).all())
    True
    """

    _defaults = _DEFAULTS
    _build = staticmethod(_build)

    def __init__(self, weights, *, dt_limit=(0.0, math.inf), n_groups=1, norm_eps=1e-05):
        raw = {"dt_limit": dt_limit, "n_groups": n_groups, "norm_eps": norm_eps}
        object.__setattr__(self, "_impl", _build(raw, f"{_CLS}.__init__", weights=weights))

    # -- read-only attributes -------------------------------------------------------------------
    d_model = property(
        lambda self: self._impl.sizes["d_model"],
        doc="int: Residual width, the length of block_norm.weight.",
    )
    d_inner = property(
        lambda self: self._impl.sizes["d_inner"],
        doc="int: Mixer width, the columns of out_proj.weight.",
    )
    n_heads = property(
        lambda self: self._impl.sizes["n_heads"], doc="int: SSM heads, the length of A_log."
    )
    head_dim = property(
        lambda self: self._impl.sizes["head_dim"], doc="int: Channels per head, d_inner / n_heads."
    )
    d_state = property(
        lambda self: self._impl.sizes["d_state"],
        doc="int: SSM state size, (conv_dim - d_inner) / (2 * n_groups).",
    )
    n_groups = property(lambda self: self._impl.sizes["n_groups"], doc="int: B/C groups.")
    conv_dim = property(
        lambda self: self._impl.sizes["conv_dim"],
        doc="int: Conv channels, d_inner + 2 * n_groups * d_state.",
    )
    conv_kernel = property(
        lambda self: self._impl.sizes["conv_kernel"], doc="int: Conv taps K (HF conv_kernel)."
    )
    conv_bias = property(
        lambda self: self._impl.sizes["conv_bias"], doc="bool: Whether conv1d.bias is present."
    )
    proj_bias = property(
        lambda self: self._impl.sizes["proj_bias"],
        doc="bool: Whether in_proj.bias and out_proj.bias are present.",
    )
    dt_limit = property(
        lambda self: self._impl.opts["dt_limit"], doc="tuple of two float: dt clamp (lo, hi)."
    )
    norm_eps = property(lambda self: self._impl.opts["norm_eps"], doc="float: Norm epsilon.")
    fingerprint = property(
        lambda self: self._impl.fingerprint,
        doc="str: 32 hex digits identifying class, arithmetic, options and "
        "weights; states carry it.",
    )

    # -- sklearn-style parameters -------------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict:
        """Return every keyword option with the value in force.

        Parameters
        ----------
        deep : bool, default=True
            Accepted for scikit-learn compatibility and ignored.

        Returns
        -------
        dict
            ``{'dt_limit': (lo, hi), 'n_groups': int, 'norm_eps': float}`` (``weights`` is not
            included); ``dt_limit`` is a tuple of two floats.
        """
        return dict(self._impl.opts)

    # -- identity, copying --------------------------------------------------------------------
    def __repr__(self) -> str:
        s, o = self._impl.sizes, self._impl.opts
        inner = ", ".join(
            [
                f"{k}={s[k]!r}"
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
                )
            ]
            + [f"{k}={o[k]!r}" for k in _OPTION_NAMES]
        )
        return f"{_CLS}({inner})"

    # -- states -------------------------------------------------------------------------------
    def allocate_state(self, batch_size: int, *extra) -> Mamba2State:
        """Return a zeroed Mamba2State for ``batch_size`` sequences.

        Parameters
        ----------
        batch_size : int
            Rows, in [1, 2**62] (memory is the practical limit). There is no second
            argument: a Mamba-2 state has a constant size whatever the number of tokens.

        Returns
        -------
        Mamba2State
            ``conv_window`` (batch_size, conv_dim, conv_kernel) and ``h`` (batch_size, n_heads,
            head_dim, d_state), all +0.0; ``row_tokens`` zeros; the block's fingerprint.
            Memory: batch_size * (conv_dim * conv_kernel + n_heads * head_dim * d_state) * 4
            bytes.

        Raises
        ------
        TypeError
            ``batch_size`` is not an int, or a second argument is given (a Transformer-style
            ``max_tokens`` has no meaning here).
        ValueError
            ``batch_size`` outside [1, 2**62].
        MemoryError
            The buffers cannot be allocated; the message gives the bytes asked for.
        """
        where = f"{_CLS}.allocate_state"
        if extra:
            raise TypeError(
                f"{where}: takes only batch_size; got {len(extra)} extra positional "
                f"argument(s) {extra!r} (a Mamba-2 state has a constant size, there "
                "is no max_tokens)"
            )
        b = check_int(batch_size, "batch_size", where, min_value=1, max_value=_MAX_BATCH)
        s = self._impl.sizes
        nbytes = (
            b * (s["conv_dim"] * s["conv_kernel"] + s["n_heads"] * s["head_dim"] * s["d_state"]) * 4
            + 8 * b
        )
        try:
            if nbytes > sys.maxsize:
                raise MemoryError
            return Mamba2State._make(
                _PRIVATE,
                batch_size=b,
                n_heads=s["n_heads"],
                head_dim=s["head_dim"],
                d_state=s["d_state"],
                n_groups=s["n_groups"],
                conv_dim=s["conv_dim"],
                conv_kernel=s["conv_kernel"],
                fingerprint=self._impl.fingerprint,
            )
        except MemoryError:
            raise MemoryError(
                f"{where}: cannot allocate a state of batch_size={b}: conv_window "
                f"{format_shape((b, s['conv_dim'], s['conv_kernel']))} and h "
                f"{format_shape((b, s['n_heads'], s['head_dim'], s['d_state']))} float32 plus "
                f"row_tokens need {nbytes} bytes ({nbytes / 2**30:.3g} GiB)"
            ) from None

    # -- calls --------------------------------------------------------------------------------
    def forward(self, x, state: Mamba2State | None = None, *, lengths=None) -> np.ndarray:
        """Run the block on ``x``; with a state, advance each row by its real tokens.

        Parameters
        ----------
        x : buffer of shape (batch, n_tokens, d_model), dtype float32
            Any float32 buffer (NumPy array, memoryview, ...); never written. Non-contiguous
            input is copied once (bytes only).
        state : Mamba2State or None, default=None
            None: every row starts from a zero conv window and SSM state, used for this call
            only. Otherwise a state of this block with ``batch_size == batch``: each row
            continues from its ``conv_window`` and ``h``, which are updated in place, and
            ``row_tokens[b] += n_b``. Rows with ``n_b = 0`` are idle and untouched.
        lengths : None, sequence of int or 1-D integer array, default=None
            Real tokens per row ``n_b`` in [0, n_tokens]; ``x[b, n_b:]`` is right padding, never
            read (NaN allowed there).

        Returns
        -------
        ndarray of shape (batch, n_tokens, d_model), dtype float32
            Fresh, C-contiguous; padding positions are exactly +0.0.

        Raises
        ------
        TypeError
            ``x`` not a float32 buffer; ``state`` not a Mamba2State; bad ``lengths`` type.
        ValueError
            Wrong shape of ``x``; NaN/inf in a real position of ``x`` (index and value); bad
            ``lengths`` count or range; a state of another block (both fingerprints) or batch
            size; ``row_tokens`` negative; NaN/inf in what the call reads of a row it advances,
            ``conv_window[b, :, 1:]`` or ``h[b]`` (buffer, index, value).
        RuntimeError
            The state is in use by another call.

        Notes
        -----
        Every check completes before the state is touched (a failed call leaves
        ``conv_window``, ``h`` and ``row_tokens`` byte-identical); the native computation runs
        with the GIL released. Output bits depend only on each row's own tokens and starting
        state (SPEC.md 3.1).
        """
        return self._call(x, state, lengths, f"{_CLS}.forward", step=False)

    __call__ = forward

    def step(self, x, state: Mamba2State) -> np.ndarray:
        """Advance every row of ``state`` by one token and return the block output.

        Parameters
        ----------
        x : buffer of shape (batch, d_model) or (batch, 1, d_model), dtype float32
            One token per row.
        state : Mamba2State
            Required; as in :meth:`forward`.

        Returns
        -------
        ndarray of shape (batch, 1, d_model), dtype float32
            Bitwise equal to ``forward(x, state)`` with one token.

        Raises
        ------
        TypeError
            ``state`` is None or not a Mamba2State; ``x`` not a float32 buffer.
        ValueError
            As in :meth:`forward`; also ``x`` with n_tokens != 1.
        RuntimeError
            The state is in use by another call.
        """
        return self._call(x, state, None, f"{_CLS}.step", step=True)

    # -- internals ----------------------------------------------------------------------------
    def _call(self, x, state, lengths, where: str, *, step: bool) -> np.ndarray:
        impl = self._impl  # one snapshot: set_params swaps configurations atomically
        s = impl.sizes
        xa, lens = self._check_call_inputs(
            x,
            state,
            lengths,
            where,
            step=step,
            d_model=s["d_model"],
            state_cls=Mamba2State,
            type_error=_mamba2_state_type_error,
            alloc_call="allocate_state(batch_size)",
        )
        bsz = xa.shape[0]
        if state is None:
            return impl.core.forward(
                xa,
                lens,
                np.zeros((bsz, s["conv_dim"], s["conv_kernel"]), np.float32),
                np.zeros((bsz, s["n_heads"], s["head_dim"], s["d_state"]), np.float32),
            )
        self._check_state_fits(impl, state, xa, where)
        self._lock_state(state, where)
        try:
            state._check_buffers(where)  # dtype, shape, C order, writable, no aliasing
            start = np.array(state.row_tokens, dtype=np.int64, copy=True)
            for b in range(bsz):
                held, n = int(start[b]), int(lens[b])
                if held < 0:
                    raise ValueError(f"{where}: state.row_tokens[{b}]={held} must be >= 0")
                if n and held > _INT64_MAX - n:
                    raise ValueError(
                        f"{where}: state.row_tokens[{b}]={held} + {n} tokens overflows int64"
                    )
            # The native call checks what it reads of each advancing row before writing and
            # returns None when a value is not finite; the exact check then names it.
            y = impl.core.forward(xa, lens, state.conv_window, state.h, check_state=True)
            if y is None:
                _check_state_finite(state, lens, where)
                raise RuntimeError(
                    f"{where}: internal error: the native state check failed but no "
                    "non-finite value was found"
                )
            state.row_tokens[:] = start + lens
        finally:
            state._lock.release()
        return y
