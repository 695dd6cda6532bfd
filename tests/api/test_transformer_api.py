"""API contract of TransformerBlockInference, TransformerState and TransformerDecodeSession.

Covers every SPEC.md 10 row that concerns the Transformer block (exception type, the argument the
message names, and that a failed call leaves the state's buffers and counters byte-identical),
plus get/set_params, read-only attributes, pickling, sessions, state helpers, ``lengths`` forms
and buffer-protocol inputs (SPEC.md 1, 2, 4, 5, 6, 9).
"""

from __future__ import annotations

import array
import copy
import gc
import pickle
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import API_SIZES as SIZES
from helpers import assert_bitwise_equal, force_num_threads, make_transformer_weights, to_hf_names

import exactblocks
from exactblocks import TransformerBlockInference, TransformerDecodeSession, TransformerState

D = SIZES["d_model"]
NH = SIZES["n_heads"]
TBI = "TransformerBlockInference"


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def snapshot(st):
    return (st.k_cache.tobytes(), st.v_cache.tobytes(), st.row_tokens.tobytes())


def assert_unchanged(st, snap):
    assert snapshot(st) == snap, "state changed by a failed call"


def primed_state(block, x, max_tokens=16):
    """A state holding the 5 tokens of x (B = 2)."""
    st = block.allocate_state(x.shape[0], max_tokens)
    block.forward(x, st)
    return st


def build(weights, **opts):
    opts.setdefault("n_heads", NH)
    return TransformerBlockInference(weights, **opts)


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (literal text)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ------------------------------------------------------------------------------------------
# SPEC 1: package surface
# ------------------------------------------------------------------------------------------


def test_public_names_and_version():
    assert exactblocks.__version__ == "0.1.0"
    for name in (
        "TransformerBlockInference",
        "TransformerState",
        "TransformerDecodeSession",
        "arithmetic_version",
        "set_num_threads",
        "get_num_threads",
    ):
        assert name in exactblocks.__all__ and hasattr(exactblocks, name)
    assert not hasattr(exactblocks, "from_hf")  # reserved, no stub in v1


def test_extension_queries(core, block):
    assert exactblocks.arithmetic_version() == core.arithmetic_version()
    assert isinstance(exactblocks.arithmetic_version(), str) and exactblocks.arithmetic_version()
    assert block.numeric_mode_used() == "identical" == core.numeric_mode()
    assert block.vendor_used() == "cpu" == core.vendor()


def test_num_threads_roundtrip_and_checks(core):
    old = exactblocks.get_num_threads()
    try:
        exactblocks.set_num_threads(1)
        assert exactblocks.get_num_threads() == 1 == core.get_num_threads()
        cpus = exactblocks.runtime.usable_cpus()
        exactblocks.set_num_threads(np.int64(cpus))
        assert exactblocks.get_num_threads() == cpus == core.get_num_threads()
        for bad in (True, 2.0, "2", None):
            with raises(TypeError, "n"):
                exactblocks.set_num_threads(bad)
        with raises(ValueError, "n", ">= 1", "0"):
            exactblocks.set_num_threads(0)
        # Any count above the usable CPUs, however large, is capped to them with a warning
        # (README, SPEC.md 1): 10**30 once reached the extension, 10**6 raised a ValueError.
        for big in (4096, 4097, 10**6, 2**31, 10**30, 10**5000):
            exactblocks.set_num_threads(1)
            with pytest.warns(RuntimeWarning, match="exceeds the .* usable by this process"):
                exactblocks.set_num_threads(big)
            assert exactblocks.get_num_threads() == cpus == core.get_num_threads()
    finally:
        exactblocks.set_num_threads(old)


def test_threads_do_not_change_bits(block, x):
    old = exactblocks.get_num_threads()
    try:
        exactblocks.set_num_threads(1)
        y1 = block.forward(x)
        exactblocks.set_num_threads(2)
        y2 = block.forward(x)
    finally:
        exactblocks.set_num_threads(old)
    assert_bitwise_equal(y1, y2, "1 vs 2 threads")


