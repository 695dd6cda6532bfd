"""Pinned output bits of one fixed small configuration per block (issue: "a test pins the
output bits (a digest) of one fixed small configuration per block so that any change of
arithmetic shows").

The digests are keyed by `arithmetic_version()`: a change that moves any output bit must bump
the version (SPEC 1) and add the new digests here, with the old ones kept as history. The same
outputs are also checked against the float64 references, so a pin can never hold garbage.
Weights and inputs come from an integer hash, not a random generator, so they are the same on
every platform and NumPy version.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from reference.mamba2_ref import mamba2_ref, prepare
from reference.moe_ref import moe_mlp_ref
from reference.transformer_ref import transformer_ref

import exactblocks as eb
from exactblocks import _ext

PINNED = {
    "fp32-identical-1": {
        "transformer": "0a17914ec7cd3c240ffff7c096493dee7eda1acfb6f801690e960fa2b1d69398",
        "mamba2": "1c5f57067332a64f85e9d7f63b4e50bc6ea2a15e2f8fe686aa983a8ad0436f4e",
        # d_state a multiple of 16: the register scan (ops::ssm_scan_tokens), pinned from the
        # per-token ssm_scan_step it replaced; two calls, runs longer than one 32-token pass.
        "mamba2_ds48": "03aba24c994a99ad0253846148f4bd51a799cbaec95b8da7047ce53ef4f08e3f",
        "mamba2_ds128": "e329cadbb7fdd77e03fe822f31f973dfa87016f61835ff2bffce6625aa13efa7",
        # prefill rows >= 16 tokens: the blocked prefill attention (ops::attention_prefill_block),
        # pinned before its value pass took several heads at once.
        "prefill_r3_hd24": "b777a087c555041dabf0781bd0a2beaf8eb1e126ab2b474a960f50e6345a452d",
        "prefill_r4_hd40_window": "83e6f5f00fcb60e12ed5be1a84ff2b7a7cbe5e4af1bd0e77b7875bb24852e666",  # noqa: E501
        "prefill_r1_hd16": "3977ceb8d49bf555160bd8c07bbac11dc1f13f433679d2e698c705103a395fc8",
        # the MoE MLP (SPEC 4.8): an MLP-only block, top-2 renormalised, and a shared expert
        "moe_mlp": "c8ed843e1712c0364ab9b30b71ed1bfc3e0d63ca58aa1948a0f804606935b830",
    },
}


def det(shape, salt, scale=0.25, offset=0.0):
    """Deterministic float32 array: an integer hash of (index, salt) mapped to [-scale, scale)."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64) + np.uint64(salt * 1000003)
    h = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2**32)
    h = (h ^ (h >> np.uint64(13))) * np.uint64(2246822519) % np.uint64(2**32)
    u = h.astype(np.float64) / 2.0**32 - 0.5
    return (offset + 2 * scale * u).astype(np.float32).reshape(shape)


def digest(*arrays):
    m = hashlib.sha256()
    for a in arrays:
        m.update(np.ascontiguousarray(a).tobytes())
    return m.hexdigest()


def transformer_case():
    d, H, KV, hd, it = 24, 4, 2, 8, 40
    shapes = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "q_proj.weight": (H * hd, d),
        "k_proj.weight": (KV * hd, d),
        "v_proj.weight": (KV * hd, d),
        "o_proj.weight": (d, H * hd),
        "q_proj.bias": (H * hd,),
        "k_proj.bias": (KV * hd,),
        "v_proj.bias": (KV * hd,),
        "q_norm.weight": (hd,),
        "k_norm.weight": (hd,),
        "gate_proj.weight": (it, d),
        "up_proj.weight": (it, d),
        "down_proj.weight": (d, it),
    }
    w = det_transformer_weights(shapes)
    opts = dict(
        n_heads=H,
        n_kv_heads=KV,
        window=6,
        qkv_bias=True,
        qk_norm=True,
        rope_theta=1000.0,
        attn_softcap=20.0,
    )
    x = det((2, 9, d), 99, scale=2.0)
    return w, opts, x


def det_mamba2_weights(d, di, nh, ns, K, G):
    """Deterministic Mamba-2 weights: d_model d, d_inner di, nh heads, d_state ns, conv K,
    G groups."""
    cd = di + 2 * G * ns
    return {
        "block_norm.weight": det((d,), 1, offset=1.0),
        "in_proj.weight": det((di + cd + nh, d), 2),
        "conv1d.weight": det((cd, 1, K), 3),
        "conv1d.bias": det((cd,), 4),
        "dt_bias": det((nh,), 5, offset=-1.0),
        "A_log": det((nh,), 6, scale=1.0),
        "D": det((nh,), 7, offset=1.0),
        "norm.weight": det((di,), 8, offset=1.0),
        "out_proj.weight": det((d, di), 9),
    }


