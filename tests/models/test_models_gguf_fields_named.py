"""A GGUF's bad field or tensor is named as the file states it, with the file.

The checks made after the metadata becomes an HF-style config report the GGUF key the user can
find in the file (``llama.attention.layer_norm_rms_epsilon``, not ``rms_norm_eps``); a derived
width that does not divide names its root fields; a tensor type the loader cannot use, and a
``tokenizer.ggml.model`` no tokenizer kind has, are refused naming the tensor or field and the
accepted values. The files are written here with ``gguf.GGUFWriter`` (tests/models/
test_models_gguf_bounds.py's tiny llama), some patched byte by byte.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from test_models_gguf_bounds import patch_tensor_info, refused, write_llama

import exactblocks


@pytest.mark.parametrize(
    ("keys", "needles"),
    [
        (
            {"llama.attention.layer_norm_rms_epsilon": -1.0},
            ["llama.attention.layer_norm_rms_epsilon=-1.0", "a number > 0", "rms_norm_eps"],
        ),
        (
            {"llama.attention.layer_norm_rms_epsilon": 0.0},
            ["llama.attention.layer_norm_rms_epsilon=0.0", "a number > 0"],
        ),
        ({"llama.rope.freq_base": -5.0}, ["llama.rope.freq_base=-5.0", "a number > 0"]),
        ({"llama.feed_forward_length": 0}, ["llama.feed_forward_length=0", "integer >= 1"]),
        (
            {"llama.attention.head_count_kv": 4},
            ["llama.attention.head_count=2 is not divisible by llama.attention.head_count_kv=4"],
        ),
        (
            {"llama.attention.head_count": 4, "llama.attention.head_count_kv": 3},
            ["llama.attention.head_count=4 is not divisible by llama.attention.head_count_kv=3"],
        ),
    ],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_a_bad_value_names_the_gguf_key_and_the_file(tmp_path, keys, needles):
    path = write_llama(tmp_path / "m.gguf", keys=keys)
    message = refused(path, repr(path), *needles)
    assert "rope_scaling[" not in message and "config field 'rms" not in message, message
    assert "\n" not in message


@pytest.mark.parametrize("d", [8, 16])
def test_a_head_count_that_does_not_divide_the_width_names_both_fields(tmp_path, d):
    path = write_llama(
        tmp_path / "m.gguf",
        keys={
            "llama.embedding_length": d,
            "llama.attention.head_count": 3,
            "llama.attention.head_count_kv": 3,
        },
    )
    message = refused(
        path,
        repr(path),
        f"llama.embedding_length={d} is not divisible by llama.attention.head_count=3",
        "llama.attention.key_length",
    )
    assert "rope" not in message and "rows" not in message, message


def test_a_q_tensor_of_the_wrong_rows_is_named_by_its_gguf_name(tmp_path):
    """key_length=6 with 2 heads: q must have 12 rows, the file's has 8 (it is not split into
    heads by the q/k un-permutation before its shape is checked)."""
    path = write_llama(tmp_path / "m.gguf", keys={"llama.attention.key_length": 6,
                                                  "llama.attention.value_length": 6})  # fmt: skip
    message = refused(path, repr(path), "'blk.0.attn_q.weight'", "(8, 8)", "(12, 8)")
    assert "w has" not in message, message


@pytest.mark.parametrize(("code", "name"), [(26, "I32"), (24, "I8"), (25, "I16")])
def test_a_tensor_of_a_type_the_loader_cannot_use_is_named(tmp_path, code, name):
    path = write_llama(tmp_path / "m.gguf")
    patch_tensor_info(path, "output_norm.weight", ggml_type=code)
    message = refused(path, repr(path), "'output_norm.weight'", f"type {name}", "F32", "Q4_K")
    assert "not yet implemented" not in message, message


@pytest.mark.parametrize("kind", ["wordpiece2", ""])
def test_an_unknown_tokenizer_model_is_refused(tmp_path, kind):
    path = write_llama(tmp_path / "m.gguf", keys={"tokenizer.ggml.model": kind})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a warning any more
        with pytest.raises(ValueError) as info:
            exactblocks.load_model(path)
    message = str(info.value)
    for needle in (repr(path), f"tokenizer.ggml.model={kind!r}", "'gpt2'", "'llama'", "'bert'"):
        assert needle in message, message


def test_a_known_tokenizer_kind_without_a_builder_still_loads(tmp_path):
    """'bert' is a kind llama.cpp knows: the model loads, without a tokenizer (a warning)."""
    path = write_llama(tmp_path / "m.gguf", keys={"tokenizer.ggml.model": "bert"})
    with pytest.warns(UserWarning, match="no tokenizer"):
        model = exactblocks.load_model(path)
    assert model.tokenizer is None and len(model.blocks) == 2


# a byte-level vocabulary that builds (tokens and merges), in the tiny file's 32 rows
_BPE = {
    "tokenizer.ggml.tokens": ["a", "b", "ab"] + [f"t{i}" for i in range(29)],
    "tokenizer.ggml.merges": ["a b"],
}


@pytest.mark.parametrize("pre", ["no-such-pre", "gpt2", "Qwen2"])
def test_an_unknown_pre_tokenizer_is_refused(tmp_path, pre):
    """llama.cpp refuses a tokenizer.ggml.pre it does not know ("unknown pre-tokenizer
    type"); so does the loader, rather than splitting the text with a regex the model may not
    have been trained with."""
    path = write_llama(tmp_path / "m.gguf", keys={**_BPE, "tokenizer.ggml.pre": pre})
    message = refused(path, repr(path), f"tokenizer.ggml.pre={pre!r}", "'qwen2'", "'gpt-2'",
                      "'smollm'", "or no field")  # fmt: skip
    assert "\n" not in message


@pytest.mark.parametrize("pre", ["gpt-2", "default", "deepseek-llm", "qwen2", "smollm", ""])
def test_a_known_or_empty_pre_tokenizer_loads(tmp_path, pre):
    path = write_llama(tmp_path / "m.gguf", keys={**_BPE, "tokenizer.ggml.pre": pre})
    model = exactblocks.load_model(path)
    assert model.tokenizer is not None and model.tokenizer.encode("ab") == [2]


@pytest.mark.parametrize(
    ("key", "raw", "offset"),
    [
        ("tokenizer.chat_template", b"{{ messages[0].content }}\xff", 25),
        ("tokenizer.chat_template", b"\xc3(", 0),
        ("tokenizer.ggml.pre", b"qwen\x80", 4),
    ],
)
def test_a_string_field_that_is_not_utf8_is_refused(tmp_path, key, raw, offset):
    """Not read with replacement characters in place of the bad bytes."""
    path = write_llama(tmp_path / "m.gguf", keys={**_BPE, key: raw})
    refused(path, repr(path), f"{key} is not valid UTF-8", f"offset {offset}", "expected UTF-8")


def test_a_string_field_that_is_not_utf8_is_refused_through_gguf_reader(tmp_path):
    """The same refusal when the tokenizer is read through gguf.GGUFReader."""
    from models_helpers import require

    gguf = require("gguf", "gguf.GGUFReader reads the file")
    from exactblocks.text import GGUFTokenizer

    raw = b"{{ messages[0].content }}\xff"
    path = write_llama(tmp_path / "m.gguf", keys={**_BPE, "tokenizer.chat_template": raw})
    with pytest.raises(ValueError, match="tokenizer.chat_template is not valid UTF-8"):
        GGUFTokenizer.from_gguf(gguf.GGUFReader(path))


@pytest.mark.parametrize("arch", ["nemotron_h", "granitehybrid"])
def test_a_zero_head_count_is_named_not_a_division_by_zero(tmp_path, arch):
    """The hybrids' readers divided embedding_length by head_count before checking it (an
    'integer division or modulo by zero'): the keys are named now."""
    import gguf
    import numpy as np

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 8,
                       "feed_forward_length": 0, "attention.head_count": 0,
                       "attention.head_count_kv": 0}.items():  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_tensor("token_embd.weight", np.zeros((32, 8), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = refused(path, repr(path), f"{arch}.embedding_length=8 is not divisible by "
                      f"{arch}.attention.head_count=0")  # fmt: skip
    assert "division" not in message


def _mixtral_as_llama() -> dict:
    """The tensors llama.cpp's convert_hf_to_gguf.py writes for a Mixtral (arch llama): a router
    and stacked experts in place of each layer's dense MLP (4 experts of width 16)."""
    rng = np.random.default_rng(2)
    out = {}
    for n in range(2):
        out.update({f"blk.{n}.ffn_{k}.weight": None for k in ("gate", "up", "down")})
        shapes = {"gate_inp": (4, 8), "gate_exps": (4, 16, 8), "up_exps": (4, 16, 8),
                  "down_exps": (4, 8, 16)}  # fmt: skip
        for k, shape in shapes.items():
            out[f"blk.{n}.ffn_{k}.weight"] = rng.standard_normal(shape).astype(np.float32)
    return out