def test_env_threads_read_at_import(tmp_path):
    code = "import exactblocks; print(exactblocks.get_num_threads())"
    env = {"EXACTBLOCKS_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"
    # Beyond the 4096 bound: a warning naming the variable, then the CPU count (<= 4096).
    env["EXACTBLOCKS_NUM_THREADS"] = str(10**30)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "EXACTBLOCKS_NUM_THREADS" in out.stderr and "[1, 4096]" in out.stderr
    assert 1 <= int(out.stdout.strip()) <= 4096


def test_import_works_without_extension_and_explains_how_to_build():
    code = (
        "import sys; sys.modules['exactblocks._core'] = None\n"
        "import exactblocks, numpy as np\n"
        "assert exactblocks.TransformerBlockInference.__doc__\n"
        "try:\n"
        "    exactblocks.arithmetic_version()\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": ":".join(sys.path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "IMPORTERROR" in out.stdout and "pip install" in out.stdout
    assert "C++17" in out.stdout


def test_extension_version_mismatch_is_import_error(monkeypatch):
    from exactblocks import _ext

    class FakeCore:
        __version__ = "9.9.9"

    monkeypatch.setattr(_ext, "_core", None)
    monkeypatch.setattr(_ext.importlib, "import_module", lambda name: FakeCore)
    with raises(ImportError, "9.9.9", "0.1.0"):
        _ext.core()


# ------------------------------------------------------------------------------------------
# SPEC 4.1 / 4.2 / 10: construction
# ------------------------------------------------------------------------------------------


def test_resolved_attributes(block, weights):
    assert (block.d_model, block.n_heads, block.n_kv_heads, block.head_dim, block.intermediate) == (
        32,
        4,
        2,
        8,
        64,
    )
    assert block.rope_dim == 8 and block.window == 0 and block.max_positions == 8192
    assert block.norm == "rmsnorm" and block.mlp == "swiglu" and block.norm_eps == 1e-06
    assert block.rope_theta == 10000.0 and block.rope_scaling is None
    assert block.attn_softcap is None and block.numeric_profile is None
    assert re.fullmatch(r"[0-9a-f]{32}", block.fingerprint)


@pytest.mark.parametrize("bad", [[("q_proj.weight", np.zeros(1, np.float32))], None, 3])
def test_weights_not_mapping(core, bad):
    with raises(TypeError, "weights", type(bad).__name__):
        TransformerBlockInference(bad, n_heads=NH)


def test_weight_key_not_str(weights):
    weights[7] = np.zeros(3, np.float32)
    with raises(TypeError, "weights", "int"):
        build(weights)


def test_missing_weight_lists_missing_and_expected(weights):
    del weights["v_proj.weight"]
    with pytest.raises(ValueError) as ei:
        build(weights)
    msg = str(ei.value)
    assert msg.startswith(f"{TBI}.__init__: ") and "missing" in msg and "'v_proj.weight'" in msg
    for k in weights:
        assert repr(k) in msg  # the full expected key set is listed


def test_unknown_weight_named(weights):
    weights["q_proj.weigth"] = weights["q_proj.weight"]
    with raises(ValueError, "q_proj.weigth", "unknown"):
        build(weights)


def test_whole_model_names_get_a_prefix_hint(weights):
    # A model's state_dict (model.layers.N.self_attn.q_proj.weight, ...) names the layer
    # prefix to strip, with the one-liner that does it.
    sd = {f"model.layers.3.{k}": v for k, v in to_hf_names(weights).items()}
    with raises(
        ValueError,
        "unknown weight names",
        "'model.layers.3.'",
        "k[15:]: v for k, v in state_dict.items() if k.startswith('model.layers.3.')",
    ):
        build(sd)
    stripped = {k[15:]: v for k, v in sd.items() if k.startswith("model.layers.3.")}
    assert build(stripped).fingerprint == build(weights).fingerprint


@pytest.mark.parametrize(
    "name,shape,option",
    [
        ("q_proj.bias", (32,), "qkv_bias"),
        ("o_proj.bias", (32,), "o_bias"),
        ("q_norm.weight", (8,), "qk_norm"),
        ("up_proj.bias", (64,), "mlp_bias"),
        ("input_layernorm.bias", (32,), "norm_bias"),
    ],
)
def test_optional_weight_with_option_off(weights, name, shape, option):
    weights[name] = np.zeros(shape, np.float32)
    with raises(ValueError, name, option):
        build(weights)


def test_gate_weight_with_ungated_mlp(weights):
    with raises(ValueError, "gate_proj.weight", "mlp='gelu'", "gated"):
        build(weights, mlp="gelu")


def test_mixed_spellings(weights):
    hf = to_hf_names(weights)
    hf["k_proj.weight"] = hf.pop("self_attn.k_proj.weight")
    with raises(ValueError, "mix", "'k_proj.weight'", "self_attn."):
        build(hf)


def test_hf_spelling_equals_short(core, weights, x):
    a, b = build(weights), build(to_hf_names(weights))
    assert a.fingerprint == b.fingerprint
    assert_bitwise_equal(a.forward(x), b.forward(x))


def test_hf_spelling_error_uses_hf_key(weights):
    hf = to_hf_names(weights)
    hf["self_attn.k_proj.weight"] = hf["self_attn.k_proj.weight"][:, :5]
    with raises(ValueError, "weights['self_attn.k_proj.weight']", "(16, 5)", "(16, 32)"):
        build(hf)


@pytest.mark.parametrize("bad", [[[0.0] * 32] * 32, None, "abc", 1.5])
def test_weight_not_a_buffer(weights, bad):
    weights["q_proj.weight"] = bad
    with raises(TypeError, "weights['q_proj.weight']", type(bad).__name__):
        build(weights)


@pytest.mark.parametrize(
    "dtype,fragments",
    [
        (np.float64, ("float64", "astype")),
        (np.float16, ("float16", "astype(numpy.float32)")),
        (np.uint16, ("uint16", "bfloat16")),
        (np.int32, ("int32",)),
        (">f4", ("big-endian",)),
        (np.bool_, ("bool",)),
    ],
)
def test_weight_dtype_refused(weights, dtype, fragments):
    weights["k_proj.weight"] = weights["k_proj.weight"].astype(dtype)
    with raises(TypeError, "weights['k_proj.weight']", *fragments):
        build(weights)


def test_weight_bytes_refused(weights):
    weights["input_layernorm.weight"] = bytes(128)
    with raises(TypeError, "weights['input_layernorm.weight']", "uint8"):
        build(weights)


@pytest.mark.parametrize(
    "name,new_shape,fragments",
    [
        ("k_proj.weight", (24, 32), ("(24, 32)", "(16, 32)", "n_kv_heads", "head_dim")),
        ("v_proj.weight", (16, 30), ("(16, 30)", "(16, 32)", "input_layernorm.weight")),
        ("o_proj.weight", (32, 16), ("(32, 16)", "(32, 32)", "n_heads*head_dim")),
        ("down_proj.weight", (32, 48), ("(32, 48)", "(32, 64)", "up_proj.weight")),
        ("gate_proj.weight", (48, 32), ("(48, 32)", "(64, 32)", "intermediate")),
        ("post_attention_layernorm.weight", (31,), ("(31,)", "(32,)", "d_model")),
        ("q_proj.weight", (32, 32, 1), ("2-D", "(32, 32, 1)")),
    ],
)
def test_weight_shape_wrong(weights, name, new_shape, fragments):
    rng = np.random.default_rng(0)
    weights[name] = rng.standard_normal(new_shape).astype(np.float32)
    with raises(ValueError, f"weights['{name}']", *fragments):
        build(weights, n_kv_heads=2)


def test_k_rows_not_multiple_of_head_dim(weights):
    weights["k_proj.weight"] = np.zeros((20, D), np.float32)
    with raises(ValueError, "weights['k_proj.weight']", "20 rows", "head_dim=8"):
        build(weights)


def test_q_rows_not_multiple_of_n_heads(weights):
    with raises(ValueError, "q_proj.weight", "32 rows", "n_heads=5"):
        build(weights, n_heads=5)


def test_kv_heads_derived_not_dividing(core):
    rng = np.random.default_rng(2)
    w = make_transformer_weights(rng, 32, 4, 3, 8, 64)
    with raises(ValueError, "n_heads=4", "n_kv_heads=3"):
        build(w)


@pytest.mark.parametrize("where", ["flat0", "inf", "last"])
def test_nonfinite_weight(weights, where):
    arr = weights["up_proj.weight"].copy()
    k, val = {"flat0": (0, np.nan), "inf": (77, np.inf), "last": (arr.size - 1, -np.inf)}[where]
    arr.reshape(-1)[k] = val
    weights["up_proj.weight"] = arr
    with raises(ValueError, "weights['up_proj.weight']", f"flat index {k}", repr(float(val))):
        build(weights)


@pytest.mark.parametrize(
    "opt,value",
    [
        ("n_heads", True),
        ("n_heads", "4"),
        ("n_heads", 4.0),
        ("n_kv_heads", 2.0),
        ("head_dim", "8"),
        ("window", 2.5),
        ("window", False),
        ("max_positions", 100.0),
        ("rope_dim", 8.0),
        ("rope_theta", "1e4"),
        ("rope_theta", True),
        ("norm_eps", "1e-6"),
        ("attn_softcap", "50"),
        ("rope_scaling", [("rope_type", "linear")]),
        ("rope_scaling", "linear"),
        ("qkv_bias", 1),
        ("o_bias", "yes"),
        ("norm_bias", None),
        ("mlp_bias", 0),
        ("qk_norm", 1.0),
        ("norm", 1),
        ("mlp", None),
        ("numeric_profile", 1),
    ],
)
def test_option_wrong_type(weights, opt, value):
    with raises(TypeError, opt, type(value).__name__):
        build(weights, **{opt: value})


@pytest.mark.parametrize(
    "opt,value,fragment",
    [
        ("n_heads", 0, "[1, 16777216]"),
        ("n_heads", -4, "[1, 16777216]"),
        ("n_kv_heads", 0, "[1, 16777216]"),
        ("head_dim", 0, "[1, 16777216]"),
        ("window", -1, "[0, 16777216]"),
        ("rope_theta", 0.0, "> 0"),
        ("rope_theta", -1.0, "> 0"),
        ("rope_theta", float("inf"), "finite"),
        ("rope_theta", float("nan"), "finite"),
        ("norm_eps", 0.0, "> 0"),
        ("norm_eps", float("nan"), "finite"),
        ("attn_softcap", 0.0, "> 0"),
        ("attn_softcap", float("inf"), "finite"),
        ("rope_dim", 3, "even"),
        ("rope_dim", 16, "[2, "),
        ("rope_dim", -2, "even"),  # 0 is valid: no RoPE
        ("max_positions", 0, "[1, 16777216]"),
        ("max_positions", 2**24 + 1, "[1, 16777216]"),
    ],
)
def test_option_out_of_range(weights, opt, value, fragment):
    with raises(ValueError, opt, fragment):
        build(weights, **{opt: value})


def test_max_positions_upper_bound_accepted(weights):
    assert build(weights, max_positions=2**24).max_positions == 2**24


def test_n_kv_heads_not_dividing(weights):
    with raises(ValueError, "n_heads=4", "n_kv_heads=3"):
        build(weights, n_kv_heads=3)


def test_odd_head_dim_needs_rope_dim(core):
    w = make_transformer_weights(np.random.default_rng(3), 32, 4, 2, 5, 64)
    with raises(ValueError, "head_dim=5", "rope_dim"):
        build(w)
    blk = build(w, rope_dim=4)
    assert (blk.head_dim, blk.rope_dim) == (5, 4)


@pytest.mark.parametrize(
    "opt,value,accepted",
    [
        ("norm", "RMSNorm", "'rmsnorm'"),
        ("norm", "batchnorm", "'rmsnorm_offset'"),
        ("mlp", "relu", "'geglu_tanh'"),
        ("mlp", "SwiGLU", "'swiglu'"),
        ("numeric_profile", "fp32_v1", "None"),
        ("numeric_profile", "fixed15_v1", "'fp32'"),
    ],
)
def test_unsupported_string(weights, opt, value, accepted):
    with raises(ValueError, opt, repr(value), accepted):
        build(weights, **{opt: value})


def test_numeric_profile_fp32_same_fingerprint(weights):
    assert build(weights, numeric_profile="fp32").fingerprint == build(weights).fingerprint


def test_no_numeric_mode_keyword(weights):
    with pytest.raises(TypeError):
        build(weights, numeric_mode="identical")


def test_norm_bias_needs_layernorm(weights):
    weights["input_layernorm.bias"] = np.zeros(D, np.float32)
    weights["post_attention_layernorm.bias"] = np.zeros(D, np.float32)
    with raises(ValueError, "norm_bias", "layernorm"):
        build(weights, norm_bias=True)
    assert build(weights, norm_bias=True, norm="layernorm").norm_bias is True


def test_qk_norm_with_layernorm(weights):
    """q/k norms take the block norm's kind, LayerNorm included (StableLM qk_layernorm)."""
    weights["q_norm.weight"] = np.ones(8, np.float32)
    weights["k_norm.weight"] = np.ones(8, np.float32)
    assert build(weights, qk_norm=True, norm="layernorm").norm == "layernorm"
    assert build(weights, qk_norm=True).qk_norm is True


@pytest.mark.parametrize(
    "scaling,exc,fragments",
    [
        ({"rope_type": "su", "factor": 2.0}, ValueError, ("'su'", "'llama3'", "'longrope'")),
        (
            {"rope_type": "yarn", "factor": 2.0},
            ValueError,
            ("rope_scaling['original_max_position_embeddings']", "missing"),
        ),
        ({"rope_type": "dynamic", "factor": 2.0}, ValueError, ("'dynamic'", "not supported yet")),
        ({"rope_type": "longrope"}, ValueError, ("'longrope'",)),
        ({"rope_type": "linear"}, ValueError, ("rope_scaling['factor']", "missing")),
        ({"factor": 2.0}, ValueError, ("rope_scaling['rope_type']", "missing")),
        (
            {"rope_type": "linear", "factor": 2.0, "attention_factor": 1.0},
            ValueError,
            ("rope_scaling['attention_factor']",),
        ),
        (
            {"rope_type": "linear", "type": "llama3", "factor": 2.0},
            ValueError,
            ("rope_scaling['rope_type']", "rope_scaling['type']", "disagree"),
        ),
        ({"rope_type": "linear", "factor": 0.0}, ValueError, ("rope_scaling['factor']", "> 0")),
        ({"rope_type": "linear", "factor": float("nan")}, ValueError, ("rope_scaling['factor']",)),
        ({"rope_type": "linear", "factor": "2"}, TypeError, ("rope_scaling['factor']",)),
        ({"rope_type": 3}, TypeError, ("rope_scaling['rope_type']",)),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
            },
            ValueError,
            ("high_freq_factor", "low_freq_factor"),
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64.0,
            },
            TypeError,
            ("rope_scaling['original_max_position_embeddings']",),
        ),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            ValueError,
            ("rope_scaling['original_max_position_embeddings']", "missing"),
        ),
        (
            {"rope_type": "default", "rope_theta": 500000.0},
            ValueError,
            ("rope_scaling['rope_theta']", "rope_theta=10000.0"),
        ),
    ],
)
def test_rope_scaling_checks(weights, scaling, exc, fragments):
    with raises(exc, *fragments):
        build(weights, rope_scaling=scaling)


