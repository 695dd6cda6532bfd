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
from .._state import PRIVATE_TOKEN
from .._validation import check_int, format_shape
from .._weights import canonical_copy, check_weight, packed_layout, resolve_names
from .config import (
    DENSE_OPTIONS,
    MAX_POSITIONS_LIMIT,
    OPTIONS,
    check_options,
    core_config,
    resolve,
    rope_set_for,
)
from .moe import is_moe
from .session import TransformerDecodeSession
from .state import TransformerState, _check_counters, _check_readable, _state_type_error
from .weights import HF_PREFIXES, SHORT_TO_HF, check_names, check_shapes, fold_spellings

__all__ = ["TransformerBlockInference"]

_CLS = "TransformerBlockInference"
_MAX_BATCH = 1 << 62  # allocate_state's batch_size; memory is the real limit (MemoryError)
# The core's packed matrices (weight_storage names) and the tensors stacked into each, in order.
_PACKED = (
    ("qkv_proj", ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
    ("o_proj", ("o_proj.weight",)),
    ("gate_up_proj", ("gate_proj.weight", "up_proj.weight")),
    ("down_proj", ("down_proj.weight",)),
)


def _build(raw: dict, where: str, weights=None, canonical=None):
    """Check everything, copy the weights, build the core. Nothing observable changes on error.

    ``weights`` is the user's dict (any spelling); ``canonical`` instead reuses the private,
    read-only, checked copies of an existing configuration (``set_params``, unpickling).
    """
    o = check_options(raw, where)
    if canonical is None:
        folded, origin = fold_spellings(weights, o, where)  # fused / other HF spellings
        by_short, user_key, _ = resolve_names(folded, where, SHORT_TO_HF, HF_PREFIXES)
        user_key = {n: origin.get(k, k) for n, k in user_key.items()}
    else:
        by_short, user_key = canonical, {k: k for k in canonical}

    def spell(n):  # the name as the user spelled it (short for a missing tensor)
        return user_key.get(n, n)

    check_names(by_short, o, spell, where)
    arrs = {n: check_weight(v, f"weights[{spell(n)!r}]", where) for n, v in by_short.items()}
    sizes = check_shapes(arrs, o, spell, where)
    core_mod = _ext.core()
    opts = resolve(o, sizes, core_mod, where)
    if canonical is None:
        weights_c = {n: canonical_copy(a, f"weights[{spell(n)!r}]", where) for n, a in arrs.items()}
    else:
        weights_c = arrs  # the canonical ones: private, read-only and checked finite
    return make_impl(
        _CLS,
        OPTIONS if is_moe(opts) else DENSE_OPTIONS,  # a dense block's fingerprint is unchanged
        raw,
        opts,
        sizes,
        weights_c,
        core_mod,
        core_config(core_mod, opts, sizes),
        core_mod.TransformerCore,
        _moe_layout(arrs, sizes) if is_moe(opts) else packed_layout(_PACKED, arrs),
    )


def _moe_layout(arrs: dict, sizes: dict) -> dict:
    """Where an MoE block's matrices live in the core (ResidentWeights): the attention half's
    as a dense block's, the router, each expert's gate|up and down, the shared expert's. No
    float32 copy of an expert is kept; a lookup rebuilds the stack from the packed experts."""
    out = packed_layout(_PACKED[:2], arrs)
    e, it = arrs["router.weight"].shape[0], sizes["intermediate"]
    out["router.weight"] = ("router", 0, e)
    out["experts.gate_up_proj"] = (tuple(f"experts.{x}.gate_up_proj" for x in range(e)), 0, 2 * it)
    out["experts.down_proj"] = (
        tuple(f"experts.{x}.down_proj" for x in range(e)),
        0,
        sizes["d_model"],
    )
    sit = sizes.get("shared_intermediate", 0)
    if sit:
        out["shared_expert.gate_proj.weight"] = ("shared_expert.gate_up_proj", 0, sit)
        out["shared_expert.up_proj.weight"] = ("shared_expert.gate_up_proj", sit, 2 * sit)
        out["shared_expert.down_proj.weight"] = ("shared_expert.down_proj", 0, sizes["d_model"])
        out["shared_expert_gate.weight"] = ("shared_expert_gate", 0, 1)
    return out


class TransformerBlockInference(BlockCommon):
    """One decoder block (attention + MLP, or one half), bit-exact float32 inference on the CPU.

    Computes HF ``LlamaDecoderLayer.forward`` (transformers 5.x) and the decoder layers of the
    families below, selected by the options, with a fixed sequence of binary32 operations per
    output element (SPEC.md 3), so that ``step`` == ``forward`` == any chunking, a ragged row ==
    that row alone, and 1 thread == N threads, bit for bit. Covered HF layer classes (SPEC.md
    4.1): Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3 (text), StableLm (incl.
    StableLM 2 12B parallel), Starcoder2, OLMo 2, SmolLM3 (RoPE and NoPE layers), Granite, Phi3
    (fused projections, longrope), Llama with yarn, the attention and MLP blocks of Nemotron-H
    and the dense layers of GraniteMoeHybrid (Granite-4.0-H; its Mamba layers' mixer is
    :class:`Mamba2BlockInference`), and the MoE layers of Qwen3-MoE, Qwen2-MoE (shared expert),
    OLMoE and Mixtral (SPEC.md 4.8). Not covered: GraniteMoe and Nemotron-H expert layers,
    Falcon-H1's parallel hybrid, Zamba2's shared block.

    Parameters
    ----------
    weights : Mapping of str to float32 buffer
        In torch's [out, in] layout, with the short names (``'q_proj.weight'``, ...) or the HF
        layer names (the keys of the HF decoder layer's ``state_dict()``,
        ``'self_attn.q_proj.weight'``, ``'mlp.up_proj.weight'``, ...). With QW =
        n_heads*head_dim, KW = n_kv_heads*head_dim, IT = rows of up_proj.weight, d = d_model =
        the length of the first block norm weight:

        - block norms, (d,) each [``.bias`` (d,) with norm_bias], by ``norm_placement``:
          'pre' ``input_layernorm`` (attention input), ``post_attention_layernorm`` (MLP
          input); 'sandwich' ``input_layernorm``, ``post_attention_layernorm`` (attention
          output), ``pre_feedforward_layernorm``, ``post_feedforward_layernorm`` (MLP output);
          'post' ``post_attention_layernorm``, ``post_feedforward_layernorm``; 'parallel'
          ``input_layernorm`` only. A half block has its half's norms; a pre-norm half block's
          single norm may also be named ``norm.weight`` (Nemotron-H's name), which means
          ``input_layernorm.weight`` for block_parts='attention' and
          ``post_attention_layernorm.weight`` for block_parts='mlp'.
        - attention half: ``q_proj.weight`` (QW, d), ``k_proj.weight``, ``v_proj.weight``
          (KW, d) [``.bias`` with qkv_bias]; ``o_proj.weight`` (d, QW) [``.bias`` (d,) with
          o_bias]; ``q_norm.weight``, ``k_norm.weight`` with qk_norm, shaped by qk_norm_scope.
          Phi-3's fused ``qkv_proj.weight`` (HF ``self_attn.qkv_proj.weight``) is accepted
          instead of q/k/v and split by rows: q (QW rows), then k (KW), then v (KW).
        - MLP half: ``gate_proj.weight`` (IT, d) for gated MLPs; ``up_proj.weight`` (IT, d);
          ``down_proj.weight`` (d, IT) [biases with mlp_bias]. Phi-3's fused
          ``gate_up_proj.weight`` (HF ``mlp.gate_up_proj.weight``, 2*IT rows) is accepted
          instead of gate/up and split: gate = the first IT rows, up = the last IT rows.
        - Also accepted: Nemotron-H's ``mixer.*`` names, GraniteMoeHybrid's
          ``shared_mlp.input_linear.weight`` (fused gate/up as above) and
          ``shared_mlp.output_linear.weight`` (down_proj), StableLM's per-head
          ``self_attn.q_layernorm.norms.N.weight`` (stacked into q_norm, N = 0 .. n-1).

        A tensor is given once (never both fused and split names). The key set must be exact: a
        layer is never built from a subset of its weights, and a dict carrying another layer
        shape's names is refused with the architecture it looks like and the option to pass.
        Arrays are copied (editing them later has no effect) and never written.
    n_heads : int or None, default=None
        Query heads (HF ``num_attention_heads``), in [1, 2**24]. Required, except for
        block_parts='mlp', which has no attention and takes None (TypeError otherwise).
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
        HF ``rope_scaling`` / ``rope_parameters`` with HF's key names (legacy key ``'type'``
        accepted; original_max_position_embeddings an int in [1, 2**24]):
        ``{'rope_type': 'default'}``; ``{'rope_type': 'linear', 'factor'}``;
        ``{'rope_type': 'llama3', 'factor', 'low_freq_factor', 'high_freq_factor',
        'original_max_position_embeddings'}``; ``{'rope_type': 'yarn', 'factor',
        'original_max_position_embeddings'}`` with optional ``'beta_fast'`` (default 32),
        ``'beta_slow'`` (1), ``'mscale'``, ``'mscale_all_dim'`` (used when both are given and
        nonzero), ``'attention_factor'`` (default derived from factor and the mscales) and
        ``'truncate'`` (bool, default True); ``{'rope_type': 'longrope', 'short_factor',
        'long_factor', 'original_max_position_embeddings'}`` (two lists of rope_dim/2 reals
        > 0; original >= 2) with optional ``'factor'`` and ``'attention_factor'``. HF's
        derivations (``transformers/modeling_rope_utils.py``): where longrope (or yarn) gives no
        factor, HF uses ``max_position_embeddings / original_max_position_embeddings``; here
        ``max_positions`` plays the role of max_position_embeddings. Optional keys may be None
        (= not given). Longrope picks its factor set per state: see :meth:`allocate_state`.
        Extra keys allowed: ``'rope_theta'`` (must equal rope_theta) and
        ``'partial_rotary_factor'``: with rope_dim=None it gives ``rope_dim = int(head_dim *
        partial_rotary_factor)`` (HF StableLM ``rotary_ndims``, Phi-3), which must be even and
        in [2, head_dim]; with rope_dim given the two must agree.
    rope_dim : int or None, default=None
        Rotate the first rope_dim dims of each head (even, in [2, head_dim]); 0 = no RoPE at all
        (SmolLM3's NoPE layers, Nemotron-H and Granite-4.0-H attention; rope_theta and
        rope_scaling are then checked but unused); None = derived from
        ``rope_scaling['partial_rotary_factor']`` when present, else head_dim.
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
        LayerNorm biases of the block norms; needs norm='layernorm'.
    mlp : {'swiglu', 'geglu', 'geglu_tanh', 'gelu', 'gelu_tanh', 'relu2'}, default='swiglu'
        Gated ``down(act(gate) * up)`` with silu / erf-GELU / tanh-GELU, or ungated
        ``down(act(up))`` with erf-GELU / tanh-GELU / squared ReLU (``relu2``, Nemotron-H).
    mlp_bias : bool, default=False
        Biases on up, down and (gated) gate.
    qk_norm : bool, default=False
        Norms of q and k before RoPE, of the block norm's kind and eps, without bias (Qwen3,
        Gemma 3, OLMo 2, StableLM ``qk_layernorm``).
    qk_norm_scope : {'head', 'all_heads', 'per_head_weights'}, default='head'
        With qk_norm: 'head' normalises each head over head_dim with one (head_dim,) weight
        shared by the heads (Qwen3, Gemma 3); 'all_heads' normalises q over all
        n_heads*head_dim values with q_norm.weight (QW,) and k over n_kv_heads*head_dim with
        k_norm.weight (KW,) (OLMo 2); 'per_head_weights' normalises each head over head_dim
        with its own row of q_norm.weight (n_heads, head_dim) / k_norm.weight (n_kv_heads,
        head_dim) (StableLM's per-head LayerNorm). Other than 'head' needs qk_norm=True.
    attn_softcap : float or None, default=None
        Scores s -> cap * tanh(s / cap) before the mask (Gemma2), > 0, used as float32: it must
        round to a positive finite float32 (about [1.4e-45, 3.4028235e38]).
    query_pre_attn_scalar : float or None, default=None
        Gemma 2/3: scores are scaled by ``query_pre_attn_scalar**-0.5`` instead of
        ``head_dim**-0.5``, computed in binary64 as ``1 / sqrt(q)`` and rounded to float32 once.
        Real > 0. Not together with attn_scale.
    attn_scale : float or None, default=None
        The score scale itself (Granite ``attention_multiplier``), real > 0 rounded to float32
        once (it must round to a positive finite float32); None = head_dim**-0.5 (or
        query_pre_attn_scalar's). Not together with query_pre_attn_scalar.
    residual_multiplier : float, default=1.0
        Both residual adds become ``x + branch * m`` (Granite ``residual_multiplier``; float32
        m, a multiply then an add); the branch is taken after its post norm if any. Real > 0,
        rounding to a positive finite float32; 1.0 adds without the multiply.
    norm_placement : {'pre', 'sandwich', 'post', 'parallel'}, default='pre'
        'pre': ``x1 = x + attn(N_in(x))``, ``y = x1 + mlp(N_pa(x1))`` (Llama).
        'sandwich' (Gemma 2/3): ``x1 = x + N_pa(attn(N_in(x)))``,
        ``y = x1 + N_pf(mlp(N_ff(x1)))`` with N_ff = pre_feedforward_layernorm, N_pf =
        post_feedforward_layernorm. 'post' (OLMo 2): ``x1 = x + N_pa(attn(x))``,
        ``y = x1 + N_pf(mlp(x1))``, no input norm. 'parallel' (StableLM 2 12B
        ``use_parallel_residual``, one norm; full blocks only; GPT-NeoX's two-norm form is
        not covered): ``h = N_in(x)``, ``y = (x + attn(h)) + mlp(h)``.
    block_parts : {'full', 'attention', 'mlp'}, default='full'
        'full' = attention then MLP. 'attention' = the attention half only, with its norm(s)
        and residual (Nemotron-H attention blocks; Granite-4.0-H attention); no MLP weights,
        intermediate = 0. 'mlp' = the MLP half only, ``y = x + mlp(N(x))`` (Nemotron-H MLP
        blocks; the dense MLP half of a Granite-4.0-H layer after its Mamba-2 mixer): no
        attention weights or options (n_heads, n_kv_heads, head_dim, rope_dim stay None), an
        empty cache (its state only counts positions). Attention options on an MLP half and
        MLP options on an attention half are refused.
    numeric_profile : {None, 'fp32'}, default=None
        float32 weights and arithmetic (the only profile in v1).
    num_experts : int, default=0
        0 = the dense MLP; E >= 1: the MLP half is a mixture of E experts (SPEC.md 4.8): a
        router ``router.weight`` (E, d) (HF ``mlp.gate.weight``), softmax, the top
        ``num_experts_per_tok`` (equal values: the lower expert index first), each a gated
        ``mlp`` without biases whose [gate; up] rows are ``experts.gate_up_proj`` (E, 2*IT, d)
        and down ``experts.down_proj`` (E, d, IT) (HF ``mlp.experts.*``, transformers 5's
        stacking); the outputs summed weighted in increasing expert index. Only the chosen
        experts run, each on the tokens that chose it. gate/up/down_proj are then absent.
    num_experts_per_tok : int or None, default=None
        Experts chosen per token, in [1, num_experts] (required with num_experts).
    norm_topk_prob : bool, default=False
        Divide the chosen experts' weights by their sum (Qwen2/3-MoE, OLMoE option; Mixtral
        always).
    shared_expert : bool, default=False
        A gated MLP on every token (``shared_expert.{gate,up,down}_proj.weight``, (SIT, d) /
        (d, SIT)), added as ``sigmoid(shared_expert_gate.weight @ h) * shared(h)`` (Qwen2-MoE).

    Attributes
    ----------
    d_model, n_heads, n_kv_heads, head_dim, intermediate, window, rope_theta, rope_scaling,
    rope_dim, max_positions, qkv_bias, o_bias, norm, norm_eps, norm_bias, mlp, mlp_bias, qk_norm,
    qk_norm_scope, attn_softcap, query_pre_attn_scalar, attn_scale, residual_multiplier,
    norm_placement, block_parts, numeric_profile, num_experts, num_experts_per_tok,
    norm_topk_prob, shared_expert : read-only
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
    Per row and real position p (SPEC.md 4.3, HF ``LlamaDecoderLayer`` order, pre placement):
    ``h = N_in(x)``; ``q, k, v = Wq h, Wk h, Wv h`` (+biases); optional q/k norm; RoPE at p
    (rotate_half layout, RoFormer); k, v of p go to the state; attention over the window with
    scale ``head_dim**-0.5`` (float32; or query_pre_attn_scalar's / attn_scale), optional
    softcap, two-pass softmax; ``x1 = x + Wo o``; ``y = x1 + Wd act(Wg N_post(x1)) *
    (Wu N_post(x1))`` (gated) or ``x1 + Wd act(Wu ...)``. The other placements, half blocks
    and the residual multiplier: SPEC.md 4.7.
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
        doc="int: Residual width, the length of the block norm weights.",
    )
    intermediate = property(
        lambda self: self._impl.sizes["intermediate"],
        doc="int: MLP hidden width, the rows of up_proj.weight (0 for block_parts='attention').",
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
            ``n_kv_heads``, ``head_dim`` and ``rope_dim`` as ints (None for
            block_parts='mlp'); ``rope_scaling`` a copy.
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
            2 * batch_size * n_kv_heads * capacity * head_dim * 4 bytes (none for
            block_parts='mlp': n_kv_heads = head_dim = 0 there). With longrope the state also
            fixes its factor set for its whole life, ``rope_factors``: 'long' when max_tokens
            > ``original_max_position_embeddings``, else 'short'; every call with the state
            rotates with that set (a state-less ``forward`` of L tokens uses the set of
            ``allocate_state(B, L)``). HF picks the set by the current sequence length, so
            exactblocks matches HF whenever a sequence stays on one side of the switch, and
            decode == prefill always holds.

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
        kv, hd, cap, nbytes = self._state_size(b, m)
        w = impl.opts["window"]
        try:
            if nbytes > sys.maxsize:
                raise MemoryError
            return TransformerState._make(
                PRIVATE_TOKEN,
                batch_size=b,
                n_kv_heads=kv,
                head_dim=hd,
                max_tokens=m,
                window=w,
                fingerprint=impl.fp,  # the object: its state is recognised by identity
                rope_factors=rope_set_for(impl.opts, m),
            )
        except MemoryError:
            raise MemoryError(
                f"{where}: cannot allocate a state of batch_size={b}, max_tokens={m}: k_cache "
                f"and v_cache of shape {format_shape((b, kv, cap, hd))} float32 plus row_tokens "
                f"need {nbytes} bytes ({nbytes / 2**30:.3g} GiB)"
            ) from None

    def _state_size(self, b: int, m: int) -> tuple:
        """``(n_kv_heads, head_dim, capacity, nbytes)`` of a state of ``b`` rows and
        ``max_tokens=m``: nbytes of k_cache, v_cache and row_tokens."""
        # an MLP-only block keeps no keys or values: (B, 0, cap, 0) buffers, counters only
        opts = self._impl.opts
        kv, hd = opts["n_kv_heads"] or 0, opts["head_dim"] or 0
        w = opts["window"]
        cap = min(w, m) if w > 0 else m
        return kv, hd, cap, 2 * b * kv * cap * hd * 4 + 8 * b

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
        wholly after the call (SPEC.md 2.5). A long call on the main thread polls for pending
        signals about every 20 ms: a handler that raises (KeyboardInterrupt, a timeout) stops
        it within about 100 ms, with the state exactly as before the call. Output bits depend
        only on each row's own tokens and starting state (SPEC.md 3.1).
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
    def _model_call(self, x, state, lengths, *, step: bool, session, undo) -> np.ndarray:
        """This block as one layer of a ``Model`` call: ``step`` / ``forward`` (through the
        model's decode session when given), saving the cache slots it overwrites into ``undo``
        (the model state's log, rolled back if a later layer fails)."""
        where = f"{_CLS}.{'step' if step else 'forward'}"
        if session is not None:
            session._check_open(where)
        return self._call(x, state, lengths, where, step=step, session=session, undo=undo)

    def _call(self, x, state, lengths, where: str, *, step: bool, session, undo=None):
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
            shape = (bsz, opts["n_kv_heads"] or 0, 0, opts["head_dim"] or 0)
            k = np.zeros(shape, np.float32)
            v = np.zeros(shape, np.float32)
            # longrope: the set of a fresh allocate_state(B, L) (long iff L > original max)
            rope_set = int(rope_set_for(opts, n_tok) == "long")
            try:
                return core.forward(xa, lens, np.zeros(bsz, np.int64), k, v, rope_set=rope_set)
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
                    rope_set=int(state.rope_factors == "long"),  # longrope: the state's set
                    row_tokens=state.row_tokens,
                    undo=undo,
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
