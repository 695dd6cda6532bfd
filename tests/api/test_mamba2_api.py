"""API contract of Mamba2BlockInference and Mamba2State (SPEC.md 1, 2, 7, 8, 9, 10).

Covers every SPEC.md 10 row that concerns the Mamba-2 block: the exception type, the argument
the message names (and that messages start with ``Class.method: ``), and that a failed call
leaves the state's ``conv_window``, ``h`` and ``row_tokens`` byte-identical. Also: both weight
spellings, sizes derived from shapes, get/set_params, read-only attributes, repr, pickling,
fingerprints, buffer-protocol inputs, ``lengths`` with a state, ``reset`` and the runnable
example of ``docs/mamba2.md``.
"""

from __future__ import annotations

import array
import copy
import pickle
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_bitwise_equal, force_num_threads, make_mamba2_weights

import exactblocks
from exactblocks import Mamba2BlockInference, Mamba2State, TransformerState

MBI = "Mamba2BlockInference"
# Small sizes: d_model 16, d_inner 24 = 6 heads of 4, 2 groups of d_state 3, conv kernel 4.
D, DI, NH, NS, NG, K = 16, 24, 6, 3, 2, 4
CD = DI + 2 * NG * NS
N_IN = DI + CD + NH

HF_NAMES = {
    "block_norm.weight": "norm.weight",
    "in_proj.weight": "mixer.in_proj.weight",
    "in_proj.bias": "mixer.in_proj.bias",
    "conv1d.weight": "mixer.conv1d.weight",
    "conv1d.bias": "mixer.conv1d.bias",
    "dt_bias": "mixer.dt_bias",
    "A_log": "mixer.A_log",
    "D": "mixer.D",
    "norm.weight": "mixer.norm.weight",
    "out_proj.weight": "mixer.out_proj.weight",
    "out_proj.bias": "mixer.out_proj.bias",
}


def make_weights(seed=0, *, d=D, di=DI, nh=NH, ns=NS, ng=NG, k=K, conv_bias=True, proj_bias=False):
    """Random Mamba-2 weights (short names) at this file's sizes (tests/helpers.py)."""
    return make_mamba2_weights(
        seed, d=d, di=di, nh=nh, ns=ns, ng=ng, k=k, conv_bias=conv_bias, proj_bias=proj_bias
    )


def to_hf(w):
    return {HF_NAMES[k]: v for k, v in w.items()}


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (literal text)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def snapshot(st):
    return (st.conv_window.tobytes(), st.h.tobytes(), st.row_tokens.tobytes())


@pytest.fixture
def weights():
    return make_weights()


@pytest.fixture
def block(core, weights):
    return Mamba2BlockInference(weights, n_groups=NG)


@pytest.fixture
def x():
    return np.random.default_rng(5).standard_normal((2, 5, D)).astype(np.float32)


@pytest.fixture
def primed(block, x):
    """A state that has consumed the 5 tokens of x in both rows (non-zero buffers)."""
    st = block.allocate_state(2)
    block.forward(x, st)
    return st


def build(w, **kw):
    kw.setdefault("n_groups", NG)
    return Mamba2BlockInference(w, **kw)


# ------------------------------------------------------------------------------------------
# surface, attributes, params
# ------------------------------------------------------------------------------------------


def test_public_names():
    for name in ("Mamba2BlockInference", "Mamba2State"):
        assert name in exactblocks.__all__ and getattr(exactblocks, name) is not None
    assert not hasattr(Mamba2BlockInference, "decode_session")


def test_sizes_derived_from_shapes(block):
    got = {
        a: getattr(block, a)
        for a in (
            "d_model",
            "d_inner",
            "n_heads",
            "head_dim",
            "d_state",
            "n_groups",
            "conv_dim",
            "conv_kernel",
            "conv_bias",
            "proj_bias",
            "dt_limit",
            "norm_eps",
        )
    }
    assert got == {
        "d_model": D,
        "d_inner": DI,
        "n_heads": NH,
        "head_dim": DI // NH,
        "d_state": NS,
        "n_groups": NG,
        "conv_dim": CD,
        "conv_kernel": K,
        "conv_bias": True,
        "proj_bias": False,
        "dt_limit": (0.0, float("inf")),
        "norm_eps": 1e-05,
    }
    assert type(block.dt_limit[0]) is float and type(block.dt_limit[1]) is float


def test_non_integer_expand_and_k1(core):
    # d_inner / d_model = 21 / 16 is not an integer; K = 1 (no past tokens read).
    w = make_weights(1, di=21, nh=7, ns=2, ng=1, k=1, proj_bias=True)
    blk = Mamba2BlockInference(w)
    assert (blk.d_inner, blk.head_dim, blk.conv_kernel, blk.proj_bias) == (21, 3, 1, True)
    x = np.random.default_rng(0).standard_normal((1, 3, D)).astype(np.float32)
    st = blk.allocate_state(1)
    y = np.concatenate([blk.step(x[:, t], st) for t in range(3)], axis=1)
    assert_bitwise_equal(y, blk.forward(x), "K=1 step vs forward")


def test_extension_queries(block, core):
    assert block.numeric_mode_used() == "identical" == core.numeric_mode()
    assert block.vendor_used() == "cpu" == core.vendor()


@pytest.mark.parametrize(
    "attr",
    [
        "d_model",
        "d_inner",
        "n_heads",
        "head_dim",
        "d_state",
        "n_groups",
        "conv_dim",
        "conv_kernel",
        "dt_limit",
        "norm_eps",
        "conv_bias",
        "proj_bias",
        "fingerprint",
        "new_attr",
    ],
)
def test_block_attributes_read_only(block, attr):
    with raises(AttributeError, attr):
        setattr(block, attr, 3)
    with pytest.raises(AttributeError):
        delattr(block, "n_heads")


