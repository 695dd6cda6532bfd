"""Constrained decoding: a grammar a generation must follow, and its per-sequence token mask.

What lives here: :class:`Grammar` (a JSON schema, "any JSON object", a Lark grammar or a
regular expression, compiled and checked by llguidance before any work; what
``SamplingParams(grammar=...)`` carries), :class:`GrammarError` and :class:`GrammarMatcher`
(one sequence's matcher: the tokens allowed next, consuming each accepted token). What does
not: the tokenizer bridge (``exactblocks.text.grammar``), sampling and stop rules
(``exactblocks.models.generate``, whose :class:`~exactblocks.models.generate.Generation` uses
a matcher), the HTTP ``response_format`` (``exactblocks.serve``).

Why llguidance (1.9.1): a Rust core in a CPU wheel with no torch dependency; it builds the
token mask from any tokenizer's byte vocabulary (byte-level BPE and SentencePiece alike), and
compiles JSON schemas and Lark grammars (the same engine behind OpenAI-style structured output
in several servers). Its mask for SmolLM2's 49152 tokens costs about 0.1 ms a token.

Exactness: the mask is a pure function of the grammar and the tokens generated so far, and
sampling among the allowed tokens is :func:`exactblocks.sampling.pick_token` of the logits with
the others at -inf (computed over the allowed ids, which gives the same token and draw), so a
constrained request is as batch-invariant and seed-reproducible as any other.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from exactblocks.text.grammar import ll_tokenizer, require_llguidance

__all__ = ["JSON_LAYOUT", "Grammar", "GrammarError", "GrammarMatcher"]

#: llguidance's JSON compile options for every JSON grammar: one line, ``json.dumps``'s
#: separators, no other whitespace (a schema's ``x-guidance`` overrides them).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(message) -> str:
    """An llguidance message on one line: its parser-state dump (``<state>...``) and its
    source excerpts (indented lines: the grammar's line, a caret) dropped, the rest joined."""
    text = str(message).split("<state>")[0].split("<grammar>")[0]
    kept = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln[:1].isspace()]
    return " ".join(kept)


class GrammarError(ValueError):
    """A grammar or JSON schema llguidance refuses (invalid, or a feature it does not support),
    a grammar no text can follow, or a matcher past llguidance's limits.

    Attributes
    ----------
    kind : str
        ``"json_schema"``, ``"json_object"``, ``"lark"`` or ``"regex"``.
    detail : str
        llguidance's own message (``'Unimplemented keys: ["unevaluatedProperties"]'``).
    """

    def __init__(self, message: str, kind: str, detail: str = ""):
        super().__init__(message)
        self.kind = kind
        self.detail = detail or message


