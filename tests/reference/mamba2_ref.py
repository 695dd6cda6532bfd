"""NumPy float64 references of one Mamba-2 block (SPEC.md 7.3, state layout of section 8).

Two independent evaluations of the same function, both in float64 on one row of tokens:

- `mamba2_ref`: the recurrent form exactly as SPEC 7.3 writes it (the order of operations of
  HF ``Mamba2Block`` with ``Mamba2Mixer``'s single-token path, and of exactblocks): block
  RMSNorm, in_proj, causal depthwise conv over a window that continues ``conv_window``, silu,
  per-token state update ``h = h * exp(dt * A) + (dt * B) * x``, ``y = C . h + D * x``, gated
  RMSNorm per group, out_proj, residual.
- `mamba2_ssd_ref`: the chunked state-space-duality form of Dao and Gu, "Transformers are
  SSMs" (arXiv:2405.21060), written after ``ssd_minimal_discrete`` of state-spaces/mamba
  (``mamba_ssm/modules/ssd_minimal.py``): the sequence is cut into chunks of `chunk_size`,
  intra-chunk outputs come from the masked "attention" ``(C B^T) o exp(segsum(dt A))`` and the
  inter-chunk part from chunk-boundary states. Its causal conv is a strided-window einsum and
  the group-to-head broadcast a ``repeat``, so the two references share only the parameter
  preparation (`prepare`) and the gated norm / out_proj tail (`_tail`).

In exact arithmetic both give the same y, final h and final conv window; in float64 they agree
to about 1e-12 at test sizes, which `tests/oracle/test_mamba2_hf.py` checks before using
`mamba2_ref` as the reference for exactblocks and for HF.

The contract defines everything in binary32; these references evaluate the same formulas in
float64 from the binary32 inputs (x, weights, initial state), so they differ from an exact
evaluation of the contract only by float64 rounding. ``softplus`` keeps PyTorch's threshold
rule (``v`` for ``v > 20``), which SPEC 3.4 also prescribes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# HF ``Mamba2Block.state_dict()`` key -> SPEC 7.2 short name.
HF_TO_SHORT = {
    "norm.weight": "block_norm.weight",
    "mixer.in_proj.weight": "in_proj.weight",
    "mixer.in_proj.bias": "in_proj.bias",
    "mixer.conv1d.weight": "conv1d.weight",
    "mixer.conv1d.bias": "conv1d.bias",
    "mixer.dt_bias": "dt_bias",
    "mixer.A_log": "A_log",
    "mixer.D": "D",
    "mixer.norm.weight": "norm.weight",
    "mixer.out_proj.weight": "out_proj.weight",
    "mixer.out_proj.bias": "out_proj.bias",
}


@dataclass
class Mamba2Params:
    """Float64 parameters of one Mamba-2 block with its derived sizes (SPEC 7.2).

    Attributes
    ----------
    w : dict of str to numpy.ndarray
        Short names (SPEC 7.2) -> float64 arrays; ``conv1d.weight`` reshaped to (conv_dim, K).
    A : numpy.ndarray
        (n_heads,) float64, ``-exp(A_log)``.
    d_model, d_inner, n_heads, head_dim, d_state, n_groups, conv_dim, K : int
        Sizes derived from the weight shapes and `n_groups`.
    dt_limit : tuple of float
        (lo, hi) clamp of dt.
    eps : float
        Epsilon of both RMSNorms.
    """

    w: dict
    A: np.ndarray
    d_model: int
    d_inner: int
    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_dim: int
    K: int
    dt_limit: tuple
    eps: float


@dataclass
class Mamba2RefResult:
    """Output of `mamba2_ref` / `mamba2_ssd_ref` for one row.

    Attributes
    ----------
    y : numpy.ndarray
        (L, d_model) float64, the block output.
    h : numpy.ndarray
        (n_heads, head_dim, d_state) float64, the SSM state after the last token (SPEC 8 ``h``).
    conv_window : numpy.ndarray
        (conv_dim, K) float64, the last K pre-conv xBC vectors, oldest in column 0
        (SPEC 8 ``conv_window``).
    dt : numpy.ndarray
        (L, n_heads) float64, the clamped dt of every token (for tests that check the clamp
        is active).
    """

    y: np.ndarray
    h: np.ndarray
    conv_window: np.ndarray
    dt: np.ndarray


def short_names(weights) -> dict:
    """Map HF ``Mamba2Block.state_dict()`` keys to SPEC 7.2 short names; float64 copies.

    Parameters
    ----------
    weights : Mapping[str, array_like]
        Short names or HF keys (a dict is in HF form iff some key starts with ``'mixer.'``).

    Returns
    -------
    dict[str, numpy.ndarray]
        Short name -> float64 array.

    Raises
    ------
    ValueError
        An unknown HF key.
    """
    hf = any(k.startswith("mixer.") for k in weights)
    out = {}
    for key, val in weights.items():
        if hf:
            if key not in HF_TO_SHORT:
                raise ValueError(f"short_names: unknown HF key {key!r}")
            key = HF_TO_SHORT[key]
        out[key] = np.array(val, dtype=np.float64)
    return out


def prepare(
    weights, *, n_groups: int = 1, dt_limit=(0.0, float("inf")), norm_eps: float = 1e-5
) -> Mamba2Params:
    """Float64 parameters and sizes of a block (SPEC 7.2 derivations).

    Parameters
    ----------
    weights : Mapping[str, array_like]
        Short names or HF keys (see `short_names`), float32 values.
    n_groups : int, default=1
        HF ``n_groups``.
    dt_limit : tuple of two float, default=(0.0, inf)
        HF ``time_step_limit``.
    norm_eps : float, default=1e-5
        HF ``layer_norm_epsilon`` (both norms).

    Returns
    -------
    Mamba2Params

    Raises
    ------
    ValueError
        Inconsistent sizes.
    """
    w = short_names(weights)
    cw = w["conv1d.weight"]
    if cw.ndim == 3:
        cw = cw[:, 0, :]
    w["conv1d.weight"] = cw
    d_model = w["block_norm.weight"].shape[0]
    d_inner = w["out_proj.weight"].shape[1]
    n_heads = w["A_log"].shape[0]
    conv_dim, K = cw.shape
    if d_inner % n_heads or (conv_dim - d_inner) % (2 * n_groups) or n_heads % n_groups:
        raise ValueError("prepare: inconsistent sizes")
    d_state = (conv_dim - d_inner) // (2 * n_groups)
    if w["in_proj.weight"].shape != (d_inner + conv_dim + n_heads, d_model):
        raise ValueError("prepare: in_proj.weight shape")
    return Mamba2Params(
        w=w,
        A=-np.exp(w["A_log"]),
        d_model=d_model,
        d_inner=d_inner,
        n_heads=n_heads,
        head_dim=d_inner // n_heads,
        d_state=d_state,
        n_groups=n_groups,
        conv_dim=conv_dim,
        K=K,
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
        eps=float(norm_eps),
    )


def softplus(v: np.ndarray) -> np.ndarray:
    """``v if v > 20 else log1p(exp(v))`` elementwise (PyTorch's threshold rule, SPEC 3.4).

    Parameters
    ----------
    v : numpy.ndarray
        float64, any shape.

    Returns
    -------
    numpy.ndarray
        Same shape, float64.
    """
    return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


def silu(v: np.ndarray) -> np.ndarray:
    """``v / (1 + exp(-v))`` elementwise (SPEC 3.4 silu; HF ``ACT2FN['silu']``).

    Parameters
    ----------
    v : numpy.ndarray
        float64, any shape.

    Returns
    -------
    numpy.ndarray
        Same shape, float64.
    """
    return v / (1.0 + np.exp(-v))


def _head_part(x: np.ndarray, p: Mamba2Params):
    """Steps 1-2 and the dt of step 5: returns z (L, d_inner), u (L, conv_dim), dt (L, nh)."""
    w = p.w
    hn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + p.eps) * w["block_norm.weight"]
    zxbcdt = hn @ w["in_proj.weight"].T
    if "in_proj.bias" in w:
        zxbcdt = zxbcdt + w["in_proj.bias"]
    z = zxbcdt[:, : p.d_inner]
    u = zxbcdt[:, p.d_inner : p.d_inner + p.conv_dim]
    dt_raw = zxbcdt[:, p.d_inner + p.conv_dim :]
    dt = softplus(dt_raw + w["dt_bias"])
    dt = np.minimum(np.maximum(dt, p.dt_limit[0]), p.dt_limit[1])
    return z, u, dt


def _tail(x: np.ndarray, y: np.ndarray, z: np.ndarray, p: Mamba2Params) -> np.ndarray:
    """Steps 7-8: gated RMSNorm per group, out_proj, residual. y, z (L, d_inner)."""
    w = p.w
    v = y * silu(z)
    gs = p.d_inner // p.n_groups
    vg = v.reshape(v.shape[0], p.n_groups, gs)
    r = 1.0 / np.sqrt(np.mean(vg * vg, axis=-1, keepdims=True) + p.eps)
    o = (vg * r).reshape(v.shape) * w["norm.weight"]
    out = o @ w["out_proj.weight"].T
    if "out_proj.bias" in w:
        out = out + w["out_proj.bias"]
    return x + out


def _initial(p: Mamba2Params, h0, conv0):
    h = np.zeros((p.n_heads, p.head_dim, p.d_state)) if h0 is None else np.array(h0, np.float64)
    cw = np.zeros((p.conv_dim, p.K)) if conv0 is None else np.array(conv0, np.float64)
    if h.shape != (p.n_heads, p.head_dim, p.d_state) or cw.shape != (p.conv_dim, p.K):
        raise ValueError(f"initial state shapes {h.shape}, {cw.shape}")
    return h, cw


def mamba2_ref(x, params: Mamba2Params, h0=None, conv0=None) -> Mamba2RefResult:
    """Recurrent form of SPEC 7.3 for one row, float64, optionally from an initial state.

    Follows HF ``Mamba2Block.forward`` (transformers 5.x, ``Mamba2Mixer`` with
    ``causal_conv1d_update`` and ``mamba2_selective_state_update``) token by token, with
    ``dt`` clamped to ``dt_limit`` at every token (SPEC 7.5) and the gated norm per group.

    Parameters
    ----------
    x : array_like
        (L, d_model) float32 or float64 input row, L >= 0.
    params : Mamba2Params
        From `prepare`.
    h0 : array_like or None
        (n_heads, head_dim, d_state) initial SSM state (SPEC 8 ``h``); None = zeros.
    conv0 : array_like or None
        (conv_dim, K) initial conv window, oldest column first (SPEC 8 ``conv_window``);
        None = zeros.

    Returns
    -------
    Mamba2RefResult
        Output (L, d_model) and the state after the last token.

    Raises
    ------
    ValueError
        x or the initial state has the wrong shape.
    """
    p = params
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != p.d_model:
        raise ValueError(f"mamba2_ref: x shape {x.shape}, expected (L, {p.d_model})")
    h, window = _initial(p, h0, conv0)
    z, u, dt = _head_part(x, p)
    w = p.w
    L = x.shape[0]
    gsz = p.n_heads // p.n_groups
    group = np.arange(p.n_heads) // gsz
    gn = p.n_groups * p.d_state
    ys = np.zeros((L, p.d_inner))
    for t in range(L):
        # Step 3: the window shifts left by one; the newest column is u_t.
        window = np.concatenate([window[:, 1:], u[t][:, None]], axis=1)
        c = np.sum(w["conv1d.weight"] * window, axis=1)
        if "conv1d.bias" in w:
            c = c + w["conv1d.bias"]
        a = silu(c)
        xs = a[: p.d_inner].reshape(p.n_heads, p.head_dim)
        Bt = a[p.d_inner : p.d_inner + gn].reshape(p.n_groups, p.d_state)[group]  # (nh, ds)
        Ct = a[p.d_inner + gn :].reshape(p.n_groups, p.d_state)[group]
        # Step 6.
        dA = np.exp(dt[t] * p.A)  # (nh,)
        h = h * dA[:, None, None] + (dt[t][:, None] * Bt)[:, None, :] * xs[:, :, None]
        y = np.einsum("ipn,in->ip", h, Ct) + xs * w["D"][:, None]
        ys[t] = y.reshape(-1)
    out = _tail(x, ys, z, p)
    return Mamba2RefResult(y=out, h=h, conv_window=window, dt=dt)


def _segsum(a: np.ndarray) -> np.ndarray:
    """``out[..., i, j] = sum(a[..., j+1 : i+1])`` for j <= i, -inf above the diagonal.

    Stable segment sum of ``ssd_minimal`` (masked cumulative sum, no differences of cumsums).
    a (..., T) -> (..., T, T).
    """
    T = a.shape[-1]
    x = np.repeat(a[..., None], T, axis=-1)  # x[..., i, j] = a[..., i]
    x = np.where(np.tril(np.ones((T, T), bool), -1), x, 0.0)
    s = np.cumsum(x, axis=-2)
    return np.where(np.tril(np.ones((T, T), bool), 0), s, -np.inf)


def ssd_chunked(X, A, B, C, chunk_size: int, initial_state=None):
    """Chunked SSD scan (``ssd_minimal_discrete``, arXiv:2405.21060 Listing 1), float64.

    Computes ``h_t = exp(A_t) h_{t-1} + B_t x_t^T``, ``y_t = h_t C_t`` for every head by the
    chunked dual form; the caller has already multiplied ``X = x * dt`` and ``A = A * dt``.

    Parameters
    ----------
    X : numpy.ndarray
        (L, n_heads, head_dim) float64.
    A : numpy.ndarray
        (L, n_heads) float64, log decay per token (``dt * A``, <= 0).
    B, C : numpy.ndarray
        (L, n_heads, d_state) float64 (groups already broadcast to heads).
    chunk_size : int
        Chunk length >= 1; L is zero-padded to a multiple (padding has A = 0, X = 0, so it
        leaves the final state unchanged).
    initial_state : numpy.ndarray or None
        (n_heads, head_dim, d_state); None = zeros.

    Returns
    -------
    Y : numpy.ndarray
        (L, n_heads, head_dim) float64, without the D skip term.
    final_state : numpy.ndarray
        (n_heads, head_dim, d_state) float64.
    """
    L, nh, hd = X.shape
    ds = B.shape[-1]
    pad = (-L) % chunk_size

    def chunks(t):
        t = np.concatenate([t, np.zeros((pad,) + t.shape[1:])], axis=0)
        return t.reshape((-1, chunk_size) + t.shape[1:])

    Xc, Ac, Bc, Cc = chunks(X), chunks(A), chunks(B), chunks(C)  # (c, l, ...)
    Ac = Ac.transpose(2, 0, 1)  # (h, c, l)
    A_cumsum = np.cumsum(Ac, axis=-1)
    # 1. Intra-chunk (diagonal blocks).
    Lmat = np.exp(_segsum(Ac))  # (h, c, l, s)
    Y_diag = np.einsum("clhn,cshn,hcls,cshp->clhp", Cc, Bc, Lmat, Xc)
    # 2. State of each chunk from its own tokens (right factor of the off-diagonal blocks).
    decay_states = np.exp(A_cumsum[:, :, -1:] - A_cumsum)  # (h, c, l)
    states = np.einsum("clhn,hcl,clhp->chpn", Bc, decay_states, Xc)
    # 3. Inter-chunk recurrence over chunk boundaries.
    h0 = np.zeros((1, nh, hd, ds)) if initial_state is None else initial_state[None]
    states = np.concatenate([h0, states], axis=0)  # (c+1, h, p, n)
    decay_chunk = np.exp(_segsum(np.pad(A_cumsum[:, :, -1], ((0, 0), (1, 0)))))  # (h, c+1, c+1)
    new_states = np.einsum("hzc,chpn->zhpn", decay_chunk, states)
    states, final_state = new_states[:-1], new_states[-1]
    # 4. State -> output per chunk (left factor of the off-diagonal blocks).
    state_decay_out = np.exp(A_cumsum)  # (h, c, l)
    Y_off = np.einsum("clhn,chpn,hcl->clhp", Cc, states, state_decay_out)
    Y = (Y_diag + Y_off).reshape(-1, nh, hd)[:L]
    return Y, final_state


def mamba2_ssd_ref(
    x, params: Mamba2Params, h0=None, conv0=None, chunk_size: int = 8
) -> Mamba2RefResult:
    """The same block as `mamba2_ref`, with the scan in the chunked SSD form (`ssd_chunked`).

    Independent check of `mamba2_ref`: the causal conv is a strided window over
    ``[conv0[:, 1:], u_0 .. u_{L-1}]`` contracted in one einsum, groups are broadcast with
    ``repeat`` (HF ``repeat_interleave`` order) and the scan is chunked (Dao and Gu,
    arXiv:2405.21060; state-spaces/mamba ``ssd_minimal.py``).

    Parameters
    ----------
    x : array_like
        (L, d_model), L >= 1.
    params : Mamba2Params
        From `prepare`.
    h0, conv0 : array_like or None
        Initial state as in `mamba2_ref`.
    chunk_size : int, default=8
        SSD chunk length (any value gives the same result up to float64 rounding).

    Returns
    -------
    Mamba2RefResult
    """
    p = params
    x = np.asarray(x, dtype=np.float64)
    L = x.shape[0]
    h, window = _initial(p, h0, conv0)
    z, u, dt = _head_part(x, p)
    w = p.w
    K = p.K
    # Causal depthwise conv: sequence of K-1 earlier inputs followed by the L new ones.
    seq = np.concatenate([window[:, 1:].T, u], axis=0)  # (K-1+L, conv_dim)
    win = np.lib.stride_tricks.sliding_window_view(seq, K, axis=0)  # (L, conv_dim, K)
    c = np.einsum("tck,ck->tc", win, w["conv1d.weight"])
    if "conv1d.bias" in w:
        c = c + w["conv1d.bias"]
    a = silu(c)
    new_window = seq[-K:].T if K > 0 else window
    gn = p.n_groups * p.d_state
    rep = p.n_heads // p.n_groups
    xs = a[:, : p.d_inner].reshape(L, p.n_heads, p.head_dim)
    Bt = np.repeat(a[:, p.d_inner : p.d_inner + gn].reshape(L, p.n_groups, p.d_state), rep, 1)
    Ct = np.repeat(a[:, p.d_inner + gn :].reshape(L, p.n_groups, p.d_state), rep, 1)
    Y, hT = ssd_chunked(xs * dt[:, :, None], dt * p.A, Bt, Ct, chunk_size, h)
    y = Y + xs * w["D"][None, :, None]
    out = _tail(x, y.reshape(L, p.d_inner), z, p)
    return Mamba2RefResult(y=out, h=hT, conv_window=new_window, dt=dt)
