"""Float64 reference of the Mamba-2 backward formulas of SPEC 7.6, for one row from a zero state.

The same formulas as the C++ kernel (``csrc/blocks/mamba2/backward.hpp``,
``csrc/ops/ssm_scan_backward.hpp``), written with NumPy in float64: the adjoint of out_proj,
the gated RMSNorm per group, the reverse-time scan over ``lam = dLoss/dh``
(``lam_t = lam_(t+1) * dA_(t+1) + C_t dy_t``; ``dx = D dy + dt (lam . B)``,
``dB = dt sum_p lam x``, ``dC = sum_p h_t dy``, ``ddt = sum lam (B x) + A dA sum lam h_(t-1)``,
``dA = dt dA sum lam h_(t-1)``), dt (the clamp passes where ``lo <= softplus <= hi``,
softplus' = sigmoid), SiLU, the causal conv, in_proj and the block RMSNorm. The tests check
these formulas against central finite differences of ``mamba2_ref`` (an independent forward)
and the kernel against them.
"""

from __future__ import annotations

import numpy as np
from reference.mamba2_ref import Mamba2Params, silu, softplus


def _dsilu(v: np.ndarray) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-v))
    return s * (1.0 + v * (1.0 - s))


def mamba2_backward_ref(x, gy, p: Mamba2Params) -> dict:
    """Gradients of ``sum(gy * mamba2_ref(x).y)`` for one row (L, d_model), float64.

    Parameters
    ----------
    x, gy : array_like
        (L, d_model) input row and output gradient.
    p : Mamba2Params
        From ``reference.mamba2_ref.prepare``.

    Returns
    -------
    dict of str to numpy.ndarray
        ``'x'`` and one float64 gradient per weight of ``p.w`` (short names; ``conv1d.weight``
        as (conv_dim, K)).
    """
    w = p.w
    x = np.asarray(x, np.float64)
    g = np.asarray(gy, np.float64)
    L, di, cd, K, nh, hd, ns, ng = (
        x.shape[0], p.d_inner, p.conv_dim, p.K, p.n_heads, p.head_dim, p.d_state, p.n_groups
    )  # fmt: skip
    # forward
    r1 = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + p.eps)
    xn = x * r1
    hn = xn * w["block_norm.weight"]
    zx = hn @ w["in_proj.weight"].T + w.get("in_proj.bias", 0.0)
    z, u, dt_raw = zx[:, :di], zx[:, di : di + cd], zx[:, di + cd :]
    upad = np.concatenate([np.zeros((K - 1, cd)), u])  # u_(t-K+1+k) = upad[t + k]
    c = sum(upad[k : k + L] * w["conv1d.weight"][:, k] for k in range(K))
    c = c + w.get("conv1d.bias", 0.0)
    a = silu(c)
    gn = ng * ns
    grp = np.arange(nh) // (nh // ng)
    xs = a[:, :di].reshape(L, nh, hd)
    Bh = a[:, di : di + gn].reshape(L, ng, ns)[:, grp]  # (L, nh, ns)
    Ch = a[:, di + gn :].reshape(L, ng, ns)[:, grp]
    pre = dt_raw + w["dt_bias"]
    sp = softplus(pre)
    lo, hi = p.dt_limit
    dt = np.minimum(np.maximum(sp, lo), hi)
    dA = np.exp(dt * p.A)  # (L, nh)
    hs = np.zeros((L + 1, nh, hd, ns))  # hs[t + 1] = h_t
    for t in range(L):
        hs[t + 1] = (
            hs[t] * dA[t][:, None, None] + (dt[t][:, None] * Bh[t])[:, None, :] * xs[t][..., None]
        )
    y = np.einsum("tipn,tin->tip", hs[1:], Ch) + xs * w["D"][:, None]
    y = y.reshape(L, di)
    v = y * silu(z)
    gs = di // ng
    vg = v.reshape(L, ng, gs)
    r2 = 1.0 / np.sqrt(np.mean(vg * vg, axis=-1, keepdims=True) + p.eps)
    vn = (vg * r2).reshape(L, di)
    o = vn * w["norm.weight"]
    out = {}
    # out = x + W_out o + b_out
    d_o = g @ w["out_proj.weight"]
    out["out_proj.weight"] = g.T @ o
    if "out_proj.bias" in w:
        out["out_proj.bias"] = g.sum(0)
    out["norm.weight"] = (d_o * vn).sum(0)
    gw = (d_o * w["norm.weight"]).reshape(L, ng, gs)
    s = (gw * vg).sum(-1, keepdims=True)
    dv = (gw * r2 - vg * (r2**3 * s / gs)).reshape(L, di)
    dy = (dv * silu(z)).reshape(L, nh, hd)
    dz = dv * y * _dsilu(z)
    # the scan's adjoint
    lam = np.zeros((nh, hd, ns))
    dxs = np.zeros((L, nh, hd))
    dBh = np.zeros((L, nh, ns))
    dCh = np.zeros((L, nh, ns))
    ddt = np.zeros((L, nh))
    dAt = np.zeros((L, nh))
    dDt = np.zeros((L, nh))
    for t in range(L - 1, -1, -1):
        da_next = dA[t + 1] if t + 1 < L else np.zeros(nh)
        lam = lam * da_next[:, None, None] + Ch[t][:, None, :] * dy[t][..., None]
        s1 = np.einsum("ipn,in->ip", lam, Bh[t])
        s2 = np.einsum("ipn,ipn->ip", lam, hs[t])
        dxs[t] = dy[t] * w["D"][:, None] + dt[t][:, None] * s1
        dBh[t] = dt[t][:, None] * np.einsum("ipn,ip->in", lam, xs[t])
        dCh[t] = np.einsum("ipn,ip->in", hs[t + 1], dy[t])
        S1 = (s1 * xs[t]).sum(-1)
        S2 = s2.sum(-1)
        ddt[t] = S1 + S2 * p.A * dA[t]
        dAt[t] = S2 * dt[t] * dA[t]
        dDt[t] = (dy[t] * xs[t]).sum(-1)
    dact = np.zeros((L, cd))
    dact[:, :di] = dxs.reshape(L, di)
    for gg in range(ng):
        dact[:, di + gg * ns : di + (gg + 1) * ns] = dBh[:, grp == gg].sum(1)
        dact[:, di + gn + gg * ns : di + gn + (gg + 1) * ns] = dCh[:, grp == gg].sum(1)
    mask = (sp >= lo) & (sp <= hi)
    sig = np.where(pre > 20.0, 1.0, 1.0 / (1.0 + np.exp(-np.minimum(pre, 20.0))))
    dpre = np.where(mask, ddt, 0.0) * sig
    out["dt_bias"] = dpre.sum(0)
    out["A_log"] = dAt.sum(0) * p.A
    out["D"] = dDt.sum(0)
    dc = dact * _dsilu(c)
    du = np.zeros((L, cd))
    for s_ in range(L):
        for t in range(s_, min(s_ + K, L)):
            du[s_] += w["conv1d.weight"][:, s_ - t + K - 1] * dc[t]
    out["conv1d.weight"] = np.stack([(dc * upad[k : k + L]).sum(0) for k in range(K)], axis=1)
    if "conv1d.bias" in w:
        out["conv1d.bias"] = dc.sum(0)
    dzx = np.concatenate([dz, du, dpre], axis=1)
    dhn = dzx @ w["in_proj.weight"]
    out["in_proj.weight"] = dzx.T @ hn
    if "in_proj.bias" in w:
        out["in_proj.bias"] = dzx.sum(0)
    out["block_norm.weight"] = (dhn * xn).sum(0)
    gw1 = dhn * w["block_norm.weight"]
    s1n = (gw1 * x).sum(-1, keepdims=True)
    out["x"] = g + gw1 * r1 - x * (r1**3 * s1n / p.d_model)
    return out
