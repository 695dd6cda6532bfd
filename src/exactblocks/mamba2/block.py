"""Mamba2BlockInference: one Mamba-2 block (norm, mixer, residual), bit-exact on the CPU.

What lives here: the block class, the construction path (:func:`_build`: options, weight names
in both spellings, every size derived from the shapes, canonical copies, typed config,
fingerprint, core) and the call path shared by ``forward`` and ``step`` (all checks first, then
one core call with the GIL released, then the counters). What does not: the option table and
checks (``config.py``), the weight table and shape checks (``weights.py``), the state and its
checks (``state.py``), what both blocks share (``_block.py``), arithmetic
(``csrc/blocks/mamba2/``; A = -exp(A_log) is computed there with the library's exp).
"""

from __future__ import annotations

import sys

import numpy as np

from .. import _ext
from .._block import BlockCommon, make_impl
from .._options import install
from .._state import PRIVATE_TOKEN
from .._validation import check_array, check_finite, check_int, format_shape
from .._weights import canonical_copy, check_weight, packed_layout, resolve_names
from .config import OPTIONS, check_options, core_config
from .state import Mamba2State, _check_counters, _check_finite, _state_type_error
from .weights import HF_PREFIXES, SHORT_TO_HF, check_a, check_names, check_shapes

__all__ = ["Mamba2BlockInference"]

_CLS = "Mamba2BlockInference"
_MAX_BATCH = 1 << 62  # allocate_state's batch_size; memory is the real limit
# The core's packed matrices (weight_storage names) and the tensor in each.
_PACKED = (("in_proj", ("in_proj.weight",)), ("out_proj", ("out_proj.weight",)))