def det_transformer_weights(shapes):
    """Deterministic weights of the given {name: shape}; norms around 1, the rest around 0."""
    return {
        k: det(s, i, offset=1.0 if k.endswith("norm.weight") else 0.0)
        for i, (k, s) in enumerate(sorted(shapes.items()))
    }


def mamba2_case():
    d, di, nh, ns, K, G = 16, 32, 4, 8, 3, 2
    w = det_mamba2_weights(d, di, nh, ns, K, G)
    opts = dict(n_groups=G, dt_limit=(0.001, 2.0))
    x = det((2, 9, d), 98, scale=2.0)
    return w, opts, x


def test_transformer_digest():
    w, opts, x = transformer_case()
    blk = eb.TransformerBlockInference(w, **opts)
    st = blk.allocate_state(2, 12)
    y = blk.forward(x, st, lengths=[9, 5])
    for b, n in enumerate([9, 5]):  # the pinned bits are also close to the float64 reference
        ref = transformer_ref(w, x[b, :n], **opts).y
        assert np.max(np.abs(y[b, :n] - ref)) <= 1e-5 * max(1.0, np.max(np.abs(ref)))
    got = digest(y, st.k_cache, st.v_cache)
    assert got == PINNED[eb.arithmetic_version()]["transformer"], got


def test_mamba2_digest():
    w, opts, x = mamba2_case()
    blk = eb.Mamba2BlockInference(w, **opts)
    st = blk.allocate_state(2)
    y = blk.forward(x, st, lengths=[9, 5])
    params = prepare(w, **opts)
    for b, n in enumerate([9, 5]):
        ref = mamba2_ref(x[b, :n].astype(np.float64), params).y
        assert np.max(np.abs(y[b, :n] - ref)) <= 1e-5 * max(1.0, np.max(np.abs(ref)))
    got = digest(y, st.h, st.conv_window)
    assert got == PINNED[eb.arithmetic_version()]["mamba2"], got


SCAN_CASES = {  # name: (d, d_inner, n_heads, d_state, conv kernel, n_groups, L, lengths)
    "mamba2_ds48": (16, 30, 3, 48, 4, 1, 40, [40, 33]),  # head_dim 10: 4-row passes + rest
    "mamba2_ds128": (16, 20, 4, 128, 2, 2, 37, [37, 5]),  # head_dim 5: 2-row passes + rest
}


def scan_case_digest(name):
    """Digest of a prefill with `lengths`, then a 3-token call, on fresh states (no dt_limit)."""
    d, di, nh, ns, K, G, L, lengths = SCAN_CASES[name]
    w = det_mamba2_weights(d, di, nh, ns, K, G)
    x = det((len(lengths), L, d), 98, scale=2.0)
    blk = eb.Mamba2BlockInference(w, n_groups=G)
    st = blk.allocate_state(len(lengths))
    y = blk.forward(x, st, lengths=lengths)
    params = prepare(w, n_groups=G)
    for b, n in enumerate(lengths):
        ref = mamba2_ref(x[b, :n].astype(np.float64), params).y
        assert np.max(np.abs(y[b, :n] - ref)) <= 1e-5 * max(1.0, np.max(np.abs(ref)))
    y2 = blk.forward(x[:, :3], st, lengths=[3, 1])
    return digest(y, y2, st.h, st.conv_window)


PREFILL_CASES = {  # name: (d, n_heads, n_kv_heads, head_dim, intermediate, L, lengths, window)
    "prefill_r3_hd24": (24, 6, 2, 24, 40, 45, [45, 17], 0),
    "prefill_r4_hd40_window": (32, 8, 2, 40, 48, 70, [70, 33], 50),
    "prefill_r1_hd16": (16, 2, 2, 16, 32, 37, [37, 18], 0),
}


