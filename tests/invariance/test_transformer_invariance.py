"""Bitwise invariance of TransformerBlockInference (SPEC.md 3.1, 5, 9; STYLE 5.11).

Every claim here is exact: outputs are compared as ``view(np.uint32)``. For each option
(and combinations) one ``forward`` == token-by-token ``step`` == random chunk splits with a
carried state (with and without ``lengths``); a ragged row == that row alone; padding is
exactly +0.0 and never read; 1 thread == 2 and 3 threads (in process and in a subprocess via
``EXACTBLOCKS_NUM_THREADS``); every SIMD path the machine has == the scalar reference.
A failure here is a bug, never a tolerance to widen.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import force_num_threads, make_transformer_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactblocks as eb
from exactblocks import _ext

SIZES = dict(d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, intermediate=80)

# Each option appears at least once, several in combination.
CONFIGS = {
    "default": {},
    "gqa_window": dict(window=5),
    "mqa_window1": dict(n_kv_heads=1, window=1),
    "biases": dict(qkv_bias=True, o_bias=True, mlp_bias=True),
    "layernorm_gelu": dict(norm="layernorm", norm_bias=True, mlp="gelu", mlp_bias=True),
    "gemma_like": dict(norm="rmsnorm_offset", mlp="geglu_tanh", head_dim=20),
    "qwen3_like": dict(qk_norm=True, head_dim=16, window=7, qkv_bias=True),
    "gemma3_qknorm": dict(norm="rmsnorm_offset", qk_norm=True, mlp="geglu"),
    "softcap": dict(attn_softcap=1.5, window=6),
    "llama3_rope": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "linear_rope_partial": dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_dim=6),
    "stablelm_like": dict(
        norm="layernorm", norm_bias=True, mlp="gelu_tanh", rope_dim=4, qkv_bias=True
    ),
    "odd_head_dim": dict(head_dim=7, rope_dim=4, n_kv_heads=4),
    # the layer shapes of SPEC.md 4.7
    "gemma2_sandwich": dict(
        norm="rmsnorm_offset",
        norm_placement="sandwich",
        mlp="geglu_tanh",
        query_pre_attn_scalar=24,
        attn_softcap=20.0,
        window=6,
    ),
    "gemma3_sandwich_qk": dict(
        norm="rmsnorm_offset",
        norm_placement="sandwich",
        mlp="geglu_tanh",
        qk_norm=True,
        query_pre_attn_scalar=12,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "olmo2_post": dict(norm_placement="post", qk_norm=True, qk_norm_scope="all_heads"),
    "stablelm2_parallel": dict(
        norm="layernorm",
        norm_bias=True,
        qkv_bias=True,
        qk_norm=True,
        qk_norm_scope="per_head_weights",
        norm_placement="parallel",
        rope_dim=4,
    ),
    "granite_scales": dict(attn_scale=0.3, residual_multiplier=0.22),
    "nope": dict(rope_dim=0, window=5),
    "attention_half": dict(block_parts="attention", rope_dim=0, residual_multiplier=0.5),
    "mlp_half_relu2": dict(block_parts="mlp", mlp="relu2"),
    "yarn": dict(
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 16.0,
            "mscale": 0.9,
            "mscale_all_dim": 0.6,
        }
    ),
    # longrope: every call here holds more than 2 positions (long set) and fewer than 4096
    # (short set); the state-less forward uses the set of allocate_state(B, L)
    "longrope_long": dict(
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 9.0],
            "original_max_position_embeddings": 2,
        }
    ),
    "longrope_short": dict(
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 9.0],
            "original_max_position_embeddings": 4096,
            "factor": 4.0,
        }
    ),
}

WEIGHT_KEYS = ("d_model", "n_heads", "n_kv_heads", "head_dim", "intermediate")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise_equal(a: np.ndarray, b: np.ndarray, what: str = "") -> None:
    """Compare two float32 arrays bit for bit; report the first differing index."""
    assert a.shape == b.shape, f"{what}: shapes {a.shape} != {b.shape}"
    diff = bits(a) != bits(b)
    if diff.any():
        idx = tuple(int(i) for i in np.argwhere(diff)[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())} elements differ; first at {idx}: "
            f"{a[idx]!r} (0x{int(bits(a)[idx]):08x}) vs {b[idx]!r} "
            f"(0x{int(bits(b)[idx]):08x})"
        )


def make_block(name: str, seed: int = 0):
    opts = dict(SIZES)
    opts.update(CONFIGS[name])
    w = make_transformer_weights(np.random.default_rng(seed), **opts)
    drop = ["d_model", "intermediate"]
    if opts.get("block_parts") == "mlp":  # no attention: no head counts
        drop += ["n_heads", "n_kv_heads", "head_dim"]
    kwargs = {k: v for k, v in opts.items() if k not in drop}
    return eb.TransformerBlockInference(w, **kwargs)


def inputs(rng, b, n, d, scale=1.0):
    return (scale * rng.standard_normal((b, n, d))).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_equals_steps_and_chunks(name):
    blk = make_block(name)
    rng = np.random.default_rng(1)
    B, L = 3, 17
    x = inputs(rng, B, L, blk.d_model)
    ref = blk.forward(x)
    # state-less forward == fresh state of max_tokens L
    st0 = blk.allocate_state(B, L)
    assert_bitwise_equal(ref, blk.forward(x, st0), f"{name}: forward(state)")
    # token by token
    st1 = blk.allocate_state(B, L + 3)
    steps = np.concatenate([blk.step(x[:, t], st1) for t in range(L)], axis=1)
    assert_bitwise_equal(ref, steps, f"{name}: step loop")
    assert st1.row_tokens.tolist() == [L] * B
    # random chunk splits, several draws
    for draw in range(3):
        cuts = sorted(rng.choice(np.arange(1, L), size=draw + 2, replace=False).tolist())
        st2 = blk.allocate_state(B, L)
        parts, lo = [], 0
        for hi in cuts + [L]:
            parts.append(blk.forward(x[:, lo:hi], st2))
            lo = hi
        assert_bitwise_equal(ref, np.concatenate(parts, axis=1), f"{name}: chunks {cuts}")
        # the cache holds the same bits whichever way the tokens arrived
        assert_bitwise_equal(st0.k_cache, st2.k_cache, f"{name}: k_cache chunks {cuts}")
        assert_bitwise_equal(st0.v_cache, st2.v_cache, f"{name}: v_cache chunks {cuts}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ragged_row_equals_row_alone_and_padding_is_zero(name):
    blk = make_block(name)
    rng = np.random.default_rng(2)
    B, L = 4, 11
    x = inputs(rng, B, L, blk.d_model)
    lengths = [11, 4, 0, 7]
    xp = x.copy()
    for b, n in enumerate(lengths):
        xp[b, n:] = np.nan  # padding is never read
    y = blk.forward(xp, lengths=lengths)
    for b, n in enumerate(lengths):
        assert np.all(bits(y[b, n:]) == 0), f"{name}: padding of row {b} is not +0.0"
        if n:
            alone = blk.forward(x[b : b + 1, :n])
            assert_bitwise_equal(y[b, :n], alone[0], f"{name}: row {b} vs alone")
    assert_bitwise_equal(
        blk.forward(x), blk.forward(x, lengths=[L] * B), f"{name}: lengths=[L]*B vs None"
    )


@pytest.mark.parametrize("name", ["default", "gqa_window", "qwen3_like"])
def test_continuous_batching_rows_at_different_positions(name):
    """Rows at different positions, some idle, in one call == each sequence alone."""
    blk = make_block(name)
    rng = np.random.default_rng(3)
    B, T = 3, 20
    seqs = [inputs(rng, 1, T, blk.d_model)[0] for _ in range(B)]
    alone = [blk.forward(s[None])[0] for s in seqs]
    st = blk.allocate_state(B, T)
    pos = [0] * B
    outs = [[] for _ in range(B)]
    while min(pos) < T:
        want = [int(rng.integers(0, 5)) for _ in range(B)]
        n = [min(w, T - p) for w, p in zip(want, pos)]
        L = max(max(n), 1)
        x = np.full((B, L, blk.d_model), np.nan, np.float32)
        for b in range(B):
            x[b, : n[b]] = seqs[b][pos[b] : pos[b] + n[b]]
        before = st.k_cache.copy()
        y = blk.forward(x, st, lengths=n)
        for b in range(B):
            outs[b].append(y[b, : n[b]])
            assert np.all(bits(y[b, n[b] :]) == 0)
            if n[b] == 0:  # idle rows are untouched
                assert_bitwise_equal(before[b], st.k_cache[b], "idle row cache")
            pos[b] += n[b]
        assert st.row_tokens.tolist() == pos
    for b in range(B):
        assert_bitwise_equal(alone[b], np.concatenate(outs[b], axis=0), f"{name}: row {b}")


def test_window_ring_longer_than_capacity():
    """A ring of `window` slots: calls longer than the ring, and positions past it."""
    blk = make_block("gqa_window")
    rng = np.random.default_rng(4)
    x = inputs(rng, 2, 23, blk.d_model)
    ref = blk.forward(x)
    st = blk.allocate_state(2, 30)
    assert st.capacity == 5
    y = np.concatenate(
        [blk.forward(x[:, :12], st), blk.forward(x[:, 12:13], st), blk.forward(x[:, 13:], st)],
        axis=1,
    )
    assert_bitwise_equal(ref, y, "ring chunks")
    # the window edge: position p attends to exactly [p-4, p]; changing token p-5 changes
    # nothing at p, changing token p-4 does.
    p = 10
    x2 = x.copy()
    x2[:, p - 5] += 1.0
    y2 = blk.forward(x2)
    assert_bitwise_equal(ref[:, p], y2[:, p], "token outside the window")
    x3 = x.copy()
    x3[:, p - 4] += 1.0
    assert not np.array_equal(bits(ref[:, p]), bits(blk.forward(x3)[:, p]))


def test_rollback_without_window_is_exact():
    blk = make_block("default")
    rng = np.random.default_rng(5)
    x = inputs(rng, 1, 12, blk.d_model)
    other = inputs(rng, 1, 4, blk.d_model)
    ref = blk.forward(x)
    st = blk.allocate_state(1, 16)
    blk.forward(x[:, :8], st)
    blk.forward(other, st)  # a wrong continuation ...
    st.row_tokens[0] = 8  # ... rolled back
    assert_bitwise_equal(ref[:, 8:], blk.forward(x[:, 8:], st), "after rollback")


@pytest.mark.parametrize("name", ["default", "biases", "qwen3_like", "softcap"])
def test_threads_do_not_change_bits(name):
    blk = make_block(name)
    rng = np.random.default_rng(6)
    x = inputs(rng, 3, 33, blk.d_model)
    saved = eb.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 8):
            force_num_threads(n)
            st = blk.allocate_state(3, 40)
            y = blk.forward(x[:, :20], st)
            results.append(
                (np.concatenate([y, blk.forward(x[:, 20:], st)], axis=1), blk.step(x[:, 0], st))
            )
    finally:
        eb.set_num_threads(saved)
    for (y, s), n in zip(results[1:], (2, 3, 8)):
        assert_bitwise_equal(results[0][0], y, f"{name}: threads 1 vs {n}")
        assert_bitwise_equal(results[0][1], s, f"{name}: step threads 1 vs {n}")


_SUBPROCESS = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    import exactblocks as eb
    from helpers import make_transformer_weights
    w = make_transformer_weights(np.random.default_rng(0), 48, 4, 2, 12, 80, qkv_bias=True)
    blk = eb.TransformerBlockInference(w, n_heads=4, qkv_bias=True, window=9)
    x = np.random.default_rng(1).standard_normal((2, 40, 48)).astype(np.float32)
    sys.stdout.write(eb.get_num_threads().__repr__() + " " + blk.forward(x).tobytes().hex())
""")