def test_repr_shows_options_not_weights(block):
    r = repr(block)
    assert r.startswith(f"{MBI}(") and f"d_model={D}" in r and f"n_groups={NG}" in r
    assert "dt_limit=(0.0, inf)" in r and "norm_eps=1e-05" in r and "array" not in r


def test_get_params(block):
    p = block.get_params()
    assert p == {"dt_limit": (0.0, float("inf")), "n_groups": NG, "norm_eps": 1e-05}
    assert block.get_params(deep=False) == p
    p["n_groups"] = 99
    assert block.n_groups == NG


def test_get_params_rebuilds_same_block(block, weights, x):
    clone = Mamba2BlockInference(weights, **block.get_params())
    assert clone.fingerprint == block.fingerprint
    assert_bitwise_equal(clone.forward(x), block.forward(x))


def test_set_params_changes_and_refuses_old_states(block, x, primed):
    fp, y0 = block.fingerprint, block.forward(x)
    assert block.set_params(dt_limit=[0.01, 0.05], norm_eps=1e-6) is block
    assert block.dt_limit == (0.01, 0.05) and block.norm_eps == 1e-6
    assert block.fingerprint != fp
    assert not np.array_equal(block.forward(x).view(np.uint32), y0.view(np.uint32))
    snap = snapshot(primed)
    with raises(ValueError, f"{MBI}.forward: ", "fingerprint", fp, block.fingerprint):
        block.forward(x, primed)
    assert snapshot(primed) == snap
    block.set_params(dt_limit=(0.0, float("inf")), norm_eps=1e-05)
    assert block.fingerprint == fp
    block.forward(x, primed)


def test_set_params_n_groups(weights):
    blk = build(weights, n_groups=1)
    assert blk.d_state == 2 * NS
    blk.set_params(n_groups=2)
    assert blk.d_state == NS and blk.n_groups == 2
    blk.set_params(n_groups=3)  # 12 B/C channels = 2*3*2 and 3 divides n_heads=6
    assert blk.d_state == 2 and blk.n_groups == 3


@pytest.mark.parametrize(
    "params,exc,fragments",
    [
        ({"weights": {}}, ValueError, ["weights"]),
        ({"n_heads": 2}, ValueError, ["n_heads"]),
        ({"n_groups": 4}, ValueError, ["n_groups=4"]),  # 12 B/C channels: 2*4 does not divide
        ({"norm_eps": 0.0}, ValueError, ["norm_eps"]),
        ({"dt_limit": (1.0, 0.5)}, ValueError, ["dt_limit"]),
        ({"n_groups": 2.0}, TypeError, ["n_groups"]),
    ],
)
def test_set_params_errors_change_nothing(block, x, params, exc, fragments):
    fp, opts, y = block.fingerprint, block.get_params(), block.forward(x)
    with raises(exc, f"{MBI}.set_params: ", *fragments):
        block.set_params(**params)
    assert block.fingerprint == fp and block.get_params() == opts
    assert_bitwise_equal(block.forward(x), y)


def test_backward_is_implemented(block, x):
    """The seed's backward works (tests/*/test_mamba2_backward_*.py hold its contract)."""
    g = block.backward(x, x)
    assert g["x"].shape == x.shape and set(g) > {"x"}
    with pytest.raises(TypeError):
        block.backward(x)


def test_pickle_deepcopy_same_bits(core, x):
    w = make_weights(3, proj_bias=True)
    blk = build(w, dt_limit=(0.001, 0.2), norm_eps=1e-4)
    y = blk.forward(x)
    for clone in (pickle.loads(pickle.dumps(blk)), copy.deepcopy(blk), copy.copy(blk)):
        assert type(clone) is Mamba2BlockInference
        assert clone.fingerprint == blk.fingerprint and repr(clone) == repr(blk)
        assert clone.get_params() == blk.get_params()
        assert_bitwise_equal(clone.forward(x), y, "restored block")


def test_pickled_state_works_with_restored_block(block, x, primed):
    blk2, st2 = pickle.loads(pickle.dumps((block, primed)))
    assert isinstance(st2, Mamba2State) and st2.fingerprint == primed.fingerprint
    assert snapshot(st2) == snapshot(primed)
    x1 = x[:, :1] * 0.5
    assert_bitwise_equal(blk2.step(x1, st2), block.step(x1, primed))
    assert snapshot(st2) == snapshot(primed)
    st3 = copy.deepcopy(primed)
    assert st3.h is not primed.h and snapshot(st3) == snapshot(primed)


# ------------------------------------------------------------------------------------------
# fingerprint and weights
# ------------------------------------------------------------------------------------------


def test_fingerprint_format_and_determinism(block, weights):
    fp = block.fingerprint
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    assert build(weights).fingerprint == fp
    w2 = dict(weights)
    w2["conv1d.weight"] = weights["conv1d.weight"].reshape(CD, K)  # the 2-D spelling
    assert build(w2).fingerprint == fp
    assert build(to_hf(weights)).fingerprint == fp  # the HF spelling
    w3 = dict(weights)
    w3["D"] = weights["D"].copy()
    w3["D"][0] = np.nextafter(w3["D"][0], np.float32(9))  # one ulp in one weight
    assert build(w3).fingerprint != fp
    assert build(weights, norm_eps=2e-5).fingerprint != fp


def test_hf_spelling_equals_short(block, weights, x):
    hf = build(to_hf(weights))
    assert_bitwise_equal(hf.forward(x), block.forward(x), "HF vs short spelling")


