"""Compact exact weight storage (ops/gemm/format.hpp PanelFormat, ops/gemm/pack.cpp).

A matrix whose every weight is a GGUF block-quantised value is packed as codes plus float32
scales; the kernels rebuild each weight with the packer's own verified operation. The claim
is bitwise: the same GEMM, the same block, the same bits as float32 panels (and as the scalar
triple-loop reference), on every ISA, thread count and row count (decode rebuilds weights in
registers, prefill K block by K block into a float32 panel). Test data comes from the `gguf`
package's own quantiser (llama.cpp's algorithm), not from this library.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_mamba2_weights, make_transformer_weights

import exactblocks as eb
from benchmarks.workloads import bf16_round
from exactblocks import _ext

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

T = gguf.GGMLQuantizationType
# GGUF type -> the packed format its dequantised values fit (Q4_0 and Q5_0 are d * (q - 8|16):
# int8 codes with one scale)
FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0"}


@pytest.fixture(scope="module")
def core():
    return _ext.core()


def gguf_values(x: np.ndarray, kind: str) -> np.ndarray:
    """x's rows quantised by gguf (blocks of 32 along the last axis) and dequantised: float32."""
    t = getattr(T, kind)
    return np.ascontiguousarray(dequantize(quantize(x.astype(np.float32), t), t), dtype=np.float32)


def each_isa_and_threads(core):
    saved_isa, saved_threads = core.get_isa(), core.get_num_threads()
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            for nt in (1, 2, 3):
                core.set_num_threads(nt)
                yield isa, nt
    finally:
        core.set_isa(saved_isa)
        core.set_num_threads(saved_threads)


def u32(a):
    return np.asarray(a).view(np.uint32)