def test_threads_env_subprocess():
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = {}
    for n in ("1", "2"):
        env = dict(os.environ, EXACTBLOCKS_NUM_THREADS=n, OMP_NUM_THREADS=n)
        res = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS.format(tests=tests)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        threads, hexbytes = res.stdout.split()
        assert threads == n
        outs[n] = hexbytes
    assert outs["1"] == outs["2"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_isa_equals_scalar(name):
    core = _ext.core()
    isas = core.available_isas()
    blk = make_block(name)
    rng = np.random.default_rng(7)
    x = inputs(rng, 2, 21, blk.d_model)
    saved = core.get_isa()
    got = {}
    try:
        for isa in isas:
            core.set_isa(isa)
            st = blk.allocate_state(2, 22)
            y = blk.forward(x[:, :13], st, lengths=[13, 9])
            got[isa] = (y, blk.step(x[:, 13], st))
    finally:
        core.set_isa(saved)
    for isa in isas:
        assert_bitwise_equal(got["scalar"][0], got[isa][0], f"{name}: {isa} vs scalar (forward)")
        assert_bitwise_equal(got["scalar"][1], got[isa][1], f"{name}: {isa} vs scalar (step)")


def test_decode_session_equals_block_calls():
    blk = make_block("gqa_window")
    rng = np.random.default_rng(8)
    x = inputs(rng, 2, 14, blk.d_model)
    st_a, st_b = blk.allocate_state(2, 14), blk.allocate_state(2, 14)
    ya = [blk.forward(x[:, :6], st_a)] + [blk.step(x[:, t], st_a) for t in range(6, 14)]
    with blk.decode_session(st_b) as sess:
        yb = [sess.forward(x[:, :6])] + [sess.step(x[:, t]) for t in range(6, 14)]
    assert_bitwise_equal(np.concatenate(ya, 1), np.concatenate(yb, 1), "session vs block")
    assert_bitwise_equal(st_a.k_cache, st_b.k_cache, "session cache")


def test_same_call_twice_and_pickled_block():
    import pickle

    blk = make_block("biases")
    x = inputs(np.random.default_rng(9), 2, 9, blk.d_model)
    y1, y2 = blk.forward(x), blk.forward(x)
    assert_bitwise_equal(y1, y2, "repeat")
    blk2 = pickle.loads(pickle.dumps(blk))
    assert blk2.fingerprint == blk.fingerprint
    assert_bitwise_equal(y1, blk2.forward(x), "pickled block")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_shapes(data):
    n_kv = data.draw(st.integers(1, 3), "n_kv_heads")
    n_heads = n_kv * data.draw(st.integers(1, 3), "n_rep")
    head_dim = data.draw(st.integers(2, 20), "head_dim")
    rope_dim = data.draw(st.integers(1, head_dim // 2), "rope_half") * 2
    opts = dict(
        d_model=data.draw(st.integers(1, 40), "d_model"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate=data.draw(st.integers(1, 50)),
        window=data.draw(st.integers(0, 6), "window"),
        rope_dim=rope_dim,
        mlp=data.draw(st.sampled_from(["swiglu", "gelu", "geglu_tanh"])),
        qkv_bias=data.draw(st.booleans()),
        qk_norm=data.draw(st.booleans()),
    )
    w = make_transformer_weights(np.random.default_rng(data.draw(st.integers(0, 99))), **opts)
    blk = eb.TransformerBlockInference(
        w, **{k: v for k, v in opts.items() if k not in ("d_model", "intermediate")}
    )
    B, L = data.draw(st.integers(1, 3), "B"), data.draw(st.integers(1, 12), "L")
    x = inputs(np.random.default_rng(0), B, L, opts["d_model"])
    ref = blk.forward(x)
    st_ = blk.allocate_state(B, L)
    cut = data.draw(st.integers(1, L), "cut")
    y = np.concatenate(
        [blk.forward(x[:, :cut], st_)] + ([blk.forward(x[:, cut:], st_)] if cut < L else []), axis=1
    )
    assert_bitwise_equal(ref, y, f"hypothesis {opts} B={B} L={L} cut={cut}")
    lengths = [data.draw(st.integers(0, L)) for _ in range(B)]
    yr = blk.forward(x, lengths=lengths)
    for b, n in enumerate(lengths):
        assert np.all(bits(yr[b, n:]) == 0)
        if n:
            assert_bitwise_equal(yr[b, :n], blk.forward(x[b : b + 1, :n])[0], "ragged row")


@pytest.mark.parametrize("n_kv,n_rep", [(1, 8), (1, 3), (3, 3), (2, 5), (3, 1)])
def test_decode_heads_split_over_threads(n_kv, n_rep):
    """A decode step with fewer (token, KV head) pairs than 2 per thread splits each KV head's
    query heads over tasks (csrc/ops/attention/plan.hpp): one row decoded token by token
    on 1, 2, 3 and 8 threads and on every ISA has the bits of one prefill of the same tokens
    (which keeps every KV head's queries together)."""
    core = _ext.core()
    opts = dict(SIZES, n_kv_heads=n_kv, n_heads=n_kv * n_rep, head_dim=16)
    w = make_transformer_weights(np.random.default_rng(n_kv * 10 + n_rep), **opts)
    blk = eb.TransformerBlockInference(
        w, **{k: v for k, v in opts.items() if k not in ("d_model", "intermediate")}
    )
    x = inputs(np.random.default_rng(3), 1, 24, blk.d_model)
    ref = blk.forward(x)
    saved_isa, saved_nt = core.get_isa(), eb.get_num_threads()
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            for n in (1, 2, 3, 8):
                force_num_threads(n)
                st = blk.allocate_state(1, 24)
                steps = np.concatenate([blk.step(x[:, t], st) for t in range(24)], axis=1)
                assert_bitwise_equal(ref, steps, f"n_kv={n_kv} n_rep={n_rep} {isa} {n} threads")
    finally:
        core.set_isa(saved_isa)
        eb.set_num_threads(saved_nt)


@pytest.mark.parametrize("name", ["default", "gqa_window", "odd_head_dim", "softcap", "gemma_like"])
def test_long_prefill_paths_agree_on_every_isa(name):
    """Rows with >= 16 tokens in a call score their keys from transposed key blocks, shorter
    calls key by key (csrc/ops/attention/kernels.hpp): both paths, on every ISA, give the same
    bits."""
    core = _ext.core()
    blk = make_block(name)
    rng = np.random.default_rng(12)
    x = inputs(rng, 2, 41, blk.d_model)
    saved = core.get_isa()
    outs = {}
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            st = blk.allocate_state(2, 48)
            y = np.concatenate(
                [
                    blk.forward(x[:, :30], st, lengths=[30, 20])[:, :20],
                    blk.forward(x[:, 20:41], st, lengths=[0, 21])[:, :0],
                ],
                axis=1,
            )
            outs[isa] = (blk.forward(x), y, st.k_cache.copy())
            st2 = blk.allocate_state(2, 48)
            steps = np.concatenate([blk.step(x[:, t], st2) for t in range(41)], axis=1)
            assert_bitwise_equal(outs[isa][0], steps, f"{name} {isa}: long forward vs steps")
    finally:
        core.set_isa(saved)
    for isa in outs:
        for a, b, what in zip(outs["scalar"], outs[isa], ("forward", "ragged", "cache")):
            assert_bitwise_equal(a, b, f"{name}: {isa} vs scalar ({what})")
