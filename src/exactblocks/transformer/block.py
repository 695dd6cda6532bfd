"""TransformerBlockInference: one Llama-family decoder block, bit-exact on the CPU.

What lives here: the block class, the construction path (:func:`_build`: options, weight names,
shapes, resolved options, canonical copies, typed config, fingerprint, core) and the call path
shared by ``forward``, ``step`` and the decode session (all checks first, then one core call with
the GIL released, then the counters). What does not: the option table and checks
(``config.py``), the weight table and shape checks (``weights.py``), the state and its checks
(``state.py``), the session (``session.py``), what both blocks share (``_block.py``), arithmetic
(``csrc/blocks/transformer/``).
"""

from __future__ import annotations

import sys

import numpy as np

from .. import _ext
from .._block import BlockCommon, make_impl
from .._options import install
from .._state import _PRIVATE
from .._validation import check_array, check_int, format_shape
from .._weights import canonical_copy, resolve_names
from .config import MAX_POSITIONS_LIMIT, OPTIONS, check_options, core_config, resolve
from .session import TransformerDecodeSession
from .state import TransformerState, _check_counters, _check_readable, _state_type_error
from .weights import HF_PREFIXES, SHORT_TO_HF, check_names, check_shapes

__all__ = ["TransformerBlockInference"]

_CLS = "TransformerBlockInference"
_MAX_BATCH = 1 << 62  # allocate_state's batch_size; memory is the real limit (MemoryError)


def _build(raw: dict, where: str, weights=None, canonical=None):
    """Check everything, copy the weights, build the core. Nothing observable changes on error.

    ``weights`` is the user's dict (any spelling); ``canonical`` instead reuses the private,
    read-only, checked copies of an existing configuration (``set_params``, unpickling).
    """
    o = check_options(raw, where)
    if canonical is None:
        by_short, user_key, _ = resolve_names(weights, where, SHORT_TO_HF, HF_PREFIXES)
    else:
        by_short, user_key = canonical, {k: k for k in canonical}

    def spell(n):  # the name as the user spelled it (short for a missing tensor)
        return user_key.get(n, n)

    check_names(by_short, o, spell, where)
    arrs = {n: check_array(v, f"weights[{spell(n)!r}]", where) for n, v in by_short.items()}
    sizes = check_shapes(arrs, o, spell, where)
    core_mod = _ext.core()
    opts = resolve(o, sizes, core_mod, where)
    if canonical is None:
        weights_c = {n: canonical_copy(a, f"weights[{spell(n)!r}]", where) for n, a in arrs.items()}
    else:
        weights_c = canonical  # already private, read-only and checked finite
    return make_impl(
        _CLS,
        OPTIONS,
        raw,
        opts,
        sizes,
        weights_c,
        core_mod,
        core_config(core_mod, opts, sizes),
        core_mod.TransformerCore,
    )


