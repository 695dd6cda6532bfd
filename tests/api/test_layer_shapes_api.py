"""API of the layer-shape options (SPEC.md 4.1, 4.2, 4.7): types and values of each
new option, bad combinations, the weight spellings folded at construction (fused Phi-3
projections, Nemotron-H, GraniteMoeHybrid, StableLM per-head norms) and the refusals that name
the architecture a weight dict looks like. Numerics are in tests/oracle/test_layer_shapes_hf.py
and tests/invariance/test_transformer_invariance.py."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from helpers import API_SIZES as SIZES
from helpers import make_transformer_weights, to_hf_names

from exactblocks import TransformerBlockInference

NH, NKV, HD, D, IT = (
    SIZES[k] for k in ("n_heads", "n_kv_heads", "head_dim", "d_model", "intermediate")
)


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (literal text)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def weights_for(seed=7, **opts):
    return make_transformer_weights(np.random.default_rng(seed), **SIZES, **opts)


def build(w, **opts):
    kw = {} if opts.get("block_parts") == "mlp" else {"n_heads": NH}
    kw.update(opts)
    return TransformerBlockInference(w, **kw)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture
def x():
    return np.random.default_rng(3).standard_normal((2, 6, D)).astype(np.float32)


# --------------------------------------------------------------------------- option values


@pytest.mark.parametrize(
    "opt,value,exc,fragments",
    [
        ("norm_placement", "Pre", ValueError, ("norm_placement", "'sandwich'", "'parallel'")),
        ("norm_placement", 1, TypeError, ("norm_placement",)),
        ("block_parts", "attention_only", ValueError, ("block_parts", "'attention'", "'mlp'")),
        ("block_parts", None, TypeError, ("block_parts",)),
        ("qk_norm_scope", "heads", ValueError, ("qk_norm_scope", "'all_heads'")),
        ("qk_norm_scope", ["head"], TypeError, ("qk_norm_scope",)),
        ("query_pre_attn_scalar", 0, ValueError, ("query_pre_attn_scalar", "> 0")),
        ("query_pre_attn_scalar", float("nan"), ValueError, ("query_pre_attn_scalar", "finite")),
        ("query_pre_attn_scalar", "256", TypeError, ("query_pre_attn_scalar",)),
        ("query_pre_attn_scalar", True, TypeError, ("query_pre_attn_scalar",)),
        ("attn_scale", -0.5, ValueError, ("attn_scale", "> 0")),
        ("attn_scale", float("inf"), ValueError, ("attn_scale", "finite")),
        ("attn_scale", 1e39, ValueError, ("attn_scale",)),
        ("attn_scale", "0.1", TypeError, ("attn_scale",)),
        ("residual_multiplier", 0.0, ValueError, ("residual_multiplier", "> 0")),
        ("residual_multiplier", None, TypeError, ("residual_multiplier",)),
        ("residual_multiplier", 1e-50, ValueError, ("residual_multiplier",)),
        ("mlp", "relu", ValueError, ("mlp", "'relu2'")),
        ("rope_dim", 3, ValueError, ("rope_dim", "0 (no RoPE)", "even")),
    ],
)
def test_option_type_and_value(opt, value, exc, fragments):
    with raises(exc, "TransformerBlockInference.__init__", *fragments):
        build(weights_for(), **{opt: value})


def test_new_options_in_force_and_properties(x):
    w = weights_for(norm_placement="sandwich")
    blk = build(
        w,
        norm_placement="sandwich",
        query_pre_attn_scalar=24,
        residual_multiplier=0.5,
    )
    p = blk.get_params()
    assert (p["norm_placement"], p["block_parts"], p["qk_norm_scope"]) == (
        "sandwich",
        "full",
        "head",
    )
    assert p["query_pre_attn_scalar"] == 24 and p["attn_scale"] is None
    assert blk.residual_multiplier == 0.5 and blk.norm_placement == "sandwich"
    twin = TransformerBlockInference(w, **p)
    assert twin.fingerprint == blk.fingerprint
    assert np.array_equal(bits(twin.forward(x)), bits(blk.forward(x)))
    with pytest.raises(AttributeError):
        blk.norm_placement = "pre"
    # query_pre_attn_scalar q is attn_scale = 1/sqrt(q) (rounded to float32 either way)
    same = build(w, norm_placement="sandwich", attn_scale=24**-0.5, residual_multiplier=0.5)
    assert np.array_equal(bits(same.forward(x)), bits(blk.forward(x)))
    assert same.fingerprint != blk.fingerprint  # different options in force


def test_each_setting_changes_the_output(x):
    base_w = weights_for()
    ref = build(base_w).forward(x)
    for opts in (
        dict(attn_scale=0.2),
        dict(query_pre_attn_scalar=3.0),
        dict(residual_multiplier=0.5),
        dict(rope_dim=0),
    ):
        assert not np.array_equal(build(base_w, **opts).forward(x), ref), opts


def test_combinations_refused():
    w = weights_for()
    with raises(ValueError, "query_pre_attn_scalar", "attn_scale", "one of them"):
        build(w, query_pre_attn_scalar=24, attn_scale=0.2)
    with raises(ValueError, "qk_norm_scope='all_heads'", "qk_norm=True"):
        build(w, qk_norm_scope="all_heads")
    with raises(ValueError, "norm_placement='parallel'", "block_parts='full'"):
        build(
            weights_for(block_parts="attention"), block_parts="attention", norm_placement="parallel"
        )
    with raises(TypeError, "n_heads is required", "block_parts='mlp'"):
        TransformerBlockInference(w)
    mw = weights_for(block_parts="mlp")
    with raises(ValueError, "n_heads=4", "attention option", "block_parts='mlp'"):
        build(mw, block_parts="mlp", n_heads=4)
    with raises(ValueError, "window=3", "attention option"):
        build(mw, block_parts="mlp", window=3)
    aw = weights_for(block_parts="attention")
    with raises(ValueError, "mlp='geglu'", "MLP option", "block_parts='attention'"):
        build(aw, block_parts="attention", mlp="geglu")
    with raises(ValueError, "query_pre_attn_scalar=1e-300", "float32"):
        build(w, query_pre_attn_scalar=1e-300)


# --------------------------------------------------------------------------- rope


LONG = dict(
    rope_type="longrope",
    short_factor=[1.0, 1.5, 2.0, 3.0],
    long_factor=[1.0, 3.0, 5.0, 7.0],
    original_max_position_embeddings=16,
)


@pytest.mark.parametrize(
    "scaling,exc,fragments",
    [
        (
            {"rope_type": "yarn", "factor": 4.0},
            ValueError,
            ("original_max_position_embeddings", "missing"),
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": "x",
            },
            TypeError,
            ("rope_scaling['beta_fast']",),
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "truncate": 1,
            },
            TypeError,
            ("rope_scaling['truncate']",),
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "mscale": -1,
            },
            ValueError,
            ("rope_scaling['mscale']",),
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "low_freq_factor": 1,
            },
            ValueError,
            ("rope_scaling['low_freq_factor']", "not supported for rope type 'yarn'"),
        ),
        (dict(LONG, short_factor=None), ValueError, ("rope_scaling['short_factor']", "missing")),
        (dict(LONG, long_factor=2.0), TypeError, ("rope_scaling['long_factor']", "list")),
        (dict(LONG, long_factor=[]), ValueError, ("rope_scaling['long_factor']", "empty")),
        (
            dict(LONG, long_factor=[1, 2, 0, 3]),
            ValueError,
            ("rope_scaling['long_factor'][2]", "> 0"),
        ),
        (
            dict(LONG, short_factor=[1.0, 2.0]),
            ValueError,
            ("short_factor", "2 factors", "rope_dim / 2 = 4"),
        ),
        (dict(LONG, original_max_position_embeddings=1), ValueError, ("longrope", ">= 2")),
        (dict(LONG, attention_factor=0.0), ValueError, ("rope_scaling['attention_factor']", "> 0")),
    ],
)
def test_yarn_longrope_checks(scaling, exc, fragments):
    with raises(exc, "TransformerBlockInference.__init__", *fragments):
        build(weights_for(), rope_scaling=scaling)


def test_yarn_longrope_accepted_and_none_keys(x):
    w = weights_for()
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    a = build(w, rope_scaling=yarn)
    # HF configs spell "not given" as None: same block
    b = build(w, rope_scaling=dict(yarn, beta_fast=None, mscale=None, attention_factor=None))
    assert np.array_equal(bits(a.forward(x)), bits(b.forward(x)))
    assert a.get_params()["rope_scaling"] == yarn
    blk = build(w, rope_scaling=LONG, max_positions=64)
    assert blk.get_params()["rope_scaling"]["long_factor"] == LONG["long_factor"]
    # longrope's default factor is max_positions / original (HF: max_position_embeddings)
    other = build(w, rope_scaling=LONG, max_positions=128)
    assert not np.array_equal(blk.forward(x), other.forward(x))
    explicit = build(w, rope_scaling=dict(LONG, factor=4.0), max_positions=128)
    assert np.array_equal(bits(explicit.forward(x)), bits(blk.forward(x)))


def test_longrope_state_set_and_repr():
    blk = build(weights_for(), rope_scaling=LONG, max_positions=64)
    short, long = blk.allocate_state(1, 16), blk.allocate_state(1, 17)
    assert (short.rope_factors, long.rope_factors) == ("short", "long")
    assert "rope_factors='long'" in repr(long)
    assert pickle.loads(pickle.dumps(long)).rope_factors == "long"
    with pytest.raises(AttributeError):
        long.rope_factors = "short"
    assert build(weights_for()).allocate_state(1, 4).rope_factors is None


def test_rope_dim_zero_ignores_rope_tables(x):
    w = weights_for()
    a = build(w, rope_dim=0)
    b = build(w, rope_dim=0, rope_theta=5.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert np.array_equal(bits(a.forward(x)), bits(b.forward(x)))
    assert a.rope_dim == 0 and a.get_params()["rope_dim"] == 0


# --------------------------------------------------------------------------- half blocks


def test_half_blocks(x):
    aw = weights_for(block_parts="attention")
    assert set(aw) == {
        "input_layernorm.weight",
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
    }
    attn = build(aw, block_parts="attention")
    assert attn.intermediate == 0 and attn.d_model == D
    mw = weights_for(block_parts="mlp")
    assert set(mw) == {
        "post_attention_layernorm.weight",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    }
    mlp = build(mw, block_parts="mlp")
    p = mlp.get_params()
    assert (p["n_heads"], p["n_kv_heads"], p["head_dim"], p["rope_dim"]) == (None,) * 4
    assert mlp.intermediate == IT
    st = mlp.allocate_state(2, 8)
    assert st.k_cache.shape == (2, 0, 8, 0)
    y = mlp.forward(x, st)
    assert st.row_tokens.tolist() == [6, 6]
    assert np.array_equal(bits(y), bits(mlp.forward(x)))
    # the two halves of a pre-norm layer == the full block, bit for bit
    full = build({**aw, **mw})
    assert np.array_equal(bits(mlp.forward(attn.forward(x))), bits(full.forward(x)))
    # Nemotron-H's single norm name
    nem = {
        ("norm.weight" if k == "input_layernorm.weight" else "mixer." + k): v for k, v in aw.items()
    }
    assert build(nem, block_parts="attention").fingerprint == attn.fingerprint
    nem_m = {("norm.weight" if k.startswith("post_") else "mixer." + k): v for k, v in mw.items()}
    assert build(nem_m, block_parts="mlp").fingerprint == mlp.fingerprint
    with raises(ValueError, "weights['norm.weight']", "Nemotron-H", "block_parts='attention'"):
        build(nem)
    with raises(ValueError, "norm.weight", "norm_placement='sandwich'"):
        build(nem, block_parts="attention", norm_placement="sandwich")
    with raises(ValueError, "twice"):
        build(
            {**nem, "input_layernorm.weight": aw["input_layernorm.weight"]}, block_parts="attention"
        )


# --------------------------------------------------------------------------- spellings


def test_fused_phi3_projections(x):
    w = weights_for()
    split = build(w)
    fused = {
        k: v
        for k, v in w.items()
        if k.split(".")[0] not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    }
    fused["qkv_proj.weight"] = np.concatenate(
        [w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]]
    )
    fused["gate_up_proj.weight"] = np.concatenate([w["gate_proj.weight"], w["up_proj.weight"]])
    blk = build(fused)
    assert blk.fingerprint == split.fingerprint
    assert np.array_equal(bits(blk.forward(x)), bits(split.forward(x)))
    hf = to_hf_names(
        {
            k: v
            for k, v in fused.items()
            if "_proj" not in k or k.startswith("o_") or k.startswith("down")
        }
    )
    hf["self_attn.qkv_proj.weight"] = fused["qkv_proj.weight"]
    hf["mlp.gate_up_proj.weight"] = fused["gate_up_proj.weight"]
    assert build(hf).fingerprint == split.fingerprint
    assert build(fused, head_dim=HD).fingerprint == split.fingerprint  # split by head_dim
    with raises(ValueError, "'q_proj.weight' twice", "qkv_proj.weight"):
        build({**fused, "q_proj.weight": w["q_proj.weight"]})
    with raises(ValueError, "gate_up_proj.weight", "2 * intermediate"):
        build({**fused, "gate_up_proj.weight": fused["gate_up_proj.weight"][:-1]})
    with raises(ValueError, "qkv_proj.weight", "not a positive even number"):
        build({**fused, "qkv_proj.weight": fused["qkv_proj.weight"][:-1]})
    with raises(TypeError, "qkv_proj.weight"):
        build({**fused, "qkv_proj.weight": fused["qkv_proj.weight"].astype(np.float64)})


def test_granite_hybrid_and_stablelm_spellings(x):
    w = weights_for(qk_norm=True, qk_norm_scope="per_head_weights", norm="layernorm")
    ref = build(w, qk_norm=True, qk_norm_scope="per_head_weights", norm="layernorm")
    hf = to_hf_names(
        {k: v for k, v in w.items() if not k.startswith(("q_norm", "k_norm", "gate", "up", "down"))}
    )
    for h in range(NH):
        hf[f"self_attn.q_layernorm.norms.{h}.weight"] = w["q_norm.weight"][h]
    for h in range(NKV):
        hf[f"self_attn.k_layernorm.norms.{h}.weight"] = w["k_norm.weight"][h]
    hf["shared_mlp.input_linear.weight"] = np.concatenate(
        [w["gate_proj.weight"], w["up_proj.weight"]]
    )
    hf["shared_mlp.output_linear.weight"] = w["down_proj.weight"]
    blk = build(hf, qk_norm=True, qk_norm_scope="per_head_weights", norm="layernorm")
    assert blk.fingerprint == ref.fingerprint
    del hf["self_attn.k_layernorm.norms.0.weight"]
    with raises(ValueError, "k_layernorm.norms.N.weight", "without gaps"):
        build(hf, qk_norm=True, qk_norm_scope="per_head_weights", norm="layernorm")


# --------------------------------------------------------------------------- teaching refusals


def test_refusals_name_the_architecture():
    gemma = weights_for(norm_placement="sandwich")
    with raises(ValueError, "Gemma 2 / Gemma 3", "norm_placement='sandwich'"):
        build(gemma)
    with raises(ValueError, "Gemma 2 / Gemma 3", "norm_placement='sandwich'"):
        build(gemma, norm_placement="post")
    olmo = weights_for(norm_placement="post", qk_norm=True, qk_norm_scope="all_heads")
    with raises(ValueError, "OLMo 2", "norm_placement='post'"):
        build(olmo, qk_norm=True, qk_norm_scope="all_heads")
    with raises(ValueError, "q_norm.weight", "(32,)", "qk_norm_scope='all_heads'"):
        build(olmo, norm_placement="post", qk_norm=True)
    with raises(ValueError, "q/k norms", "qk_norm=True"):
        build(olmo, norm_placement="post")
    stab = weights_for(qk_norm=True, qk_norm_scope="per_head_weights")
    with raises(ValueError, "(4, 8)", "qk_norm_scope='per_head_weights'"):
        build(stab, qk_norm=True)
    with raises(ValueError, "attention-only layer", "block_parts='attention'"):
        build(weights_for(block_parts="attention"))
    with raises(ValueError, "MLP-only layer", "block_parts='mlp'"):
        build(weights_for(block_parts="mlp"))
    # never from a subset of its weights: a full layer given to a half block
    with raises(ValueError, "only used with an MLP half"):
        build(weights_for(), block_parts="attention")
    with raises(ValueError, "only used with"):
        build(weights_for(), block_parts="mlp")
    # a sandwich placement without its MLP norms
    partial = {k: v for k, v in gemma.items() if not k.startswith("pre_feedforward")}
    with raises(ValueError, "missing", "pre_feedforward_layernorm.weight"):
        build(partial, norm_placement="sandwich")