def test_rope_scaling_accepted_forms(core, weights, x):
    base = build(weights)
    # 'default' (HF 5.x rope_parameters) is accepted and is the same arithmetic as None.
    dflt = build(weights, rope_scaling={"rope_type": "default", "rope_theta": 10000.0})
    assert dflt.fingerprint == base.fingerprint
    assert_bitwise_equal(dflt.forward(x), base.forward(x))
    assert dflt.rope_scaling == {"rope_type": "default", "rope_theta": 10000.0}
    lin = build(weights, rope_scaling={"type": "linear", "factor": 4})
    assert lin.fingerprint != base.fingerprint
    assert not np.array_equal(lin.forward(x), base.forward(x))
    l3 = build(
        weights,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert l3.rope_scaling["rope_type"] == "llama3"
    prf = build(
        weights, rope_dim=4, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}
    )
    assert prf.rope_dim == 4


def test_rope_scaling_copied(weights):
    rs = {"rope_type": "linear", "factor": 2.0}
    blk = build(weights, rope_scaling=rs)
    rs["factor"] = 100.0
    got = blk.rope_scaling
    assert got == {"rope_type": "linear", "factor": 2.0}
    got["factor"] = 5.0
    assert blk.rope_scaling["factor"] == 2.0


def test_positional_and_unknown_options(weights):
    with pytest.raises(TypeError):
        TransformerBlockInference(weights, NH)
    with pytest.raises(TypeError):
        build(weights, n_head=4)
    with pytest.raises(TypeError):
        TransformerBlockInference(weights)  # n_heads is required


@pytest.mark.parametrize(
    "opts",
    [
        dict(qkv_bias=True, o_bias=True),
        dict(norm="layernorm", norm_bias=True, mlp="gelu_tanh", mlp_bias=True),
        dict(norm="rmsnorm_offset", qk_norm=True, mlp="geglu_tanh", attn_softcap=30.0),
        dict(window=3, mlp="geglu", mlp_bias=True),
    ],
)
def test_option_combinations_construct_and_run(core, opts, x):
    w = make_transformer_weights(np.random.default_rng(5), **SIZES, **opts)
    blk = build(w, **opts)
    y = blk.forward(x)
    assert y.shape == x.shape and np.isfinite(y).all()
    for k, v in opts.items():
        assert getattr(blk, k) == v


def test_weights_are_copied(core, weights, x):
    blk = build(weights)
    y0 = blk.forward(x)
    weights["q_proj.weight"][...] = 0.0
    weights["down_proj.weight"] += 1.0
    assert_bitwise_equal(blk.forward(x), y0, "after editing the caller's weights")


def test_noncontiguous_and_buffer_weights(core, weights, x):
    ref = build(weights)
    w2 = dict(weights)
    w2["q_proj.weight"] = np.asfortranarray(weights["q_proj.weight"])
    big = np.zeros((64, 2 * D), np.float32)
    big[::2, ::2] = weights["up_proj.weight"][:32]
    big[1::2, ::2] = weights["up_proj.weight"][32:]
    strided = np.concatenate([big[::2, ::2], big[1::2, ::2]])  # contiguous again; build view:
    holder = np.zeros((64, D, 2), np.float32)
    holder[:, :, 0] = strided
    w2["up_proj.weight"] = holder[:, :, 0]  # non-contiguous view
    assert not w2["up_proj.weight"].flags.c_contiguous
    a = array.array("f", weights["o_proj.weight"].ravel().tolist())
    w2["o_proj.weight"] = memoryview(a).cast("B").cast("f", weights["o_proj.weight"].shape)
    blk = build(w2)
    assert blk.fingerprint == ref.fingerprint
    assert_bitwise_equal(blk.forward(x), ref.forward(x))


# ------------------------------------------------------------------------------------------
# read-only attributes, repr, params, pickling
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attr",
    [
        "d_model",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "intermediate",
        "window",
        "rope_theta",
        "rope_scaling",
        "rope_dim",
        "max_positions",
        "qkv_bias",
        "o_bias",
        "norm",
        "norm_eps",
        "norm_bias",
        "mlp",
        "mlp_bias",
        "qk_norm",
        "attn_softcap",
        "numeric_profile",
        "fingerprint",
    ],
)
def test_block_attributes_read_only(block, attr):
    before = getattr(block, attr)
    with raises(AttributeError, attr):
        setattr(block, attr, 2)
    assert getattr(block, attr) == before


def test_block_no_new_attributes(block):
    with pytest.raises(AttributeError):
        block.foo = 1


def test_repr_shows_options_not_weights(block):
    r = repr(block)
    assert r.startswith("TransformerBlockInference(") and "n_kv_heads=2" in r
    assert "head_dim=8" in r and "rope_dim=8" in r and "mlp='swiglu'" in r
    assert "array" not in r and len(r) < 1000


def test_get_params(block):
    p = block.get_params()
    assert set(p) == {
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "window",
        "rope_theta",
        "rope_scaling",
        "rope_dim",
        "max_positions",
        "qkv_bias",
        "o_bias",
        "norm",
        "norm_eps",
        "norm_bias",
        "mlp",
        "mlp_bias",
        "qk_norm",
        "qk_norm_scope",
        "attn_softcap",
        "query_pre_attn_scalar",
        "attn_scale",
        "residual_multiplier",
        "norm_placement",
        "block_parts",
        "numeric_profile",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "shared_expert",
    }
    assert (p["n_kv_heads"], p["head_dim"], p["rope_dim"]) == (2, 8, 8)
    assert all(type(p[k]) is int for k in ("n_kv_heads", "head_dim", "rope_dim"))
    assert block.get_params(deep=False) == p


def test_get_params_rebuilds_same_block(block, weights, x):
    twin = TransformerBlockInference(weights, **block.get_params())
    assert twin.fingerprint == block.fingerprint
    assert_bitwise_equal(twin.forward(x), block.forward(x))


def test_set_params_changes_and_refuses_old_states(block, weights, x):
    st = primed_state(block, x)
    fp0, y0 = block.fingerprint, block.forward(x)
    assert block.set_params(window=2) is block
    assert block.window == 2 and block.fingerprint != fp0
    assert not np.array_equal(block.forward(x), y0)
    snap = snapshot(st)
    with raises(ValueError, "fingerprint", st.fingerprint, block.fingerprint):
        block.forward(x, st)
    assert_unchanged(st, snap)
    block.set_params(window=0)
    assert block.fingerprint == fp0
    assert_bitwise_equal(block.forward(x), y0)


def test_set_params_derives_none_options_again(block):
    block.set_params(n_heads=2)  # head_dim and n_kv_heads were None: derived again
    assert (block.n_heads, block.head_dim, block.n_kv_heads) == (2, 16, 1)


@pytest.mark.parametrize(
    "params,exc,fragment",
    [
        ({"weights": {}}, ValueError, "weights"),
        ({"n_head": 2}, ValueError, "n_head"),
        ({"window": -1}, ValueError, "window"),
        ({"window": 1.5}, TypeError, "window"),
        ({"mlp": "gelu"}, ValueError, "gate_proj.weight"),
        ({"qkv_bias": True}, ValueError, "missing"),
        ({"n_kv_heads": 3}, ValueError, "n_kv_heads=3"),
    ],
)
def test_set_params_errors_change_nothing(block, x, params, exc, fragment):
    before = (block.get_params(), block.fingerprint, repr(block))
    y0 = block.forward(x)
    with raises(exc, "TransformerBlockInference.set_params: ", fragment):
        block.set_params(**{"window": 1, **params})
    assert (block.get_params(), block.fingerprint, repr(block)) == before
    assert_bitwise_equal(block.forward(x), y0)


