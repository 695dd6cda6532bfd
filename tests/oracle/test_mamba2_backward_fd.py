"""The backward formulas of SPEC 7.6 checked by finite differences, in float64.

``tests/reference/mamba2_backward_ref.py`` writes the kernel's formulas in float64. Here, on
tiny blocks (one and two groups, with and without the dt clamp biting, both biases, K = 1 and
4, d_state 5), every gradient it gives is checked against central finite differences of the
independent float64 forward ``mamba2_ref`` along random directions (each weight, and x),
within 1e-6 relative; then exactblocks' float32 backward is checked against the formulas
within 1e-4 of each tensor's largest entry.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import make_mamba2_weights
from reference.mamba2_backward_ref import mamba2_backward_ref
from reference.mamba2_ref import mamba2_ref, prepare

import exactblocks as eb

FD_REL = 1e-6
EB_REL = 1e-4
CASES = {
    "g2_k4": (dict(ng=2), dict(n_groups=2)),
    "g1_k1_bias_clamp": (
        dict(ng=1, k=1, proj_bias=True),
        dict(dt_limit=(0.004, 0.03)),
    ),
}


def loss(x, gy, p):
    return float((gy * mamba2_ref(x, p).y).sum())


def with_weight(p, name, value):
    w = dict(p.w)
    w[name] = value
    A = -np.exp(w["A_log"]) if name == "A_log" else p.A
    return dataclasses.replace(p, w=w, A=A)


@pytest.mark.parametrize("case", list(CASES))
def test_formulas_match_finite_differences(case):
    wkw, okw = CASES[case]
    wts = make_mamba2_weights(21, **wkw)
    p = prepare(wts, **okw)
    rng = np.random.default_rng(0)
    L = 7
    x = rng.standard_normal((L, p.d_model))
    gy = rng.standard_normal((L, p.d_model))
    grads = mamba2_backward_ref(x, gy, p)
    assert set(grads) == {"x", *p.w}
    eps = 1e-6
    for name in grads:
        base = x if name == "x" else p.w[name]
        direction = rng.standard_normal(base.shape)
        if name == "x":
            fp, fm = loss(x + eps * direction, gy, p), loss(x - eps * direction, gy, p)
        else:
            fp = loss(x, gy, with_weight(p, name, base + eps * direction))
            fm = loss(x, gy, with_weight(p, name, base - eps * direction))
        fd = (fp - fm) / (2 * eps)
        an = float((grads[name] * direction).sum())
        scale = float(np.abs(grads[name]).sum() * np.abs(direction).max())
        print(f"[fd] {case} {name}: analytic={an:.10g} fd={fd:.10g}")
        assert abs(an - fd) <= FD_REL * max(scale, 1e-12), (name, an, fd)


@pytest.mark.parametrize("case", list(CASES))
def test_exactblocks_matches_formulas(case):
    wkw, okw = CASES[case]
    wts = make_mamba2_weights(22, **wkw)
    p = prepare(wts, **okw)
    blk = eb.Mamba2BlockInference(wts, **okw)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 40, p.d_model)).astype(np.float32)
    gy = rng.standard_normal(x.shape).astype(np.float32)
    got = blk.backward(x, gy, lengths=[40, 35])
    ref = {k: 0.0 for k in got}
    ref["x"] = np.zeros(x.shape)
    for b, n in enumerate([40, 35]):
        r = mamba2_backward_ref(x[b, :n], gy[b, :n], p)
        ref["x"][b, :n] = r.pop("x")
        for k, v in r.items():
            ref[k] = ref[k] + v
    for k, v in got.items():
        rv = np.asarray(ref[k]).reshape(v.shape)
        err = np.abs(v - rv).max() / max(np.abs(rv).max(), 1e-30)
        print(f"[fd] {case} exactblocks {k}: err={err:.3g}")
        assert err <= EB_REL, (k, err)
