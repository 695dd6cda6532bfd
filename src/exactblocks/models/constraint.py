"""A generation constrained to a grammar: llguidance's token masks on one row's logits.

What lives here: :class:`GrammarConstraint` (one row's matcher: the tokens its grammar allows
next, the tokens it took) and the llguidance tokenizer of a model's tokenizer (built once per
tokenizer, about a second for a 49152-token vocabulary). What does not: which grammar (the
caller's: a tool-call grammar comes from ``exactblocks.text.tool_call_grammar``), sampling
(``exactblocks.sampling.pick_token``, unchanged: it sees masked logits).

Exactness: a row's mask depends only on its grammar and the tokens it took, and the masked
logits are a function of the row's own logits and mask, so a constrained row gives the same
tokens alone or in any batch, like every other row.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from exactblocks.text import token_bytes

__all__ = ["GrammarConstraint"]

_LOCK = threading.Lock()


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, special ids, an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        specials = set(getattr(tokenizer, "special_token_ids", ()) or ())
        n = min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))
        self.tokens = [bytes(token_bytes(tokenizer, i)) for i in range(n)]
        # ids past the tokenizer's vocabulary (padding rows of the embedding) never match text
        self.tokens += [b"\xff[pad%d]" % i for i in range(n, vocab_size)]
        self.special_token_ids = sorted(i for i in specials if i < vocab_size)
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tok = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tok.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer, vocab_size: int, eos: tuple):
    import llguidance

    wrapped = llguidance.TokenizerWrapper(_Wrapped(tokenizer, vocab_size, eos[0]))
    return llguidance.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=list(eos))


class GrammarConstraint:
    """One row's grammar: the tokens allowed next, and the tokens taken.

    Parameters
    ----------
    grammar : str
        A Lark grammar in llguidance's dialect (``%json {schema}`` rules allowed).
    tokenizer : object
        The model's tokenizer (``encode``, ``decode``; ``id_to_token`` for byte-level BPE).
    vocab_size : int
    eos_token_ids : sequence of int
        The model's end tokens: allowed once the grammar accepts.
    where : str
        The call named in errors.

    Raises
    ------
    ImportError
        ``llguidance`` is not installed.
    TypeError
        No tokenizer.
    ValueError
        The grammar does not compile (llguidance's message), or no end token.
    """

    def __init__(self, grammar: str, *, tokenizer, vocab_size: int, eos_token_ids, where: str):
        try:
            import llguidance
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"{where}: a constrained generation needs the `llguidance` package; install "
                "it with `pip install llguidance`"
            ) from exc
        if tokenizer is None:
            raise TypeError(f"{where}: a grammar needs a tokenizer; this model has none")
        eos = tuple(int(i) for i in eos_token_ids)
        if not eos:
            raise ValueError(f"{where}: a grammar needs an end token; this model has none")
        with _LOCK:  # built once per tokenizer, by the first row that needs it
            ll = _ll_tokenizer(tokenizer, int(vocab_size), eos)
        self.vocab_size = int(vocab_size)
        self.matcher = llguidance.LLMatcher(
            ll, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
        )
        if self.matcher.is_error():
            raise ValueError(f"{where}: the grammar does not compile: {self.matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """bool: the grammar is complete and allows no further token."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """The tokens allowed next: a bool array of shape (vocab_size,)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def mask(self, logits: np.ndarray, temperature: float) -> np.ndarray:
        """``logits`` (float32, (vocab_size,)) with every token the grammar refuses lowered to
        ``max(allowed logits) - 1e5 * max(1, temperature)``: finite, never the argmax, and at
        least 1e5 below the best allowed scaled logit, so its ``exp`` in sampling is exactly 0
        and it is never drawn. A new array; ``logits`` is not written.
        """
        ok = self.allowed()
        if ok.all():
            return logits
        if not ok.any():  # an error state: nothing but an end token can follow
            raise ValueError(f"the grammar allows no next token: {self.matcher.get_error()}")
        top = np.float32(logits[ok].max())
        floor = np.float32(top - np.float32(1e5 * max(1.0, float(temperature))))
        return np.where(ok, logits, floor).astype(np.float32, copy=False)

    def accept(self, token: int) -> None:
        """Take ``token`` (one the last mask allowed).

        Raises
        ------
        ValueError
            The grammar refuses it.
        """
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"the grammar refuses token {token}: {self.matcher.get_error()}")
