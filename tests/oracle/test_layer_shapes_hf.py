"""The layer shapes of SPEC.md 4.7 through the public API, against HF's own layer classes.

Each HF layer of ``test_core_layer_shapes`` (same builders, same seeded weights) is built as
``exactblocks.TransformerBlockInference`` from the HF layer's own ``state_dict()``, with the HF
names (Phi-3's fused ``qkv_proj`` / ``gate_up_proj``, Nemotron-H's ``norm`` / ``mixer.*``,
GraniteMoeHybrid's ``shared_mlp.*``, StableLM's per-head ``q_layernorm.norms.N``) and the
public options, and compared with the HF layer in float32 with eager attention (SPEC 4.6:
rtol = atol = 2e-4). Then, for every shape, the bit promises through the block API, all as
``view(np.uint32)`` equality: one prefill == token-by-token ``step`` == a chunk split with a
carried state; a ragged row == that row alone, padding +0.0; 1 == 2 threads; every ISA the
machine has == scalar. And longrope's factor set per state (``state.rope_factors``).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

# skips this module locally when torch / transformers / the build are missing (CI: an error)
import test_core_layer_shapes as shapes

import exactblocks as eb
from exactblocks import _ext

RTOL = ATOL = 2e-4  # SPEC 4.6
NH, MAX_POS = shapes.NH, shapes.MAX_POS


def _gemma(name: str, cfg) -> dict:
    sliding = name.endswith("sliding")
    o = dict(
        n_heads=NH,
        norm="rmsnorm_offset",
        norm_placement="sandwich",
        mlp="geglu_tanh",
        query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        window=cfg.sliding_window if sliding else 0,
        norm_eps=cfg.rms_norm_eps,
        max_positions=MAX_POS,
    )
    if name.startswith("gemma2"):
        o["attn_softcap"] = cfg.attn_logit_softcapping
    else:
        o["qk_norm"] = True
        rope = dict(cfg.rope_parameters["sliding_attention" if sliding else "full_attention"])
        o.update(rope_theta=rope["rope_theta"], rope_scaling=rope)
    return o


def public_options(name: str) -> dict:
    """The public options of each HF layer, from its HF config (as a user would set them)."""
    shape = shapes.get_shape(name)
    cfg = shape.extra["config"]
    if name.startswith("gemma"):
        return _gemma(name, cfg)
    base = dict(n_heads=NH, max_positions=MAX_POS)
    if name == "olmo2":
        return dict(
            base,
            norm_placement="post",
            qk_norm=True,
            qk_norm_scope="all_heads",
            rope_theta=500000.0,
            norm_eps=cfg.rms_norm_eps,
        )
    if name.startswith("smollm3"):
        return dict(
            base,
            rope_theta=2000000.0,
            rope_dim=None if name.endswith("_rope") else 0,
            norm_eps=cfg.rms_norm_eps,
        )
    if name == "granite":
        return dict(
            base,
            attn_scale=cfg.attention_multiplier,
            residual_multiplier=cfg.residual_multiplier,
            norm_eps=cfg.rms_norm_eps,
        )
    if name.startswith("phi3"):
        # partial_rotary_factor inside the rope dict gives rope_dim; max_positions plays HF's
        # max_position_embeddings in longrope's default factor
        return dict(
            base,
            rope_scaling=shape.extra["rope"],
            max_positions=cfg.max_position_embeddings,
            norm_eps=cfg.rms_norm_eps,
        )
    if name.startswith("llama_yarn"):
        return dict(base, rope_scaling=shape.extra["rope"], norm_eps=cfg.rms_norm_eps)
    if name == "nemotron_h_attention":
        return dict(base, block_parts="attention", rope_dim=0, norm_eps=cfg.layer_norm_epsilon)
    if name == "nemotron_h_mlp":
        return dict(
            block_parts="mlp", mlp="relu2", norm_eps=cfg.layer_norm_epsilon, max_positions=MAX_POS
        )
    if name.startswith("granite_hybrid"):
        return dict(
            base,
            attn_scale=cfg.attention_multiplier,
            residual_multiplier=cfg.residual_multiplier,
            rope_dim=None if name.endswith("_rope") else 0,
            norm_eps=cfg.rms_norm_eps,
        )
    assert name.startswith("stablelm")
    return dict(
        base,
        norm="layernorm",
        norm_bias=True,
        qkv_bias=True,
        qk_norm=True,
        qk_norm_scope="per_head_weights",
        rope_dim=shapes.HD // 4,  # partial_rotary_factor=0.25
        norm_eps=cfg.layer_norm_eps,
        norm_placement="parallel" if cfg.use_parallel_residual else "pre",
    )


def hf_state(name: str) -> dict:
    """The HF layer's own state_dict(), HF names, float32 arrays."""
    return shapes._state(shapes.get_shape(name).extra["layer"])