@pytest.mark.parametrize("experts", [False, True], ids=["dense_tensors", "expert_tensors"])
@pytest.mark.parametrize(
    "key, message",
    [
        # expert_count >= 1 makes the file Mixtral's, which needs expert_used_count
        ("llama.expert_count", "has no 'llama.expert_used_count' field"),
        # a dense Llama stating experts used
        (
            "llama.expert_used_count",
            "llama.expert_used_count=4 is not supported (expected 0 "
            "without llama.expert_count >= 1",
        ),
    ],  # fmt: skip
)
def test_a_gguf_expert_key_alone_is_refused_naming_the_key(tmp_path, key, message, experts):
    """An expert key without its partner is named before any tensor (not a shape, not an
    unexpected expert tensor)."""
    tensors = _mixtral_as_llama() if experts else None
    path = write_llama(tmp_path / "m.gguf", keys={key: 4}, tensors=tensors)
    text = refused(path, repr(path), message)
    assert "has shape" not in text and "unexpected tensor" not in text, text


def test_a_gguf_ffn_of_the_wrong_shape_names_the_dense_width(tmp_path):
    """The MoE labels leave a dense GGUF's tensors as they were: intermediate_size (16)."""
    rng = np.random.default_rng(1)
    bad = {"blk.0.ffn_gate.weight": rng.standard_normal((15, 8)).astype(np.float32)}
    path = write_llama(tmp_path / "m.gguf", tensors=bad)
    refused(path, "has shape (15, 8); the config implies (16, 8)",
            "(rows: intermediate_size=16, columns: hidden_size=8)")  # fmt: skip
