"""NumPy float64 reference of an MLP-only MoE block (SPEC.md 4.8, pre placement, rmsnorm).

``moe_mlp_ref`` evaluates ``y = x + moe(rmsnorm(x))`` in float64: router logits, softmax, the
top-k by a stable descending sort (equal values: the lower expert index first, the contract's
tie rule), optional renormalisation, SwiGLU experts, the weighted sum, and an optional shared
expert with its sigmoid gate. It returns the chosen experts too, so a test can assert the
routing it meant to set up.
"""

from __future__ import annotations

import numpy as np


def _silu(v):
    return v / (1.0 + np.exp(-v))


def moe_mlp_ref(w, x, top_k, norm_topk, eps=1e-6):
    """float64 ``x + moe(rmsnorm(x))`` of an MLP-only MoE block.

    Parameters
    ----------
    w : dict of str to ndarray
        The block's short-named weights (``post_attention_layernorm.weight``, ``router.weight``,
        ``experts.gate_up_proj``, ``experts.down_proj``, optionally ``shared_expert.*``).
    x : ndarray of shape (..., d_model)
    top_k : int
    norm_topk : bool
    eps : float, default=1e-6

    Returns
    -------
    y : ndarray of shape (..., d_model), float64
    order : ndarray of shape (..., top_k), int
        The chosen experts of each token in rank order.
    """
    x = x.astype(np.float64)
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w["post_attention_layernorm.weight"]
    logits = h @ w["router.weight"].T.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")[..., :top_k]
    gu = w["experts.gate_up_proj"].astype(np.float64)
    dn = w["experts.down_proj"].astype(np.float64)
    it = gu.shape[1] // 2
    y = np.zeros_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        chosen = order[idx]
        wts = p[idx][chosen]
        if norm_topk:
            wts = wts / wts.sum()
        for e, wt in zip(chosen, wts):
            a = gu[e] @ h[idx]
            y[idx] += wt * (dn[e] @ (_silu(a[:it]) * a[it:]))
        if "shared_expert_gate.weight" in w:
            sg = w["shared_expert.gate_proj.weight"].astype(np.float64) @ h[idx]
            su = w["shared_expert.up_proj.weight"].astype(np.float64) @ h[idx]
            s = w["shared_expert.down_proj.weight"].astype(np.float64) @ (_silu(sg) * su)
            g = float(w["shared_expert_gate.weight"].astype(np.float64)[0] @ h[idx])
            y[idx] += s / (1.0 + np.exp(-g))
    return x + y, order
