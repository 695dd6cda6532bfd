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

import numpy as np

import exactblocks as eb
from reference.mamba2_ref import mamba2_ref, prepare
from reference.transformer_ref import transformer_ref

PINNED = {
    "fp32-identical-1": {
        "transformer": "0a17914ec7cd3c240ffff7c096493dee7eda1acfb6f801690e960fa2b1d69398",
        "mamba2": "1c5f57067332a64f85e9d7f63b4e50bc6ea2a15e2f8fe686aa983a8ad0436f4e",
    },
}


def det(shape, salt, scale=0.25, offset=0.0):
    """Deterministic float32 array: an integer hash of (index, salt) mapped to [-scale, scale)."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64) + np.uint64(salt * 1000003)
    h = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2 ** 32)
    h = (h ^ (h >> np.uint64(13))) * np.uint64(2246822519) % np.uint64(2 ** 32)
    u = h.astype(np.float64) / 2.0 ** 32 - 0.5
    return (offset + 2 * scale * u).astype(np.float32).reshape(shape)


def digest(*arrays):
    m = hashlib.sha256()
    for a in arrays:
        m.update(np.ascontiguousarray(a).tobytes())
    return m.hexdigest()


def transformer_case():
    d, H, KV, hd, it = 24, 4, 2, 8, 40
    shapes = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
              "q_proj.weight": (H * hd, d), "k_proj.weight": (KV * hd, d),
              "v_proj.weight": (KV * hd, d), "o_proj.weight": (d, H * hd),
              "q_proj.bias": (H * hd,), "k_proj.bias": (KV * hd,), "v_proj.bias": (KV * hd,),
              "q_norm.weight": (hd,), "k_norm.weight": (hd,),
              "gate_proj.weight": (it, d), "up_proj.weight": (it, d), "down_proj.weight": (d, it)}
    w = {k: det(s, i, offset=1.0 if k.endswith("norm.weight") else 0.0)
         for i, (k, s) in enumerate(sorted(shapes.items()))}
    opts = dict(n_heads=H, n_kv_heads=KV, window=6, qkv_bias=True, qk_norm=True,
                rope_theta=1000.0, attn_softcap=20.0)
    x = det((2, 9, d), 99, scale=2.0)
    return w, opts, x


def mamba2_case():
    d, di, nh, ns, K, G = 16, 32, 4, 8, 3, 2
    cd = di + 2 * G * ns
    w = {"block_norm.weight": det((d,), 1, offset=1.0),
         "in_proj.weight": det((di + cd + nh, d), 2), "conv1d.weight": det((cd, 1, K), 3),
         "conv1d.bias": det((cd,), 4), "dt_bias": det((nh,), 5, offset=-1.0),
         "A_log": det((nh,), 6, scale=1.0), "D": det((nh,), 7, offset=1.0),
         "norm.weight": det((di,), 8, offset=1.0), "out_proj.weight": det((d, di), 9)}
    opts = dict(n_groups=G, dt_limit=(0.001, 2.0))
    x = det((2, 9, d), 98, scale=2.0)
    return w, opts, x


def test_transformer_digest():
    w, opts, x = transformer_case()
    blk = eb.TransformerBlockInference(w, **opts)
    st = blk.allocate_state(2, 12)
    y = blk.forward(x, st, lengths=[9, 5])
    for b, n in enumerate([9, 5]):   # the pinned bits are also close to the float64 reference
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
