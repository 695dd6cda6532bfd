"""NumPy float64 reference of one Transformer decoder block (SPEC.md 4.3 and 4.4).

`transformer_ref` computes the block of `exactblocks.TransformerBlockInference` for any
option set, on one row of tokens, optionally continuing from a cache of earlier positions.
Every value is float64, except the two quantities the contract itself defines in binary32
(SPEC 4.4): the RoPE inverse frequencies (computed in binary64, rounded to float32 once) and
the RoPE angle `float32(p) * inv_freq` (one binary32 multiply). The attention scale is the
float32 nearest to head_dim**-0.5, as in SPEC 4.3 step 6. So the reference differs from an
exact evaluation of the contract only by float64 rounding (about 1e-16 relative).

Alongside the output it estimates, for every output element, the standard deviation sigma
of the rounding error that a binary32 evaluation of the block makes (statistical rounding-error
analysis in the style of Higham and Mary, "A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 41(5), 2019): every binary32 rounding is modelled as an
independent, zero-mean relative error delta with |delta| <= u = 2**-24 (variance u**2 / 3), and
variances are propagated to first order (|f'|**2 times the input variance, summed over inputs)
through each step of SPEC 4.3, plus the local rounding variance of the step:

- a sum or dot of K terms t_k with running sums s_k (any order of comparable shape):
  (u**2 / 3) * (sum_k s_k**2 + sum_k t_k**2) (each running sum and each product rounded once);
- an elementwise routine within 1 ulp: (2 u v)**2 for its value v; exp, tanh, erf, sin, cos;
- RoPE angles: (2 u |angle| |rotated value|)**2, which covers an oracle whose inv_freq is 1 ulp
  off the contract's (HF computes it with a float32 ``pow``; measured <= 1 ulp);
- 1 + erf and 1 + tanh in the GELUs: the routine's 1-ulp error stays absolute, (u g)**2.

A worst-case componentwise bound (Higham, "Accuracy and Stability of Numerical Algorithms",
3.1) compounds a factor of about sqrt(K) per matrix product; through the seven reductions of a
block it is some 1e5 times larger than the errors observed at test sizes and catches nothing,
which is why the statistical model is used. `error_bound` turns sigma into a tolerance
``lam * sigma``: for an error made of many independent roundings (near Gaussian), |err| > 8 sigma
has probability about 1e-15 per element. Measured on the oracle cases (d_model 64-128, L <= 30):
HF float32 and exactblocks both stay below 0.37 of 8 sigma, typically 2 sigma at most; an eps
of 1e-5 instead of 1e-6 exceeds it 7-fold, a bias off by 1e-4 128-fold.

Inputs x and weights are taken as exact (they are binary32 values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

U32 = 2.0**-24  # unit roundoff of binary32, round to nearest

_NORMS = ("rmsnorm", "layernorm", "rmsnorm_offset")
_MLPS = ("swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh")
_GATED = {"swiglu": True, "geglu": True, "geglu_tanh": True, "gelu": False, "gelu_tanh": False}
_ACT_OF_MLP = {
    "swiglu": "silu",
    "geglu": "gelu",
    "geglu_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gelu_tanh": "gelu_tanh",
}

_R = U32 * U32 / 3.0  # variance of one rounding, relative: delta uniform in [-u, u]
_ULP2 = (2.0 * U32) ** 2  # variance bound of a 1-ulp elementwise routine, relative


@dataclass
class RefResult:
    """Output of `transformer_ref`.

    Attributes
    ----------
    y : numpy.ndarray
        (L, d) float64, the block output.
    sigma : numpy.ndarray
        (L, d) float64, the estimated standard deviation of a binary32 evaluation's rounding
        error in each output element (module docstring); see `error_bound`.
    cache : dict
        Every position seen so far, for continuing with ``past=``: ``'k'``, ``'v'``
        (n_kv_heads, P, head_dim) float64 (keys after qk_norm and RoPE, as HF caches them),
        ``'k_var'``, ``'v_var'`` (their error variances, same shapes) and ``'positions'``
        (P,) int64.
    """

    y: np.ndarray
    sigma: np.ndarray
    cache: dict


def error_bound(result: RefResult, lam: float = 8.0) -> np.ndarray:
    """Elementwise tolerance ``lam * sigma`` for a binary32 implementation vs `result.y`.

    Parameters
    ----------
    result : RefResult
        From `transformer_ref`.
    lam : float
        Number of standard deviations; 8 leaves a probability of about 1e-15 per element for
        a near-Gaussian error.

    Returns
    -------
    numpy.ndarray
        (L, d) float64.
    """
    return lam * result.sigma


def short_names(weights) -> dict:
    """Map HF decoder-layer names to SPEC 4.2 short names; float64 copies.

    Parameters
    ----------
    weights : Mapping[str, array_like]
        Short names (``'q_proj.weight'``) or HF layer names (``'self_attn.q_proj.weight'``,
        ``'mlp.up_proj.weight'``), torch [out, in] layout.

    Returns
    -------
    dict[str, numpy.ndarray]
        Short name -> float64 array.

    Raises
    ------
    ValueError
        Two keys map to the same short name.
    """
    out = {}
    for key, val in weights.items():
        name = key
        for prefix in ("self_attn.", "mlp."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        if name in out:
            raise ValueError(f"short_names: two keys map to {name!r}")
        out[name] = np.asarray(val, dtype=np.float64)
    return out


def rope_inv_freq(rope_dim: int, rope_theta: float, rope_scaling=None) -> np.ndarray:
    """RoPE inverse frequencies per SPEC 4.4: binary64, scaled in binary64, rounded once.

    Parameters
    ----------
    rope_dim : int
        Even number of rotated dimensions.
    rope_theta : float
        RoPE base.
    rope_scaling : Mapping or None
        None, or ``{'rope_type' (or 'type'): 'default' | 'linear' | 'llama3', ...}`` with the
        keys of SPEC 4.4 (HF ``_compute_linear_scaling_rope_parameters`` and
        ``_compute_llama3_parameters``).

    Returns
    -------
    numpy.ndarray
        (rope_dim // 2,) float32.

    Raises
    ------
    ValueError
        A rope type the reference does not implement.
    """
    half = rope_dim // 2
    inv = np.array([rope_theta ** (-2.0 * i / rope_dim) for i in range(half)], dtype=np.float64)
    kind = "default"
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(rope_scaling["factor"])
    elif kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old = float(rope_scaling["original_max_position_embeddings"])
        out = np.empty_like(inv)
        for i, f in enumerate(inv):
            lam = 2.0 * math.pi / f
            if lam > old / low:
                out[i] = f / factor
            elif lam < old / high:
                out[i] = f
            else:
                g = (old / lam - low) / (high - low)
                out[i] = (1.0 - g) * f / factor + g * f
        inv = out
    elif kind != "default":
        raise ValueError(f"rope_inv_freq: rope type {kind!r} not in the reference")
    return inv.astype(np.float32)


def rope_angles(positions, inv_freq32: np.ndarray) -> np.ndarray:
    """Angles ``float32(p) * inv_freq`` as one binary32 multiply (SPEC 4.4), as float64.

    Parameters
    ----------
    positions : array_like of int
        (L,) positions, each < 2**24.
    inv_freq32 : numpy.ndarray
        (rope_dim // 2,) float32.

    Returns
    -------
    numpy.ndarray
        (L, rope_dim // 2) float64 holding binary32 values.
    """
    p32 = np.asarray(positions, dtype=np.float32)[:, None]
    return (p32 * inv_freq32[None, :]).astype(np.float32).astype(np.float64)


def _sum_var(terms, axis=-1):
    """Local rounding variance of summing `terms` along `axis` (module docstring)."""
    s = np.cumsum(terms, axis=axis)
    return _R * ((s * s).sum(axis) + (terms * terms).sum(axis))


def _norm(x, var_x, w, b, kind, eps):
    """Norm over the last axis (SPEC 4.3) with its error variance. Returns (y, var_y)."""
    n = x.shape[-1]
    if kind == "layernorm":
        mu = x.mean(-1, keepdims=True)
        var_mu = (var_x.sum(-1, keepdims=True) + _sum_var(x)[..., None]) / (n * n)
        c = x - mu
        var_c = var_x + var_mu + _R * c * c
    else:
        c, var_c = x, var_x
    ss = (c * c).sum(-1, keepdims=True)
    ms = ss / n + eps
    r = 1.0 / np.sqrt(ms)
    # relative variance of r = (ms)^(-1/2): half the relative error of ms, plus sqrt and divide
    var_ss = 4.0 * (c * c * var_c).sum(-1, keepdims=True) + _sum_var(c * c)[..., None]
    rel_r = 0.25 * var_ss / (n * ms) ** 2 + 3.0 * _R
    wf = 1.0 + w if kind == "rmsnorm_offset" else w
    y = (c * r) * wf
    var_y = (wf * r) ** 2 * var_c + y * y * (rel_r + 2.0 * _R)
    if b is not None:
        y = y + b
        var_y = var_y + _R * y * y
    return y, var_y


def _linear(a, var_a, w, b, rows_per_chunk=8, local=True):
    """``a @ w.T + b`` with its error variance (``local=False`` leaves out the sums' own
    rounding, the costly part, for large layers). Returns (y, var_y)."""
    y = a @ w.T
    var_y = var_a @ (w * w).T
    for i in range(0, a.shape[0] if local else 0, rows_per_chunk):
        terms = a[i : i + rows_per_chunk, None, :] * w[None, :, :]
        var_y[i : i + rows_per_chunk] += _sum_var(terms)
    if b is not None:
        y = y + b
        var_y = var_y + _R * y * y
    return y, var_y


def _act(g, kind):
    """Activation value and derivative (float64; HF ACT2FN definitions)."""
    if kind == "silu":
        sg = 1.0 / (1.0 + np.exp(-g))
        return g * sg, sg * (1.0 + g * (1.0 - sg))
    if kind == "gelu":
        erf = np.vectorize(math.erf)(g / math.sqrt(2.0))
        phi = np.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
        return 0.5 * g * (1.0 + erf), 0.5 * (1.0 + erf) + g * phi
    if kind == "gelu_tanh":
        k = math.sqrt(2.0 / math.pi)
        inner = k * (g + 0.044715 * g**3)
        th = np.tanh(inner)
        d_inner = k * (1.0 + 3.0 * 0.044715 * g * g)
        return 0.5 * g * (1.0 + th), 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * d_inner
    raise ValueError(kind)


def _act_var(g, var_g, kind):
    """Activation with its error variance: propagated, 1-ulp routine, 4 roundings."""
    a, da = _act(g, kind)
    var = da * da * var_g + a * a * (_ULP2 + 4.0 * _R)
    if kind != "silu":  # 1 + erf / 1 + tanh: the routine's absolute error survives cancellation
        var = var + (U32 * g) ** 2
    return a, var


def _rope(z, var_z, ang):
    """Rotate the first 2*half dims of z (..., hd) by angles ang (L, half); NeoX pairs."""
    half = ang.shape[-1]
    shape = (ang.shape[0],) + (1,) * (z.ndim - 2) + (half,)
    c = np.cos(ang).reshape(shape)
    s = np.sin(ang).reshape(shape)
    ang = ang.reshape(shape)
    a, b = z[..., :half], z[..., half : 2 * half]
    va, vb = var_z[..., :half], var_z[..., half : 2 * half]
    out, var = z.copy(), var_z.copy()
    a2 = a * c - b * s
    b2 = b * c + a * s
    out[..., :half] = a2
    out[..., half : 2 * half] = b2
    loc_a = (_ULP2 + _R) * ((a * c) ** 2 + (b * s) ** 2) + _R * a2 * a2
    loc_b = (_ULP2 + _R) * ((b * c) ** 2 + (a * s) ** 2) + _R * b2 * b2
    # angle off by <= 2u|angle| (see module docstring): d(a2) = -b2 dθ, d(b2) = a2 dθ
    ang_var = (2.0 * U32 * ang) ** 2
    var[..., :half] = c * c * va + s * s * vb + loc_a + ang_var * b2 * b2
    var[..., half : 2 * half] = c * c * vb + s * s * va + loc_b + ang_var * a2 * a2
    return out, var


def _check_flag(name, given, present):
    if given is not None and bool(given) != present:
        raise ValueError(
            f"transformer_ref: {name}={given} but the weights say {present} "
            "(optional tensors present iff their option is on)"
        )


def transformer_ref(
    weights,
    x,
    positions=None,
    *,
    n_heads,
    n_kv_heads=None,
    head_dim=None,
    window=0,
    rope_theta=10000.0,
    rope_scaling=None,
    rope_dim=None,
    max_positions=None,
    qkv_bias=None,
    o_bias=None,
    norm="rmsnorm",
    norm_eps=1e-6,
    norm_bias=None,
    mlp="swiglu",
    mlp_bias=None,
    qk_norm=False,
    qk_norm_scope="head",
    attn_softcap=None,
    query_pre_attn_scalar=None,
    attn_scale=None,
    residual_multiplier=1.0,
    norm_placement="pre",
    block_parts="full",
    numeric_profile=None,
    past=None,
    sigma=True,
) -> RefResult:
    """Float64 reference of `TransformerBlockInference` for one row (SPEC 4.3, 4.4).

    Takes the block's keyword options by their SPEC 4.1 names, so a test can pass the same
    dict to the block and to the reference. The flags qkv_bias, o_bias, norm_bias, mlp_bias
    may be omitted (None): they are read from which tensors are present; when given they must
    agree with the weights. max_positions and numeric_profile are accepted and ignored.

    Parameters
    ----------
    weights : Mapping[str, array_like]
        SPEC 4.2 tensors, short or HF layer names, [out, in] layout.
    x : array_like
        (L, d_model) inputs of one row, L >= 1.
    positions : None, int or array_like of int
        Absolute positions of the L tokens: None = consecutive from the position after the
        newest one in `past` (0 without `past`); an int = consecutive from it; an array = (L,)
        explicit positions.
    n_heads, n_kv_heads, head_dim, window, rope_theta, rope_scaling, rope_dim : int, float, ...
        As in SPEC 4.1 (None defaults resolved as there).
    norm, norm_eps, mlp, qk_norm, attn_softcap : str, float, str, bool, float or None
        As in SPEC 4.1.
    qkv_bias, o_bias, norm_bias, mlp_bias : bool or None
        Checked against the tensors present when given.
    qk_norm_scope : {'head'}
        Only the default scope is in the reference.
    query_pre_attn_scalar, attn_scale : float or None
        Score scale ``float32(1 / sqrt(query_pre_attn_scalar))`` or ``float32(attn_scale)``
        instead of ``float32(head_dim**-0.5)`` (SPEC 4.7).
    residual_multiplier : float
        Both residual adds are ``x + branch * float32(m)`` (SPEC 4.7).
    norm_placement : {'pre', 'sandwich', 'post', 'parallel'}
        Where the block norms sit (SPEC 4.7; pre_feedforward_layernorm and
        post_feedforward_layernorm weights for sandwich / post).
    block_parts : {'full'}
        Only full blocks are in the reference.
    max_positions, numeric_profile
        Ignored (accepted so the block's option dict can be passed as is).
    sigma : bool
        False skips the matrix products' own rounding terms in ``sigma`` (the costly part of
        the error model; ``sigma`` is then a lower estimate), for real-model sizes.
    past : dict or None
        A previous `RefResult.cache`: keys/values of earlier positions. A query at position p
        attends to every held or new key j with j <= p (and j > p - window if window > 0),
        in increasing position.

    Returns
    -------
    RefResult
        y (L, d) float64, its error sigma and the extended cache.

    Raises
    ------
    ValueError
        Unknown norm/mlp, flags that contradict the weights, inconsistent shapes.
    """
    w = short_names(weights)
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"transformer_ref: x must be (L, d), got {x.shape}")
    n_tok, d = x.shape
    if norm not in _NORMS or mlp not in _MLPS:
        raise ValueError(f"transformer_ref: norm={norm!r} / mlp={mlp!r} unknown")
    gated = _GATED[mlp]
    _check_flag("qkv_bias", qkv_bias, "q_proj.bias" in w)
    _check_flag("o_bias", o_bias, "o_proj.bias" in w)
    if block_parts != "full" or qk_norm_scope != "head":
        raise ValueError("transformer_ref: only full blocks with qk_norm_scope='head'")
    if norm_placement not in ("pre", "sandwich", "post", "parallel"):
        raise ValueError(f"transformer_ref: norm_placement={norm_placement!r} unknown")
    _check_flag(
        "norm_bias",
        norm_bias,
        any(k.endswith("layernorm.bias") for k in w),
    )
    _check_flag("mlp_bias", mlp_bias, "up_proj.bias" in w)
    _check_flag("qk_norm", qk_norm, "q_norm.weight" in w)
    if ("gate_proj.weight" in w) != gated:
        raise ValueError(f"transformer_ref: gate_proj presence does not match mlp={mlp!r}")
    for k in w:
        if k.endswith("layernorm.weight") and w[k].shape != (d,):
            raise ValueError(f"transformer_ref: {k} length != x.shape[1]")

    qw = w["q_proj.weight"].shape[0]
    if head_dim is None:
        head_dim = qw // n_heads
    if n_kv_heads is None:
        n_kv_heads = w["k_proj.weight"].shape[0] // head_dim
    if qw != n_heads * head_dim or w["k_proj.weight"].shape[0] != n_kv_heads * head_dim:
        raise ValueError("transformer_ref: q/k rows do not match n_heads/n_kv_heads*head_dim")
    if rope_dim is None:
        rope_dim = head_dim
    m_res = float(np.float32(residual_multiplier))
    n_rep = n_heads // n_kv_heads

    # Positions.
    if past is not None:
        past_pos = np.asarray(past["positions"], dtype=np.int64)
        start_default = int(past_pos[-1]) + 1 if past_pos.size else 0
    else:
        past_pos = np.zeros(0, dtype=np.int64)
        start_default = 0
    if positions is None:
        pos = np.arange(n_tok, dtype=np.int64) + start_default
    elif np.ndim(positions) == 0:
        pos = np.arange(n_tok, dtype=np.int64) + int(positions)
    else:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.shape != (n_tok,):
            raise ValueError(f"transformer_ref: positions shape {pos.shape} != ({n_tok},)")

    get = w.get

    def block_norm(name, a, var_a):
        return _norm(a, var_a, w[f"{name}.weight"], get(f"{name}.bias"), norm, norm_eps)

    def residual(base, var_base, branch, var_branch):
        if m_res != 1.0:
            branch = branch * m_res
            var_branch = var_branch * m_res**2 + _R * branch * branch
        out = base + branch
        return out, var_base + var_branch + _R * out * out

    # 1. input norm (x is exact: variance 0)
    if norm_placement == "post":
        h, var_h = x, np.zeros_like(x)
    else:
        h, var_h = block_norm("input_layernorm", x, np.zeros_like(x))
    # 2. projections
    q, var_q = _linear(h, var_h, w["q_proj.weight"], get("q_proj.bias"), local=sigma)
    k, var_k = _linear(h, var_h, w["k_proj.weight"], get("k_proj.bias"), local=sigma)
    v, var_v = _linear(h, var_h, w["v_proj.weight"], get("v_proj.bias"), local=sigma)
    q, var_q = (a.reshape(n_tok, n_heads, head_dim) for a in (q, var_q))
    k, var_k = (a.reshape(n_tok, n_kv_heads, head_dim) for a in (k, var_k))
    v, var_v = (a.reshape(n_tok, n_kv_heads, head_dim) for a in (v, var_v))
    # 3. qk norm (kind and eps of the block norm)
    if qk_norm:
        q, var_q = _norm(q, var_q, w["q_norm.weight"], None, norm, norm_eps)
        k, var_k = _norm(k, var_k, w["k_norm.weight"], None, norm, norm_eps)
    # 4. RoPE (rope_dim 0: none)
    if rope_dim:
        ang = rope_angles(pos, rope_inv_freq(rope_dim, rope_theta, rope_scaling))
        q, var_q = _rope(q, var_q, ang)
        k, var_k = _rope(k, var_k, ang)

    # 5. cache (KV, P, hd)
    new = [a.transpose(1, 0, 2) for a in (k, v, var_k, var_v)]
    if past is not None:
        old = [
            past["k"],
            past["v"],
            past.get("k_var", np.zeros_like(past["k"])),
            past.get("v_var", np.zeros_like(past["v"])),
        ]
        new = [np.concatenate([o_, n_], axis=1) for o_, n_ in zip(old, new)]
    k_all, v_all, vk_all, vv_all = new
    pos_all = np.concatenate([past_pos, pos])

    # 6. attention
    if query_pre_attn_scalar is not None:
        scale = float(np.float32(1.0 / math.sqrt(query_pre_attn_scalar)))
    elif attn_scale is not None:
        scale = float(np.float32(attn_scale))
    else:
        scale = float(np.float32(head_dim**-0.5))
    o = np.zeros((n_tok, n_heads, head_dim))
    var_o = np.zeros_like(o)
    for t in range(n_tok):
        allowed = pos_all <= pos[t]
        if window > 0:
            allowed &= pos_all > pos[t] - window
        idx = np.nonzero(allowed)[0]
        for i in range(n_heads):
            g = i // n_rep
            kk, vkk, vv, vvv = k_all[g, idx], vk_all[g, idx], v_all[g, idx], vv_all[g, idx]
            qq, vqq = q[t, i], var_q[t, i]
            s = (kk @ qq) * scale
            var_s = scale**2 * (vkk @ (qq * qq) + (kk * kk) @ vqq + _sum_var(kk * qq)) + _R * s * s
            if attn_softcap is not None:
                th = np.tanh(s / attn_softcap)
                s = th * attn_softcap
                var_s = (1.0 - th * th) ** 2 * var_s + (_ULP2 + 2.0 * _R) * s * s
            m = s.max()
            e = np.exp(s - m)
            z = e.sum()
            p = e / z
            # relative variances: exp argument (propagated + its rounding), exp, Z, divide
            rel_e = var_s + _R * (s - m) ** 2 + _ULP2
            rel_z = (p * p * rel_e).sum() + _sum_var(e) / (z * z)
            var_p = (
                p
                * p
                * (rel_e * (1.0 - p) ** 2 + (p * p * rel_e).sum() - p * p * rel_e + rel_z + _R)
            )
            o[t, i] = p @ vv
            var_o[t, i] = var_p @ (vv * vv) + (p * p) @ vvv + _sum_var(p[:, None] * vv, axis=0)
    o, var_o = o.reshape(n_tok, -1), var_o.reshape(n_tok, -1)

    # 7. o_proj (post norm under sandwich / post) and residual
    a, var_a = _linear(o, var_o, w["o_proj.weight"], get("o_proj.bias"), local=sigma)
    if norm_placement in ("sandwich", "post"):
        a, var_a = block_norm("post_attention_layernorm", a, var_a)
    x1, var_x1 = residual(x, np.zeros_like(x), a, var_a)
    # 8. MLP input
    if norm_placement == "pre":
        h2, var_h2 = block_norm("post_attention_layernorm", x1, var_x1)
    elif norm_placement == "sandwich":
        h2, var_h2 = block_norm("pre_feedforward_layernorm", x1, var_x1)
    elif norm_placement == "post":
        h2, var_h2 = x1, var_x1
    else:  # parallel: the attention's input norm
        h2, var_h2 = h, var_h
    # 9. MLP (post norm under sandwich / post) and residual
    act = _ACT_OF_MLP[mlp]
    up, var_up = _linear(h2, var_h2, w["up_proj.weight"], get("up_proj.bias"), local=sigma)
    if gated:
        gg, var_gg = _linear(h2, var_h2, w["gate_proj.weight"], get("gate_proj.bias"), local=sigma)
        ag, var_ag = _act_var(gg, var_gg, act)
        u = ag * up
        var_u = var_ag * up * up + ag * ag * var_up + _R * u * u
    else:
        u, var_u = _act_var(up, var_up, act)
    dn, var_dn = _linear(u, var_u, w["down_proj.weight"], get("down_proj.bias"), local=sigma)
    if norm_placement in ("sandwich", "post"):
        dn, var_dn = block_norm("post_feedforward_layernorm", dn, var_dn)
    y, var_y = residual(x1, var_x1, dn, var_dn)

    cache = {"k": k_all, "v": v_all, "k_var": vk_all, "v_var": vv_all, "positions": pos_all}
    return RefResult(y=y, sigma=np.sqrt(var_y), cache=cache)
