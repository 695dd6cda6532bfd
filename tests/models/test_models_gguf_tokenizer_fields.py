"""Malformed tokenizer fields and chat templates are refused at load, naming what is wrong.

Each case writes a small GGUF (``gguf.GGUFWriter``) whose tokenizer is a real byte-level BPE
vocabulary with one field broken, and checks that ``GGUFTokenizer.from_gguf`` (and, for a whole
model file, ``load_model``) raises a ValueError naming the file, the field and what was
expected, never the ``tokenizers`` library's bare ``Exception`` or a ``TypeError`` from a
comparison. A chat template that cannot render a one-message conversation is found at load, for
a GGUF and for a Hugging Face folder, with an error naming the template.
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest
from models_helpers import make_hf_model, require

import exactblocks
from exactblocks.loaders.gguf import GGUFFile
from exactblocks.text import (
    GGUFTokenizer,
    HFTokenizer,
    UnsupportedTokenizerError,
    bytes_to_unicode,
)

LETTERS = "abcdefgh"
BYTES = list(bytes_to_unicode().values())  # 256 byte tokens
PAIRS = [a + b for a in LETTERS for b in LETTERS]  # 64 merged tokens: 320 in all
TOKENS = BYTES + PAIRS
MERGES = [f"{p[0]} {p[1]}" for p in PAIRS]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write(path: str, *, hf=None, skip=(), **fields) -> str:
    """A GGUF at ``path`` with the tokenizer above; ``fields`` override a key (dots as '__'),
    given as ``(kind, value)`` with kind one of string/uint32/bool/array; ``hf`` adds a whole
    qwen2 model's config and tensors."""
    gguf = require("gguf", "the gguf package writes the files")
    w = gguf.GGUFWriter(path, "qwen2")
    if hf is not None:
        from test_models_gguf import _KIND

        c = hf.config
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        for name, t in hf.state_dict().items():
            if name == "model.embed_tokens.weight":
                kind = "token_embd.weight"
            elif name == "model.norm.weight":
                kind = "output_norm.weight"
            elif name == "lm_head.weight":
                if c.tie_word_embeddings:
                    continue
                kind = "output.weight"
            else:
                _, _, n, rest = name.split(".", 3)
                kind = f"blk.{n}.{_KIND[rest]}"
            w.add_tensor(kind, t.float().numpy())
    base = {
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", "qwen2"),
        "tokenizer.ggml.tokens": ("array", TOKENS),
        "tokenizer.ggml.merges": ("array", MERGES),
        "tokenizer.ggml.token_type": ("array", [1] * len(TOKENS)),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.chat_template": ("string", TEMPLATE),
    }
    base.update({k.replace("__", "."): v for k, v in fields.items()})
    for key, (kind, value) in base.items():
        if key in skip:
            continue
        getattr(w, f"add_{kind}")(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refused(path: str, pattern: str):
    """from_gguf raises a ValueError whose message names the file and matches ``pattern``."""
    with pytest.raises(ValueError) as info:
        GGUFTokenizer.from_gguf(GGUFFile(path))
    message = str(info.value)
    assert type(info.value) is ValueError, message  # not an "unsupported kind"
    assert repr(path) in message, message
    assert re.search(pattern, message), message
    return message


def test_the_well_formed_file_loads(tmp_path):
    tok = GGUFTokenizer.from_gguf(GGUFFile(write(str(tmp_path / "ok.gguf"))))
    assert tok.vocab_size == 320 and tok.eos_token_id == 2
    assert tok.encode("ab cd") == [TOKENS.index("ab"), TOKENS.index("Ġ"), TOKENS.index("cd")]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x"


CASES = {
    "merge_of_unknown_token": (
        {"tokenizer__ggml__merges": ("array", MERGES + ["zz qq"])},
        r"tokenizer\.ggml\.merges\[64\]='zz qq' names 'zz', which is not a token",
    ),
    "merge_whose_result_is_unknown": (
        {"tokenizer__ggml__merges": ("array", MERGES + ["a Ġ"])},
        r"tokenizer\.ggml\.merges\[64\]='a Ġ' names 'aĠ', which is not a token",
    ),
    "eos_id_as_a_string": (
        {"tokenizer__ggml__eos_token_id": ("string", "2")},
        r"tokenizer\.ggml\.eos_token_id is '2' \(a str\); expected an integer token id in "
        r"\[0, 320\)",
    ),
    "bos_id_outside_the_vocabulary": (
        {"tokenizer__ggml__bos_token_id": ("uint32", 320)},
        r"tokenizer\.ggml\.bos_token_id is 320 \(an int\); expected an integer token id",
    ),
    "token_types_of_another_length": (
        {"tokenizer__ggml__token_type": ("array", [1] * 319)},
        r"tokenizer\.ggml\.token_type has 319 entries; expected one per token \(320\)",
    ),
    "token_types_as_strings": (
        {"tokenizer__ggml__token_type": ("array", ["1"] * 320)},
        r"tokenizer\.ggml\.token_type\[0\] is '1' \(a str\); expected an array of integers",
    ),
    "tokens_as_integers": (
        {"tokenizer__ggml__tokens": ("array", list(range(320)))},
        r"tokenizer\.ggml\.tokens\[0\] is 0 \(an int\); expected an array of strings",
    ),
    "tokens_as_a_string": (
        {"tokenizer__ggml__tokens": ("string", "abc")},
        r"tokenizer\.ggml\.tokens is 'abc' \(a str\); expected an array of strings",
    ),
    "no_tokens": (
        {"tokenizer__ggml__tokens": ("array", [])},
        r"no tokenizer\.ggml\.tokens|tokenizer\.ggml\.tokens is empty",
    ),
    "add_bos_token_as_an_integer": (
        {"tokenizer__ggml__add_bos_token": ("uint32", 1)},
        r"tokenizer\.ggml\.add_bos_token is 1 \(an int\); expected a bool",
    ),
    "chat_template_as_an_integer": (
        {"tokenizer__chat_template": ("uint32", 7)},
        r"tokenizer\.chat_template is 7 \(an int\); expected a string",
    ),
    "merge_of_three_tokens": (
        {"tokenizer__ggml__merges": ("array", MERGES + ["a b c"])},
        r"tokenizer\.ggml\.merges\[64\]='a b c' is not two tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_field_is_named(tmp_path, case):
    fields, pattern = CASES[case]
    refused(write(str(tmp_path / f"{case}.gguf"), **fields), pattern)


def test_sentencepiece_scores_of_another_length(tmp_path):
    gguf = require("gguf", "the gguf package writes the files")
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.add_array("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", "a", "b"])
    w.add_array("tokenizer.ggml.scores", [0.0, 0.0, 0.0])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    refused(path, r"tokenizer\.ggml\.scores has 3 entries; expected one per token \(5\)")


def test_an_unsupported_kind_is_not_a_malformed_file(tmp_path):
    """A tokenizer kind that is not built stays a warning in load_model (the model loads)."""
    path = write(str(tmp_path / "bert.gguf"), tokenizer__ggml__model=("string", "bert"))
    with pytest.raises(UnsupportedTokenizerError, match="tokenizer.ggml.model is 'bert'"):
        GGUFTokenizer.from_gguf(GGUFFile(path))


@pytest.mark.parametrize(
    ("template", "detail"),
    [
        ("{{ raise_exception('Conversation roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}{{ m.content }}", "Unexpected end of template"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ],
)
def test_a_chat_template_that_cannot_render_is_found_at_load(tmp_path, template, detail):
    path = write(str(tmp_path / "t.gguf"), tokenizer__chat_template=("string", template))
    message = refused(path, r"the chat template \(tokenizer\.chat_template of '.*t\.gguf'\) fails")
    assert detail in message


def test_load_model_refuses_a_malformed_tokenizer_and_a_broken_template(tmp_path):
    """Before, these were a bare Exception from tokenizers, a TypeError, and a load that
    succeeded with a template failing at the first request."""
    hf = make_hf_model("qwen2")  # vocabulary of 320, as the tokenizer above
    assert hf.config.vocab_size == len(TOKENS)
    good = write(str(tmp_path / "good.gguf"), hf=hf)
    model = exactblocks.load_model(good)
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "ab"}], add_generation_prompt=True, tokenize=True
    )
    assert model.tokenizer.decode(ids) == "<user>ab<assistant>"
    for name, fields, pattern in [
        ("merges", {"tokenizer__ggml__merges": ("array", MERGES + ["zz qq"])}, "names 'zz'"),
        # the model's end-token check reads the field before the tokenizer does: either names it
        ("eos", {"tokenizer__ggml__eos_token_id": ("string", "2")}, "eos_token_id(=| is )'2'"),
        (
            "template",
            {"tokenizer__chat_template": ("string", "{{ raise_exception('no') }}")},
            r"the chat template \(tokenizer\.chat_template of .*\) fails .*: no",
        ),
    ]:
        path = write(str(tmp_path / f"{name}.gguf"), hf=hf, **fields)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not downgraded to "no tokenizer"
            with pytest.raises(ValueError, match=pattern) as info:
                exactblocks.load_model(path)
        assert repr(path) in str(info.value)


