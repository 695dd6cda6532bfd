"""Logprobs and echo in the OpenAI shapes: token spellings, the chat and legacy logprobs, and
the echoed prompt (its text, each token's offset, the prompt's logprobs: scoring).

What lives here: :func:`token_bytes`, :func:`token_text` (both re-exported by
``exactblocks.serve.api``), :func:`chat_logprobs`, :func:`legacy_logprobs`,
:func:`prompt_logprobs` and ``_prompt_text``. What does not: computing a logprob (the engine;
a prompt's: ``exactblocks.serve.scoring``), the routes (``exactblocks.serve.completions``).
"""

from __future__ import annotations

from ..text import Detokenizer, bytes_to_unicode
from .engine import PromptEvent, TokenEvent

__all__ = ["chat_logprobs", "legacy_logprobs", "prompt_logprobs", "token_bytes", "token_text"]

_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tok, i: int) -> list[int]:
    """The UTF-8 bytes of token ``i``: a byte-level BPE token's own bytes, else its text's.

    Parameters
    ----------
    tok : tokenizer
        ``decode``, and ``id_to_token`` for a byte-level BPE.
    i : int

    Returns
    -------
    list of int
    """
    spelled = getattr(tok, "id_to_token", None)
    if spelled is not None:
        s = spelled(i)
        if all(c in _BYTE_OF for c in s):
            return [_BYTE_OF[c] for c in s]
    return list(tok.decode([i]).encode("utf-8"))


def token_text(tok, i: int) -> str:
    """Token ``i`` as the logprobs report it: its text, or, for a token that is not whole
    UTF-8 (a part of a character), its bytes spelled ``bytes:\\xe2\\x80`` as OpenAI does, so
    two such tokens never share a ``top_logprobs`` key.

    Parameters
    ----------
    tok : tokenizer
    i : int

    Returns
    -------
    str
    """
    text = tok.decode([i])
    if "\ufffd" in text:
        raw = bytes(token_bytes(tok, i))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def chat_logprobs(tok, token_str, ev: TokenEvent) -> dict:
    """One item of a chat choice's ``logprobs.content``: the token spelled by ``token_str``,
    its logprob and bytes, and its alternatives (``tok`` None: the spelling's bytes)."""

    def one(i, lp):
        s = token_str(i)
        raw = list(s.encode("utf-8")) if tok is None else token_bytes(tok, i)
        return {"token": s, "logprob": lp, "bytes": raw}

    top = [one(i, lp) for i, lp in (ev.top_logprobs or [])]
    return {**one(ev.token, ev.logprob), "top_logprobs": top}


def legacy_logprobs(token_str, evs, shift=0, out=None) -> dict:
    """The ``/v1/completions`` logprobs of token events (text offsets moved by ``shift``),
    appended to ``out`` (a new one when None)."""
    out = out or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in evs:
        out["tokens"].append(token_str(e.token))
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({token_str(i): lp for i, lp in e.top_logprobs or []})
        out["text_offset"].append(e.text_offset + shift)
    return out


def prompt_logprobs(token_str, ids: list, offsets: list, pev: PromptEvent) -> dict:
    """The ``/v1/completions`` logprobs of an echoed prompt: its tokens ``ids``, their text
    ``offsets`` (``_prompt_text``) and the logprobs of its :class:`PromptEvent`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for j, (t, (lp, top)) in enumerate(zip(ids, pev.logprobs)):
        out["tokens"].append(token_str(t))
        out["token_logprobs"].append(lp)
        first = j == 0
        out["top_logprobs"].append(None if first else {token_str(i): v for i, v in top or []})
        out["text_offset"].append(offsets[j])
    return out


def _prompt_text(tok, ids: list) -> tuple[str, list[int]]:
    """A prompt's text as its tokens decode, and each token's offset in it (characters).

    The offsets follow the generation core's rule: a token starts where the text of the
    tokens before it ends, counting only whole characters.
    """
    if tok is None:
        return "", [0] * len(ids)
    detok = Detokenizer(tok)
    offsets = []
    for t in ids:
        offsets.append(detok.decoded_len)
        detok.push(int(t))
    detok.finish()
    return detok.text, offsets