def prefill_case_digest(name):
    """Digest of a ragged prefill, then a 20-token call on the same state."""
    d, H, KV, hd, it, L, lengths, window = PREFILL_CASES[name]
    shapes = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "q_proj.weight": (H * hd, d),
        "k_proj.weight": (KV * hd, d),
        "v_proj.weight": (KV * hd, d),
        "o_proj.weight": (d, H * hd),
        "gate_proj.weight": (it, d),
        "up_proj.weight": (it, d),
        "down_proj.weight": (d, it),
    }
    w = det_transformer_weights(shapes)
    opts = dict(n_heads=H, n_kv_heads=KV, window=window, rope_theta=1000.0)
    blk = eb.TransformerBlockInference(w, **opts)
    x = det((len(lengths), L, d), 97, scale=2.0)
    st = blk.allocate_state(len(lengths), 2 * L)
    y = blk.forward(x, st, lengths=lengths)
    for b, n in enumerate(lengths):
        ref = transformer_ref(w, x[b, :n], **opts).y
        assert np.max(np.abs(y[b, :n] - ref)) <= 1e-5 * max(1.0, np.max(np.abs(ref)))
    y2 = blk.forward(x[:, :20], st, lengths=[20] * len(lengths))
    return digest(y, y2, st.k_cache, st.v_cache)


def all_case_digests():
    return [scan_case_digest(n) for n in sorted(SCAN_CASES)] + [
        prefill_case_digest(n) for n in sorted(PREFILL_CASES)
    ]


@pytest.mark.parametrize("name", sorted(SCAN_CASES))
def test_mamba2_register_scan_digest(name):
    assert scan_case_digest(name) == PINNED[eb.arithmetic_version()][name]


@pytest.mark.parametrize("name", sorted(PREFILL_CASES))
def test_prefill_block_digest(name):
    assert prefill_case_digest(name) == PINNED[eb.arithmetic_version()][name]


def test_digests_on_every_isa():
    """Every SIMD path this CPU has gives the pinned bits (EXACTBLOCKS_ISA in a subprocess)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import sys; sys.path[:0] = [%r, %r]\n"  # noqa: UP031
        "import test_digest as t\n"
        "print(*t.all_case_digests())\n" % (here, os.path.dirname(here))
    )
    pinned = PINNED[eb.arithmetic_version()]
    want = " ".join(
        [pinned[n] for n in sorted(SCAN_CASES)] + [pinned[n] for n in sorted(PREFILL_CASES)]
    )
    for isa in _ext.core().available_isas():
        res = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, EXACTBLOCKS_ISA=isa),
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == want.split(), isa


@pytest.mark.parametrize("piece_ns", [0, 20000])
@pytest.mark.parametrize("threads", [1, 2])
def test_digests_with_every_region_in_pieces(threads, piece_ns):
    """A call that can be stopped (SPEC.md 2.5) runs its parallel regions in pieces, with
    cancel points between them (csrc/base/cancel.hpp). Watching every call and cutting every
    region into single grains (piece_ns 0) or pieces of about 20 us gives the pinned bits."""
    from helpers import force_num_threads

    core = _ext.core()
    saved = eb.get_num_threads()
    force_num_threads(threads)
    core._set_cancel_tuning(0, piece_ns)
    try:
        test_transformer_digest()
        test_mamba2_digest()
        got = all_case_digests()
    finally:
        core._set_cancel_tuning()
        eb.set_num_threads(saved)
    pinned = PINNED[eb.arithmetic_version()]
    assert got == [pinned[n] for n in sorted(SCAN_CASES)] + [
        pinned[n] for n in sorted(PREFILL_CASES)
    ]


def test_moe_mlp_digest():
    d, e, it, sit = 32, 5, 32, 32
    shapes = {
        "post_attention_layernorm.weight": (d,),
        "router.weight": (e, d),
        "experts.gate_up_proj": (e, 2 * it, d),
        "experts.down_proj": (e, d, it),
        "shared_expert.gate_proj.weight": (sit, d),
        "shared_expert.up_proj.weight": (sit, d),
        "shared_expert.down_proj.weight": (d, sit),
        "shared_expert_gate.weight": (1, d),
    }
    w = det_transformer_weights(shapes)
    w["router.weight"] = w["router.weight"] * np.float32(8.0)  # routing far from ties
    x = det((2, 9, d), 97, scale=2.0)
    opts = dict(block_parts="mlp", num_experts=e, num_experts_per_tok=2, norm_topk_prob=True,
                shared_expert=True)  # fmt: skip
    blk = eb.TransformerBlockInference(w, **opts)
    y = blk.forward(x, lengths=[9, 4])
    for b, n in enumerate([9, 4]):  # the pinned bits are also close to the float64 reference
        ref, _ = moe_mlp_ref(w, x[b, :n], 2, True)
        assert np.max(np.abs(y[b, :n] - ref)) <= 1e-5 * max(1.0, np.max(np.abs(ref)))
    got = digest(y)
    assert got == PINNED[eb.arithmetic_version()]["moe_mlp"], got