def test_hf_norm_weight_is_block_norm(weights, x):
    # In HF form 'norm.weight' is the block norm (length d_model); the gated norm is
    # 'mixer.norm.weight'. Swapping the two meanings must fail on shape: d_model is then read
    # from the HF 'norm.weight' (length d_inner) and out_proj has the wrong row count.
    hf = to_hf(weights)
    hf["norm.weight"], hf["mixer.norm.weight"] = (
        weights["norm.weight"],
        weights["block_norm.weight"],
    )
    with raises(
        ValueError,
        "weights['mixer.out_proj.weight']",
        f"({D}, {DI})",
        f"d_model={DI} (length of weights['norm.weight'])",
    ):
        build(hf)


def test_weights_are_copied(block, weights, x):
    y = block.forward(x)
    for a in weights.values():
        a[...] = 0.5
    assert_bitwise_equal(block.forward(x), y)


def test_noncontiguous_and_buffer_weights(block, weights, x):
    w = {}
    for k, a in weights.items():
        if a.ndim == 2:
            w[k] = np.asfortranarray(a)
        elif k == "D":
            w[k] = memoryview(array.array("f", a.tolist()))
        else:
            w[k] = a
    w["A_log"] = np.concatenate([weights["A_log"], np.zeros(NH, np.float32)]).reshape(2, NH)[0]
    w["dt_bias"] = np.stack([weights["dt_bias"], weights["dt_bias"]], axis=1)[:, 0]
    assert not w["dt_bias"].flags.c_contiguous
    blk = build(w)
    assert blk.fingerprint == block.fingerprint
    assert_bitwise_equal(blk.forward(x), block.forward(x))


@pytest.mark.parametrize("bad", [None, [("D", 1)], "weights", 3])
def test_weights_not_mapping(core, bad):
    with raises(TypeError, f"{MBI}.__init__: ", "weights"):
        Mamba2BlockInference(bad)


def test_weight_key_not_str(weights):
    weights[3] = weights["D"]
    with raises(TypeError, "weights", "int"):
        build(weights)


@pytest.mark.parametrize("hf", [False, True])
def test_missing_weight_lists_missing_and_expected(weights, hf):
    del weights["A_log"]
    w = to_hf(weights) if hf else weights
    miss = "mixer.A_log" if hf else "A_log"
    out = "mixer.out_proj.weight" if hf else "out_proj.weight"
    with raises(ValueError, f"{MBI}.__init__: ", "missing", repr(miss), repr(out)):
        build(w)


def test_unknown_weight_named(weights):
    weights["A_logg"] = weights["A_log"]
    with raises(ValueError, "unknown", "A_logg"):
        build(weights)
    hf = to_hf(make_weights())
    hf["mixer.conv1d.weights"] = hf["mixer.conv1d.weight"]
    with raises(ValueError, "unknown", "mixer.conv1d.weights"):
        build(hf)


@pytest.mark.parametrize(
    "present,absent", [("in_proj.bias", "out_proj.bias"), ("out_proj.bias", "in_proj.bias")]
)
def test_projection_biases_come_as_a_pair(weights, present, absent):
    full = make_weights(proj_bias=True)
    weights[present] = full[present]
    with raises(ValueError, present, absent, "use_bias"):
        build(weights)


def test_mixed_spellings(weights):
    w = to_hf(weights)
    w["A_log"] = w.pop("mixer.A_log")
    with raises(ValueError, "mix", "'A_log'", "mixer."):
        build(w)
    w = to_hf(weights)
    w["block_norm.weight"] = w.pop("norm.weight")
    with raises(ValueError, "mix", "'block_norm.weight'"):
        build(w)


@pytest.mark.parametrize("bad", [None, [1.0, 2.0], 3.0])
def test_weight_not_a_buffer(weights, bad):
    weights["D"] = bad
    with raises(TypeError, "weights['D']", type(bad).__name__):
        build(weights)


@pytest.mark.parametrize(
    "dtype,fragments",
    [
        (np.float64, ["float64", "astype"]),
        (np.float16, ["float16", "astype"]),
        (np.uint16, ["uint16", "bfloat16"]),
        (np.int32, ["int32"]),
        (np.dtype(">f4"), ["big-endian"]),
    ],
)
def test_weight_dtype_refused(weights, dtype, fragments):
    weights["in_proj.weight"] = weights["in_proj.weight"].astype(dtype)
    with raises(TypeError, "weights['in_proj.weight']", *fragments):
        build(weights)


@pytest.mark.parametrize(
    "name,shape,fragments",
    [
        ("block_norm.weight", (D, 1), ["weights['block_norm.weight']", "1-D", f"({D}, 1)"]),
        ("block_norm.weight", (0,), ["weights['block_norm.weight']", "empty"]),
        (
            "out_proj.weight",
            (D + 1, DI),
            ["weights['out_proj.weight']", f"({D + 1}, {DI})", f"d_model={D}"],
        ),
        ("out_proj.weight", (D, DI + 1), ["weights['norm.weight']", f"{DI + 1}"]),
        ("norm.weight", (DI - 1,), ["weights['norm.weight']", f"{DI - 1}", f"d_inner={DI}"]),
        ("D", (NH + 1,), ["weights['D']", f"({NH + 1},)", f"n_heads={NH}", "weights['A_log']"]),
        ("dt_bias", (NH, 1), ["weights['dt_bias']", "1-D"]),
        ("A_log", (0,), ["weights['A_log']", "empty"]),
        (
            "conv1d.weight",
            (CD, 2, K),
            ["weights['conv1d.weight']", f"({CD}, 2, {K})", "(conv_dim, 1, conv_kernel)"],
        ),
        ("conv1d.weight", (CD, 1, 0), ["weights['conv1d.weight']", "conv_kernel", ">= 1"]),
        ("conv1d.bias", (CD + 1,), ["weights['conv1d.bias']", f"({CD + 1},)", f"conv_dim={CD}"]),
        (
            "in_proj.weight",
            (N_IN + 1, D),
            [
                "weights['in_proj.weight']",
                f"({N_IN + 1}, {D})",
                f"({N_IN}, {D})",
                f"{DI} + {CD} + {NH}",
            ],
        ),
        ("in_proj.weight", (N_IN, D + 1), ["weights['in_proj.weight']", f"d_model={D}"]),
    ],
)
def test_weight_shape_wrong(weights, name, shape, fragments):
    weights[name] = np.zeros(shape, np.float32) + 0.1
    with raises(ValueError, f"{MBI}.__init__: ", *fragments):
        build(weights)