_BLOCKS: dict = {}


def block(name: str):
    if name not in _BLOCKS:
        _BLOCKS[name] = eb.TransformerBlockInference(hf_state(name), **public_options(name))
    return _BLOCKS[name]


NAMES = sorted(shapes.BUILDERS)


# --------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("name", NAMES)
def test_public_block_matches_hf(name):
    shape = shapes.get_shape(name)
    x = shapes.make_x(2, shape.seq_len, seed=7)
    want = shape.hf(x)
    got = block(name).forward(x)
    err = float(np.max(np.abs(got - want)))
    print(f"{name}: max |exactblocks - HF| = {err:.3g}")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_public_block_is_the_core_block(name):
    """The HF spelling (fused, mixer., norm, shared_mlp, per-head names) builds the same block,
    bit for bit, as the core test's canonical short split weights; one-core shapes also have
    the same fingerprint."""
    shape = shapes.get_shape(name)
    x = shapes.make_x(2, shape.seq_len, seed=5)
    want = shapes.core_forward(shape, x)
    shapes.assert_bits(block(name).forward(x), want, f"{name}: public block vs core")
    if len(shape.cores) == 1:
        short = eb.TransformerBlockInference(shape.cores[0][1], **public_options(name))
        assert short.fingerprint == block(name).fingerprint


@pytest.mark.parametrize("rope", ["rope", "nope"])
def test_granite_hybrid_halves_equal_full_block(rope):
    """A GraniteMoeHybrid dense attention layer = its attention half then its MLP half."""
    name = f"granite_hybrid_{rope}"
    sd = hf_state(name)
    opts = public_options(name)
    attn_w = {
        k: v for k, v in sd.items() if k.startswith("self_attn.") or k == "input_layernorm.weight"
    }
    mlp_w = {k: v for k, v in sd.items() if k not in attn_w}
    attn = eb.TransformerBlockInference(attn_w, block_parts="attention", **opts)
    mlp_opts = dict(
        block_parts="mlp",
        residual_multiplier=opts["residual_multiplier"],
        norm_eps=opts["norm_eps"],
        max_positions=MAX_POS,
    )
    mlp = eb.TransformerBlockInference(mlp_w, **mlp_opts)
    x = shapes.make_x(2, 20, seed=9)
    shapes.assert_bits(mlp.forward(attn.forward(x)), block(name).forward(x), f"{name}: halves")


# --------------------------------------------------------------------------- longrope