@dataclass(frozen=True)
class Grammar:
    """A constraint on a generation's text: build it with the class methods, never directly.

    Attributes
    ----------
    kind : str
        ``"json_schema"``, ``"json_object"``, ``"lark"`` or ``"regex"``.
    source : str
        The grammar as llguidance reads it (``LLMatcher.grammar_from_json_schema`` /
        ``grammar_from_lark`` / ``grammar_from_regex``), checked by
        ``LLMatcher.validate_grammar``.
    name : str or None
        A JSON schema's name (``response_format.json_schema.name``).

    Notes
    -----
    JSON is laid out on one line as Python's ``json.dumps`` does (``{"a": 1, "b": [2]}``:
    :data:`JSON_LAYOUT`, llguidance's ``whitespace_flexible`` off, so a model cannot spend its
    tokens on whitespace); a schema's own ``x-guidance`` options override it. A ``max_tokens``
    too small for the answer still ends it with ``"length"`` and an incomplete value. Two equal
    grammars compare equal (the ``source`` strings).
    """

    kind: str
    source: str
    name: str | None = None

    @classmethod
    def _checked(cls, kind: str, source: str, name=None) -> Grammar:
        ll = require_llguidance()
        is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(source)
        if is_error:
            what = {"json_schema": "JSON schema", "json_object": "JSON object grammar",
                    "lark": "Lark grammar", "regex": "regular expression"}[kind]  # fmt: skip
            detail = _one_line(messages[0]) if messages else "rejected"
            raise GrammarError(f"the {what} is invalid or unsupported: {detail}", kind, detail)
        return cls(kind, source, name)

    @classmethod
    def json_schema(cls, schema, *, name: str | None = None) -> Grammar:
        """A JSON value valid under ``schema`` (JSON Schema draft 2020-12, llguidance's subset).

        Parameters
        ----------
        schema : dict or bool or str
            The schema (a str is parsed as JSON first).
        name : str or None, default=None

        Returns
        -------
        Grammar

        Raises
        ------
        TypeError
            ``schema`` not a dict, a bool or a str.
        GrammarError
            A str that is not JSON; a schema llguidance refuses: an invalid one (``{"type":
            "foo"}``, a dangling ``$ref``) or one using a keyword it does not implement
            (``unevaluatedProperties``, an unknown ``format``, look-around in a ``pattern``);
            the message is llguidance's.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not JSON: {exc}", "json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise TypeError(
                f"Grammar.json_schema: schema must be a dict (a JSON schema); got "
                f"{type(schema).__name__}"
            )
        ll = require_llguidance()
        try:
            source = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                           defaults=dict(JSON_LAYOUT))  # fmt: skip
        except ValueError as exc:
            detail = _one_line(exc)
            raise GrammarError(f"the JSON schema is invalid: {detail}", "json_schema",
                               detail) from None  # fmt: skip
        return cls._checked("json_schema", source, name)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        ll = require_llguidance()
        source = ll.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                       defaults=dict(JSON_LAYOUT))  # fmt: skip
        return cls._checked("json_object", source)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Text in the language of a Lark grammar (llguidance's Lark dialect; rule ``start``).

        Parameters
        ----------
        grammar : str
            E.g. ``'start: "yes" | "no"'``; ``%json {...}`` embeds a JSON schema.

        Raises
        ------
        TypeError
            ``grammar`` not a str.
        GrammarError
            A grammar llguidance refuses (the message is its parser's).
        """
        if not isinstance(grammar, str):
            raise TypeError(f"Grammar.lark: grammar must be a str; got {type(grammar).__name__}")
        return cls._checked("lark", require_llguidance().LLMatcher.grammar_from_lark(grammar))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the whole of ``pattern`` (Rust ``regex`` syntax, no look-around).

        Raises
        ------
        TypeError
            ``pattern`` not a str.
        GrammarError
            A pattern llguidance refuses.
        """
        if not isinstance(pattern, str):
            raise TypeError(f"Grammar.regex: pattern must be a str; got {type(pattern).__name__}")
        return cls._checked("regex", require_llguidance().LLMatcher.grammar_from_regex(pattern))

    def matcher(self, tokenizer, vocab_size: int, eos_token_ids, *,
                allow_eos: bool = True) -> GrammarMatcher:  # fmt: skip
        """A fresh :class:`GrammarMatcher` of this grammar for one sequence (checked against
        the tokenizer as :meth:`check` does; GrammarError when it fails)."""
        return GrammarMatcher(self, tokenizer, vocab_size, eos_token_ids, allow_eos=allow_eos)

    def check(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        """Check that a generation can start under this grammar with ``tokenizer``.

        What every :meth:`matcher` checks when it is made (so ``Model.generate`` refuses the
        grammar before any forward pass); the server calls it while it checks a request,
        before queueing it.

        Parameters
        ----------
        tokenizer : GGUFTokenizer or HFTokenizer
        vocab_size : int
        eos_token_ids : sequence of int

        Raises
        ------
        GrammarError
            llguidance's matcher fails on the grammar, on its first mask or on the text the
            grammar forces from the start (its fast-forward tokens), within llguidance's
            default limits (``LLParserLimits``); or no token may start the text. A schema
            whose every value nests without end (a required property that is ``{"$ref":
            "#"}``) fails so. The message is llguidance's, on one line.
        """
        GrammarMatcher(self, tokenizer, vocab_size, eos_token_ids)


class GrammarMatcher:
    """One sequence's llguidance matcher: which tokens may come next; consume each token.

    Parameters
    ----------
    grammar : Grammar
    tokenizer : GGUFTokenizer or HFTokenizer
    vocab_size : int
        The logits' length.
    eos_token_ids : sequence of int
        The model's end tokens, allowed where the grammar may end.
    allow_eos : bool, default=True
        False (``ignore_eos``): the end tokens are never allowed.

    Raises
    ------
    ImportError
        llguidance is not installed.
    GrammarError
        The grammar fails against this tokenizer (:meth:`Grammar.check`): the matcher, its
        first mask or the text forced from the start fails, or no token may start the text.

    Attributes
    ----------
    mask_seconds : float
        Wall time spent computing masks so far (on whichever thread computed them).
    wait_seconds : float
        Wall time :meth:`allowed` held its caller so far: the whole mask when computed there,
        only what was left of a :meth:`prefetch` still running.
    masks : int
        Masks computed so far.

    Notes
    -----
    Not thread-safe beyond :meth:`prefetch`: one thread drives a matcher (pick, consume), and
    a prefetched mask is computed on the executor's thread while that thread does other
    work (the server's engine runs the next forward pass meanwhile).
    """

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int, eos_token_ids, *,
                 allow_eos: bool = True):  # fmt: skip
        ll = require_llguidance()
        self.grammar = grammar
        self.vocab_size = int(vocab_size)
        self._eos = np.asarray(sorted(int(i) for i in eos_token_ids), np.int64)
        self._allow_eos = bool(allow_eos)
        self._m = ll.LLMatcher(ll_tokenizer(tokenizer, vocab_size, eos_token_ids),
                               grammar.source, log_level=0)  # fmt: skip
        self._bits = np.zeros((self.vocab_size + 31) // 32, np.int32)
        self._future = None
        self.mask_seconds = 0.0
        self.wait_seconds = 0.0
        self.masks = 0
        self._consumed = 0
        self._first: np.ndarray | None = self._start()

    def _refuse(self, matcher) -> GrammarError:
        detail = _one_line(matcher.get_error()) or "no token may start the text"
        return GrammarError(f"the grammar cannot start a generation: {detail}",
                            self.grammar.kind, detail)  # fmt: skip

    def _start(self) -> np.ndarray:
        """The first mask, after checking the matcher and the text forced from the start (on a
        copy: the model still picks every token itself)."""
        if self._m.is_error():
            raise self._refuse(self._m)
        first = self._compute(refuse=True)
        if first.size == 0 and not self._m.is_accepting():
            raise self._refuse(self._m)
        forced = self._m.deep_copy()
        ff = forced.compute_ff_tokens()
        if not forced.is_error() and ff:
            forced.consume_tokens(ff)
            if not forced.is_error():
                bits = np.zeros_like(self._bits)
                forced.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if forced.is_error():
            raise self._refuse(forced)
        return first

    @property
    def done(self) -> bool:
        """bool: the grammar is complete and nothing may follow (only an end token)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """bool: the text so far is complete under the grammar (it may also continue)."""
        return bool(self._m.is_accepting())

    def prefetch(self, executor) -> None:
        """Start computing the next :meth:`allowed` on ``executor`` (a
        ``concurrent.futures.Executor``); :meth:`allowed` then waits for it. The mask depends
        only on the tokens consumed so far, so where it is computed changes nothing."""
        if self._future is None and self._first is None and not self.done:
            self._future = executor.submit(self._compute)

    def allowed(self) -> np.ndarray:
        """The ids that may come next, ascending (int64); empty when none may.

        Raises
        ------
        GrammarError
            The matcher failed: past llguidance's limits (a grammar that nests without end
            beyond what :meth:`Grammar.check` sees), or after a token it refused. The message
            is one line: the token it failed at and llguidance's message.
        """
        if self._first is not None:  # computed (and checked) when the matcher was made
            first, self._first = self._first, None
            return first
        t0 = time.perf_counter()
        future, self._future = self._future, None
        try:
            return self._compute() if future is None else future.result()
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _limits(self) -> GrammarError:
        detail = _one_line(self._m.get_error())
        return GrammarError(
            f"the grammar exceeded llguidance's limits at token {self._consumed + 1} of the "
            f"generation: {detail}",
            self.grammar.kind,
            detail,
        )

    def _compute(self, refuse: bool = False) -> np.ndarray:
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise self._refuse(self._m) if refuse else self._limits()
        words = np.flatnonzero(self._bits)
        if words.size * 8 < self._bits.size:  # few allowed (most steps): expand those words only
            rows, cols = np.nonzero(
                np.unpackbits(self._bits[words].view(np.uint8), bitorder="little").reshape(-1, 32)
            )
            ids = words[rows] * 32 + cols
            ids = ids[ids < self.vocab_size]
        else:
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
            ids = np.flatnonzero(bits[: self.vocab_size])
        if not self._allow_eos and self._eos.size:
            ids = ids[~np.isin(ids, self._eos)]
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1
        return ids

    def consume(self, token: int) -> None:
        """Advance the matcher by ``token`` (one the last :meth:`allowed` listed).

        Raises
        ------
        GrammarError
            The grammar does not allow ``token`` here (the message is one line); a token the
            last mask allowed that fails is past llguidance's limits (as :meth:`allowed`).
        """
        if self._future is not None:  # a prefetch nobody read: let it finish, drop it
            future, self._future = self._future, None
            future.exception()
        self._first = None
        t = int(token)
        was_allowed = 0 <= t < self.vocab_size and bool((self._bits[t >> 5] >> (t & 31)) & 1)
        if not self._m.consume_token(t):
            if was_allowed:
                raise self._limits()
            detail = _one_line(self._m.get_error())
            raise GrammarError(f"the grammar does not allow token {t} here: {detail}",
                               self.grammar.kind, detail)  # fmt: skip
        self._consumed += 1