@pytest.mark.parametrize("name,shape", [("in_proj.bias", (N_IN - 1,)), ("out_proj.bias", (1,))])
def test_bias_shape_wrong(name, shape):
    w = make_weights(proj_bias=True)
    w[name] = np.zeros(shape, np.float32)
    with raises(ValueError, f"weights['{name}']", str(shape)):
        build(w)


def test_head_dim_not_exact(core):
    w = make_weights(di=24, nh=5)  # 24 / 5
    with raises(ValueError, "d_inner=24", "n_heads=5", "head_dim"):
        Mamba2BlockInference(w)


def test_conv_dim_vs_n_groups(weights):
    w = dict(weights)
    w["conv1d.weight"] = np.zeros((CD + 1, 1, K), np.float32)
    with raises(ValueError, f"conv_dim={CD + 1}", f"d_inner={DI}", "2*n_groups"):
        build(w)
    w["conv1d.weight"] = np.zeros((DI, 1, K), np.float32)  # no room for B and C
    with raises(ValueError, f"conv_dim={DI}", "positive"):
        build(w)
    with raises(ValueError, "n_groups=4", f"conv_dim={CD}"):  # 12 % 8 != 0
        build(weights, n_groups=4)


def test_n_groups_not_dividing_n_heads(core):
    w = make_weights(di=20, nh=5, ns=2, ng=2)  # B/C width 8 fits 2 groups, 5 heads do not
    with raises(ValueError, "n_groups=2", "n_heads=5"):
        Mamba2BlockInference(w, n_groups=2)


@pytest.mark.parametrize(
    "name,index",
    [("in_proj.weight", (3, 2)), ("conv1d.weight", (5, 0, 1)), ("D", (4,)), ("norm.weight", (7,))],
)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_weight(weights, name, index, value):
    weights[name][index] = value
    flat = int(np.ravel_multi_index(index, weights[name].shape))
    with raises(ValueError, f"weights['{name}']", f"flat index {flat}", repr(float(value))):
        build(weights)


def test_a_log_with_nonfinite_a(weights):
    weights["A_log"][2] = 89.0  # exp(89) overflows float32
    with raises(ValueError, "weights['A_log']", "flat index 2", "89.0", "A=-inf"):
        build(weights)
    weights["A_log"][2] = 88.5  # largest region still finite: accepted
    assert build(weights).n_heads == NH
    hf = to_hf(make_weights())
    hf["mixer.A_log"][0] = 100.0
    with raises(ValueError, "weights['mixer.A_log']", "flat index 0"):
        build(hf)


@pytest.mark.parametrize(
    "opt,value",
    [
        ("n_groups", True),
        ("n_groups", 2.0),
        ("n_groups", "2"),
        ("n_groups", None),
        ("norm_eps", "1e-5"),
        ("norm_eps", True),
        ("norm_eps", None),
        ("dt_limit", 0.1),
        ("dt_limit", "ab"),
        ("dt_limit", None),
        ("dt_limit", {0: 0.0, 1: 1.0}),
        ("dt_limit", np.array([0.0, 1.0])),
        ("dt_limit", (0.0, "1")),
        ("dt_limit", (True, 1.0)),
    ],
)
def test_option_wrong_type(weights, opt, value):
    with raises(TypeError, f"{MBI}.__init__: ", opt):
        build(weights, **{opt: value})


@pytest.mark.parametrize(
    "opt,value,fragments",
    [
        ("n_groups", 0, ["n_groups", "[1, 16777216]", "0"]),
        ("n_groups", -2, ["n_groups", "-2"]),
        ("norm_eps", 0.0, ["norm_eps", "> 0"]),
        ("norm_eps", -1e-5, ["norm_eps"]),
        ("norm_eps", float("nan"), ["norm_eps", "nan"]),
        ("norm_eps", float("inf"), ["norm_eps"]),
        ("dt_limit", (float("nan"), 1.0), ["dt_limit[0]", "nan"]),
        ("dt_limit", (0.0, float("nan")), ["dt_limit[1]", "nan"]),
        ("dt_limit", (1.0, 0.5), ["dt_limit", "lo <= hi"]),
        ("dt_limit", (-0.1, 1.0), ["dt_limit[0]", ">= 0"]),
        ("dt_limit", (float("inf"), float("inf")), ["dt_limit[0]", "finite", "inf"]),
        ("dt_limit", (0.0, -float("inf")), ["dt_limit[1]"]),
        ("dt_limit", (0.0, 1.0, 2.0), ["dt_limit", "two", "3"]),
        ("dt_limit", [0.5], ["dt_limit", "two", "1"]),
    ],
)
def test_option_out_of_range(weights, opt, value, fragments):
    with raises(ValueError, f"{MBI}.__init__: ", *fragments):
        build(weights, **{opt: value})


def test_options_accepted_forms(weights, x):
    a = build(weights, dt_limit=[0, 1], norm_eps=np.float32(1e-5), n_groups=np.int64(NG))
    b = build(weights, dt_limit=(0.0, 1.0), norm_eps=float(np.float32(1e-5)))
    assert a.dt_limit == (0.0, 1.0) and a.n_groups == NG and type(a.n_groups) is int
    assert a.fingerprint == b.fingerprint
    c = build(weights, dt_limit=(0.05, 0.05))  # lo == hi: dt is constant
    assert c.dt_limit == (0.05, 0.05)
    c.forward(x)