def test_longrope_set_fixed_per_state():
    name = "phi3_longrope_long"
    blk = block(name)
    original = shapes.PHI3_ORIGINAL
    assert blk.allocate_state(1, original).rope_factors == "short"
    assert blk.allocate_state(1, original + 1).rope_factors == "long"
    assert block("granite").allocate_state(1, 4).rope_factors is None
    # A long state decoding a sequence longer than the original maximum == HF's prefill of it
    # (HF uses the long set for the whole sequence) == a state-less forward of the same tokens.
    x = shapes.make_x(1, 24, seed=21)
    st = blk.allocate_state(1, 24)
    steps = np.concatenate([blk.step(x[:, t], st) for t in range(24)], axis=1)
    shapes.assert_bits(steps, blk.forward(x), "long state decode vs prefill")
    np.testing.assert_allclose(steps, shapes.get_shape(name).hf(x), rtol=RTOL, atol=ATOL)
    # A short state == HF on a sequence within the original maximum; a long state on the same
    # short sequence uses the long factors (HF would not): they differ.
    xs = x[:, :12]
    short_st = blk.allocate_state(1, original)  # <= original: the short set
    y_short = blk.forward(xs, short_st)
    np.testing.assert_allclose(
        y_short, shapes.get_shape("phi3_longrope_short").hf(xs), rtol=RTOL, atol=ATOL
    )
    y_long = blk.forward(xs, blk.allocate_state(1, 40))
    assert not np.array_equal(y_short, y_long)
    # the set survives pickling
    back = pickle.loads(pickle.dumps(short_st))
    assert back.rope_factors == "short"
    y_next = blk.forward(x[:, 12:13], short_st)
    shapes.assert_bits(blk.forward(x[:, 12:13], back), y_next, "pickled short state")
    with pytest.raises(AttributeError):
        short_st.rope_factors = "long"


# --------------------------------------------------------------------------- bits


def _run(blk, x, chunks=None, lengths=None):
    """forward over chunks along L with one state (lengths per row, clipped per chunk)."""
    B, L, _ = x.shape
    st = blk.allocate_state(B, min(blk.max_positions, max(L, 1)))
    bounds = np.cumsum([0] + list(chunks or [L]))
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lens = None if lengths is None else np.clip(np.asarray(lengths) - a, 0, b - a)
        outs.append(blk.forward(x[:, a:b], st, lengths=lens))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", NAMES)
def test_bits_step_chunks_ragged(name):
    blk = block(name)
    L = shapes.get_shape(name).seq_len
    x = shapes.make_x(2, L, seed=11)
    full = blk.forward(x)
    st = blk.allocate_state(2, L)
    steps = np.concatenate([blk.step(x[:, t], st) for t in range(L)], axis=1)
    shapes.assert_bits(steps, full, f"{name}: step vs forward")
    chunks = [5, 7, L - 12] if L > 12 else [5, L - 5]
    shapes.assert_bits(_run(blk, x, chunks=chunks), full, f"{name}: chunks vs forward")
    x3 = shapes.make_x(3, L, seed=13)
    lengths = [L, L - 6, 0]
    both = _run(blk, x3, chunks=[9, L - 9], lengths=lengths)
    for b, n in enumerate(lengths):
        if n:
            alone = blk.forward(x3[b : b + 1, :n], blk.allocate_state(1, L))
            shapes.assert_bits(both[b : b + 1, :n], alone, f"{name}: row {b} ragged vs alone")
        assert not shapes.bits(both[b, n:]).any(), f"{name}: padding of row {b}"


@pytest.mark.parametrize("name", NAMES)
def test_bits_threads_and_isas(name):
    blk = block(name)
    core = _ext.core()
    L = shapes.get_shape(name).seq_len
    x = shapes.make_x(2, L, seed=17)
    saved_isa, saved_nt = core.get_isa(), core.get_num_threads()
    try:
        core.set_isa("scalar")
        eb.set_num_threads(1)
        ref = blk.forward(x)
        for isa in core.available_isas():
            core.set_isa(isa)
            for n in (1, 2):
                eb.set_num_threads(n)
                shapes.assert_bits(blk.forward(x), ref, f"{name}: {isa}, {n} threads")
                st = blk.allocate_state(2, L)  # longrope: the set of forward(x)
                steps = np.concatenate([blk.step(x[:, t], st) for t in range(6)], axis=1)
                shapes.assert_bits(steps, ref[:, :6], f"{name}: {isa} decode, {n} threads")
    finally:
        core.set_isa(saved_isa)
        eb.set_num_threads(saved_nt)