def _build(raw: dict, where: str, weights=None, canonical=None):
    """Check everything, copy the weights, build the core. Nothing observable changes on error.

    ``weights`` is the user's dict (any spelling); ``canonical`` instead reuses the private,
    read-only, checked copies of an existing configuration (``set_params``, unpickling).
    """
    o = check_options(raw, where)
    if canonical is None:
        by_short, user_key, hf_form = resolve_names(weights, where, SHORT_TO_HF, HF_PREFIXES)
    else:
        by_short, user_key, hf_form = canonical, {k: k for k in canonical}, False

    def spell(n):  # the name as the user spelled it (or would have, for a missing tensor)
        return user_key.get(n, SHORT_TO_HF[n] if hf_form else n)

    check_names(by_short, o, spell, where)
    arrs = {n: check_weight(v, f"weights[{spell(n)!r}]", where) for n, v in by_short.items()}
    sizes = check_shapes(arrs, o, spell, where)
    core_mod = _ext.core()
    if canonical is None:
        weights_c = {}
        for n, a in arrs.items():
            c = canonical_copy(a, f"weights[{spell(n)!r}]", where)
            if n == "conv1d.weight" and c.ndim == 3:
                c = c.reshape(sizes["conv_dim"], sizes["conv_kernel"])  # a read-only view
            weights_c[n] = c
    else:
        weights_c = arrs  # the canonical ones: private, read-only, 2-D conv, checked finite
    check_a(core_mod, weights_c["A_log"], spell, where)
    impl = make_impl(
        _CLS,
        OPTIONS,
        raw,
        o,
        sizes,
        weights_c,
        core_mod,
        core_config(core_mod, o, sizes),
        core_mod.Mamba2Core,
        packed_layout(_PACKED, arrs),
    )
    # backward returns each gradient under the name and in the shape the constructor took
    impl.sizes["grad_names"] = {n: spell(n) for n in weights_c}
    impl.sizes["conv_weight_shape"] = tuple(arrs["conv1d.weight"].shape)
    return impl


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

    _build = staticmethod(_build)
    _REPR_SIZES = (
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
    # __init__(self, weights, *, dt_limit, n_groups, norm_eps) and one read-only property per
    # option: from config.OPTIONS (install() below).

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
        return self._public_options()

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
        nbytes = self._state_nbytes(b)
        try:
            if nbytes > sys.maxsize:
                raise MemoryError
            return Mamba2State._make(
                PRIVATE_TOKEN,
                batch_size=b,
                n_heads=s["n_heads"],
                head_dim=s["head_dim"],
                d_state=s["d_state"],
                n_groups=s["n_groups"],
                conv_dim=s["conv_dim"],
                conv_kernel=s["conv_kernel"],
                fingerprint=self._impl.fp,  # the object: its state is recognised by identity
            )
        except MemoryError:
            raise MemoryError(
                f"{where}: cannot allocate a state of batch_size={b}: conv_window "
                f"{format_shape((b, s['conv_dim'], s['conv_kernel']))} and h "
                f"{format_shape((b, s['n_heads'], s['head_dim'], s['d_state']))} float32 plus "
                f"row_tokens need {nbytes} bytes ({nbytes / 2**30:.3g} GiB)"
            ) from None

    def _state_nbytes(self, b: int) -> int:
        """Bytes of a state of ``b`` rows: conv_window, h and row_tokens."""
        s = self._impl.sizes
        per_row = s["conv_dim"] * s["conv_kernel"] + s["n_heads"] * s["head_dim"] * s["d_state"]
        return b * per_row * 4 + 8 * b

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
        MemoryError
            The output or the scratch cannot be allocated (the message names the call and
            the bytes); the state is unchanged and the scratch grown so far is released.

        Notes
        -----
        Every check completes before the state is touched (a failed call leaves
        ``conv_window``, ``h`` and ``row_tokens`` byte-identical); the native computation runs
        with the GIL released and writes ``conv_window``, ``h`` and then ``row_tokens`` in one
        step: an exception raised into the call (Ctrl-C, a signal handler) leaves the state
        wholly before or wholly after the call (SPEC.md 2.5). A long call on the main thread
        polls for pending signals about every 20 ms: a handler that raises (KeyboardInterrupt,
        a timeout) stops it within about 100 ms, with the state exactly as before the call.
        Output bits depend only on each row's own tokens and starting state (SPEC.md 3.1).
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

    def backward(self, x, grad_output, *extra, lengths=None, state=None) -> dict:
        """Gradients of a zero-state prefill (a vector-Jacobian product).

        Recomputes the forward with the current weights on every call; no earlier forward or
        cached state is used or changed. For ``y = forward(x, lengths=lengths)`` and the
        loss ``sum(grad_output * y)`` over the real positions, returns the gradient with
        respect to ``x`` and to every constructor weight. Every gradient element is a fixed
        sequence of float32 operations (SPEC.md 7.6): the same bits at any thread count and on
        every SIMD path, and a row's ``x`` gradient is the same whatever the other rows.

        Parameters
        ----------
        x : buffer of shape (batch, n_tokens, d_model), dtype float32
            The forward input, as :meth:`forward` takes it; real positions must be finite.
        grad_output : buffer of shape (batch, n_tokens, d_model), dtype float32
            Gradient of the loss with respect to the block output (residual included). Real
            positions must be finite; padding positions are never read.
        lengths : None, sequence of int or 1-D integer array, default=None
            Real tokens per row in [0, n_tokens], as in :meth:`forward`: padding positions
            get a zero ``x`` gradient and contribute nothing to the weight gradients.
        state : None
            Must be None: there is no gradient through a carried state.

        Returns
        -------
        dict of str to ndarray (float32)
            ``'x'`` (batch, n_tokens, d_model), then one entry per constructor weight under
            the name the constructor took (short or HF spelling) and in that weight's shape
            (``conv1d.weight`` as given: (conv_dim, 1, K) or (conv_dim, K)). Weight gradients
            are summed over the batch's rows and real positions. A weight stored compactly
            (``weight_storage``) gets the float32 gradient of its float32 values.

        Raises
        ------
        TypeError
            ``x`` or ``grad_output`` not a float32 buffer; an extra positional argument.
        ValueError
            A wrong shape (``grad_output`` must have ``x``'s shape); NaN or infinity in a
            real position of ``x`` or ``grad_output`` (array, index, value); bad ``lengths``;
            a ``state`` (carried-state and decode gradients are not available).
        MemoryError
            The scratch cannot be allocated.
        KeyboardInterrupt
            Ctrl-C (or any exception a signal handler raises) during a long call: it stops
            within about 100 ms; the block is unchanged (SPEC.md 2.5).

        Notes
        -----
        Not differentiated: a carried state (the prefill starts from zero), decode steps and
        the final state. The clamp of dt to ``dt_limit`` passes the gradient where
        ``lo <= softplus(.) <= hi`` and blocks it elsewhere, as ``torch.clamp`` does.

        Memory: the call keeps every real token's activations, about
        ``4 * M * (5 * d_model + 2 * (d_inner + conv_dim + n_heads) + 3 * conv_dim +
        9 * d_inner + 2 * n_heads * d_state)`` bytes for M real tokens, the scan state before
        every 32nd token of each row (``4 * ceil(n_b / 32) * n_heads * head_dim * d_state``
        bytes per row), one chunk's 33 states per thread, in_proj and out_proj rebuilt as
        float32 and a transposed copy of the in_proj gradient's rows (``4 * M * (d_inner +
        conv_dim + n_heads)`` bytes); nothing is stored between calls. Agreement with
        torch autograd of HF ``Mamba2Block`` (float64): see SPEC.md 7.6 for the tolerance.

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
        >>> x = r(2, 5, d)
        >>> g = blk.backward(x, np.ones_like(x))
        >>> g['x'].shape, g['conv1d.weight'].shape
        ((2, 5, 16), (48, 1, 4))
        """
        where = f"{_CLS}.backward"
        if extra:
            raise TypeError(
                f"{where}: takes x and grad_output; got {len(extra)} extra positional "
                "argument(s) (a state? backward differentiates a zero-state prefill only)"
            )
        if state is not None:
            raise ValueError(
                f"{where}: state must be None (got {type(state).__name__}); gradients with "
                "respect to a carried state, decode backward and final-state cotangents are "
                "not available: backward differentiates a zero-state prefill"
            )
        impl = self._impl  # one snapshot: set_params swaps configurations atomically
        s = impl.sizes
        xa, lens = self._check_call_inputs(
            x,
            None,
            lengths,
            where,
            step=False,
            d_model=s["d_model"],
            state_cls=Mamba2State,
            type_error=_state_type_error,
            alloc_call="allocate_state(batch_size)",
        )
        ga = check_array(grad_output, "grad_output", where)
        if ga.shape != xa.shape:
            raise ValueError(
                f"{where}: grad_output has shape {format_shape(ga.shape)}; expected the "
                f"shape of x, {format_shape(xa.shape)}"
            )
        if lengths is None:
            check_finite(ga, "grad_output", where)
        else:
            for b in range(ga.shape[0]):
                n = int(lens[b])
                if n:
                    check_finite(ga[b, :n], "grad_output", where, index_base=(b,))
        try:
            dx, grads = _ext.core().mamba2_backward(impl.core, xa, ga, lens)
        except MemoryError as exc:
            raise MemoryError(
                f"{where}: cannot allocate the scratch of a backward pass over "
                f"{int(lens.sum())} tokens ({exc})"
            ) from None
        out = {"x": dx}
        names = s["grad_names"]
        for n, gr in grads.items():
            if n == "conv1d.weight":
                gr = gr.reshape(s["conv_weight_shape"])
            out[names[n]] = gr
        return out

    def set_params(self, **params):  # noqa: D102 - BlockCommon.set_params's docstring
        names = self._impl.sizes["grad_names"], self._impl.sizes["conv_weight_shape"]
        super().set_params(**params)
        # the weights are unchanged: backward keeps the constructor's names and shapes
        self._impl.sizes["grad_names"], self._impl.sizes["conv_weight_shape"] = names
        return self

    set_params.__doc__ = BlockCommon.set_params.__doc__

    def __getstate__(self) -> dict:
        st = super().__getstate__()
        s = self._impl.sizes  # backward's names and conv shape (absent from older pickles)
        st["grad_names"], st["conv_weight_shape"] = dict(s["grad_names"]), s["conv_weight_shape"]
        return st

    def __setstate__(self, st: dict) -> None:
        super().__setstate__(st)
        if "grad_names" in st:
            s = self._impl.sizes
            s["grad_names"] = dict(st["grad_names"])
            s["conv_weight_shape"] = tuple(st["conv_weight_shape"])

    # -- internals ----------------------------------------------------------------------------
    def _model_call(self, x, state, lengths, *, step: bool, session, undo) -> np.ndarray:
        """This block as one layer of a ``Model`` call (``session`` is always None: Mamba-2
        has no decode session), saving the conv window and SSM state rows it overwrites into
        ``undo`` (the model state's log, rolled back if a later layer fails)."""
        where = f"{_CLS}.{'step' if step else 'forward'}"
        return self._call(x, state, lengths, where, step=step, undo=undo)

    def _call(self, x, state, lengths, where: str, *, step: bool, undo=None) -> np.ndarray:
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
            type_error=_state_type_error,
            alloc_call="allocate_state(batch_size)",
        )
        bsz = xa.shape[0]
        if state is None:
            try:
                return impl.core.forward(
                    xa,
                    lens,
                    np.zeros((bsz, s["conv_dim"], s["conv_kernel"]), np.float32),
                    np.zeros((bsz, s["n_heads"], s["head_dim"], s["d_state"]), np.float32),
                )
            except MemoryError as exc:
                raise self._memory_error(where, exc, None) from None
        self._check_state_fits(impl, state, xa, where)
        with self._claim_state(state, where):
            start = _check_counters(state, lens, where)
            # The native call checks what it reads of each advancing row before writing and
            # returns None when a value is not finite; the exact check then names it. Once
            # conv_window and h are written it sets row_tokens = start + lens in the same
            # native step: an interrupt never falls between the buffers and the counters.
            try:
                y = impl.core.forward(
                    xa,
                    lens,
                    state.conv_window,
                    state.h,
                    check_state=True,
                    start=start,
                    row_tokens=state.row_tokens,
                    undo=undo,
                )
            except MemoryError as exc:
                raise self._memory_error(where, exc, state) from None
            if y is None:
                _check_finite(state, lens, where)
                raise RuntimeError(
                    f"{where}: internal error: the native state check failed but no "
                    "non-finite value was found"
                )
        return y


install(Mamba2BlockInference, OPTIONS)
