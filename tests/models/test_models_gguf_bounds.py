"""Counts and sizes a file states are checked before anything is sized by them.

A tiny file may claim a huge model (``llama.block_count = 2**20`` over two layers of tensors, an
HF ``config.json`` with ``num_hidden_layers: 1048576``), a zero head count or alignment, a count
stored as a string, dimensions whose product overflows, or data of the wrong size for its type.
Each is refused at once with a ValueError naming the file's field or tensor and what was
expected, before the expected tensors of every stated layer are listed (the peak of Python
allocations stays far below what listing 2**20 layers takes). The bad files are written here
with ``gguf.GGUFWriter``, some then patched byte by byte.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
import warnings

import numpy as np
import pytest
from models_helpers import make_hf_model, require

import exactblocks

D, FF, VOCAB, HEADS = 8, 16, 32, 2
_LAYER = {"attn_q": (D, D), "attn_k": (D, D), "attn_v": (D, D), "attn_output": (D, D),
          "ffn_gate": (FF, D), "ffn_up": (FF, D), "ffn_down": (D, FF), "attn_norm": (D,),
          "ffn_norm": (D,)}  # fmt: skip


def write_llama(path, *, n_layers=2, keys=None, drop=(), tensor_types=None, tensors=None) -> str:
    """A tiny llama GGUF of ``n_layers`` layers; ``keys`` overrides or adds metadata (a value
    of type str, bytes (a string's raw bytes), float, bool, int or a list of ints; ints of
    2**32 and more are written as uint64); ``tensors`` replaces tensors by name (an array, or
    None to leave the tensor out) and adds the names a llama has not."""
    gguf = require("gguf", "the gguf package writes the file")
    w = gguf.GGUFWriter(str(path), "llama")
    meta = {
        "llama.block_count": n_layers,
        "llama.context_length": 64,
        "llama.embedding_length": D,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        **(keys or {}),
    }
    for key, value in meta.items():
        if key in drop:
            continue
        if isinstance(value, (str, bytes)):  # (add_string skips an empty string)
            w.add_key_value(key, value, gguf.GGUFValueType.STRING)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif value >= 2**32:
            w.add_uint64(key, value)
        else:
            w.add_uint32(key, value)
    if "tokenizer.ggml.model" not in meta:
        w.add_tokenizer_model("gpt2")
    if "tokenizer.ggml.tokens" not in meta:
        w.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, D), "output_norm.weight": (D,)}
    for n in range(n_layers):
        for kind, shape in _LAYER.items():
            shapes[f"blk.{n}.{kind}.weight"] = shape
    for name, shape in shapes.items():
        array = rng.standard_normal(shape).astype(np.float32)
        array = (tensors or {}).get(name, array)
        if array is not None:
            w.add_tensor(name, array)
    for name, array in (tensors or {}).items():  # tensors a llama does not have
        if name not in shapes and array is not None:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def patch_tensor_info(path, name: str, *, dims=None, ggml_type=None) -> None:
    """Rewrite one tensor's entry in the header in place (same number of dimensions)."""
    data = bytearray(open(path, "rb").read())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if dims is not None:
        assert len(dims) == n_dims
        struct.pack_into(f"<{n_dims}Q", data, at + 4, *dims)
    if ggml_type is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    open(path, "wb").write(bytes(data))


def refused(path, *needles):
    with open(path, "rb") as f:
        before = f.read()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny file's token list is not a real tokenizer
        with pytest.raises(ValueError) as info:
            exactblocks.load_model(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert "division" not in message and "modulo" not in message, message
    with open(path, "rb") as f:
        assert f.read() == before  # nothing the caller owns is changed
    return message


def test_the_tiny_file_loads(tmp_path):
    """(The writer makes a valid file: each refusal below is the one change it makes.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = exactblocks.load_model(write_llama(tmp_path / "ok.gguf"))
    assert model.family == "llama" and len(model.blocks) == 2


def test_a_huge_block_count_is_refused_before_anything_is_sized(tmp_path):
    path = write_llama(tmp_path / "m.gguf", keys={"llama.block_count": 2**20})
    assert os.path.getsize(path) < 64 * 1024
    tracemalloc.start()
    try:
        refused(path, "llama.block_count=1048576", "holds the tensors of 2 layers", repr(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # listing 2**20 layers' tensors takes gigabytes


def test_a_huge_layer_count_in_config_json_is_refused(tmp_path):
    folder = tmp_path / "m"
    make_hf_model("llama").save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    cfg["num_hidden_layers"] = 1048576
    (folder / "config.json").write_text(json.dumps(cfg))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            exactblocks.load_model(str(folder))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "num_hidden_layers=1048576" in message and "tensors of 2 layers" in message, message
    assert peak < 16 * 2**20, peak


@pytest.mark.parametrize(
    ("keys", "needles"),
    [
        ({"llama.attention.head_count": 0}, ["llama.attention.head_count=0", "[1, "]),
        ({"llama.attention.head_count_kv": 0}, ["llama.attention.head_count_kv=0", "[1, "]),
        ({"llama.block_count": "2"}, ["llama.block_count='2' is not a count", "integer"]),
        ({"llama.embedding_length": "8"}, ["llama.embedding_length='8' is not a count"]),
        ({"llama.block_count": 0}, ["llama.block_count=0", "[1, "]),
        ({"llama.context_length": 2**40}, ["llama.context_length=1099511627776", "[1, "]),
        ({"llama.context_length": 2**30}, ["max_position_embeddings=1073741824", "at most"]),
        (
            {"llama.attention.layer_norm_rms_epsilon": "tiny"},
            ["llama.attention.layer_norm_rms_epsilon='tiny' is not a number"],
        ),
        ({"llama.rope.freq_base": float("inf")}, ["llama.rope.freq_base=inf is not finite"]),
        ({"general.alignment": 0}, ["general.alignment=0 is not a power of two"]),
        ({"general.alignment": 24}, ["general.alignment=24 is not a power of two"]),
        ({"tokenizer.ggml.eos_token_id": "2"}, ["tokenizer.ggml.eos_token_id='2'", "token id"]),
    ],
    ids=lambda v: (
        next(iter(v)) + "=" + str(next(iter(v.values())))[:8] if isinstance(v, dict) else None
    ),
)
def test_malformed_counts_name_the_field(tmp_path, keys, needles):
    refused(write_llama(tmp_path / "m.gguf", keys=keys), *needles)


def test_dimensions_whose_product_overflows(tmp_path):
    path = write_llama(tmp_path / "m.gguf")
    patch_tensor_info(path, "blk.0.attn_q.weight", dims=(2**40, 2**40))
    refused(path, "'blk.0.attn_q.weight'", "[1099511627776, 1099511627776]", "overflows")


def test_rows_that_are_not_whole_blocks_of_the_type(tmp_path):
    path = write_llama(tmp_path / "m.gguf")
    patch_tensor_info(path, "blk.0.attn_q.weight", ggml_type=8)  # Q8_0: blocks of 32 values
    refused(path, "'blk.0.attn_q.weight'", "Q8_0", "rows of 8 values", "block of 32")


def test_data_of_the_wrong_size_for_its_type(tmp_path):
    """An F32 tensor relabelled F16 holds half the bytes its data takes in the file: the next
    tensor's data does not start where that tensor's ends."""
    path = write_llama(tmp_path / "m.gguf")
    patch_tensor_info(path, "blk.0.ffn_gate.weight", ggml_type=1)  # F16
    refused(path, "'blk.0.ffn_up.weight'", "data offset", "expected")


def test_a_header_stating_more_tensors_than_the_file_holds(tmp_path):
    path = write_llama(tmp_path / "m.gguf")
    data = bytearray(open(path, "rb").read())
    struct.pack_into("<Q", data, 8, 2**40)  # tensor_count, after magic and version
    open(path, "wb").write(bytes(data))
    refused(path, "states 1099511627776 tensors", "more than the file's")


def test_a_layer_past_the_count_and_a_missing_count(tmp_path):
    refused(write_llama(tmp_path / "a.gguf", drop=("llama.block_count",)), "'llama.block_count'")
    path = write_llama(tmp_path / "b.gguf", n_layers=3, keys={"llama.block_count": 2})
    refused(path, "'blk.2.", "names layer 2, but the file has 2")


@pytest.mark.parametrize(
    ("tensors", "needles"),
    [
        ({"blk.1.ffn_down.weight": None}, ["lacks tensors ['blk.1.ffn_down.weight']"]),
        (
            {"blk.0.attn_q.weight": np.zeros((D, D + 1), np.float32)},
            ["tensor 'blk.0.attn_q.weight'", "has shape (8, 9)", "implies (8, 8)"],
        ),
        (
            {"blk.0.attn_norm.weight": np.ones((D, 1), np.float32)},
            ["tensor 'blk.0.attn_norm.weight'", "has shape (8, 1)", "implies (8,)"],
        ),
        (
            {"blk.0.attn_q.weight": np.full((D, D), np.nan, np.float32)},
            ["layer 0", "tensor 'blk.0.attn_q.weight' must be finite", "nan"],
        ),
        (
            {"blk.1.ffn_down.weight": np.full((D, FF), np.inf, np.float32)},
            ["layer 1", "tensor 'blk.1.ffn_down.weight' must be finite", "inf"],
        ),
        (
            {"output_norm.weight": np.full((D,), np.nan, np.float32)},
            ["tensor 'output_norm.weight' holds nan"],
        ),
    ],
    ids=["missing", "shape", "rank", "nan", "inf", "top-nan"],
)
def test_a_bad_tensor_is_named_as_the_file_names_it(tmp_path, tensors, needles):
    """Not by the HF name it is read under (``model.layers.1.mlp.down_proj.weight``), which the
    file does not hold."""
    message = refused(write_llama(tmp_path / "m.gguf", tensors=tensors), "m.gguf", *needles)
    assert "model." not in message and "weights[" not in message, message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.block_count", [2, 2]),
        ("llama.embedding_length", [8, 8]),
        ("llama.context_length", [64]),
    ],
)
def test_an_array_where_one_count_is_expected_is_not_a_count(tmp_path, key, value):
    refused(write_llama(tmp_path / "m.gguf", keys={key: value}), f"{key}={value!r} is not a count",
            "not an array")  # fmt: skip


def test_a_token_list_longer_than_the_embedding_is_refused(tmp_path):
    """llama.cpp requires one ``token_embd`` row per token; the ids past the rows could be
    encoded but not embedded."""
    gguf = require("gguf", "the gguf package writes the file")
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", D),
                       ("feed_forward_length", FF), ("attention.head_count", HEADS)):  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    tokens = ["a", "b", "c", "ab", "abc", "bc"] + [f"x{i}" for i in range(VOCAB)]
    w.add_token_list(tokens)
    w.add_token_merges(["a b", "ab c", "b c"])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, D), "output_norm.weight": (D,)}
    shapes.update({f"blk.0.{kind}.weight": shape for kind, shape in _LAYER.items()})
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rows = f"'token_embd.weight' in {path} has {VOCAB} rows"
    refused(path, "tokenizer.ggml.tokens", f"has {VOCAB + 6} tokens", rows,
            f"ids {VOCAB}..{VOCAB + 5}")  # fmt: skip
