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
    cases["-0.0 in a Q8_0 matrix"] = q8_neg_zero
    neg_zero = np.zeros((4, 32), np.float32)
    neg_zero[2, 5] = -0.0  # not d*q (+ m) of any block, but a bfloat16 value
    cases["a -0.0 among zeros"] = neg_zero
    for what, m in cases.items():
        aa = np.ascontiguousarray(a[:, : m.shape[1]])
        got, fmt = core.gemm(aa, np.ascontiguousarray(m))
        assert fmt == ("bf16" if what.startswith("a -0.0") else "float32"), what
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