class TransformerBlockInference(BlockCommon):
    """One pre-norm decoder block (attention + MLP), bit-exact float32 inference on the CPU.

    Computes HF ``LlamaDecoderLayer.forward`` (transformers 5.x) and its Mistral, Qwen2, Qwen3,
    Gemma, StableLM and Starcoder2 variants selected by the options, with a fixed sequence of
    binary32 operations per output element (SPEC.md 3), so that ``step`` == ``forward`` == any
    chunking, a ragged row == that row alone, and 1 thread == N threads, bit for bit.

    Parameters
    ----------
    weights : Mapping of str to float32 buffer
        In torch's [out, in] layout, with the short names (``'q_proj.weight'``, ...) or the HF
        layer names (the keys of ``LlamaDecoderLayer.state_dict()``, ``'self_attn.q_proj.weight'``,
        ``'mlp.up_proj.weight'``, ...). With QW = n_heads*head_dim, KW = n_kv_heads*head_dim,
        IT = rows of up_proj.weight, d = d_model = len(input_layernorm.weight):
        ``input_layernorm.weight``, ``post_attention_layernorm.weight`` (d,) [``.bias`` (d,)
        with norm_bias]; ``q_proj.weight`` (QW, d), ``k_proj.weight``, ``v_proj.weight`` (KW, d)
        [``.bias`` with qkv_bias]; ``o_proj.weight`` (d, QW) [``.bias`` (d,) with o_bias];
        ``q_norm.weight``, ``k_norm.weight`` (head_dim,) with qk_norm; ``gate_proj.weight``
        (IT, d) for gated MLPs; ``up_proj.weight`` (IT, d); ``down_proj.weight`` (d, IT)
        [biases with mlp_bias]. The key set must be exact. Arrays are copied (editing them later
        has no effect) and never written.
    n_heads : int
        Query heads (HF ``num_attention_heads``), in [1, 2**24].
    n_kv_heads : int or None, default=None
        K/V heads, dividing n_heads (HF ``num_key_value_heads``), in [1, 2**24]; None = k_proj
        rows / head_dim.
    head_dim : int or None, default=None
        Width of a head, in [1, 2**24]; None = q_proj rows / n_heads (exact). Free of d_model.
    window : int, default=0
        0 = causal attention; W in [1, 2**24] = sliding window: a query at position p sees keys
        ``p-W+1 .. p`` (W keys including itself; HF ``sliding_window``). A window >=
        max_positions gives the same outputs as 0.
    rope_theta : float, default=10000.0
        RoPE base, finite > 0. Together with rope_scaling and max_positions it must give a
        usable float32 table: every ``inv_freq_i`` (computed in binary64, scaled, rounded to
        float32) finite and > 0, and ``float32(max_positions - 1) * max(inv_freq)`` finite;
        otherwise ValueError (e.g. rope_theta=1e-300 or a linear factor of 1e-300).
    rope_scaling : Mapping or None, default=None
        HF ``rope_scaling`` / ``rope_parameters``: ``{'rope_type': 'default'}``,
        ``{'rope_type': 'linear', 'factor': f}`` or ``{'rope_type': 'llama3', 'factor',
        'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'}`` (legacy key
        ``'type'`` accepted; original_max_position_embeddings an int in [1, 2**24]). Extra keys
        allowed: ``'rope_theta'`` (must equal rope_theta) and ``'partial_rotary_factor'``: with
        rope_dim=None it gives ``rope_dim = int(head_dim * partial_rotary_factor)`` (HF StableLM
        ``rotary_ndims``), which must be even and in [2, head_dim]; with rope_dim given the two
        must agree.
    rope_dim : int or None, default=None
        Rotate the first rope_dim dims of each head (even, in [2, head_dim]); None = derived
        from ``rope_scaling['partial_rotary_factor']`` when present, else head_dim.
    max_positions : int, default=8192
        Positions p < max_positions can be computed; in [1, 2**24].
    qkv_bias, o_bias : bool, default=False
        Biases on q/k/v (Qwen2) and on o_proj.
    norm : {'rmsnorm', 'layernorm', 'rmsnorm_offset'}, default='rmsnorm'
        ``LlamaRMSNorm``; ``torch.nn.LayerNorm``; ``GemmaRMSNorm`` (scale 1 + w).
    norm_eps : float, default=1e-06
        Epsilon of every norm of the block, > 0, used as float32: it must round to a positive
        finite float32, i.e. lie in about [1.4e-45, 3.4028235e38] (1e-50 or 1e39 are refused).
    norm_bias : bool, default=False
        LayerNorm biases; needs norm='layernorm'.
    mlp : {'swiglu', 'geglu', 'geglu_tanh', 'gelu', 'gelu_tanh'}, default='swiglu'
        Gated ``down(act(gate) * up)`` with silu / erf-GELU / tanh-GELU, or ungated
        ``down(act(up))``.
    mlp_bias : bool, default=False
        Biases on up, down and (gated) gate.
    qk_norm : bool, default=False
        Per-head norm of q and k over head_dim before RoPE (Qwen3, Gemma3); not with layernorm.
    attn_softcap : float or None, default=None
        Scores s -> cap * tanh(s / cap) before the mask (Gemma2), > 0, used as float32: it must
        round to a positive finite float32 (about [1.4e-45, 3.4028235e38]).
    numeric_profile : {None, 'fp32'}, default=None
        float32 weights and arithmetic (the only profile in v1).

    Attributes
    ----------
    d_model, n_heads, n_kv_heads, head_dim, intermediate, window, rope_theta, rope_scaling,
    rope_dim, max_positions, qkv_bias, o_bias, norm, norm_eps, norm_bias, mlp, mlp_bias, qk_norm,
    attn_softcap, numeric_profile : read-only
        The resolved configuration (assignment raises AttributeError; use ``set_params``).
    fingerprint : str
        32 lowercase hex digits (XXH3-128) over the class, ``arithmetic_version()``, the resolved
        options and the weight bytes; states carry it.

    Raises
    ------
    TypeError
        ``weights`` not a Mapping, a key not a str, a weight not a float32 buffer (the message
        gives the exact widening where one exists), an option of the wrong type, a positional or
        unknown option.
    ValueError
        Missing, unknown or mixed-spelling weight names; an optional tensor present while its
        option is off; a wrong shape (tensor, shape got, shape expected and where each number
        came from); a NaN or infinite weight (tensor, flat index, value); an option out of range
        or inconsistent with another option or the weights.
    ImportError
        The compiled extension is missing or of another version.

    See Also
    --------
    TransformerState, TransformerDecodeSession

    Notes
    -----
    Per row and real position p (SPEC.md 4.3, HF ``LlamaDecoderLayer`` order):
    ``h = N_in(x)``; ``q, k, v = Wq h, Wk h, Wv h`` (+biases); optional q/k norm; RoPE at p
    (rotate_half layout, RoFormer); k, v of p go to the state; attention over the window with
    scale ``head_dim**-0.5`` (float32), optional softcap, two-pass softmax; ``x1 = x + Wo o``;
    ``y = x1 + Wd act(Wg N_post(x1)) * (Wu N_post(x1))`` (gated) or ``x1 + Wd act(Wu ...)``.
    Agreement with HF float32 eager attention is within rtol = atol = 2e-4 at test sizes; bit
    equality with PyTorch is not promised.

    References
    ----------
    .. [1] Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
       arXiv:2104.09864.

    Examples
    --------
    >>> import numpy as np, exactblocks
    >>> rng = np.random.default_rng(0)
    >>> d, hd, it = 32, 8, 64
    >>> def r(*s): return (0.1 * rng.standard_normal(s)).astype(np.float32)
    >>> w = {'input_layernorm.weight': 1 + r(d), 'post_attention_layernorm.weight': 1 + r(d),
    ...      'q_proj.weight': r(4 * hd, d), 'k_proj.weight': r(2 * hd, d),
    ...      'v_proj.weight': r(2 * hd, d), 'o_proj.weight': r(d, 4 * hd),
    ...      'gate_proj.weight': r(it, d), 'up_proj.weight': r(it, d),
    ...      'down_proj.weight': r(d, it)}
    >>> blk = exactblocks.TransformerBlockInference(w, n_heads=4)
    >>> blk.n_kv_heads, blk.head_dim
    (2, 8)
    >>> x = r(1, 5, d)
    >>> st = blk.allocate_state(1, 16)
    >>> y = np.concatenate([blk.step(x[:, t], st) for t in range(5)], axis=1)
    >>> bool((y.view(np.uint32) == blk.forward(x).view(np.uint32)).all())
    True
    """

    _build = staticmethod(_build)
    _REPR_SIZES = ("d_model", "intermediate")
    # __init__(self, weights, *, n_heads, ...), one read-only property per option: from
    # config.OPTIONS (install() below).

    # -- read-only attributes -------------------------------------------------------------------
    d_model = property(
        lambda self: self._impl.sizes["d_model"],
        doc="int: Residual width, the length of input_layernorm.weight.",
    )
    intermediate = property(
        lambda self: self._impl.sizes["intermediate"],
        doc="int: MLP hidden width, the rows of up_proj.weight.",
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
            Every keyword option of the constructor (``weights`` is not included), resolved:
            ``n_kv_heads``, ``head_dim`` and ``rope_dim`` as ints; ``rope_scaling`` a copy.
        """
        return self._public_options()

    # -- states and sessions ------------------------------------------------------------------
    def allocate_state(self, batch_size: int, max_tokens: int) -> TransformerState:
        """Return a zeroed KV cache for ``batch_size`` sequences of up to ``max_tokens`` positions.

        Parameters
        ----------
        batch_size : int
            Rows, in [1, 2**62] (memory is the practical limit).
        max_tokens : int
            Positions each row may hold, in [1, max_positions].

        Returns
        -------
        TransformerState
            ``k_cache``/``v_cache`` of shape (batch_size, n_kv_heads, capacity, head_dim),
            capacity = max_tokens (min(window, max_tokens) with a window), all +0.0;
            ``row_tokens`` zeros; the block's fingerprint. Memory:
            2 * batch_size * n_kv_heads * capacity * head_dim * 4 bytes.

        Raises
        ------
        TypeError
            A non-int argument.
        ValueError
            An argument < 1, batch_size > 2**62, or max_tokens > max_positions.
        MemoryError
            The buffers cannot be allocated; the message gives the bytes asked for.
        """
        where = f"{_CLS}.allocate_state"
        impl = self._impl
        b = check_int(batch_size, "batch_size", where, min_value=1, max_value=_MAX_BATCH)
        m = check_int(max_tokens, "max_tokens", where, min_value=1, max_value=MAX_POSITIONS_LIMIT)
        if m > impl.opts["max_positions"]:
            raise ValueError(
                f"{where}: max_tokens={m} exceeds max_positions="
                f"{impl.opts['max_positions']} of the block (raise max_positions, "
                "up to 2**24, with set_params or at construction)"
            )
        kv, hd, w = impl.opts["n_kv_heads"], impl.opts["head_dim"], impl.opts["window"]
        cap = min(w, m) if w > 0 else m
        nbytes = 2 * b * kv * cap * hd * 4 + 8 * b
        try:
            if nbytes > sys.maxsize:
                raise MemoryError
            return TransformerState._make(
                _PRIVATE,
                batch_size=b,
                n_kv_heads=kv,
                head_dim=hd,
                max_tokens=m,
                window=w,
                fingerprint=impl.fingerprint,
            )
        except MemoryError:
            raise MemoryError(
                f"{where}: cannot allocate a state of batch_size={b}, max_tokens={m}: k_cache "
                f"and v_cache of shape {format_shape((b, kv, cap, hd))} float32 plus row_tokens "
                f"need {nbytes} bytes ({nbytes / 2**30:.3g} GiB)"
            ) from None

    def decode_session(self, state: TransformerState):
        """Open an exclusive decode session working in place on ``state``.

        Parameters
        ----------
        state : TransformerState
            A state of this block (same fingerprint), not claimed by another open session.

        Returns
        -------
        TransformerDecodeSession
            Holds the claim until ``close()``, ``discard()``, the end of a ``with`` block or its
            garbage collection.

        Raises
        ------
        TypeError
            ``state`` is None or not a TransformerState.
        ValueError
            The state belongs to another block, or is claimed by an open session.
        """
        where = f"{_CLS}.decode_session"
        if not isinstance(state, TransformerState):
            raise _state_type_error(where, state)
        self._check_fingerprint(self._impl, state, where)
        return TransformerDecodeSession._open_claim(self, state, where)

    # -- calls --------------------------------------------------------------------------------
    def forward(self, x, state: TransformerState | None = None, *, lengths=None) -> np.ndarray:
        """Run the block on ``x``; with a state, advance each row by its real tokens.

        Parameters
        ----------
        x : buffer of shape (batch, n_tokens, d_model), dtype float32
            Any float32 buffer (NumPy array, memoryview, ...); never written. Non-contiguous
            input is copied once (bytes only).
        state : TransformerState or None, default=None
            None: every row starts at position 0 with an empty cache used for this call only
            (then n_tokens <= max_positions).
            Otherwise a state of this block with ``batch_size == batch``; row b's tokens take
            positions ``row_tokens[b] .. row_tokens[b] + n_b - 1`` and ``row_tokens[b] += n_b``.
        lengths : None, sequence of int or 1-D integer array, default=None
            Real tokens per row ``n_b`` in [0, n_tokens]; ``x[b, n_b:]`` is padding, never read.

        Returns
        -------
        ndarray of shape (batch, n_tokens, d_model), dtype float32
            Fresh, C-contiguous; padding positions are exactly +0.0.

        Raises
        ------
        TypeError
            ``x`` not a float32 buffer; ``state`` not a TransformerState; bad ``lengths`` type.
        ValueError
            Wrong shape of ``x``; NaN/inf in a real position of ``x`` (index and value);
            bad ``lengths`` count or range; a state of another block or batch size, claimed by an
            open session, with ``row_tokens`` outside [0, max_tokens], with non-finite readable
            slots, or without room (row, held, asked, limit); positions >= max_positions (without
            a state: n_tokens > max_positions, whatever ``lengths``); a state buffer reshaped,
            retyped, made read-only or replaced in place (checked before anything is written).
        RuntimeError
            The state is in use by another call.
        MemoryError
            The output or the scratch cannot be allocated (the message names the call and
            the bytes); the state is unchanged and the scratch grown so far is released.

        Notes
        -----
        Every check completes before the state is touched; the native computation runs with the
        GIL released and writes the cache, then ``row_tokens``, in one step: an exception
        raised into the call (Ctrl-C, a signal handler) leaves the state wholly before or
        wholly after the call (SPEC.md 2.5). Output bits depend only on each row's own tokens
        and starting state (SPEC.md 3.1).
        """
        return self._call(x, state, lengths, f"{_CLS}.forward", step=False, session=None)

    __call__ = forward

    def step(self, x, state: TransformerState) -> np.ndarray:
        """Advance every row of ``state`` by one token and return the block output.

        Parameters
        ----------
        x : buffer of shape (batch, d_model) or (batch, 1, d_model), dtype float32
            One token per row.
        state : TransformerState
            Required; as in :meth:`forward`.

        Returns
        -------
        ndarray of shape (batch, 1, d_model), dtype float32
            Bitwise equal to ``forward(x, state)`` with one token.

        Raises
        ------
        TypeError
            ``state`` is None or not a TransformerState; ``x`` not a float32 buffer.
        ValueError
            As in :meth:`forward`; also ``x`` with n_tokens != 1.
        RuntimeError
            The state is in use by another call.
        """
        return self._call(x, state, None, f"{_CLS}.step", step=True, session=None)

    # -- internals ----------------------------------------------------------------------------
    def _call(self, x, state, lengths, where: str, *, step: bool, session) -> np.ndarray:
        impl = self._impl  # one snapshot: set_params swaps configurations atomically
        xa, lens = self._check_call_inputs(
            x,
            state,
            lengths,
            where,
            step=step,
            d_model=impl.sizes["d_model"],
            state_cls=TransformerState,
            type_error=_state_type_error,
            alloc_call="allocate_state(batch_size, max_tokens)",
        )
        bsz, n_tok, _ = xa.shape
        core = impl.core
        opts = impl.opts
        max_pos = opts["max_positions"]

        if state is None:
            # SPEC.md 4.5: a state-less call needs L <= max_positions, whatever the lengths.
            if n_tok > max_pos:
                raise ValueError(
                    f"{where}: x has {n_tok} tokens per row (shape "
                    f"{format_shape(xa.shape)}); without a state every row starts "
                    f"at position 0, and the limit is max_positions={max_pos} "
                    "tokens (raise max_positions, up to 2**24)"
                )
            # Capacity 0: no cache is read (every row starts at 0) or kept, so no scratch
            # cache is allocated (and page-faulted) per call.
            shape = (bsz, opts["n_kv_heads"], 0, opts["head_dim"])
            k = np.zeros(shape, np.float32)
            v = np.zeros(shape, np.float32)
            try:
                return core.forward(xa, lens, np.zeros(bsz, np.int64), k, v)
            except MemoryError as exc:
                raise self._memory_error(where, exc, None) from None

        self._check_state_fits(impl, state, xa, where)
        owner = state._open_session()
        if owner is not None and owner is not session:
            raise ValueError(
                f"{where}: state is claimed by an open decode session {owner!r}; "
                "call the session's step/forward, or close it first"
            )
        with self._claim_state(state, where):
            start = _check_counters(state, where)
            for b in range(bsz):
                held, asked = int(start[b]), int(lens[b])
                limit = min(state.max_tokens, max_pos)
                if held + asked > limit:
                    which = "max_tokens" if state.max_tokens <= max_pos else "max_positions"
                    if held + asked <= max_pos:
                        hint = f"create the state with max_tokens >= {held + asked}"
                    elif held + asked <= MAX_POSITIONS_LIMIT:
                        hint = (
                            f"build the block with max_positions >= {held + asked} and the "
                            f"state with max_tokens >= {held + asked}"
                        )
                    else:
                        hint = (
                            f"positions stop at {MAX_POSITIONS_LIMIT} (2^24); start a new "
                            "sequence or roll back row_tokens"
                        )
                    raise ValueError(
                        f"{where}: row {b} holds {held} positions and this call adds {asked}; "
                        f"the limit is {which}={limit} ({hint})"
                    )
            ws = session._workspace if session is not None else None
            # The native call checks the slots each row reads (SPEC 5) as it reads them, and
            # returns None before writing anything when one is not finite; the Python check
            # then names the first such element (the same rule, so it always finds one).
            # The native call also sets row_tokens = start + lens once the cache is written, in
            # the same native step: an interrupt arrives before the call (nothing changed) or
            # after it (the call completed), never between the buffers and the counters.
            try:
                y = core.forward(
                    xa,
                    lens,
                    start,
                    state.k_cache,
                    state.v_cache,
                    ws,
                    check_cache=True,
                    row_tokens=state.row_tokens,
                )
            except MemoryError as exc:
                raise self._memory_error(where, exc, state) from None
            if y is None:
                _check_readable(state, start, lens, where)
                raise RuntimeError(
                    f"{where}: internal error: the native cache check failed "
                    "but no non-finite slot was found"
                )
        return y


install(TransformerBlockInference, OPTIONS)