def test_backward_not_implemented(block, x):
    for args, kwargs in [((), {}), ((x,), {}), ((x, x), {"state": None})]:
        with raises(NotImplementedError, "TransformerBlockInference", "forward only"):
            block.backward(*args, **kwargs)


def test_pickle_and_deepcopy_same_bits(core, x):
    w = make_transformer_weights(np.random.default_rng(8), **SIZES, qkv_bias=True, window=3)
    blk = build(w, qkv_bias=True, window=3, rope_scaling={"rope_type": "linear", "factor": 2.0})
    y = blk.forward(x)
    for clone in (pickle.loads(pickle.dumps(blk)), copy.deepcopy(blk), copy.copy(blk)):
        assert type(clone) is TransformerBlockInference
        assert clone.fingerprint == blk.fingerprint and repr(clone) == repr(blk)
        assert clone.get_params() == blk.get_params()
        assert_bitwise_equal(clone.forward(x), y, "restored block")


def test_pickled_state_works_with_restored_block(block, x):
    st = primed_state(block, x)
    blk2, st2 = pickle.loads(pickle.dumps((block, st)))
    assert isinstance(st2, TransformerState) and st2.fingerprint == st.fingerprint
    assert_bitwise_equal(st2.k_cache, st.k_cache)
    assert st2.row_tokens.tolist() == [5, 5]
    x1 = x[:, :1] * 0.5
    assert_bitwise_equal(blk2.step(x1, st2), block.step(x1, st))
    assert_bitwise_equal(st2.v_cache, st.v_cache)
    st3 = copy.deepcopy(st)
    assert st3.k_cache is not st.k_cache and st3.row_tokens.tolist() == [6, 6]


# ------------------------------------------------------------------------------------------
# forward / step: inputs
# ------------------------------------------------------------------------------------------


def test_output_properties(block, x):
    x0 = x.copy()
    y = block.forward(x)
    assert type(y) is np.ndarray and y.dtype == np.float32 and y.shape == x.shape
    assert y.flags.c_contiguous and y.flags.writeable
    assert not np.shares_memory(y, x)
    assert_bitwise_equal(x, x0, "x after the call")  # never written
    assert block(x) is not y
    assert_bitwise_equal(block(x), y, "__call__ vs forward")


def test_step_equals_forward(block, x):
    st = block.allocate_state(2, 8)
    ys = [block.step(x[:, t], st) for t in range(5)]
    assert all(y.shape == (2, 1, D) for y in ys)
    assert_bitwise_equal(np.concatenate(ys, axis=1), block.forward(x))
    assert st.row_tokens.tolist() == [5, 5] and st.row_tokens.dtype == np.int64
    st2 = block.allocate_state(2, 8)
    y3 = block.step(x[:, :1], st2)  # (B, 1, d) form
    assert_bitwise_equal(y3, ys[0])


def test_stateless_equals_fresh_state(block, x):
    st = block.allocate_state(2, 5)
    assert_bitwise_equal(block.forward(x, st), block.forward(x))
    wblk = build(
        make_transformer_weights(np.random.default_rng(1234), **SIZES), window=2, n_heads=NH
    )
    st = wblk.allocate_state(2, 5)
    assert st.capacity == 2
    assert_bitwise_equal(wblk.forward(x, st), wblk.forward(x))


@pytest.mark.parametrize("bad", [[[[0.0] * D] * 5] * 2, None, 3.0, "x"])
def test_x_not_buffer(block, x, bad):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(TypeError, f"{TBI}.forward: ", "x", type(bad).__name__):
        block.forward(bad, st)
    with raises(TypeError, f"{TBI}.step: ", "x"):
        block.step(bad, st)
    assert_unchanged(st, snap)


def test_x_torch_tensor_hint(block):
    torch = pytest.importorskip("torch")
    with raises(TypeError, "x", "t.numpy()"):
        block.forward(torch.zeros(1, 2, D))


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.uint16, np.int64, ">f4"])
def test_x_dtype_refused(block, x, dtype):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(TypeError, "x", np.dtype(dtype).name):
        block.forward(x.astype(dtype), st)
    assert_unchanged(st, snap)


@pytest.mark.parametrize("shape", [(5, D), (2, 5, D, 1), (2, 5, D + 1), (0, 5, D), (2, 0, D), (D,)])
def test_x_shape_wrong_forward(block, x, shape):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(ValueError, "x", str(shape).replace(",)", ",)"), str(D)):
        block.forward(np.zeros(shape, np.float32), st)
    assert_unchanged(st, snap)


@pytest.mark.parametrize("shape", [(2, 2, D), (2, D + 1), (2, 1, 1, D), (0, D)])
def test_x_shape_wrong_step(block, x, shape):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(ValueError, f"{TBI}.step: ", "x", str(shape)):
        block.step(np.zeros(shape, np.float32), st)
    assert_unchanged(st, snap)


@pytest.mark.parametrize("val", [np.nan, np.inf, -np.inf])
def test_x_nonfinite_real_position(block, x, val):
    st = primed_state(block, x)
    snap = snapshot(st)
    xb = x.copy()
    xb[1, 3, 7] = val
    with raises(ValueError, "x[1, 3, 7]", repr(float(val))):
        block.forward(xb, st)
    with raises(ValueError, "x[1, 3, 7]"):
        block.forward(xb)
    assert_unchanged(st, snap)
    x1 = x[:, 0].copy()
    x1[0, 2] = val
    with raises(ValueError, f"{TBI}.step: ", "x[0, 0, 2]"):
        block.step(x1, st)
    assert_unchanged(st, snap)


def test_x_nan_padding_never_read(block, x):
    xb = x.copy()
    xb[0, 3:] = np.nan
    xb[1, 1:] = np.inf
    y = block.forward(xb, lengths=[3, 1])
    assert (y[0, 3:].view(np.uint32) == 0).all() and (y[1, 1:].view(np.uint32) == 0).all()
    assert_bitwise_equal(y[0, :3], block.forward(x[0:1, :3])[0])
    assert_bitwise_equal(y[1, :1], block.forward(x[1:2, :1])[0])
    st = block.allocate_state(2, 8)
    y2 = block.forward(xb, st, lengths=[3, 1])
    assert_bitwise_equal(y2, y)
    assert st.row_tokens.tolist() == [3, 1]


def test_buffer_protocol_inputs(block, x):
    y = block.forward(x)
    a = array.array("f", x.ravel().tolist())
    mv = memoryview(a).cast("B").cast("f", x.shape)
    assert_bitwise_equal(block.forward(mv), y, "array.array via memoryview")
    assert_bitwise_equal(block.forward(memoryview(x).toreadonly()), y, "read-only memoryview")
    big = np.zeros((2, 5, 2 * D), np.float32)
    big[:, :, ::2] = x
    assert_bitwise_equal(block.forward(big[:, :, ::2]), y, "non-contiguous slice")
    assert_bitwise_equal(block.forward(np.asfortranarray(x)), y, "Fortran order")
    raw = bytearray(x.nbytes + 1)
    unaligned = np.frombuffer(raw, np.float32, count=x.size, offset=1).reshape(x.shape)
    unaligned[...] = x
    assert not unaligned.flags.aligned
    assert_bitwise_equal(block.forward(unaligned), y, "unaligned buffer")
    with raises(ValueError, "x", "(10,)"):
        block.forward(array.array("f", [0.0] * 10))  # a flat array.array is 1-D


# ------------------------------------------------------------------------------------------
# lengths (SPEC 9)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "form",
    [
        lambda v: list(v),
        lambda v: tuple(v),
        lambda v: np.array(v, np.int64),
        lambda v: np.array(v, np.int32),
        lambda v: np.array(v, np.uint8),
        lambda v: [np.int16(i) for i in v],
    ],
)
def test_lengths_forms_equal(block, x, form):
    ref = block.forward(x, lengths=[4, 2])
    assert_bitwise_equal(block.forward(x, lengths=form([4, 2])), ref)


def test_lengths_full_equals_none_and_zero_rows(block, x):
    assert_bitwise_equal(block.forward(x, lengths=[5, 5]), block.forward(x))
    y = block.forward(x, lengths=[0, 5])
    assert (y[0].view(np.uint32) == 0).all()
    assert_bitwise_equal(y[1], block.forward(x[1:2])[0])
    assert (block.forward(x, lengths=[0, 0]).view(np.uint32) == 0).all()


def test_lengths_with_state_idle_rows_untouched(block, x):
    st = primed_state(block, x)
    k1, v1 = st.k_cache[1].copy(), st.v_cache[1].copy()
    block.forward(x, st, lengths=[2, 0])
    assert st.row_tokens.tolist() == [7, 5]
    assert_bitwise_equal(st.k_cache[1], k1)
    assert_bitwise_equal(st.v_cache[1], v1)


