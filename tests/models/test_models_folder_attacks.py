"""A Hugging Face folder that lies is refused with one line naming the file and the field.

Each case copies the tiny llama folder (config.json, model.safetensors, tokenizer.json, ...)
and breaks one thing in it: the safetensors header (truncated, its length past the file, not
JSON, a bad shape, dtype or offsets), the tensors against the config (wrong shape, missing,
extra), config.json (a field missing, of the wrong type, out of range; the file not JSON) or
a tokenizer file. ``load_model`` must raise a ValueError or FileNotFoundError whose message is
one line, starts with the caller's name, names the file it comes from and the field or tensor,
and leaves every file of the folder as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest

import exactblocks

SAFE = "model.safetensors"


def _read(path):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header, data):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)


def _tensor(header, suffix):
    return next(k for k in header if k.endswith(suffix))


# -- one change each: (folder) -> (file the message must name, needles) -----------------------


def truncated(folder):
    with open(os.path.join(folder, SAFE), "wb") as f:
        f.write(b"\x10\x00\x00")
    return SAFE, ["fewer than the 8-byte header"]


def length_past_the_file(folder):
    path = os.path.join(folder, SAFE)
    raw = bytearray(open(path, "rb").read())
    raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    open(path, "wb").write(bytes(raw))
    return SAFE, ["header"]


def header_not_json(folder):
    path = os.path.join(folder, SAFE)
    _, data = _read(path)
    bad = b"{not json" + b" " * 7
    open(path, "wb").write(len(bad).to_bytes(8, "little") + bad + data)
    return SAFE, ["not valid JSON"]


def header_not_an_object(folder):
    path = os.path.join(folder, SAFE)
    _, data = _read(path)
    _write(path, [1, 2], data)
    return SAFE, ["not a JSON object"]


def _entry(change, needles):
    def case(folder):
        path = os.path.join(folder, SAFE)
        header, data = _read(path)
        name = _tensor(header, "norm.weight")
        header[name].update(change(header[name]))
        _write(path, header, data)
        return SAFE, [name, *needles]

    case.__name__ = f"entry_{'_'.join(needles)[:30]}"
    return case


def _offsets(header, data, name, begin, end):
    header[name]["data_offsets"] = [begin, end]
    return header


def overlapping(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    names = [k for k in header if k != "__metadata__"]
    a, b = names[0], names[1]
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    header[b]["shape"], header[b]["dtype"] = header[a]["shape"], header[a]["dtype"]
    _write(path, header, data)
    return SAFE, ["overlap"]


def beyond_the_file(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    name = _tensor(header, "model.norm.weight")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [len(data) + 64, len(data) + 64 + end - begin]
    _write(path, header, data)
    return SAFE, [name]


def out_of_order(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    name = _tensor(header, "model.norm.weight")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [end, begin]
    _write(path, header, data)
    return SAFE, [name, "data_offsets"]


def span_not_the_shape(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    name = _tensor(header, "model.norm.weight")
    header[name]["shape"] = [header[name]["shape"][0] // 2]
    _write(path, header, data)
    return SAFE, [name]


def wrong_shape_for_the_config(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    name = _tensor(header, "layers.0.mlp.up_proj.weight")
    rows, cols = header[name]["shape"]
    header[name]["shape"] = [cols, rows]
    _write(path, header, data)
    return SAFE, [name, f"({cols}, {rows})", "intermediate_size=128", "hidden_size=64"]


def missing_tensor(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    name = _tensor(header, "layers.1.mlp.down_proj.weight")
    del header[name]
    _write(path, header, data)
    return os.path.basename(folder), [name]


def extra_tensor(folder):
    path = os.path.join(folder, SAFE)
    header, data = _read(path)
    name = _tensor(header, "model.norm.weight")
    header["model.bogus.weight"] = dict(header[name])
    header["model.bogus.weight"]["data_offsets"] = [len(data), len(data) + 4]
    header["model.bogus.weight"]["shape"] = [1]
    _write(path, header, data + b"\0\0\0\0")
    return os.path.basename(folder), ["model.bogus.weight"]


def _config(change, needles, *, named="config.json"):
    def case(folder):
        path = os.path.join(folder, "config.json")
        cfg = json.load(open(path))
        change(cfg)
        json.dump(cfg, open(path, "w"))
        return named, needles

    return case


def _set(**kw):
    return lambda cfg: cfg.update(kw)


def _drop(*keys):
    return lambda cfg: [cfg.pop(k) for k in keys]


def config_not_json(folder):
    open(os.path.join(folder, "config.json"), "w").write('{"hidden_size": ')
    return "config.json", ["not valid JSON"]


def config_a_list(folder):
    open(os.path.join(folder, "config.json"), "w").write("[1]")
    return "config.json", ["JSON object"]


def config_missing(folder):
    os.remove(os.path.join(folder, "config.json"))
    return "config.json", ["missing"]


def _file(name, text, needles):
    def case(folder):
        open(os.path.join(folder, name), "w").write(text)
        return name, needles

    case.__name__ = f"{name}_{text[:10]}"
    return case


def shard_missing(folder):
    header, _ = _read(os.path.join(folder, SAFE))
    os.rename(os.path.join(folder, SAFE), os.path.join(folder, "model-00001-of-00002.safetensors"))
    weights = {k: "model-00001-of-00002.safetensors" for k in header if k != "__metadata__"}
    weights[next(iter(weights))] = "model-00002-of-00002.safetensors"
    index = {"metadata": {}, "weight_map": weights}
    json.dump(index, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
    return "model-00002-of-00002.safetensors", []


def index_not_a_map(folder):
    os.rename(os.path.join(folder, SAFE), os.path.join(folder, "model-00001-of-00001.safetensors"))
    json.dump({"weight_map": [1]}, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
    return "model.safetensors.index.json", ["weight_map"]


CASES = [
    truncated,
    length_past_the_file,
    header_not_json,
    header_not_an_object,
    _entry(lambda e: {"shape": [2.5]}, ["shape"]),
    _entry(lambda e: {"shape": [-4]}, ["shape"]),
    _entry(lambda e: {"shape": "64"}, ["shape"]),
    _entry(lambda e: {"dtype": "F99"}, ["dtype", "'F99'"]),
    _entry(lambda e: {"dtype": "I32"}, ["I32"]),
    _entry(lambda e: {"dtype": 7}, ["dtype"]),
    _entry(lambda e: {"data_offsets": "0"}, ["data_offsets '0'", "two non-negative integers"]),
    _entry(lambda e: {"data_offsets": [0]}, ["data_offsets [0]", "two non-negative integers"]),
    overlapping,
    beyond_the_file,
    out_of_order,
    span_not_the_shape,
    wrong_shape_for_the_config,
    missing_tensor,
    extra_tensor,
    _config(_drop("architectures", "model_type"), ["architectures", "model_type"]),
    _config(_set(hidden_size="64"), ["'hidden_size'='64'", "integer"]),
    _config(_set(hidden_size=[64]), ["'hidden_size'=[64]"]),
    _config(_set(num_attention_heads=0), ["'num_attention_heads'=0"]),
    _config(_set(num_attention_heads=3), ["num_attention_heads", "num_key_value_heads"]),
    _config(_set(num_key_value_heads=3), ["'num_attention_heads'=4", "'num_key_value_heads'=3"]),
    _config(_set(rms_norm_eps="tiny"), ["'rms_norm_eps'='tiny'"]),
    _config(_set(rms_norm_eps=-1.0), ["'rms_norm_eps'=-1.0"]),
    _config(
        _set(rope_parameters={"rope_type": "default", "rope_theta": -5.0}),
        ["rope_parameters['rope_theta']=-5.0"],
    ),
    _config(_set(tie_word_embeddings="yes"), ["'tie_word_embeddings'='yes'"]),
    _config(_set(vocab_size=999), ["vocab_size=999"], named=SAFE),
    _config(_set(intermediate_size=7), ["intermediate_size=7"], named=SAFE),
    _config(_set(max_position_embeddings="128"), ["'max_position_embeddings'='128'"]),
    _config(_set(hidden_act="relu"), ["'hidden_act'='relu'"]),
    _config(_set(eos_token_id="2"), ["eos_token_id"]),
    _config(
        _set(num_hidden_layers=1),
        ["num_hidden_layers=1", "tensors of 2 layers"],
        named="tiny_llama",
    ),
    _config(
        _set(num_hidden_layers=3),
        ["num_hidden_layers=3", "tensors of 2 layers"],
        named="tiny_llama",
    ),
    config_not_json,
    config_a_list,
    config_missing,
    _file("tokenizer.json", "{not json", ["tokenizer.json"]),
    _file("tokenizer.json", '{"model": 1}', ["tokenizer.json"]),
    _file("tokenizer.json", "[]", ["tokenizer.json"]),
    _file("tokenizer_config.json", "{bad", ["tokenizer_config.json"]),
    _file("tokenizer_config.json", '{"chat_template": 5}', ["chat_template"]),
    _file("generation_config.json", "{bad", ["generation_config.json"]),
    _file("generation_config.json", '{"eos_token_id": "x"}', ["eos_token_id"]),
    shard_missing,
    index_not_a_map,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_a_broken_folder_is_refused_naming_the_file_and_field(tiny, tmp_path, case):
    source, _ = tiny("llama")
    folder = str(tmp_path / "tiny_llama")
    shutil.copytree(source, folder)
    named, needles = case(folder)
    before = {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            exactblocks.load_model(folder)
    message = str(info.value)
    assert type(info.value) in (ValueError, FileNotFoundError) or isinstance(
        info.value, ValueError
    ), type(info.value)
    assert "\n" not in message, message
    assert message.startswith(("load_model: ", "safetensors: ")), message
    assert named in message, message
    for needle in needles:
        assert needle in message, message
    after = {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}
    assert after == before  # nothing the caller owns is changed


def test_the_untouched_copy_loads(tiny, tmp_path):
    source, hf = tiny("llama")
    folder = str(tmp_path / "tiny_llama")
    shutil.copytree(source, folder)
    model = exactblocks.load_model(folder)
    assert len(model.blocks) == hf.config.num_hidden_layers
    assert np.array_equal(model.tokenizer.encode("ab"), model.tokenizer.encode("ab"))
