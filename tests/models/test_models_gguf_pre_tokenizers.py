"""Byte-level GGUF tokenizers with the Qwen2 and Llama 3 pre-tokenizers: ids equal
transformers' (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``) on the same file.

The files are written here with ``gguf.GGUFWriter``: a real byte-level BPE vocabulary (the first
8192 tokens of SmolLM2-135M's, with the merges that stay inside it, so that transformers builds
its tokenizer in seconds) plus four tokens and merges of our own (``12``, ``123``, ``45``,
``Ġ2``), so that the splits differ in ids and not only in pieces: SmolLM2's own merges never join
digits. The same vocabulary under ``tokenizer.ggml.pre`` = qwen2 (one digit per piece),
llama-bpe (runs of up to three) and smollm (GPT-2's split) gives three different id lists.
"""

from __future__ import annotations

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
]

N_TOKENS = 8192
EXTRA = (["12", "123", "45", "Ġ2"], ["1 2", "12 3", "4 5", "Ġ 2"])


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    """pre -> (folder, file name) for qwen2 (architecture qwen2), llama-bpe and smollm
    (architecture llama), one vocabulary."""
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
    for arch, pre in (("qwen2", "qwen2"), ("llama", "llama-bpe"), ("llama", "smollm")):
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
    return out


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm"])
def test_ids_equal_transformers(vocab_files, pre):
    transformers = require("transformers", "transformers is the oracle")
    folder, name = vocab_files[pre]
    ref = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours = GGUFTokenizer.from_gguf(GGUFFile(os.path.join(folder, name)))
    for text in TEXTS:
        want = ref(text)["input_ids"]
        assert ours.encode(text) == want, (pre, text)
        assert ours.decode(want) == ref.decode(want), (pre, text)


def test_the_three_splits_give_different_ids(vocab_files):
    """The oracle test above can fail: the vocabulary tells the splits apart."""
    ids = {
        pre: [
            GGUFTokenizer.from_gguf(GGUFFile(os.path.join(*vocab_files[pre]))).encode(t)
            for t in TEXTS
        ]
        for pre in vocab_files
    }
    assert ids["qwen2"] != ids["llama-bpe"] != ids["smollm"] != ids["qwen2"]
    n123 = N_TOKENS + 1  # "123": one piece under llama-bpe and GPT-2, never under qwen2
    assert n123 in ids["llama-bpe"][0] and n123 not in ids["qwen2"][0]


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