@pytest.mark.parametrize(
    "bad",
    [
        3,
        "34",
        b"\x01\x02",
        {0: 1, 1: 2},
        {1, 2},
        2.0,
        [1.0, 2],
        [True, 1],
        [1, "2"],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array(2),
        np.int64(2),
    ],
)
def test_lengths_wrong_type(block, x, bad):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(TypeError, f"{TBI}.forward: ", "lengths"):
        block.forward(x, st, lengths=bad)
    assert_unchanged(st, snap)


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ([1], "lengths"),
        ([1, 2, 3], "lengths"),
        (np.zeros((2, 1), np.int64), "lengths"),
        ([1, 6], "lengths[1]=6"),
        ([-1, 2], "lengths[0]=-1"),
    ],
)
def test_lengths_wrong_value(block, x, bad, fragment):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(ValueError, fragment):
        block.forward(x, st, lengths=bad)
    assert_unchanged(st, snap)


# ------------------------------------------------------------------------------------------
# state checks in calls
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"k_cache": None}, "state", 3, object()])
def test_state_wrong_class(block, x, bad):
    with raises(TypeError, "state", type(bad).__name__):
        block.forward(x, bad)
    with raises(TypeError, "state"):
        block.step(x[:, 0], bad)


def test_step_needs_state(block, x):
    with raises(TypeError, f"{TBI}.step: ", "state", "None"):
        block.step(x[:, 0], None)
    with pytest.raises(TypeError):
        block.step(x[:, 0])


def test_state_of_another_block(block, x, core):
    other = build(make_transformer_weights(np.random.default_rng(77), **SIZES))
    st = primed_state(other, x)
    snap = snapshot(st)
    with raises(ValueError, "state", other.fingerprint, block.fingerprint):
        block.forward(x, st)
    with raises(ValueError, "fingerprint"):
        block.step(x[:, 0], st)
    with raises(ValueError, "fingerprint"):
        block.decode_session(st)
    assert_unchanged(st, snap)


def test_state_batch_mismatch(block, x):
    st = primed_state(block, x)
    snap = snapshot(st)
    with raises(ValueError, "state.batch_size=2", "3"):
        block.forward(np.concatenate([x, x[:1]]), st)
    assert_unchanged(st, snap)


@pytest.mark.parametrize("row,value", [(0, -1), (1, 17), (1, -5)])
def test_row_tokens_out_of_range(block, x, row, value):
    st = primed_state(block, x)
    st.row_tokens[row] = value
    snap = snapshot(st)
    with raises(ValueError, f"state.row_tokens[{row}]={value}", "max_tokens=16"):
        block.forward(x, st)
    assert_unchanged(st, snap)


@pytest.mark.parametrize("buf", ["k_cache", "v_cache"])
def test_nonfinite_readable_state(block, x, buf):
    st = primed_state(block, x)
    getattr(st, buf)[1, 1, 3, 4] = np.nan
    snap = snapshot(st)
    with raises(ValueError, f"state.{buf}[1, 1, 3, 4]", "nan"):
        block.forward(x, st)
    with raises(ValueError, f"state.{buf}[1, 1, 3, 4]"):
        block.step(x[:, 0], st)
    assert_unchanged(st, snap)
    # Row 1 idle: nothing of it is read.
    block.forward(x, st, lengths=[1, 0])
    assert st.row_tokens.tolist() == [6, 5]


@pytest.fixture(params=exactblocks._ext.core().available_isas())
def isa(request, core):
    saved = core.get_isa()
    core.set_isa(request.param)
    yield request.param
    core.set_isa(saved)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize(
    "buf,value",
    [("k_cache", np.inf), ("k_cache", -np.inf), ("v_cache", np.inf), ("v_cache", -np.inf)],
)
def test_nonfinite_slot_the_softmax_would_hide(core, weights, x, isa, softcap, buf, value, threads):
    # A decode step finds a non-finite cache slot inside its attention (no second pass over the
    # cache): by the raw scores for keys, by the outputs for values. These infinities vanish
    # from the softmax's output (a -inf score weighs 0; a softcapped +inf score becomes the
    # cap), so only the raw scores show them. Every element of the key row is hit in turn.
    # On 3 threads the 4 (row, KV head) pairs are split into 8 tasks of one query head each.
    blk = build(weights, attn_softcap=softcap)
    saved = exactblocks.get_num_threads()
    force_num_threads(threads)
    try:
        for d in range(SIZES["head_dim"]):
            st = primed_state(blk, x)
            getattr(st, buf)[0, 1, 2, d] = value
            snap = snapshot(st)
            with raises(ValueError, f"state.{buf}[0, 1, 2, {d}]", "position 2", repr(value)):
                blk.step(x[:, 0], st)
            assert_unchanged(st, snap)
    finally:
        exactblocks.set_num_threads(saved)


def test_attention_overflow_is_not_a_nonfinite_slot(core, weights, x, isa):
    # Finite values near the float32 limit make the attention output overflow to infinity,
    # which the fused check takes for a sign of a bad slot; the exact check then clears it
    # and the step runs, with the bits of a step that skips the check.
    blk = build(weights)
    st = primed_state(blk, x)
    st.v_cache[:, :, :5] = np.float32(3e38)
    ref = primed_state(blk, x)
    ref.v_cache[:] = st.v_cache
    y = blk.step(x[:, 0], st)
    assert not np.isfinite(y).all() and st.row_tokens.tolist() == [6, 6]
    want = blk._impl.core.forward(
        x[:, :1],
        np.ones(2, np.int64),
        ref.row_tokens.copy(),
        ref.k_cache,
        ref.v_cache,
        None,
        check_cache=False,
    )
    assert_bitwise_equal(y, want)


def test_unreadable_state_slots_not_checked(block, x):
    st = primed_state(block, x)
    st.k_cache[:, :, 5:] = np.nan  # slots of positions not held yet
    st.v_cache[:, :, 9:] = np.inf
    y = block.forward(x[:, :2], st)
    assert np.isfinite(y).all() and st.row_tokens.tolist() == [7, 7]


def test_window_ring_reads_only_window(core, x):
    w = make_transformer_weights(np.random.default_rng(1234), **SIZES)
    blk = build(w, window=3)
    st = blk.allocate_state(2, 16)
    assert st.capacity == 3 and st.k_cache.shape == (2, 2, 3, 8)
    blk.forward(x, st)  # positions 0..4 -> slots 0,1,2,0,1; next query (5) reads 3, 4
    st.k_cache[:, :, 2] = np.nan  # slot of position 2: outside the window of position 5
    y = blk.step(x[:, 0], st)
    assert np.isfinite(y).all()
    # Position 5 went to slot 2. Row tokens = 6: the next query (6) reads positions 4, 5 =
    # slots 1, 2; slot 0 (position 3) is outside its window and is not read.
    st.v_cache[0, 1, 0, 0] = np.inf
    st.k_cache[1, 0, 1, 3] = np.nan
    snap = snapshot(st)
    with raises(ValueError, "state.k_cache[1, 0, 1, 3]", "position 4"):
        blk.step(x[:, 0], st)
    assert_unchanged(st, snap)
    st.k_cache[1, 0, 1, 3] = 0.0
    assert np.isfinite(blk.step(x[:, 0], st)).all()
    assert st.row_tokens.tolist() == [7, 7]


def test_positions_beyond_max_tokens(block, x):
    st = block.allocate_state(2, 7)
    block.forward(x, st)
    snap = snapshot(st)
    with raises(ValueError, "row 0", "holds 5", "adds 5", "max_tokens=7"):
        block.forward(x, st)
    assert_unchanged(st, snap)
    block.forward(x, st, lengths=[2, 1])
    assert st.row_tokens.tolist() == [7, 6]
    snap = snapshot(st)
    with raises(ValueError, "row 0", "holds 7", "adds 1"):
        block.step(x[:, 0], st)
    assert_unchanged(st, snap)
    block.forward(x, st, lengths=[0, 1])  # a full row may stay idle
    assert st.row_tokens.tolist() == [7, 7]


def test_stateless_beyond_max_positions(weights, x):
    # SPEC 4.5: without a state, L <= max_positions, whatever the lengths (finding: L = 5 with
    # lengths [4, 3] or [0, 0] used to be accepted by a block with max_positions=4).
    blk = build(weights, max_positions=4)
    for lengths in (None, [4, 3], [0, 0], [1, 1]):
        with raises(ValueError, f"{TBI}.forward: ", "x has 5 tokens", "max_positions=4"):
            blk.forward(x, lengths=lengths)
    y = blk.forward(x[:, :4], lengths=[4, 3])
    assert_bitwise_equal(y[0], build(weights, max_positions=8).forward(x[:1, :4])[0])


def test_concurrent_use_of_a_state_is_runtime_error(block, x):
    st = primed_state(block, x)
    impl = block._impl
    real = impl.core
    entered, release = threading.Event(), threading.Event()

    class SlowCore:
        def forward(self, *args, **kwargs):
            entered.set()
            release.wait(10)
            return real.forward(*args, **kwargs)

    impl.core = SlowCore()
    errors = []
    t = threading.Thread(target=lambda: block.forward(x[:, :1], st))
    try:
        t.start()
        assert entered.wait(10)
        snap = snapshot(st)
        try:
            block.step(x[:, 0], st)
        except RuntimeError as exc:
            errors.append(str(exc))
        assert_unchanged(st, snap)
        with raises(RuntimeError, "state"):
            st.reset()
    finally:
        release.set()
        t.join()
        impl.core = real
    assert len(errors) == 1 and "state" in errors[0] and errors[0].startswith(f"{TBI}.step: ")
    assert st.row_tokens.tolist() == [6, 6]
    # Other states and stateless calls are not blocked by a busy state.
    block.forward(x)