def _hf_folder(folder: str, **files: str) -> str:
    """A folder with a tiny tokenizer.json (the byte-level BPE above) and ``files``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[tuple(p) for p in PAIRS])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    for name, text in files.items():
        with open(os.path.join(folder, name.replace("__", ".")), "w") as f:
            f.write(text)
    return folder


def test_hf_folder_chat_template_is_checked_at_load(tmp_path):
    good = _hf_folder(str(tmp_path / "good"), chat_template__jinja=TEMPLATE)
    tok = HFTokenizer.from_folder(good)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x"
    bad = _hf_folder(str(tmp_path / "bad"), chat_template__jinja="{% if %}")
    jinja = os.path.join(bad, "chat_template.jinja")
    with pytest.raises(ValueError, match=re.escape(f"the chat template ({jinja!r}) fails")):
        HFTokenizer.from_folder(bad)
    config = '{"chat_template": "{{ raise_exception(\\"system first\\") }}"}'
    cfg = _hf_folder(str(tmp_path / "cfg"), tokenizer_config__json=config)
    with pytest.raises(ValueError, match=r"chat_template of '.*tokenizer_config\.json'.*system"):
        HFTokenizer.from_folder(cfg)


def test_a_checked_tokenizer_still_pickles(tmp_path):
    import pickle

    tok = GGUFTokenizer.from_gguf(GGUFFile(write(str(tmp_path / "ok.gguf"))))
    back = pickle.loads(pickle.dumps(tok))
    assert back.encode("abc") == tok.encode("abc")
    folder = _hf_folder(str(tmp_path / "hf"), chat_template__jinja=TEMPLATE)
    hf = HFTokenizer.from_folder(folder)
    chat = [{"role": "user", "content": "x"}]
    assert pickle.loads(pickle.dumps(hf)).apply_chat_template(chat) == "<user>x"
    assert np.array_equal(back.encode("ab"), tok.encode("ab"))