def test_positional_and_unknown_options(weights):
    with pytest.raises(TypeError):
        Mamba2BlockInference(weights, (0.0, 1.0))
    with pytest.raises(TypeError):
        Mamba2BlockInference(weights, n_heads=4)
    with pytest.raises(TypeError):
        Mamba2BlockInference(weights, chunk_size=256)


# ------------------------------------------------------------------------------------------
# calls: x, lengths, outputs
# ------------------------------------------------------------------------------------------


def test_output_properties(block, x):
    y = block.forward(x)
    assert y.shape == x.shape and y.dtype == np.float32
    assert y.flags.c_contiguous and y.flags.writeable
    assert not np.shares_memory(y, x)
    assert_bitwise_equal(block(x), y, "__call__")
    y2 = block.forward(x)
    assert not np.shares_memory(y, y2)


def test_x_never_written_and_stateless_equals_fresh_state(block, x):
    x0 = x.copy()
    y = block.forward(x)
    assert_bitwise_equal(x, x0, "x")
    st = block.allocate_state(2)
    assert_bitwise_equal(block.forward(x, st), y, "fresh state vs None")
    assert st.row_tokens.tolist() == [5, 5]


def test_buffer_protocol_inputs(block, x):
    y = block.forward(x)
    a = array.array("f", x.ravel().tolist())
    mv = memoryview(a).cast("B").cast("f", x.shape)
    assert_bitwise_equal(block.forward(mv), y, "memoryview")
    xf = np.asfortranarray(x)
    assert_bitwise_equal(block.forward(xf), y, "Fortran order")
    big = np.zeros((2, 10, D), np.float32)
    big[:, ::2] = x
    assert_bitwise_equal(block.forward(big[:, ::2]), y, "strided")
    st = block.allocate_state(2)
    assert_bitwise_equal(block.step(x[:, 0, :], st), y[:, :1], "2-D step")
    assert_bitwise_equal(block.step(x[:, 1:2, :], st), y[:, 1:2], "3-D step")


@pytest.mark.parametrize("bad", [None, [[0.0] * D], 1.5])
def test_x_not_buffer(block, primed, bad):
    snap = snapshot(primed)
    for call in (
        lambda: block.forward(bad),
        lambda: block.forward(bad, primed),
        lambda: block.step(bad, primed),
    ):
        with raises(TypeError, "x", type(bad).__name__):
            call()
    assert snapshot(primed) == snap


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.dtype(">f4")])
def test_x_dtype_refused(block, x, primed, dtype):
    snap = snapshot(primed)
    with raises(TypeError, f"{MBI}.forward: ", "x", "dtype"):
        block.forward(x.astype(dtype), primed)
    assert snapshot(primed) == snap


@pytest.mark.parametrize("shape", [(2, D), (2, 5, D + 1), (0, 5, D), (2, 0, D), (2, 5, D, 1)])
def test_x_shape_wrong_forward(block, primed, shape):
    snap = snapshot(primed)
    with raises(ValueError, f"{MBI}.forward: ", "x", str(shape)):
        block.forward(np.zeros(shape, np.float32), primed)
    assert snapshot(primed) == snap


@pytest.mark.parametrize("shape", [(2, 2, D), (2, D + 1), (2,), (2, 1, D, 1)])
def test_x_shape_wrong_step(block, primed, shape):
    snap = snapshot(primed)
    with raises(ValueError, f"{MBI}.step: ", "x", str(shape)):
        block.step(np.zeros(shape, np.float32), primed)
    assert snapshot(primed) == snap


@pytest.mark.parametrize("val", [np.nan, np.inf, -np.inf])
def test_x_nonfinite_real_position(block, x, primed, val):
    snap = snapshot(primed)
    x[1, 3, 7] = val
    with raises(ValueError, f"{MBI}.forward: ", "x[1, 3, 7]", repr(float(val))):
        block.forward(x, primed)
    with raises(ValueError, "x[1, 3, 7]"):
        block.forward(x, primed, lengths=[5, 4])
    assert snapshot(primed) == snap
    y = block.forward(x, primed, lengths=[5, 3])  # position 3 of row 1 is padding now
    assert np.isfinite(y).all()


def test_nan_padding_is_never_read(block, x):
    y = block.forward(x, lengths=[5, 2])
    x2 = x.copy()
    x2[1, 2:] = np.nan
    assert_bitwise_equal(block.forward(x2, lengths=[5, 2]), y)
    assert (y[1, 2:].view(np.uint32) == 0).all()


@pytest.mark.parametrize(
    "form",
    [
        lambda v: v,
        tuple,
        lambda v: np.array(v, np.int32),
        lambda v: np.array(v, np.uint8),
        lambda v: [np.int64(i) for i in v],
    ],
)
def test_lengths_forms(block, x, form):
    assert_bitwise_equal(block.forward(x, lengths=form([3, 5])), block.forward(x, lengths=[3, 5]))


def test_lengths_full_equals_none_and_zero_rows(block, x):
    assert_bitwise_equal(block.forward(x, lengths=[5, 5]), block.forward(x))
    y = block.forward(x, lengths=[0, 0])
    assert (y.view(np.uint32) == 0).all()


@pytest.mark.parametrize(
    "bad",
    [
        3,
        "35",
        {0: 3, 1: 5},
        [3.0, 5],
        [True, 5],
        ["3", 5],
        np.array([3.0, 5.0]),
        np.array([True, False]),
        {3, 5},
    ],
)
def test_lengths_wrong_type(block, x, primed, bad):
    snap = snapshot(primed)
    with raises(TypeError, f"{MBI}.forward: ", "lengths"):
        block.forward(x, primed, lengths=bad)
    assert snapshot(primed) == snap