# ------------------------------------------------------------------------------------------
# allocate_state and TransformerState (SPEC 5)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,exc,fragment",
    [
        ((2.0, 8), TypeError, "batch_size"),
        ((2, "8"), TypeError, "max_tokens"),
        ((True, 8), TypeError, "batch_size"),
        ((0, 8), ValueError, "batch_size"),
        ((2, 0), ValueError, "max_tokens"),
        ((2, 8193), ValueError, "max_positions=8192"),
    ],
)
def test_allocate_state_checks(block, args, exc, fragment):
    with raises(exc, f"{TBI}.allocate_state: ", fragment):
        block.allocate_state(*args)


def test_allocate_state_fields(block):
    st = block.allocate_state(3, 10)
    assert (st.batch_size, st.n_kv_heads, st.head_dim, st.max_tokens, st.window, st.capacity) == (
        3,
        2,
        8,
        10,
        0,
        10,
    )
    assert st.k_cache.shape == st.v_cache.shape == (3, 2, 10, 8)
    assert st.k_cache.dtype == np.float32 and st.k_cache.flags.c_contiguous
    assert (st.k_cache.view(np.uint32) == 0).all() and (st.v_cache.view(np.uint32) == 0).all()
    assert st.row_tokens.dtype == np.int64 and st.row_tokens.tolist() == [0, 0, 0]
    assert st.fingerprint == block.fingerprint
    assert block.allocate_state(np.int32(1), np.int64(8192)).max_tokens == 8192


def test_state_direct_construction_refused():
    with raises(TypeError, "allocate_state"):
        TransformerState()
    with raises(TypeError, "allocate_state"):
        TransformerState(2, 8)


@pytest.mark.parametrize(
    "attr",
    [
        "k_cache",
        "v_cache",
        "row_tokens",
        "fingerprint",
        "batch_size",
        "max_tokens",
        "capacity",
        "window",
    ],
)
def test_state_attributes_not_rebindable(block, attr):
    st = block.allocate_state(2, 4)
    with raises(AttributeError, attr):
        setattr(st, attr, getattr(st, attr))


def test_state_buffers_writable_in_place(block, x):
    st = primed_state(block, x)
    saved = (st.k_cache.copy(), st.v_cache.copy(), st.row_tokens.copy())
    y1 = block.step(x[:, 0], st)
    st.k_cache[...] = saved[0]  # restore by copying back (SPEC 5 saving and restoring)
    st.v_cache[...] = saved[1]
    st.row_tokens[...] = saved[2]
    assert_bitwise_equal(block.step(x[:, 0], st), y1)


def test_rollback_without_window_is_exact(block, x):
    st = block.allocate_state(2, 8)
    block.forward(x, st)
    st.row_tokens[:] = 3
    y = block.forward(x[:, 3:], st)
    assert_bitwise_equal(y, block.forward(x)[:, 3:])


def test_cached_tokens(block, x):
    st = block.allocate_state(2, 8)
    assert st.cached_tokens == 0
    block.forward(x, st)
    assert st.cached_tokens == 5
    block.forward(x, st, lengths=[1, 0])
    with raises(ValueError, "row_tokens"):
        _ = st.cached_tokens
    st.cached_tokens = 2
    assert st.row_tokens.tolist() == [2, 2] and st.cached_tokens == 2
    for bad, exc in [(2.0, TypeError), (True, TypeError), (-1, ValueError), (9, ValueError)]:
        with pytest.raises(exc, match="cached_tokens"):
            st.cached_tokens = bad
    assert st.row_tokens.tolist() == [2, 2]


def test_keys_values_without_window(block, x):
    st = primed_state(block, x)
    k, v = st.keys(), st.values()
    assert k.shape == v.shape == (2, 2, 5, 8)
    assert_bitwise_equal(k, st.k_cache[:, :, :5])
    assert_bitwise_equal(v, st.v_cache[:, :, :5])
    assert not np.shares_memory(k, st.k_cache)
    block.forward(x, st, lengths=[2, 0])
    with raises(ValueError, "row"):
        st.keys()
    assert st.keys(0).shape == (2, 7, 8) and st.values(row=1).shape == (2, 5, 8)
    assert_bitwise_equal(st.keys(1), st.k_cache[1, :, :5])
    with raises(ValueError, "row"):
        st.keys(2)
    with raises(TypeError, "row"):
        st.values(1.0)


def test_keys_values_ring_in_position_order(core, weights, x):
    # K and V of a position depend only on that token and its position, not on the window, so
    # the ring's last 3 positions must equal positions 4..6 of an unwindowed run, bit for bit.
    blk_w = build(weights, window=3)
    blk = build(weights)
    st_w, st = blk_w.allocate_state(2, 16), blk.allocate_state(2, 16)
    x7 = np.concatenate([x, x[:, :2] * 0.5], axis=1)
    blk_w.forward(x7, st_w)
    blk.forward(x7, st)
    assert st_w.capacity == 3 and st_w.keys().shape == (2, 2, 3, 8)
    assert_bitwise_equal(st_w.keys(), st.keys()[:, :, 4:7])
    assert_bitwise_equal(st_w.values(0), st.values(0)[:, 4:7])
    assert not np.array_equal(st_w.keys(), st_w.k_cache)  # 7 % 3 != 0: ring was rotated


def test_reset_rows(block, x):
    st = primed_state(block, x)
    k0 = st.k_cache[0].copy()
    st.reset(1)
    assert st.row_tokens.tolist() == [5, 0]
    assert (st.k_cache[1].view(np.uint32) == 0).all() and (st.v_cache[1] == 0).all()
    assert_bitwise_equal(st.k_cache[0], k0)
    y = block.forward(x, st, lengths=[0, 5])
    assert_bitwise_equal(y[1], block.forward(x[1:2])[0])
    st.reset([0, np.int64(1)])
    st.reset()
    assert st.row_tokens.tolist() == [0, 0] and not st.k_cache.any()
    for bad, exc in [(2, ValueError), ([0, 5], ValueError), (1.0, TypeError), ("0", TypeError)]:
        with pytest.raises(exc, match="TransformerState.reset"):
            st.reset(bad)


def test_state_repr(block):
    r = repr(block.allocate_state(2, 4))
    assert r.startswith("TransformerState(") and "row_tokens=[0, 0]" in r


# ------------------------------------------------------------------------------------------
# decode sessions (SPEC 6)
# ------------------------------------------------------------------------------------------


def test_session_same_bits_as_block(block, x):
    st_a, st_b = block.allocate_state(2, 16), block.allocate_state(2, 16)
    with block.decode_session(st_a) as sess:
        assert sess.state is st_a and sess.is_open
        ya = [sess.forward(x, lengths=[5, 3]), sess.step(x[:, 0]), sess.step(x[:, 1:2])]
        assert sess.sync_state() is st_a
    yb = [
        block.forward(x, st_b, lengths=[5, 3]),
        block.step(x[:, 0], st_b),
        block.step(x[:, 1:2], st_b),
    ]
    for a, b in zip(ya, yb):
        assert_bitwise_equal(a, b, "session vs block")
    assert_bitwise_equal(st_a.k_cache, st_b.k_cache)
    assert st_a.row_tokens.tolist() == st_b.row_tokens.tolist() == [7, 5]
    assert not sess.is_open


def test_session_claim(block, x):
    st = block.allocate_state(2, 16)
    sess = block.decode_session(st)
    snap = snapshot(st)
    with raises(ValueError, f"{TBI}.forward: ", "TransformerDecodeSession(open=True"):
        block.forward(x, st)
    with raises(ValueError, "decode session"):
        block.step(x[:, 0], st)
    with raises(ValueError, f"{TBI}.decode_session: ", "decode session"):
        block.decode_session(st)
    assert_unchanged(st, snap)
    sess.close()
    sess.close()  # idempotent
    block.step(x[:, 0], st)
    sess2 = block.decode_session(st)
    sess2.discard()
    assert not sess2.is_open
    block.step(x[:, 0], st)


def test_session_released_by_exception_and_gc(block, x):
    st = block.allocate_state(2, 16)
    with pytest.raises(KeyError):
        with block.decode_session(st):
            raise KeyError("boom")
    block.step(x[:, 0], st)
    sess = block.decode_session(st)
    sess.step(x[:, 0])
    del sess
    gc.collect()
    block.step(x[:, 0], st)  # the dropped session released its claim
    assert st.row_tokens.tolist() == [3, 3]


def test_closed_session_and_batch_mismatch(block, x):
    st = block.allocate_state(2, 16)
    sess = block.decode_session(st)
    snap = snapshot(st)
    with raises(ValueError, "TransformerDecodeSession.step: ", "batch_size=2", "3"):
        sess.step(np.zeros((3, D), np.float32))
    with raises(ValueError, "TransformerDecodeSession.forward: ", "x"):
        sess.forward(np.zeros((2, 3, D + 1), np.float32))
    with raises(TypeError, "TransformerDecodeSession.forward: ", "lengths"):
        sess.forward(x, lengths=2)
    assert_unchanged(st, snap)
    sess.close()
    with raises(ValueError, "TransformerDecodeSession.step: ", "closed"):
        sess.step(x[:, 0])
    with raises(ValueError, "closed"):
        sess.forward(x)
    assert_unchanged(st, snap)


