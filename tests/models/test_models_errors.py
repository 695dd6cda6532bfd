"""Bad input gives clear errors naming the file, field or tensor, and nothing half-built."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

import exactblocks


def _copy(folder, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(folder, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_files(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        exactblocks.load_model(str(tmp_path / "nowhere"))
    m = _copy(tiny("llama")[0], tmp_path)
    os.remove(m / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        exactblocks.load_model(str(m))
    os.remove(m / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        exactblocks.load_model(str(m))


def test_truncated_safetensors(tiny, tmp_path):
    m = _copy(tiny("qwen2")[0], tmp_path)
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated: tensor"):
        exactblocks.load_model(str(m))
    (m / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(ValueError, match="fewer than the 8-byte header"):
        exactblocks.load_model(str(m))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_size": 32}, r"has shape \(320, 64\); the config implies \(320, 32\)"),
        ({"attention_bias": True}, r"lacks tensors \['model.layers.0.self_attn.k_proj.bias'"),
        ({"num_hidden_layers": 1}, "num_hidden_layers=1 but .* holds the tensors of 2 layers"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings is false"),
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported"),
        ({"architectures": None, "model_type": "gemma"}, "model_type='gemma' is not supported"),
        ({"hidden_act": "relu"}, "'hidden_act'='relu' is not supported by the llama family"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
            r"rope_parameters\['rope_type'\]='dynamic' is not supported",
        ),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        (  # both spellings, differently: transformers takes rope_scaling, so never one silently
            {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
            r"'rope_scaling'=\{'rope_type': 'linear', 'factor': 4.0\} is not supported .*"
            r"null or the same as rope_parameters",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'rope_scaling'=.*dynamic"),
    ],
)
def test_config_that_disagrees_or_is_unsupported(tiny, tmp_path, changes, match):
    m = _copy(tiny("llama")[0], tmp_path)
    _edit_config(m, **changes)
    with pytest.raises(ValueError, match=match):
        exactblocks.load_model(str(m))


def test_rope_scaling_equal_to_rope_parameters_is_accepted(tiny, tmp_path):
    folder, hf = tiny("llama")
    m = _copy(folder, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    assert "rope_parameters" in cfg  # transformers 5 writes this spelling
    _edit_config(m, rope_scaling={"type": "default"})
    a = exactblocks.load_model(str(folder)).forward([[1, 2, 3]])
    b = exactblocks.load_model(str(m)).forward([[1, 2, 3]])
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_tied_head_that_differs_from_the_embedding(tiny):
    _, hf = tiny("llama")
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="tie_word_embeddings is true but 'lm_head.weight'"):
        exactblocks.load_model(sd, config=hf.config)


def test_nonfinite_weight_is_named(tiny):
    _, hf = tiny("mistral")
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["model.norm.weight"][3] = float("nan")
    with pytest.raises(ValueError, match=r"'model.norm.weight' holds nan at index \(3,\)"):
        exactblocks.load_model(sd, config=hf.config)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    with pytest.raises(ValueError, match="layer 1 of a state dict"):
        exactblocks.load_model(sd, config=hf.config)


def test_source_and_call_errors(tiny):
    with pytest.raises(TypeError, match="source must be a path"):
        exactblocks.load_model(42)
    with pytest.raises(
        FileNotFoundError, match=r"^load_model: '/nonexistent/m.gguf' is not a file"
    ):
        exactblocks.load_model("/nonexistent/m.gguf")
    with pytest.raises(TypeError, match="needs config="):
        exactblocks.load_model({})
    model = exactblocks.load_model(tiny("qwen3")[0])
    with pytest.raises(ValueError, match=r"ids\[1, 2\]=320 is outside the vocabulary \[0, 320\)"):
        model.forward([[1, 2, 3], [4, 5, 320]])
    with pytest.raises(ValueError, match=r"ids\[0, 0\]=-1"):
        model.forward([[-1, 2]])
    with pytest.raises(TypeError, match="must hold integers"):
        model.forward(np.ones((1, 3)))
    with pytest.raises(TypeError, match="must hold integers"):
        model.forward([[True, False]])
    model.forward([[1, 2, 320]], lengths=[2])  # padding ids are never read
    # named as the model's own argument, not the first layer's x; no wrap to a negative id
    with pytest.raises(ValueError, match=r"^Model.forward: ids has shape \(1, 0\); expected at"):
        model.forward(np.zeros((1, 0), np.int64))
    with pytest.raises(ValueError, match=r"ids\[0, 1\]=9223372036854775808 is not a token id"):
        model.forward(np.array([[1, 2**63]], np.uint64))
    with pytest.raises(ValueError, match=r"lengths\[0\]=4 is outside"):
        model.forward([[1, 2, 3]], lengths=[4])
    with pytest.raises(TypeError, match="needs a tokenizer"):
        model.generate("hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="max_positions=128"):
        model.generate([1] * 120, max_new_tokens=10)
    with pytest.raises(ValueError, match="top_p=1.5"):
        model.generate([1], max_new_tokens=2, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens is required"):
        model.allocate_state(1)
    st = model.allocate_state(2, 8)
    with pytest.raises(ValueError, match="ids has 1 rows but state.batch_size is 2"):
        model.step([1], st)
    with pytest.raises(TypeError, match="ModelState"):
        model.forward([[1]], st.layers[0])
    with pytest.raises(TypeError):
        model.config["vocab_size"] = 3  # a read-only mapping


def test_generate_names_the_prompt_and_stop_ids_it_refuses(tiny):
    folder, _ = tiny("llama")
    model = exactblocks.load_model(folder)
    v = model.vocab_size
    # was: "ids[0, 1]=..." (an argument generate does not have)
    with pytest.raises(ValueError, match=rf"^Model\.generate: prompt\[1\]={v} is outside the "
                       rf"vocabulary \[0, {v}\)$"):  # fmt: skip
        model.generate([1, v], max_new_tokens=2)
    # was: accepted, and never matched
    with pytest.raises(ValueError, match=rf"^Model\.generate: stop id {v + 5} is outside"):
        model.generate([1, 2], max_new_tokens=2, stop=[v + 5])
    assert len(model.generate([1, 2], max_new_tokens=2, stop=[v - 1, "zz"]).ids) <= 2


def test_generate_stop_of_another_type_is_a_type_error_naming_stop(tiny):
    """A dict's keys, a set's (unordered) entries or bytes' ints were taken as stop entries."""
    from exactblocks.models.generate import SamplingParams

    folder, _ = tiny("llama")
    model = exactblocks.load_model(folder)
    for stop in ({"a": 1}, {"a"}, b"ab", 2.5, iter(["a"])):
        kind = type(stop).__name__
        with pytest.raises(TypeError, match=rf"^Model\.generate: stop must be .* got {kind}$"):
            model.generate([1, 2], max_new_tokens=2, stop=stop)
        with pytest.raises(TypeError, match=rf"stop must be a str or a sequence .* got {kind}$"):
            SamplingParams(max_tokens=1, stop=stop)
    assert (
        model.generate([1, 2], max_new_tokens=2, stop=("zz", 5)).ids
        == model.generate([1, 2], max_new_tokens=2, stop=["zz", 5]).ids
    )
    assert SamplingParams(max_tokens=1, stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("rows", [300, 50])
def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny, tmp_path, rows):
    """The tiny tokenizer has 320 tokens: an embedding of fewer rows leaves its ids from there
    on without an embedding (they would fail only when generate met them)."""
    from safetensors.numpy import load_file, save_file

    m = _copy(tiny("llama")[0], tmp_path)
    tensors = load_file(str(m / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = np.ascontiguousarray(tensors[name][:rows])
    save_file(tensors, str(m / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(m, vocab_size=rows)
    with pytest.raises(ValueError) as info:
        exactblocks.load_model(str(m))
    message = str(info.value)
    for needle in (str(m), "tokenizer.json", "has 320 tokens", "'model.embed_tokens.weight' in",
                   f"has {rows} rows", f"ids {rows}..319"):  # fmt: skip
        assert needle in message, message


def test_an_embedding_larger_than_the_tokenizer_loads(tiny, tmp_path):
    """Padded embedding rows (HF's usual layout: vocab_size rounded up) are kept."""
    from safetensors.numpy import load_file, save_file

    m = _copy(tiny("llama")[0], tmp_path)
    tensors = load_file(str(m / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = np.concatenate([tensors[name], tensors[name][:16]])
    save_file(tensors, str(m / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(m, vocab_size=336)
    model = exactblocks.load_model(str(m))
    assert model.vocab_size == 336 and model.tokenizer.vocab_size == 320


@pytest.mark.parametrize(
    ("file", "value", "needles"),
    [
        ("config.json", 10**6, ["config.json", "'eos_token_id'=1000000", "[0, 320)"]),
        ("config.json", [2, 320], ["config.json", "'eos_token_id'=[2, 320]", "[0, 320)"]),
        ("config.json", "</s>", ["config.json", "'eos_token_id'='</s>'", "not a token id"]),
        ("generation_config.json", 10**6, ["generation_config.json", "=1000000", "[0, 320)"]),
        ("generation_config.json", "</s>", ["generation_config.json", "'</s>'", "not a token"]),
    ],
    ids=["config-1e6", "config-list", "config-str", "generation-1e6", "generation-str"],
)
@pytest.mark.parametrize("generation_config", [None, {"eos_token_id": 2}])
def test_an_eos_token_id_outside_the_vocabulary_is_refused(
    tiny, tmp_path, file, value, needles, generation_config
):
    """Not dropped from the stop set (before, 10**6 left model.eos_token_ids unchanged), and
    checked in config.json also when generation_config.json's id is the one used."""
    m = _copy(tiny("llama")[0], tmp_path)
    if generation_config is not None:
        (m / "generation_config.json").write_text(json.dumps(generation_config))
    path = m / file
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg["eos_token_id"] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as info:
        exactblocks.load_model(str(m))
    message = str(info.value)
    for needle in (str(m), *needles):
        assert needle in message, message


# an MoE tensor of the wrong shape names the config field that sizes it: the expert width
# (moe_intermediate_size, or intermediate_size in Mixtral and OLMoE), the expert count as the
# config spells it, Qwen2-MoE's shared_expert_intermediate_size (dense layers: intermediate_size)
_H = "hidden_size=64"
_MOE_SHAPES = [
    ("qwen3_moe", "mlp.experts.3.gate_proj", (32, 64), "moe_intermediate_size=32", _H),
    ("qwen3_moe", "mlp.experts.0.up_proj", (32, 64), "moe_intermediate_size=32", _H),
    ("qwen3_moe", "mlp.experts.7.down_proj", (64, 32), _H, "moe_intermediate_size=32"),
    ("qwen3_moe", "mlp.gate", (8, 64), "num_local_experts=8", _H),
    ("qwen3_moe", "mlp.gate_proj", (128, 64), "intermediate_size=128", _H),
    ("qwen2_moe", "mlp.experts.1.gate_proj", (32, 64), "moe_intermediate_size=32", _H),
    ("qwen2_moe", "mlp.experts.5.down_proj", (64, 32), _H, "moe_intermediate_size=32"),
    ("qwen2_moe", "mlp.gate", (6, 64), "num_experts=6", _H),
    (
        "qwen2_moe",
        "mlp.shared_expert.gate_proj",
        (48, 64),
        "shared_expert_intermediate_size=48",
        _H,
    ),
    ("qwen2_moe", "mlp.shared_expert.up_proj", (48, 64), "shared_expert_intermediate_size=48", _H),
    (
        "qwen2_moe",
        "mlp.shared_expert.down_proj",
        (64, 48),
        _H,
        "shared_expert_intermediate_size=48",
    ),
    ("qwen2_moe", "mlp.shared_expert_gate", (1, 64), None, _H),
    ("olmoe", "mlp.experts.2.gate_proj", (32, 64), "intermediate_size=32", _H),
    ("olmoe", "mlp.experts.2.down_proj", (64, 32), _H, "intermediate_size=32"),
    ("olmoe", "mlp.gate", (6, 64), "num_experts=6", _H),
    ("mixtral", "block_sparse_moe.experts.1.w1", (32, 64), "intermediate_size=32", _H),
    ("mixtral", "block_sparse_moe.experts.1.w3", (32, 64), "intermediate_size=32", _H),
    ("mixtral", "block_sparse_moe.experts.1.w2", (64, 32), _H, "intermediate_size=32"),
    ("mixtral", "block_sparse_moe.gate", (4, 64), "num_local_experts=4", _H),
]


@pytest.mark.parametrize("family, tensor, shape, rows, columns", _MOE_SHAPES)
def test_a_wrong_shaped_moe_tensor_names_the_field_that_sizes_it(
    tiny, tmp_path, family, tensor, shape, rows, columns
):
    from safetensors.numpy import load_file, save_file

    m = _copy(tiny(family)[0], tmp_path)
    layer = 1 if tensor == "mlp.gate_proj" else 0  # (qwen3_moe's layer 1 is dense)
    name = f"model.layers.{layer}.{tensor}.weight"
    weights = load_file(m / "model.safetensors")
    assert weights[name].shape == shape  # the tiny model's own shape: the config's
    weights[name] = weights[name][:-1]  # one row short
    save_file(weights, m / "model.safetensors", metadata={"format": "pt"})
    bad = (shape[0] - 1, shape[1])
    hint = f"columns: {columns}" if rows is None else f"rows: {rows}, columns: {columns}"
    want = f"has shape {bad}; the config implies {shape} ({hint})"
    with pytest.raises(ValueError, match=f"tensor '{re.escape(name)}' .*{re.escape(want)}$"):
        exactblocks.load_model(str(m))


@pytest.mark.parametrize(
    "family, field, tensor, hint",
    [  # the first tensor (by name) the edited field leaves the wrong shape
        ("qwen3_moe", "moe_intermediate_size", "mlp.experts.0.down_proj",
         "(64, 32); the config implies (64, 48) (rows: hidden_size=64, columns: "
         "moe_intermediate_size=48)"),
        ("qwen2_moe", "shared_expert_intermediate_size", "mlp.shared_expert.down_proj",
         "(64, 48); the config implies (64, 40) (rows: hidden_size=64, columns: "
         "shared_expert_intermediate_size=40)"),
        ("olmoe", "intermediate_size", "mlp.experts.0.down_proj",
         "(64, 32); the config implies (64, 40) (rows: hidden_size=64, columns: "
         "intermediate_size=40)"),
        ("mixtral", "intermediate_size", "block_sparse_moe.experts.0.w1",
         "(32, 64); the config implies (40, 64) (rows: intermediate_size=40, columns: "
         "hidden_size=64)"),
    ],
)  # fmt: skip
def test_an_moe_width_edited_in_config_json_is_named(tiny, tmp_path, family, field, tensor, hint):
    m = _copy(tiny(family)[0], tmp_path)
    _edit_config(m, **{field: 40 if field != "moe_intermediate_size" else 48})
    want = f"tensor 'model.layers.0.{tensor}.weight' in {m / 'model.safetensors'} has shape {hint}"
    with pytest.raises(ValueError, match=f"^load_model: {re.escape(want)}$"):
        exactblocks.load_model(str(m))


def test_a_wrong_shaped_expert_stack_names_its_fields(tiny):
    """A transformers object holds each layer's experts stacked (experts, rows, columns)."""
    import copy

    torch = pytest.importorskip("torch")
    hf = copy.deepcopy(tiny("qwen3_moe")[1])
    experts = hf.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 64, 64)
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[:, :-1])
    with pytest.raises(ValueError, match=re.escape(
        "has shape (8, 63, 64); the config implies (8, 64, 64) (experts: num_local_experts=8, "
        "rows: 2 * moe_intermediate_size = 2 * 32, columns: hidden_size=64)"
    )):  # fmt: skip
        exactblocks.load_model(hf)
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(8, 64, 64))
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[:, :, :-1])
    with pytest.raises(ValueError, match=re.escape(
        "has shape (8, 64, 31); the config implies (8, 64, 32) (experts: num_local_experts=8, "
        "rows: hidden_size=64, columns: moe_intermediate_size=32)"
    )):  # fmt: skip
        exactblocks.load_model(hf)


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_a_stray_moe_intermediate_size_is_ignored_as_hf_ignores_it(tiny, tmp_path, family):
    """OlmoeConfig and MixtralConfig have no moe_intermediate_size: their experts are
    intermediate_size wide whatever else config.json holds."""
    folder, _ = tiny(family)
    m = _copy(folder, tmp_path)
    _edit_config(m, moe_intermediate_size=48)
    ids = [[1, 2, 3, 4]]
    got = exactblocks.load_model(str(m)).forward(ids)
    want = exactblocks.load_model(str(folder)).forward(ids)
    assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