@pytest.mark.parametrize(
    "bad,fragments",
    [
        ([3], ["lengths", "1 entries", "batch=2"]),
        ([1, 2, 3], ["lengths", "3"]),
        ([3, 6], ["lengths[1]=6"]),
        ([-1, 3], ["lengths[0]=-1"]),
        (np.zeros((2, 1), np.int64), ["lengths", "1-D"]),
    ],
)
def test_lengths_wrong_value(block, x, primed, bad, fragments):
    snap = snapshot(primed)
    with raises(ValueError, f"{MBI}.forward: ", *fragments):
        block.forward(x, primed, lengths=bad)
    assert snapshot(primed) == snap


# ------------------------------------------------------------------------------------------
# calls: state checks (every failure leaves conv_window, h, row_tokens byte-identical)
# ------------------------------------------------------------------------------------------


def test_step_needs_state(block, x):
    with raises(TypeError, f"{MBI}.step: ", "state", "None"):
        block.step(x[:, 0], None)


@pytest.mark.parametrize("kind", ["dict", "transformer_state", "array"])
def test_state_wrong_class(block, x, kind):
    if kind == "dict":
        bad = {"h": np.zeros(1)}
    elif kind == "array":
        bad = np.zeros((2, NH, DI // NH, NS), np.float32)
    else:
        from exactblocks._state import _PRIVATE

        bad = TransformerState._make(
            _PRIVATE,
            batch_size=2,
            n_kv_heads=1,
            head_dim=4,
            max_tokens=8,
            window=0,
            fingerprint="0" * 32,
        )
    for call in (lambda: block.forward(x, bad), lambda: block.step(x[:, 0], bad)):
        with raises(TypeError, "state", "Mamba2State", type(bad).__name__):
            call()


def test_state_of_another_block(block, x, weights):
    other = build(make_weights(9))
    st = other.allocate_state(2)
    other.forward(x, st)
    snap = snapshot(st)
    with raises(ValueError, "state", other.fingerprint, block.fingerprint):
        block.forward(x, st)
    with raises(ValueError, "fingerprint"):
        block.step(x[:, 0], st)
    assert snapshot(st) == snap


def test_state_batch_mismatch(block, x):
    st = block.allocate_state(3)
    block.forward(np.ones((3, 2, D), np.float32), st)
    snap = snapshot(st)
    with raises(ValueError, "state.batch_size=3", "2"):
        block.forward(x, st)
    assert snapshot(st) == snap


def test_row_tokens_negative(block, x, primed):
    primed.row_tokens[1] = -1
    snap = snapshot(primed)
    with raises(ValueError, f"{MBI}.forward: ", "state.row_tokens[1]=-1", ">= 0"):
        block.forward(x, primed)
    assert snapshot(primed) == snap
    # row_tokens is bookkeeping only: any value >= 0 is accepted and does not change bits.
    ref = copy.deepcopy(primed)
    ref.row_tokens[:] = [5, 5]
    primed.row_tokens[:] = [0, 1234567]
    assert_bitwise_equal(block.forward(x, primed), block.forward(x, ref))
    assert primed.row_tokens.tolist() == [5, 1234572]


@pytest.mark.parametrize(
    "buf,index",
    [
        ("conv_window", (1, 7, 2)),
        ("conv_window", (0, 0, 1)),
        ("h", (1, 2, 3, 1)),
        ("h", (0, 0, 0, 0)),
    ],
)
@pytest.mark.parametrize("val", [np.nan, np.inf])
def test_nonfinite_state_of_advanced_row(block, x, primed, buf, index, val):
    getattr(primed, buf)[index] = val
    snap = snapshot(primed)
    idx = ", ".join(str(i) for i in index)
    with raises(ValueError, f"{MBI}.forward: ", f"state.{buf}[{idx}]", repr(float(val))):
        block.forward(x, primed)
    with raises(ValueError, f"state.{buf}[{idx}]"):
        block.step(x[:, 0], primed)
    assert snapshot(primed) == snap
    # The row is idle: it is neither checked nor touched, and the other row advances.
    lengths = [0, 5] if index[0] == 0 else [5, 0]
    other = 1 - index[0]
    before = (primed.conv_window[index[0]].tobytes(), primed.h[index[0]].tobytes())
    y = block.forward(x, primed, lengths=lengths)
    assert (primed.conv_window[index[0]].tobytes(), primed.h[index[0]].tobytes()) == before
    assert (y[index[0]].view(np.uint32) == 0).all() and np.isfinite(y[other]).all()
    assert primed.row_tokens.tolist() == ([5, 10] if other == 1 else [10, 5])


@pytest.mark.parametrize("val", [np.nan, np.inf, -np.inf])
def test_unread_conv_window_column_is_not_checked(block, x, primed, val):
    """SPEC 2.4: only what a call reads must be finite. Column 0 of the window (the oldest
    input) leaves the window unread, so any value there is ignored and changes no bit."""
    ref = copy.deepcopy(primed)
    ref.conv_window[:, :, 0] = 1e30
    primed.conv_window[:, 3, 0] = val
    primed.conv_window[1, :, 0] = val
    y = block.forward(x[:, :2], primed)
    assert_bitwise_equal(y, block.forward(x[:, :2], ref))
    assert_bitwise_equal(primed.conv_window, ref.conv_window)
    assert_bitwise_equal(primed.h, ref.h)


def test_nonfinite_state_first_in_row_order(block):
    """With bad values in several rows, the error names the first row's (conv_window before
    h); a value in column 0 (unread) or in an idle row is skipped, whatever the threads."""
    st = block.allocate_state(4)
    x4 = np.random.default_rng(11).standard_normal((4, 5, D)).astype(np.float32)
    block.forward(x4, st)
    st.conv_window[0, 2, 0] = np.nan  # row 0: column 0, not read
    st.conv_window[1, 5, 1] = np.inf  # row 1: idle below
    st.h[2, 1, 0, 2] = np.nan  # row 2: the first read bad value
    st.conv_window[3, 0, 2] = -np.inf  # row 3: later
    snap = snapshot(st)
    for n in (1, 2, 3):
        saved = exactblocks.get_num_threads()
        force_num_threads(n)
        try:
            with raises(ValueError, "state.h[2, 1, 0, 2]"):
                block.forward(x4, st, lengths=[5, 0, 5, 5])
        finally:
            exactblocks.set_num_threads(saved)
        assert snapshot(st) == snap
    st.h[2, 1, 0, 2] = 0.0
    with raises(ValueError, "state.conv_window[3, 0, 2]"):
        block.forward(x4, st, lengths=[5, 0, 5, 5])
    st.conv_window[3, 0, 2] = 0.0
    y = block.forward(x4, st, lengths=[5, 0, 5, 5])
    assert np.isfinite(y[[0, 2, 3]]).all()


def test_state_buffer_reshaped_in_place_is_refused(block, x, primed):
    primed.h.shape = (2, NH, NS, DI // NH)  # in-place reshape of the same memory
    with raises(ValueError, "state.h", "shape"):
        block.forward(x, primed)


def test_read_only_row_tokens_is_refused_before_any_write(block, x, primed):
    primed.row_tokens.flags.writeable = False
    snap = snapshot(primed)
    with raises(ValueError, "state.row_tokens", "writable"):
        block.forward(x, primed)
    assert snapshot(primed) == snap


M_TAMPERINGS = {
    "conv_window read-only": (
        lambda st: setattr(st.conv_window.flags, "writeable", False),
        "state.conv_window",
        "read-only",
    ),
    "h read-only": (lambda st: setattr(st.h.flags, "writeable", False), "state.h", "read-only"),
    "h flattened": (
        lambda st: object.__setattr__(st, "h", st.h.reshape(-1)),
        "state.h",
        f"shape ({2 * DI * NS},)",
    ),
    "conv_window float64": (
        lambda st: object.__setattr__(st, "conv_window", st.conv_window.astype(np.float64)),
        "state.conv_window",
        "dtype float64",
    ),
    "row_tokens int32": (
        lambda st: object.__setattr__(st, "row_tokens", st.row_tokens.astype(np.int32)),
        "state.row_tokens",
        "dtype int32",
    ),
    "h inside conv_window": (  # same bytes: the scan would overwrite the conv window
        lambda st: object.__setattr__(
            st, "h", st.conv_window.reshape(-1)[: st.h.size].reshape(st.h.shape)
        ),
        "state.conv_window and state.h",
        "share memory",
    ),
}


@pytest.mark.parametrize("case", list(M_TAMPERINGS))
def test_tampered_state_buffers_refused_before_any_write(block, x, primed, case):
    """The buffer checks are shared with TransformerState (_validation.check_state_buffers):
    same message, aliasing included, also in reset(); nothing is written."""
    tamper, buf, what = M_TAMPERINGS[case]
    tamper(primed)

    def snap():
        return tuple(
            np.asarray(getattr(primed, n)).tobytes() for n in ("conv_window", "h", "row_tokens")
        )

    before = snap()
    for where, call in (
        (f"{MBI}.forward", lambda: block.forward(x, primed)),
        (f"{MBI}.step", lambda: block.step(x[:, 0], primed)),
        ("Mamba2State.reset", lambda: primed.reset()),
    ):
        with raises(ValueError, f"{where}: ", buf, what):
            call()
        assert snap() == before, f"{where} changed the state"


@pytest.mark.parametrize(
    "opts,fragments",
    [
        ({"norm_eps": 1e-50}, ["norm_eps=1e-50", "float32", "3.4028234663852886e+38"]),
        ({"norm_eps": 1e39}, ["norm_eps=1e+39", "float32"]),
        ({"dt_limit": (0.0, 1e39)}, ["dt_limit[1]=1e+39", "float32", "3.4028234663852886e+38"]),
        ({"dt_limit": (1e39, float("inf"))}, ["dt_limit[0]=1e+39", "float32"]),
        ({"dt_limit": (0.0, 10**400)}, ["dt_limit[1]", "too large for a float"]),
        ({"n_groups": 2**64}, ["n_groups", "[1, 16777216]"]),
    ],
)
def test_options_outside_float32_or_int_range(weights, opts, fragments):
    """Finding: options finite in float64 but 0 or inf in float32 (the core's type) were
    accepted; a huge int reached float() or the binding."""
    with raises(ValueError, f"{MBI}.__init__: ", *fragments):
        build(weights, **opts)


def test_float32_edge_options_accepted(weights, x):
    big = float(np.finfo(np.float32).max)
    for opts in (
        {"dt_limit": (0.0, float("inf"))},
        {"dt_limit": (1e-50, big)},
        {"norm_eps": 1e-45},
        {"norm_eps": big},
    ):
        assert np.isfinite(build(weights, **opts).forward(x)).all(), opts
    # A lo that rounds to 0 in float32 is the same arithmetic as lo = 0: same bits.
    assert_bitwise_equal(
        build(weights, dt_limit=(1e-50, 1.0)).forward(x),
        build(weights, dt_limit=(0.0, 1.0)).forward(x),
    )


def test_allocate_state_too_large_is_memory_error(block):
    per_row = (CD * K + NH * (DI // NH) * NS) * 4 + 8  # conv_window + h (float32) + row_tokens
    for b in (10**14, 2**62):
        with raises(
            MemoryError, f"{MBI}.allocate_state: ", f"batch_size={b}", f"{b * per_row} bytes"
        ):
            block.allocate_state(b)
    with raises(ValueError, f"{MBI}.allocate_state: ", "batch_size", str(2**62)):
        block.allocate_state(2**62 + 1)


def test_concurrent_use_of_a_state_is_runtime_error(block, x, primed):
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
    t = threading.Thread(target=lambda: block.forward(x[:, :1], primed))
    try:
        t.start()
        assert entered.wait(10)
        snap = snapshot(primed)
        try:
            block.step(x[:, 0], primed)
        except RuntimeError as exc:
            errors.append(str(exc))
        assert snapshot(primed) == snap
        with raises(RuntimeError, "Mamba2State.reset: ", "state"):
            primed.reset()
    finally:
        release.set()
        t.join()
        impl.core = real
    assert len(errors) == 1 and errors[0].startswith(f"{MBI}.step: ") and "state" in errors[0]
    assert primed.row_tokens.tolist() == [6, 6]
    block.forward(x)  # other calls are not blocked by a busy state


# ------------------------------------------------------------------------------------------
# allocate_state and Mamba2State (SPEC 8)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,exc,fragment",
    [
        ((2.0,), TypeError, "batch_size"),
        (("2",), TypeError, "batch_size"),
        ((True,), TypeError, "batch_size"),
        ((0,), ValueError, "batch_size"),
        ((-3,), ValueError, "batch_size"),
        ((2, 16), TypeError, "max_tokens"),
    ],
)
def test_allocate_state_checks(block, args, exc, fragment):
    with raises(exc, f"{MBI}.allocate_state: ", fragment):
        block.allocate_state(*args)


def test_allocate_state_fields(block):
    st = block.allocate_state(np.int32(3))
    assert isinstance(st, Mamba2State)
    assert (
        st.batch_size,
        st.n_heads,
        st.head_dim,
        st.d_state,
        st.n_groups,
        st.conv_dim,
        st.conv_kernel,
    ) == (3, NH, DI // NH, NS, NG, CD, K)
    assert st.conv_window.shape == (3, CD, K) and st.conv_window.dtype == np.float32
    assert st.h.shape == (3, NH, DI // NH, NS) and st.h.dtype == np.float32
    assert st.row_tokens.dtype == np.int64 and st.row_tokens.tolist() == [0, 0, 0]
    for a in (st.conv_window, st.h):
        assert a.flags.c_contiguous and a.flags.writeable and (a.view(np.uint32) == 0).all()
    assert st.fingerprint == block.fingerprint
    assert repr(st) == (
        f"Mamba2State(batch_size=3, n_heads={NH}, head_dim={DI // NH}, "
        f"d_state={NS}, n_groups={NG}, conv_dim={CD}, conv_kernel={K}, "
        "row_tokens=[0, 0, 0])"
    )


def test_state_direct_construction_refused():
    with raises(TypeError, "Mamba2State", "allocate_state"):
        Mamba2State()
    with raises(TypeError, "allocate_state"):
        Mamba2State._make(
            object(),
            batch_size=1,
            n_heads=1,
            head_dim=1,
            d_state=1,
            n_groups=1,
            conv_dim=3,
            conv_kernel=1,
            fingerprint="",
        )


@pytest.mark.parametrize(
    "attr",
    [
        "conv_window",
        "h",
        "row_tokens",
        "fingerprint",
        "batch_size",
        "n_heads",
        "d_state",
        "conv_kernel",
        "other",
    ],
)
def test_state_attributes_not_rebindable(block, attr):
    st = block.allocate_state(1)
    with raises(AttributeError, attr):
        setattr(st, attr, np.zeros(1))
    with pytest.raises(AttributeError):
        delattr(st, "h")


def test_state_step_matches_forward_and_updates(block, x):
    st = block.allocate_state(2)
    ys = [block.step(x[:, t], st) for t in range(5)]
    assert st.row_tokens.tolist() == [5, 5]
    st2 = block.allocate_state(2)
    assert_bitwise_equal(np.concatenate(ys, axis=1), block.forward(x, st2))
    assert snapshot(st) == snapshot(st2)
    # conv_window holds the last K pre-conv xBC vectors: not zero after 5 tokens with K=4.
    assert (st.conv_window != 0).all(axis=1).any()


def test_reset_rows(block, x, primed):
    fresh = block.allocate_state(2)
    y_fresh = block.forward(x, fresh)
    before_row0 = (primed.conv_window[0].copy(), primed.h[0].copy())
    primed.reset([1])
    assert (primed.conv_window[1] == 0).all() and (primed.h[1] == 0).all()
    assert primed.row_tokens.tolist() == [5, 0]
    assert_bitwise_equal(primed.conv_window[0], before_row0[0])
    assert_bitwise_equal(primed.h[0], before_row0[1])
    y = block.forward(x, primed)
    assert_bitwise_equal(y[1], y_fresh[1], "reset row == fresh sequence")
    primed.reset(np.int64(0))
    primed.reset()
    assert snapshot(primed) == snapshot(block.allocate_state(2))
    for bad, exc in (
        ([2], ValueError),
        (-1, ValueError),
        ("0", TypeError),
        ([0.0], TypeError),
        (np.array([0.5]), TypeError),
    ):
        with raises(exc, "Mamba2State.reset: ", "rows"):
            primed.reset(bad)


def test_initial_state_written_by_hand(block, x, primed):
    # SPEC 8: writing h and conv_window is how initial states (HF initial_states) are given.
    st = block.allocate_state(2)
    st.conv_window[...] = primed.conv_window
    st.h[...] = primed.h
    assert_bitwise_equal(block.forward(x, st), block.forward(x, primed))


# ------------------------------------------------------------------------------------------
# docs/mamba2.md: the example runs
# ------------------------------------------------------------------------------------------


def test_docs_example_runs(core):
    doc = Path(__file__).resolve().parents[2] / "docs" / "mamba2.md"
    text = doc.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/mamba2.md has no python example"
    ns: dict = {}
    exec(compile(blocks[0], str(doc), "exec"), ns)  # its own asserts check the bits
    assert isinstance(ns.get("blk"), Mamba2BlockInference)