def test_session_argument_checks(block, x):
    for bad in (None, {"k_cache": 1}, "st"):
        with raises(TypeError, f"{TBI}.decode_session: ", "state"):
            block.decode_session(bad)
    with raises(TypeError, "decode_session"):
        TransformerDecodeSession()
    sess = block.decode_session(block.allocate_state(1, 4))
    with pytest.raises(AttributeError):
        sess.state = None
    with pytest.raises(TypeError):
        pickle.dumps(sess)
    sess.close()


def test_session_repr_and_load_state(block, x):
    st = block.allocate_state(2, 16)
    with block.decode_session(st) as sess:
        sess.forward(x, lengths=[5, 4])
        assert repr(sess) == "TransformerDecodeSession(open=True, batch_size=2, row_tokens=[5, 4])"
        assert sess.load_state() is st
        st.k_cache[0, 0, 2, 0] = np.nan
        with raises(
            ValueError,
            "TransformerDecodeSession.load_state: ",
            "state.k_cache[0, 0, 2, 0]",
            "read by the session's next step",
        ):
            sess.load_state()
        st.k_cache[0, 0, 2, 0] = 0.0
        st.row_tokens[1] = 99
        with raises(ValueError, "state.row_tokens[1]=99"):
            sess.load_state()
        st.row_tokens[1] = 4
        sess.load_state()
    assert repr(sess).startswith("TransformerDecodeSession(open=False")


# ------------------------------------------------------------------------------------------
# fingerprint and sharing a block between threads
# ------------------------------------------------------------------------------------------


def test_fingerprint_deterministic_and_sensitive(core, weights):
    fp = build(weights).fingerprint
    assert build(dict(weights)).fingerprint == fp
    w2 = dict(weights)
    flipped = weights["v_proj.weight"].copy()
    flipped.view(np.uint32)[3, 4] ^= 1  # one ulp in one weight
    w2["v_proj.weight"] = flipped
    assert build(w2).fingerprint != fp
    assert build(weights, rope_theta=10000.5).fingerprint != fp
    assert build(weights, max_positions=4096).fingerprint != fp
    assert build(weights, n_kv_heads=2, head_dim=8, rope_dim=8).fingerprint == fp


def test_block_serves_threads_at_once(block, x):
    ref = block.forward(x, block.allocate_state(2, 8))
    results, errors = [None] * 4, []

    def run(i):
        try:
            st = block.allocate_state(2, 8)
            results[i] = block.forward(x, st)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for y in results:
        assert_bitwise_equal(y, ref, "thread result")


# ------------------------------------------------------------------------------------------
# regressions of a hostile review (state tampering, float32 ranges, int bounds, RoPE table)
# ------------------------------------------------------------------------------------------


def _replace(st, name, value):
    """Swap a state buffer as only a hostile caller can (the attributes are not rebindable)."""
    object.__setattr__(st, name, value)


# Each entry: how the state is tampered with, the buffer the message must name, and a fragment
# saying what is wrong. States come from primed_state(block, x): k/v (2, 2, 16, 8), row_tokens (2,).
TAMPERINGS = {
    "row_tokens read-only": (
        lambda st: setattr(st.row_tokens.flags, "writeable", False),
        "state.row_tokens",
        "read-only",
    ),
    "k_cache read-only": (
        lambda st: setattr(st.k_cache.flags, "writeable", False),
        "state.k_cache",
        "read-only",
    ),
    "v_cache read-only": (
        lambda st: setattr(st.v_cache.flags, "writeable", False),
        "state.v_cache",
        "read-only",
    ),
    "k_cache reshaped": (
        lambda st: _replace(st, "k_cache", st.k_cache.reshape(2, 2, 8, 16)),
        "state.k_cache",
        "shape (2, 2, 8, 16)",
    ),
    "k_cache flattened": (
        lambda st: _replace(st, "k_cache", st.k_cache.reshape(-1)),
        "state.k_cache",
        "shape (512,)",
    ),
    "v_cache rows and heads mixed": (
        lambda st: _replace(st, "v_cache", st.v_cache.reshape(4, 1, 16, 8)),
        "state.v_cache",
        "shape (4, 1, 16, 8)",
    ),
    "row_tokens (1, 2)": (
        lambda st: _replace(st, "row_tokens", st.row_tokens.reshape(1, 2)),
        "state.row_tokens",
        "shape (1, 2)",
    ),
    "row_tokens int32": (
        lambda st: _replace(st, "row_tokens", st.row_tokens.astype(np.int32)),
        "state.row_tokens",
        "dtype int32",
    ),
    "k_cache float64": (
        lambda st: _replace(st, "k_cache", st.k_cache.astype(np.float64)),
        "state.k_cache",
        "dtype float64",
    ),
    "v_cache big-endian": (
        lambda st: _replace(st, "v_cache", st.v_cache.astype(">f4")),
        "state.v_cache",
        "dtype '>f4'",
    ),
    "k_cache Fortran order": (
        lambda st: _replace(st, "k_cache", np.asfortranarray(st.k_cache)),
        "state.k_cache",
        "non-C-contiguous",
    ),
    "v_cache is k_cache": (
        lambda st: _replace(st, "v_cache", st.k_cache),
        "state.k_cache and state.v_cache",
        "share memory",
    ),
    "v_cache a view of k_cache": (
        lambda st: _replace(st, "v_cache", st.k_cache.reshape(-1).reshape(st.k_cache.shape)),
        "state.k_cache and state.v_cache",
        "share memory",
    ),
    "k_cache a list": (
        lambda st: _replace(st, "k_cache", st.k_cache.tolist()),
        "state.k_cache",
        "got list",
    ),
}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_tampered_state_buffers_refused_before_any_write(block, x, case):
    """Finding: a read-only row_tokens let forward write k_cache and then fail in NumPy; a
    read-only or reshaped cache reached nanobind (TypeError) or the core (raw ValueError,
    IndexError). Every entry point now refuses with ValueError naming the buffer, and the state
    stays byte-identical."""
    tamper, buf, what = TAMPERINGS[case]
    st = primed_state(block, x)
    tamper(st)

    def snap():
        return tuple(
            np.asarray(getattr(st, n)).tobytes() for n in ("k_cache", "v_cache", "row_tokens")
        )

    before = snap()
    calls = {
        f"{TBI}.forward": lambda: block.forward(x, st),
        f"{TBI}.step": lambda: block.step(x[:, 0], st),
        "TransformerState.reset": lambda: st.reset(),
        "TransformerState.keys": lambda: st.keys(),
        "TransformerState.cached_tokens": lambda: setattr(st, "cached_tokens", 1),
    }
    for where, call in calls.items():
        with raises(ValueError, f"{where}: ", buf, what):
            call()
        assert snap() == before, f"{where} changed the state"
    with block.decode_session(st) as sess:
        for where, call in (
            ("TransformerDecodeSession.step", lambda: sess.step(x[:, 0])),
            ("TransformerDecodeSession.load_state", sess.load_state),
        ):
            with raises(ValueError, f"{where}: ", buf, what):
                call()
            assert snap() == before, f"{where} changed the state"


def test_intact_state_still_accepted_after_buffer_checks(block, x):
    """The checks refuse only tampering: a state whose contents were rewritten in place (the
    documented save/restore) and a restored copy keep working, bit for bit."""
    st = primed_state(block, x)
    ref = block.step(x[:, 0], copy.deepcopy(st))
    saved = [st.k_cache.copy(), st.v_cache.copy(), st.row_tokens.copy()]
    st.reset()
    st.k_cache[...], st.v_cache[...], st.row_tokens[...] = saved
    assert_bitwise_equal(block.step(x[:, 0], st), ref)


@pytest.mark.parametrize(
    "opts,fragments",
    [
        # inv_freq_0 = 1 / factor = 1e300 overflows float32 (every call used to return NaN)
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 1e-300}},
            ("rope_scaling['factor']=1e-300", "inv_freq[0]=inf", "finite and > 0"),
        ),
        # inv_freq_i = theta**(-2i/rope_dim) grows without bound for theta < 1
        ({"rope_theta": 1e-300}, ("rope_theta=1e-300", "inv_freq[1]=inf")),
        # and underflows to 0 for a huge theta (rope_dim 8: 1e300**-0.25 = 1e-75 -> 0.0)
        ({"rope_theta": 1e300}, ("rope_theta=1e+300", "inv_freq[1]=0.0")),
        # every entry finite, but float32(8191) * 1e36 overflows: the last positions' angles
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 1e-36}},
            ("rope_scaling['factor']=1e-36", "max_positions - 1", "8191", "overflows"),
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 1e-300,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            ("rope_theta=10000.0", "rope_scaling['factor']=1e-300", "inv_freq["),
        ),
    ],
)
def test_unusable_rope_table_refused_at_construction(weights, opts, fragments):
    with raises(ValueError, f"{TBI}.__init__: ", *fragments):
        build(weights, **opts)
    blk = build(weights)
    with raises(ValueError, f"{TBI}.set_params: ", *fragments):
        blk.set_params(**opts)
    assert blk.rope_theta == 10000.0 and blk.rope_scaling is None