# rows: 1 and 8 run the in-register (decode) path on AVX-512; 9, 17 and 40 several row blocks
# per panel, the rebuilt-panel (prefill) path. k: one block, several, and past one K block
# (kGemmKC = 2048), so partial sums continue across K blocks from rebuilt panels.
@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 70, 32),
        (8, 48, 96),
        (9, 100, 64),
        (17, 49, 2048 + 64),
        (40, 130, 160),
        (1, 200, 4096 + 32),
    ],
)
def test_compact_gemm_equals_float32_panels_and_reference(core, kind, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = gguf_values(0.05 * rng.standard_normal((n, k)), kind)
    a = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    ref = core.gemm_ref(a, w, bias)
    for isa, nt in each_isa_and_threads(core):
        got, fmt = core.gemm(a, w, bias, compact=True)
        plain, plain_fmt = core.gemm(a, w, bias, compact=False)
        assert (fmt, plain_fmt) == (FORMATS[kind], "float32"), (isa, nt)
        assert np.array_equal(u32(got), u32(ref)), f"{kind} {isa} {nt} threads: compact != gemm_ref"
        assert np.array_equal(u32(plain), u32(ref)), f"{isa} {nt} threads: float32 != gemm_ref"


def test_compact_row_equals_row_alone(core):
    """A decode row (rebuilt in registers) == the same row inside a prefill (rebuilt panel)."""
    rng = np.random.default_rng(5)
    w = gguf_values(0.05 * rng.standard_normal((150, 576)), "Q4_1")
    a = rng.standard_normal((37, 576)).astype(np.float32)
    for isa, nt in each_isa_and_threads(core):
        full, fmt = core.gemm(a, w)
        assert fmt == "q4_1"
        for r in (0, 8, 36):
            one, _ = core.gemm(np.ascontiguousarray(a[r : r + 1]), w)
            assert np.array_equal(u32(full[r]), u32(one[0])), (isa, nt, r)


def test_what_is_not_exactly_compact_stays_float32(core):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    w = gguf_values(0.05 * rng.standard_normal((50, 64)), "Q4_1")
    cases = {
        "plain float32": rng.standard_normal((50, 64)).astype(np.float32),
        "k not a multiple of 32": gguf_values(0.05 * rng.standard_normal((50, 64)), "Q8_0")[:, :48],
    }
    for r, c in [(0, 0), (49, 63), (17, 31)]:  # one weight off by one ulp, anywhere
        bad = w.copy()
        bad[r, c] = np.nextafter(bad[r, c], np.float32(np.inf))
        cases[f"one ulp at ({r}, {c})"] = bad
    q8_neg_zero = gguf_values(0.05 * rng.standard_normal((50, 64)), "Q8_0")
    q8_neg_zero[q8_neg_zero == 0] = -0.0  # Q8_0 scales are positive: code 0 rebuilds +0.0
    assert (np.signbit(q8_neg_zero) & (q8_neg_zero == 0)).any()
    cases["-0.0 in a Q8_0 matrix"] = q8_neg_zero  # but q6_k's d < 0 per 16 rebuilds -0.0
    neg_zero = np.zeros((4, 32), np.float32)
    neg_zero[2, 5] = -0.0  # d * q with d = +0.0 and q = -1 (q6_k; a bfloat16 value too)
    cases["a -0.0 among zeros"] = neg_zero
    for what, m in cases.items():
        aa = np.ascontiguousarray(a[:, : m.shape[1]])
        got, fmt = core.gemm(aa, np.ascontiguousarray(m))
        want = {"a -0.0 among zeros": "q6_k", "-0.0 in a Q8_0 matrix": "q6_k"}.get(what, "float32")
        assert fmt == want, what
        assert np.array_equal(u32(got), u32(core.gemm_ref(aa, np.ascontiguousarray(m), None))), what


def test_degenerate_blocks(core):
    """Blocks of one repeated value, zeros, and huge values are packed exactly or not at all."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, 64)).astype(np.float32)
    const = np.full((48, 64), 0.375, np.float32)
    zeros = np.zeros((10, 64), np.float32)
    huge = gguf_values(rng.standard_normal((10, 64)), "Q8_0") * np.float32(2.0**100)
    for what, m, fmt_ok in [
        ("constant", const, {"q4_1"}),
        ("zeros", zeros, {"q4_1"}),
        ("huge", huge, {"q8_0", "float32"}),
    ]:
        got, fmt = core.gemm(a, m)
        assert fmt in fmt_ok, (what, fmt)
        assert np.array_equal(u32(got), u32(core.gemm_ref(a, m, None))), what


def test_packed_linear_reports_format_and_bytes(core):
    rng = np.random.default_rng(8)
    w = gguf_values(0.05 * rng.standard_normal((96, 64)), "Q8_0")
    lin = core.PackedLinear(w)
    assert (lin.format, lin.n_out, lin.k_in) == ("q8_0", 96, 64)
    assert lin.nbytes == 96 * 64 + 96 * 2 * 4  # int8 codes + one float scale per 32 weights
    plain = core.PackedLinear(rng.standard_normal((96, 64)).astype(np.float32))
    assert (plain.format, plain.nbytes) == ("float32", 96 * 64 * 4)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    assert np.array_equal(u32(lin.forward(x)), u32(core.gemm_ref(x, w, None)))


# ---- whole blocks: compact storage vs float32 panels, bit for bit --------------------------


def build_twice(make):
    """The same block built with compact storage allowed, then with float32 panels only."""
    compact = make()
    return compact, compact._float32_storage_copy()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_transformer_block_compact_equals_float32(kind):
    rng = np.random.default_rng(11)
    opts = dict(n_heads=4, n_kv_heads=2, head_dim=16)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **opts)
    w = {n: gguf_values(v, kind) if v.ndim == 2 else v for n, v in w.items()}
    compact, plain = build_twice(lambda: eb.TransformerBlockInference(w, **opts, max_positions=64))
    assert [f for _, f, _ in compact.weight_storage()] == [FORMATS[kind]] * 4
    assert [f for _, f, _ in plain.weight_storage()] == ["float32"] * 4
    assert (
        sum(b for *_, b in compact.weight_storage())
        < sum(b for *_, b in plain.weight_storage()) / 3
    )
    x = rng.standard_normal((3, 20, 64)).astype(np.float32)
    lengths = np.array([20, 7, 13])
    for isa, nt in each_isa_and_threads(_ext.core()):
        outs = []
        for blk in (compact, plain):
            st = blk.allocate_state(3, 32)
            y = blk.forward(x[:, :12], st, lengths=np.minimum(lengths, 12))
            ys = [blk.step(x[:, 12 + i], st) for i in range(3)]
            outs.append((y, *ys, st.k_cache, st.v_cache))
        for got, want in zip(*outs):
            assert np.array_equal(u32(got), u32(want)), (kind, isa, nt)


def test_mamba2_block_compact_equals_float32():
    rng = np.random.default_rng(12)
    w = make_mamba2_weights(3, d=64, di=128, nh=4, ns=16, ng=1)
    w = {n: gguf_values(v, "Q4_1") if n.endswith("proj.weight") else v for n, v in w.items()}
    compact, plain = build_twice(lambda: eb.Mamba2BlockInference(w))
    assert [f for _, f, _ in compact.weight_storage()] == ["q4_1", "q4_1"]
    assert [f for _, f, _ in plain.weight_storage()] == ["float32", "float32"]
    x = rng.standard_normal((2, 40, 64)).astype(np.float32)
    for isa, nt in each_isa_and_threads(_ext.core()):
        outs = []
        for blk in (compact, plain):
            st = blk.allocate_state(2)
            y = blk.forward(x[:, :33], st, lengths=np.array([33, 20]))
            ys = [blk.step(x[:, 33 + i], st) for i in range(2)]
            outs.append((y, *ys, st.h, st.conv_window))
        for got, want in zip(*outs):
            assert np.array_equal(u32(got), u32(want)), (isa, nt)


# ---- bfloat16 checkpoints: float32 weights whose low 16 bits are zero ----------------------


def bf16_values(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 and widened back (float32 with low 16 bits zero)."""
    return bf16_round(np.asarray(x, dtype=np.float32))


@pytest.mark.parametrize("m,n,k", [(1, 70, 32), (8, 100, 2048 + 96), (9, 49, 64), (33, 130, 128)])
def test_bf16_gemm_equals_float32_panels_and_reference(core, m, n, k):
    rng = np.random.default_rng(m + n + k)
    w = bf16_values(0.05 * rng.standard_normal((n, k)))
    a = rng.standard_normal((m, k)).astype(np.float32)
    ref = core.gemm_ref(a, w, None)
    for isa, nt in each_isa_and_threads(core):
        got, fmt = core.gemm(a, w)
        assert fmt == "bf16", (isa, nt)
        assert np.array_equal(u32(got), u32(ref)), f"bf16 {isa} {nt} threads: != gemm_ref"
    w[3, 5] = np.nextafter(w[3, 5], np.float32(1))  # one weight that is not bfloat16
    assert core.gemm(a, w)[1] == "float32"


def test_transformer_block_bf16_equals_float32():
    rng = np.random.default_rng(13)
    opts = dict(n_heads=4, n_kv_heads=2, head_dim=16, o_bias=True)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **opts)
    w = {n: bf16_values(v) for n, v in w.items()}
    compact, plain = build_twice(lambda: eb.TransformerBlockInference(w, **opts, max_positions=64))
    assert [f for _, f, _ in compact.weight_storage()] == ["bf16"] * 4
    x = rng.standard_normal((2, 20, 64)).astype(np.float32)
    for isa, nt in each_isa_and_threads(_ext.core()):
        outs = []
        for blk in (compact, plain):
            st = blk.allocate_state(2, 32)
            y = blk.forward(x[:, :17], st)
            ys = [blk.step(x[:, 17 + i], st) for i in range(3)]
            outs.append((y, *ys, st.k_cache, st.v_cache))
        for got, want in zip(*outs):
            assert np.array_equal(u32(got), u32(want)), (isa, nt)


