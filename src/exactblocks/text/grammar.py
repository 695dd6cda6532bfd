"""The tokenizer bridge of constrained decoding: a tokenizer's byte vocabulary for llguidance.

What lives here: :func:`token_byte_vocabulary` (each token id's bytes, and which ids are
special) and :func:`ll_tokenizer` (the ``llguidance.LLTokenizer`` of a tokenizer, built once
and cached). What does not: grammars, matchers and the token mask
(``exactblocks.models.structured``), generation (``exactblocks.models.generate``).

llguidance (https://github.com/guidance-ai/llguidance) computes, for a grammar and the tokens
generated so far, which tokens may come next; it needs every token's bytes. A byte-level BPE
vocabulary (GPT-2's alphabet, SmolLM2) spells each byte as one character
(:func:`~exactblocks.text.bytes_to_unicode`); a SentencePiece-style vocabulary (Gemma) writes
a space as U+2581 and a byte-fallback token as ``<0xNN>``. Special tokens (``<|im_end|>``) are
marked so: no grammar text matches them; the end tokens are allowed only where the grammar
may end.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence

from .byte_level import bytes_to_unicode

__all__ = ["ll_tokenizer", "require_llguidance", "token_byte_vocabulary"]

_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}
_SPM_SPACE = "\u2581"
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def require_llguidance():
    """The ``llguidance`` module, or an ImportError that says how to install it."""
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "constrained decoding (response_format, grammar=) needs the `llguidance` package: "
            "`pip install llguidance==1.9.1` (or `pip install exactblocks[serve]`)"
        ) from exc
    return llguidance


def token_byte_vocabulary(tokenizer) -> tuple[list[bytes], list[int]]:
    """Every token id's bytes, and the special ids, of an exactblocks tokenizer.

    Parameters
    ----------
    tokenizer : GGUFTokenizer or HFTokenizer
        Needs ``vocab_size``, ``id_to_token`` (the vocabulary string of an id) and
        ``special_token_ids``.

    Returns
    -------
    tuple
        ``(tokens, special)``: ``tokens[i]`` the bytes token ``i`` stands for (a special
        token: its text's UTF-8), ``special`` the sorted special ids.

    Notes
    -----
    A vocabulary is SentencePiece-style when more than 1% of its strings hold U+2581 (a
    byte-level alphabet has no such character): U+2581 is a space and ``<0xNN>`` the byte
    0xNN, the rest is UTF-8. Otherwise each string is read in the byte-level alphabet (GPT-2's
    ``bytes_to_unicode``); a string outside it (an added token) is its own UTF-8.
    """
    n = int(tokenizer.vocab_size)
    strings = [tokenizer.id_to_token(i) or "" for i in range(n)]
    special = sorted(int(i) for i in tokenizer.special_token_ids if 0 <= int(i) < n)
    spm = sum(1 for s in strings if _SPM_SPACE in s) > n // 100
    out: list[bytes] = []
    for s in strings:
        if spm:
            m = _SPM_BYTE.fullmatch(s)
            out.append(bytes([int(m.group(1), 16)]) if m else s.replace(_SPM_SPACE, " ").encode())
        else:
            try:
                out.append(bytes(_BYTE_OF[c] for c in s))
            except KeyError:
                out.append(s.encode("utf-8"))
    for i in special:
        out[i] = strings[i].encode("utf-8")
    return out, special


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: the byte vocabulary and an encoder."""

    def __init__(self, tokenizer, eos: int, tokens: list, special: list):
        self._tokenizer = tokenizer
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """The ``llguidance.LLTokenizer`` of ``tokenizer`` over a model's vocabulary (cached).

    Parameters
    ----------
    tokenizer : GGUFTokenizer or HFTokenizer
    vocab_size : int
        The model's vocabulary (its logits' length), >= ``tokenizer.vocab_size``; the ids
        beyond the tokenizer's are never allowed.
    eos_token_ids : sequence of int
        The model's end tokens: the ones a grammar allows where it may end. At least one.

    Returns
    -------
    llguidance.LLTokenizer
        Built once per (tokenizer, vocab_size, eos_token_ids) (about 0.3 s for SmolLM2's
        49152 tokens) and kept while the tokenizer lives.

    Raises
    ------
    ImportError
        llguidance is not installed.
    ValueError
        No end token, or a tokenizer larger than ``vocab_size``.
    """
    eos = tuple(int(i) for i in eos_token_ids)
    if not eos:
        raise ValueError("ll_tokenizer: constrained decoding needs at least one end token")
    if int(tokenizer.vocab_size) > int(vocab_size):
        raise ValueError(
            f"ll_tokenizer: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"model's vocab_size={vocab_size}"
        )
    key = (int(vocab_size), eos)
    with _lock:
        built = _cache.setdefault(tokenizer, {})
        if key not in built:
            ll = require_llguidance()
            tokens, special = token_byte_vocabulary(tokenizer)
            wrapper = ll.TokenizerWrapper(_Wrapped(tokenizer, eos[0], tokens, special))
            built[key] = ll.LLTokenizer(wrapper, n_vocab=int(vocab_size), eos_token=list(eos))
        return built[key]