def test_extreme_but_usable_rope_tables_accepted(core, weights, x):
    # The same 1e36 entry is fine when no position can reach an overflowing angle.
    lin = {"rope_type": "linear", "factor": 1e-36}
    assert build(weights, rope_scaling=lin, max_positions=1).forward(x[:, :1]).shape == (2, 1, D)
    # Huge but finite angles and a tiny theta within float32: finite outputs.
    for opts in (
        {"rope_scaling": {"rope_type": "linear", "factor": 1e-30}},
        {"rope_theta": 1e-6, "max_positions": 64},
        {"rope_theta": 1e30},
    ):
        blk = build(weights, **opts)
        assert np.isfinite(blk.forward(x)).all(), opts
    # The table checked is the core's own: its largest entry for theta 1e-6 is finite.
    inv = core.rope_inv_freq(8, 1e-6, 0, 1.0, 1.0, 1.0, 0.0)
    assert np.isfinite(inv).all() and (inv > 0).all()


@pytest.mark.parametrize(
    "opt,value",
    [
        ("norm_eps", 1e-50),
        ("norm_eps", 1e39),
        ("norm_eps", 2**-151),
        ("attn_softcap", 1e-46),
        ("attn_softcap", 1e39),
        ("attn_softcap", 3.5e38),
    ],
)
def test_real_options_outside_float32_range(weights, opt, value):
    """Finding: finite in float64 but 0 or inf once rounded to float32 (as the core uses
    them): every call returned NaN (norm_eps 1e-50 on a zero row, softcap 1e-46)."""
    with raises(
        ValueError, f"{TBI}.__init__: ", f"{opt}={value!r}", "float32", "3.4028234663852886e+38"
    ):
        build(weights, **{opt: value})


def test_real_options_at_float32_range_edges_accepted(weights, x):
    zeros = np.zeros((1, 3, D), np.float32)
    y = build(weights, norm_eps=1e-45).forward(zeros)  # rounds to the smallest subnormal
    assert np.isfinite(y).all()
    big = float(np.finfo(np.float32).max)
    for opts in ({"norm_eps": big}, {"attn_softcap": big}, {"attn_softcap": 1e-40}):
        assert np.isfinite(build(weights, **opts).forward(x)).all(), opts


@pytest.mark.parametrize(
    "opts,exc,fragments",
    [
        ({"rope_theta": 10**400}, ValueError, ("rope_theta", "too large for a float")),
        ({"rope_theta": 10**5000}, ValueError, ("rope_theta", "bits", "too large")),
        ({"norm_eps": -(10**400)}, ValueError, ("norm_eps", "too large")),
        ({"window": 2**63}, ValueError, ("window", "[0, 16777216]", str(2**63))),
        ({"window": 2**70}, ValueError, ("window", "[0, 16777216]")),
        ({"window": 2**24 + 1}, ValueError, ("window", "[0, 16777216]")),
        ({"n_heads": 2**64 + 4}, ValueError, ("n_heads", "[1, 16777216]")),
        ({"n_kv_heads": 2**40}, ValueError, ("n_kv_heads", "[1, 16777216]")),
        ({"head_dim": 2**33}, ValueError, ("head_dim", "[1, 16777216]")),
        ({"rope_dim": 2**70}, ValueError, ("rope_dim", "even", "[2, head_dim]")),
        ({"rope_dim": -(10**5000)}, ValueError, ("rope_dim", "bits")),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 2**64,
                }
            },
            ValueError,
            ("rope_scaling['original_max_position_embeddings']", "[1, 16777216]"),
        ),
    ],
)
def test_huge_numeric_options_are_value_errors(weights, opts, exc, fragments):
    """Finding: window=2**63 raised RuntimeError('std::bad_cast') from the binding and
    rope_theta=10**400 a bare OverflowError."""
    with raises(exc, f"{TBI}.__init__: ", *fragments):
        build(weights, **opts)


def test_window_bound_is_causal_equivalent(block, weights, x):
    assert_bitwise_equal(build(weights, window=2**24).forward(x), block.forward(x))


def test_allocate_state_too_large_is_memory_error(block):
    """Finding: allocate_state(10**12, 64) raised NumPy's MemoryError without the prefix."""
    kv, hd = block.n_kv_heads, block.head_dim
    for b, m in ((10**12, 64), (2**62, 8192)):
        need = 2 * b * kv * m * hd * 4 + 8 * b  # SPEC 4.5 formula plus row_tokens (int64)
        with raises(
            MemoryError,
            f"{TBI}.allocate_state: ",
            f"batch_size={b}",
            f"max_tokens={m}",
            f"{need} bytes",
        ):
            block.allocate_state(b, m)
    with raises(ValueError, f"{TBI}.allocate_state: ", "batch_size", str(2**62)):
        block.allocate_state(2**62 + 1, 8)
    with raises(ValueError, "max_tokens", "16777216"):
        block.allocate_state(1, 10**30)


def test_cached_tokens_assignment_respects_the_state_lock(block, x):
    """Finding: ``state.cached_tokens = v`` wrote row_tokens while another thread's call was
    using the state; it must raise RuntimeError like reset() and leave the call's result."""
    st = primed_state(block, x)
    impl = block._impl
    real = impl.core
    entered, release = threading.Event(), threading.Event()

    class SlowCore:
        def forward(self, *args, **kwargs):
            entered.set()
            release.wait(10)
            return real.forward(*args, **kwargs)

    impl.core = SlowCore()
    t = threading.Thread(target=lambda: block.forward(x[:, :2], st))
    try:
        t.start()
        assert entered.wait(10)
        with raises(RuntimeError, "TransformerState.cached_tokens: ", "in use"):
            st.cached_tokens = 1
        assert st.row_tokens.tolist() == [5, 5]
    finally:
        release.set()
        t.join()
        impl.core = real
    assert st.row_tokens.tolist() == [7, 7]
    st.cached_tokens = 1  # free again
    assert st.row_tokens.tolist() == [1, 1]


def test_partial_rotary_factor_derives_rope_dim(weights, x):
    """Finding: rope_scaling['partial_rotary_factor'] with rope_dim=None was refused; HF
    StableLM derives rotary_ndims = int(head_dim * partial_rotary_factor)."""
    hd = SIZES["head_dim"]  # 8
    explicit = build(weights, rope_dim=4)
    for factor, rope_dim in ((0.5, 4), (0.25, 2), (0.3, 2), (1.0, hd), (0.8, 6)):
        assert int(hd * factor) == rope_dim
        blk = build(weights, rope_scaling={"rope_type": "default", "partial_rotary_factor": factor})
        assert blk.rope_dim == rope_dim and blk.get_params()["rope_dim"] == rope_dim
        if rope_dim == 4:
            assert blk.fingerprint == explicit.fingerprint
            assert_bitwise_equal(blk.forward(x), explicit.forward(x))
    # With rope_dim given, both must agree.
    assert (
        build(
            weights, rope_dim=4, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}
        ).rope_dim
        == 4
    )
    with raises(ValueError, "partial_rotary_factor", "rope_dim=6", "pass rope_dim=4"):
        build(
            weights, rope_dim=6, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}
        )
    # The derived value must be an even int in [2, head_dim].
    for factor, got in ((0.375, 3), (0.99, 7), (0.1, 0), (1.5, 12)):
        with raises(
            ValueError,
            f"{TBI}.__init__: ",
            f"partial_rotary_factor']={factor!r}",
            f"={got}",
            "even",
            f"[2, head_dim={hd}]",
        ):
            build(
                weights,
                rope_scaling={
                    "rope_type": "linear",
                    "factor": 2.0,
                    "partial_rotary_factor": factor,
                },
            )
    # set_params re-derives it (rope_dim stays None in the options given).
    blk = build(weights, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    assert blk.set_params(rope_scaling=None).rope_dim == hd


def test_position_limit_hint_never_asks_for_the_impossible(weights):
    """At max_positions = 2^24 the error must not ask for max_tokens beyond 2^24."""
    from exactblocks import TransformerBlockInference

    blk = TransformerBlockInference(
        weights, n_heads=SIZES["n_heads"], window=4, max_positions=2**24
    )
    st = blk.allocate_state(1, 2**24)
    st.row_tokens[:] = 2**24
    before = (st.k_cache.copy(), st.v_cache.copy(), st.row_tokens.copy())
    x = np.zeros((1, SIZES["d_model"]), np.float32)
    with pytest.raises(ValueError) as err:
        blk.step(x, st)
    msg = str(err.value)
    assert msg.startswith("TransformerBlockInference.step: ") and "2^24" in msg
    assert "16777217" not in msg.split("(")[-1]
    for a, b in zip(before, (st.k_cache, st.v_cache, st.row_tokens)):
        assert np.array_equal(a, b)