# ---- GGUF blocks packed directly (ops/gemm/pack.cpp pack_sources) ---------------------------

# GGUF type -> the format its blocks are packed into, straight from the file's bytes
DIRECT = {
    "Q4_0": "q8_0",
    "Q4_1": "q4_1",
    "Q5_0": "q8_0",
    "Q5_1": "q5_1",
    "Q8_0": "q8_0",
    "Q4_K": "q4_1",
    "Q5_K": "q5_1",
    "Q6_K": "q6_k",
}


def random_blocks(kind: str, n_blocks: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Random GGUF blocks of ``kind`` (uint8, (n_blocks, type_size)) with finite binary16 scales,
    some of them subnormal, -0.0 or negative: every code and scale bit pattern is exercised.
    ``extreme`` also puts +-65504 (binary16's largest), +-2^-24 (its least subnormal) and +0.0
    among the scales."""
    from exactblocks._weights import _SCALES

    rng = np.random.default_rng(seed)
    _, ts = gguf.GGML_QUANT_SIZES[getattr(T, kind)]
    raw = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    first, n_scales = _SCALES[int(getattr(T, kind))]
    for j in range(n_scales):
        h = (0.05 * rng.standard_normal(n_blocks)).astype(np.float16)
        h[::7] = (1e-6 * rng.standard_normal(n_blocks)[::7]).astype(np.float16)  # subnormal
        h[::11] = -0.0
        if extreme:
            for step, v in [(3, 65504.0), (5, -65504.0), (13, 2.0**-24), (17, -(2.0**-24))]:
                h[j::step] = v
            h[2 + j :: 19] = 0.0
        o = first + 2 * j
        raw[:, o : o + 2] = h.view(np.uint8).reshape(n_blocks, 2)
    return raw


def quantized(kind: str, rows: int, cols: int, seed: int):
    """(QuantizedMatrix, gguf's float32 values of it) for random blocks."""
    from exactblocks._weights import QuantizedMatrix

    t = getattr(T, kind)
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    raw = random_blocks(kind, rows * cols // bs, seed).reshape(rows, cols // bs * ts)
    values = dequantize(raw, t).reshape(rows, cols).astype(np.float32)
    return QuantizedMatrix(int(t), raw, (rows, cols)), values


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("kind", sorted(DIRECT))
def test_dequantize_gguf_equals_gguf_quants(core, kind, extreme):
    """The core's reading of GGUF blocks gives gguf.quants.dequantize's float32 bits, with
    scales anywhere in binary16's range (largest, subnormal, +-0.0, negative)."""
    t = getattr(T, kind)
    raw = random_blocks(kind, 3000, 21, extreme=extreme)
    want = dequantize(raw.reshape(-1), t).reshape(-1).astype(np.float32)
    assert np.isfinite(want).all()
    got = core.dequantize_gguf(int(t), raw)
    assert np.array_equal(u32(got), u32(want)), kind


@pytest.mark.parametrize("kind", sorted(DIRECT))
def test_direct_packed_block_equals_dequantised_block(kind):
    """A block built from GGUF blocks == the block built from gguf's float32 values: the same
    fingerprint, weights and output bits, on every ISA and thread count. Its storage is the
    type's compact format; the float32 packer's search finds that format or, on random blocks
    (subnormal and -0.0 scales), sometimes none, and then keeps float32 panels."""
    rng = np.random.default_rng(31)
    d, it, hd = 256, 512, 32
    opts = dict(n_heads=8, n_kv_heads=2, head_dim=hd)  # every input size a multiple of 256
    w = make_transformer_weights(rng, d_model=d, intermediate=it, **opts)
    direct, values = dict(w), dict(w)
    for i, n in enumerate(sorted(w)):
        if w[n].ndim == 2:
            direct[n], values[n] = quantized(kind, *w[n].shape, seed=100 + i)
    a = eb.TransformerBlockInference(direct, **opts, max_positions=64)
    b = eb.TransformerBlockInference(values, **opts, max_positions=64)
    fa = [f for _, f, _ in a.weight_storage()]
    assert fa == [DIRECT[kind]] * 4, fa
    assert all(f in (*DIRECT.values(), "float32") for _, f, _ in b.weight_storage())
    assert a.fingerprint == b.fingerprint
    for n in values:
        assert np.array_equal(u32(a._impl.weights[n]), u32(values[n])), n
    x = rng.standard_normal((2, 9, d)).astype(np.float32)
    for isa, nt in each_isa_and_threads(_ext.core()):
        ya, yb = a.forward(x, lengths=[9, 4]), b.forward(x, lengths=[9, 4])
        assert np.array_equal(u32(ya), u32(yb)), (kind, isa, nt)
        sa, sb = a.allocate_state(2, 16), b.allocate_state(2, 16)
        a.forward(x[:, :5], sa)
        b.forward(x[:, :5], sb)
        assert np.array_equal(u32(a.step(x[:, 5], sa)), u32(b.step(x[:, 5], sb))), (isa, nt)


def test_direct_blocks_with_a_non_finite_scale_are_refused():
    rng = np.random.default_rng(33)
    opts = dict(n_heads=2, n_kv_heads=1, head_dim=32)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **opts)
    q, _ = quantized("Q8_0", 96, 64, seed=1)
    q.blocks[1, 0:2] = np.array([np.inf], np.float16).view(np.uint8)  # row 1, block 0's d
    w["up_proj.weight"] = q
    with pytest.raises(ValueError, match=r"weights\['up_proj.weight'\].*index 64"):
        eb.TransformerBlockInference(w, **opts)
    w["up_proj.weight"] = quantized("Q8_0", 96, 64, seed=1)[1]
    w["input_layernorm.weight"] = quantized("Q8_0", 1, 64, seed=2)[0]
    with pytest.raises((TypeError, ValueError)):
        eb.TransformerBlockInference(w, **opts)


# ---- compact residency: blocks keep packed weights only --------------------------------------


@pytest.fixture(scope="module")
def q4_block():
    rng = np.random.default_rng(41)
    opts = dict(n_heads=4, n_kv_heads=2, head_dim=16)
    w = make_transformer_weights(rng, d_model=64, intermediate=96, **opts)
    w = {n: gguf_values(v, "Q4_1") if v.ndim == 2 else v for n, v in w.items()}
    return eb.TransformerBlockInference(w, **opts, max_positions=64), w


def test_resident_block_keeps_no_float32_matrices(q4_block):
    blk, w = q4_block
    res = blk._impl.weights
    assert sorted(res) == sorted(w)
    assert not any(n.endswith("proj.weight") for n in res._small)  # only in the core
    for n, v in w.items():  # rebuilt from the packed form, bit for bit
        got = res[n]
        assert not got.flags.writeable
        assert np.array_equal(u32(got), u32(v)), n


def test_resident_block_pickle_and_deepcopy_round_trip(q4_block):
    import copy
    import pickle

    blk, w = q4_block
    fresh = eb.TransformerBlockInference(w, **blk.get_params())
    x = np.random.default_rng(42).standard_normal((2, 7, 64)).astype(np.float32)
    y = blk.forward(x)
    for back in (pickle.loads(pickle.dumps(blk)), copy.deepcopy(blk)):
        assert back.fingerprint == blk.fingerprint == fresh.fingerprint
        assert back.weight_storage() == blk.weight_storage()
        assert np.array_equal(u32(back.forward(x)), u32(y))
    state = blk.__getstate__()
    for n, v in w.items():
        assert np.array_equal(u32(state["weights"][n]), u32(v)), n


def test_resident_block_set_params_rebuilds_from_packed_form(q4_block):
    import copy

    blk, w = q4_block
    b2 = copy.deepcopy(blk)
    x = np.random.default_rng(43).standard_normal((1, 5, 64)).astype(np.float32)
    y = blk.forward(x)
    b2.set_params(max_positions=32)
    assert b2.weight_storage() == blk.weight_storage()
    assert b2.fingerprint == eb.TransformerBlockInference(w, **b2.get_params()).fingerprint
    assert b2.fingerprint != blk.fingerprint  # options changed
    assert np.array_equal(u32(b2.forward(x)), u32(y))
    b2.set_params(max_positions=64)
    assert b2.fingerprint == blk.fingerprint


# ---- K-quant formats: Q6_K (q6_k: int8 codes, d per 16) and Q5_1 / Q5_K (q5_1: 5-bit codes) --


def block_values(kind: str, rows: int, cols: int, seed: int, extreme: bool = True) -> np.ndarray:
    """gguf's float32 values of random ``kind`` blocks, (rows, cols)."""
    t = getattr(T, kind)
    bs, _ = gguf.GGML_QUANT_SIZES[t]
    raw = random_blocks(kind, rows * cols // bs, seed, extreme=extreme)
    return np.ascontiguousarray(dequantize(raw.reshape(-1), t).reshape(rows, cols), np.float32)


# Q6_K values (no gguf quantiser: random blocks, scales at binary16's extremes included) and
# Q5_1 values of gguf's own quantiser, through the float32 packer's search: found, and every row
# count (1, 8: rebuilt in registers; 9, 17, 40: rebuilt panels), tail of n and K past one K
# block gives gemm_ref's and the float32 panels' bits on every ISA. (Random Q5_1 blocks, whose
# least code is not always 0, are found by the search only sometimes; they are packed directly
# below.)
KQ_VALUES = {
    "Q6_K": lambda rng, n, k, seed: block_values("Q6_K", n, k, seed),
    "Q5_1": lambda rng, n, k, seed: gguf_values(0.05 * rng.standard_normal((n, k)), "Q5_1"),
}
KQ_FORMAT = {"Q6_K": "q6_k", "Q5_1": "q5_1"}


@pytest.mark.parametrize("kind", sorted(KQ_VALUES))
@pytest.mark.parametrize(
    "m,n,k", [(1, 70, 256), (8, 48, 512), (9, 100, 256), (17, 49, 2048 + 256), (40, 130, 256)]
)
def test_kquant_gemm_equals_float32_panels_and_reference(core, kind, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = KQ_VALUES[kind](rng, n, k, m + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    ref = core.gemm_ref(a, w, bias)
    for isa, nt in each_isa_and_threads(core):
        got, fmt = core.gemm(a, w, bias, compact=True)
        plain, plain_fmt = core.gemm(a, w, bias, compact=False)
        assert (fmt, plain_fmt) == (KQ_FORMAT[kind], "float32"), (isa, nt)
        assert np.array_equal(u32(got), u32(ref)), f"{kind} {isa} {nt} threads: compact != gemm_ref"
        assert np.array_equal(u32(plain), u32(ref)), f"{isa} {nt} threads: float32 != gemm_ref"


def test_kquant_packed_linear_bytes(core):
    """q6_k and q5_1 keep one byte per code and two float32 scales per 32 inputs and output."""
    for kind, fmt in [("Q6_K", "q6_k"), ("Q5_1", "q5_1")]:
        w = KQ_VALUES[kind](np.random.default_rng(3), 96, 256, 3)
        lin = core.PackedLinear(w)
        assert (lin.format, lin.nbytes) == (fmt, 96 * 256 + 96 * 8 * 2 * 4), kind
        x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
        assert np.array_equal(u32(lin.forward(x)), u32(core.gemm_ref(x, w, None))), kind


def test_kquant_values_that_are_not_exact_stay_float32(core):
    """The search refuses whatever the kernels would not rebuild bit for bit: one weight one ulp
    off anywhere, zeros of both signs beside non-zero weights in one group of 16 (d * 0 has d's
    sign), a code ratio past int8 in a group, and Q5_1 values off by one ulp."""
    rng = np.random.default_rng(61)
    a = rng.standard_normal((2, 256)).astype(np.float32)
    q6 = block_values("Q6_K", 50, 256, 62, extreme=False)
    q5 = gguf_values(0.05 * rng.standard_normal((50, 256)), "Q5_1")
    assert core.gemm(a, q6)[1] == "q6_k" and core.gemm(a, q5)[1] == "q5_1"
    cases = {}
    for base, name in [(q6, "Q6_K"), (q5, "Q5_1")]:
        for r, c in [(0, 0), (49, 255), (17, 31), (3, 16)]:
            bad = base.copy()
            bad[r, c] = np.nextafter(bad[r, c], np.float32(np.inf))
            cases[f"{name}: one ulp at ({r}, {c})"] = bad
    both_zeros = q6.copy()
    both_zeros[5, 32:48] = np.float32(0.5) * np.arange(-8, 8, dtype=np.float32)
    both_zeros[5, 33] = -0.0  # with +0.0 at column 40 and d > 0 as the other values need
    cases["zeros of both signs in a group"] = both_zeros
    wide = q6.copy()
    wide[7, 64:80] = 0.0
    wide[7, 64] = 1.0
    wide[7, 65] = np.float32(1.0 / 256.0)  # ratio 256: q would be 256 and 1, past int8
    cases["ratio past int8"] = wide
    for what, mat in cases.items():
        got, fmt = core.gemm(a, mat)
        assert fmt == "float32", (what, fmt)
        assert np.array_equal(u32(got), u32(core.gemm_ref(a, mat, None))), what


def test_kquant_zero_groups_pack_exactly(core):
    """Q6_K groups whose d * sc is +-0.0 hold +0.0 and -0.0 as the codes' signs make them; the
    packer stores d = +0.0 with codes -1 / 0 (or d = -0.0): every sign comes back."""
    rng = np.random.default_rng(64)
    w = block_values("Q6_K", 48, 256, 65, extreme=False)
    w[:, :16] = 0.0
    w[::2, 5] = -0.0
    w[1::2, 16:32] = -0.0
    a = rng.standard_normal((1, 256)).astype(np.float32)
    got, fmt = core.gemm(a, w)
    assert fmt == "q6_k"
    assert np.array_equal(u32(got), u32(core.gemm_ref(a, w, None)))
    lin = core.PackedLinear(w)
    assert lin.format == "q6_k"


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K", "Q6_K"])
def test_direct_kquant_block_equals_float32_storage(kind):
    """A block built from Q5_1 / Q5_K / Q6_K blocks (scales at binary16's extremes included)
    stores them as q5_1 / q6_k and computes the bits of the same block with float32 panels:
    ragged prefill (rebuilt panels), decode steps (rebuilt in registers), on every ISA and
    1, 2 and 3 threads; output sizes 1024 (gate|up) and 256 leave partial panels of 48."""
    from exactblocks._weights import QuantizedMatrix

    rng = np.random.default_rng(71)
    d, it, hd = 256, 512, 32
    opts = dict(n_heads=8, n_kv_heads=2, head_dim=hd)
    w = make_transformer_weights(rng, d_model=d, intermediate=it, **opts)
    t = getattr(T, kind)
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    for i, n in enumerate(sorted(w)):
        if w[n].ndim == 2:
            rows, cols = w[n].shape
            raw = random_blocks(kind, rows * cols // bs, 200 + i, extreme=True)
            w[n] = QuantizedMatrix(int(t), raw.reshape(rows, cols // bs * ts), (rows, cols))
    compact, plain = build_twice(lambda: eb.TransformerBlockInference(w, **opts, max_positions=64))
    assert [f for _, f, _ in compact.weight_storage()] == [DIRECT[kind]] * 4
    assert [f for _, f, _ in plain.weight_storage()] == ["float32"] * 4
    ratio = sum(b for *_, b in plain.weight_storage()) / sum(
        b for *_, b in compact.weight_storage()
    )
    assert ratio > 3.0, ratio  # 4 bytes -> 1.25 bytes per weight (biases are float32 in both)
    x = rng.standard_normal((3, 20, d)).astype(np.float32)
    lengths = np.array([20, 7, 13])
    for isa, nt in each_isa_and_threads(_ext.core()):
        outs = []
        for blk in (compact, plain):
            st = blk.allocate_state(3, 32)
            y = blk.forward(x[:, :12], st, lengths=np.minimum(lengths, 12))
            ys = [blk.step(x[:, 12 + i], st) for i in range(3)]
            outs.append((y, *ys, st.k_cache, st.v_cache))
        for got, want in zip(*outs):
            assert np.array_equal(u32(got), u32(want)), (kind, isa, nt)


def test_direct_kquant_non_finite_d_is_refused():
    """Q6_K keeps its d at the end of the block (byte 208): an infinite one is found there."""
    from exactblocks._weights import QuantizedMatrix

    rng = np.random.default_rng(72)
    opts = dict(n_heads=2, n_kv_heads=1, head_dim=32)
    w = make_transformer_weights(rng, d_model=256, intermediate=256, **opts)
    raw = random_blocks("Q6_K", 256, 1).reshape(256, 210)
    raw[2, 208:210] = np.array([np.inf], np.float16).view(np.uint8)  # row 2's only block
    raw[2, 192:208] = 1  # every sub-block scale non-zero: inf * sc * q is +-inf or NaN
    w["up_proj.weight"] = QuantizedMatrix(int(T.Q6_K), raw, (256, 256))
    with pytest.raises(ValueError, match=r"weights\['up_proj.weight'\].*index 512"):
        eb.TransformerBlockInference(w, **opts)


@pytest.mark.parametrize(
    "kinds, formats",
    [
        # Q4_K_M's usual q|k|v: Q4_K q and k, a Q6_K v (consecutive parts of one format pack
        # together)
        (("Q4_K", "Q4_K", "Q6_K"), ["q4_1", "q6_k"]),
        (("Q6_K", "Q5_K", "Q5_K"), ["q6_k", "q5_1"]),
        (("Q8_0", "Q4_1", "Q8_0"), ["q8_0", "q4_1", "q8_0"]),
    ],
)
def test_direct_mixed_parts_are_packed_each_in_its_format(kinds, formats):
    """q|k|v parts as GGUF blocks of types that share no compact format are packed each run of
    one format on its own (not dequantised to float32 panels): the same weights (gguf's
    values), fingerprint and outputs, bit for bit, as the block built from those values with
    float32 panels, for ragged prefill (rebuilt panels) and decode steps (rebuilt in registers)
    on every ISA and 1, 2 and 3 threads."""
    rng = np.random.default_rng(73)
    opts = dict(n_heads=4, n_kv_heads=2, head_dim=64)
    w = make_transformer_weights(rng, d_model=256, intermediate=256, **opts)
    direct, values = dict(w), dict(w)
    for i, n in enumerate(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        direct[n], values[n] = quantized(kinds[i], *w[n].shape, seed=i)
    a = eb.TransformerBlockInference(direct, **opts, max_positions=64)
    b = eb.TransformerBlockInference(values, **opts, max_positions=64)._float32_storage_copy()
    qkv = [(f, n) for m, f, n in a.weight_storage() if m == "qkv_proj"]
    assert [f for f, _ in qkv] == formats
    q_rows, kv_rows = 4 * 64, 2 * 64
    assert sum(n for _, n in qkv) < (q_rows + 2 * kv_rows) * 256 * 4 / 2  # not float32
    assert a.fingerprint == b.fingerprint
    for n in values:
        assert np.array_equal(u32(a._impl.weights[n]), u32(values[n])), n
    x = rng.standard_normal((3, 20, 256)).astype(np.float32)
    lengths = np.array([20, 7, 13])
    for isa, nt in each_isa_and_threads(_ext.core()):
        outs = []
        for blk in (a, b):
            st = blk.allocate_state(3, 32)
            y = blk.forward(x[:, :12], st, lengths=np.minimum(lengths, 12))
            ys = [blk.step(x[:, 12 + i], st) for i in range(3)]
            outs.append((y, *ys, st.k_cache, st.v_cache))
        for got, want in zip(*outs):
            assert np.array_equal(u32(got), u32(want)), (kinds, isa, nt)
    # a pickle rebuilds the block from the float32 values: the same weights and bits
    import pickle

    c = pickle.loads(pickle.dumps(a))
    for n in values:
        assert np.array_equal(u32(c._impl.weights[n]), u32(values[n])), n
    assert np.array_equal(u32(c.forward(x[:1, :5])), u32(b.forward(x[:1, :5])))


def test_mixed_parts_keep_their_formats_through_pickle_copy_and_set_params():
    """A block rebuilt from its float32 values (pickle, copy, set_params) searches each part of
    a q|k|v that no one format holds on its own: the parts, formats and bytes of the block
    built from the blocks come back (Q5_K q|k as llama.cpp's quantiser leaves them, a Q6_K v),
    not one float32 matrix."""
    import copy
    import pickle

    from exactblocks._weights import QuantizedMatrix

    rng = np.random.default_rng(84)
    opts = dict(n_heads=4, n_kv_heads=2, head_dim=64)
    w = make_transformer_weights(rng, d_model=256, intermediate=512, **opts)
    raw = {
        "q_proj.weight": ("Q5_K", quantiser_like_q5_k(256, 1), 256),
        "k_proj.weight": ("Q5_K", quantiser_like_q5_k(128, 2), 128),
        "v_proj.weight": ("Q6_K", random_blocks("Q6_K", 128, 3), 128),
    }
    for n, (kind, blocks, rows) in raw.items():
        w[n] = QuantizedMatrix(int(getattr(T, kind)), blocks.reshape(rows, -1), (rows, 256))
    a = eb.TransformerBlockInference(w, **opts, max_positions=64)
    assert [f for m, f, _ in a.weight_storage() if m == "qkv_proj"] == ["q5_1", "q6_k"]
    rebuilt = [pickle.loads(pickle.dumps(a)), copy.deepcopy(a), copy.deepcopy(a)]
    rebuilt[2].set_params(max_positions=32)
    x = rng.standard_normal((1, 5, 256)).astype(np.float32)
    for c in rebuilt:
        assert c.weight_storage() == a.weight_storage()
        assert np.array_equal(u32(c.forward(x)), u32(a.forward(x)))


def quantiser_like_q5_k(n_blocks: int, seed: int) -> np.ndarray:
    """Random Q5_K blocks shaped as llama.cpp's quantiser leaves them: d >= 0 and code 0
    somewhere in every sub-block of 32 (here: its first weight)."""
    raw = random_blocks("Q5_K", n_blocks, seed)
    d = raw[:, 0:2].copy().view(np.float16)
    raw[:, 0:2] = np.abs(d).view(np.uint8)
    raw[:, 16] = 0  # qh bit j of weight 0 of sub-block j
    raw[:, [48, 80, 112, 144]] = 0  # both nibbles of weight 0 of sub-blocks 2i, 2i + 1
    return raw


def test_float32_search_finds_q5_k_and_q4_k_values(core):
    """Q4_K / Q5_K values (d*sc a 17-bit scale, m = -(dmin*mn)) as the quantiser leaves them are
    found by the float32 packer's search (m = the code-0 weight, d from the rounding bounds of
    every weight), so a block rebuilt from float32 (pickle, set_params) keeps its format.
    (With absurd scales, e.g. dmin = -65504 beside d*sc < 1, the rounding of m + d*q merges
    codes and the search may miss a fit: such blocks stay float32 there; read as GGUF blocks
    they are packed directly, see test_direct_kquant_block_equals_float32_storage.)"""
    rng = np.random.default_rng(81)
    for kind, raw, fmt in [
        ("Q5_K", quantiser_like_q5_k(100 * 512 // 256, 82), "q5_1"),
        ("Q4_K", random_blocks("Q4_K", 100 * 512 // 256, 83), "q4_1"),
    ]:
        t = getattr(T, kind)
        if kind == "Q4_K":  # d >= 0 and code 0 in each sub-block's first weight, as above
            raw[:, 0:2] = np.abs(raw[:, 0:2].copy().view(np.float16)).view(np.uint8)
            raw[:, [16, 48, 80, 112]] = 0
        w = np.ascontiguousarray(dequantize(raw.reshape(-1), t).reshape(100, 512), np.float32)
        a = rng.standard_normal((9, 512)).astype(np.float32)
        for isa, nt in each_isa_and_threads(core):
            got, got_fmt = core.gemm(a, w)
            assert got_fmt == fmt, (kind, isa, nt)
            assert np.array_equal(u32(got), u32(core.gemm_ref(a, w, None))), (kind, isa, nt)


def test_kquant_block_pickle_and_set_params_keep_storage():
    """A block packed from Q5_K and Q6_K blocks keeps q5_1 / q6_k through pickling and
    set_params (both rebuild from the float32 weights the core unpacks), with the same bits."""
    import copy
    import pickle

    from exactblocks._weights import QuantizedMatrix

    rng = np.random.default_rng(84)
    opts = dict(n_heads=4, n_kv_heads=2, head_dim=64)
    w = make_transformer_weights(rng, d_model=256, intermediate=512, **opts)
    for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "down_proj.weight"):
        rows, cols = w[n].shape
        raw = random_blocks("Q6_K", rows * cols // 256, rows + cols).reshape(rows, -1)
        w[n] = QuantizedMatrix(int(T.Q6_K), raw, (rows, cols))
    for i, n in enumerate(("o_proj.weight", "gate_proj.weight", "up_proj.weight")):
        rows, cols = w[n].shape
        raw = quantiser_like_q5_k(rows * cols // 256, 90 + i).reshape(rows, -1)
        w[n] = QuantizedMatrix(int(T.Q5_K), raw, (rows, cols))
    blk = eb.TransformerBlockInference(w, **opts, max_positions=64)
    storage = blk.weight_storage()
    assert [f for _, f, _ in storage] == ["q6_k", "q5_1", "q5_1", "q6_k"]
    x = rng.standard_normal((2, 6, 256)).astype(np.float32)
    y = blk.forward(x)
    for back in (pickle.loads(pickle.dumps(blk)), copy.deepcopy(blk)):
        assert back.weight_storage() == storage
        assert back.fingerprint == blk.fingerprint
        assert np.array_equal(u32(back.forward(x)), u32(y))
    b2 = copy.deepcopy(blk)
    b2.set_params(max_positions=32)
    assert b2.weight_storage() == storage
    assert np.array_equal(u32(b2.forward(x)), u32(y))
