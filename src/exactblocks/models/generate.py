"""The one generation core: how a request samples and stops, and how a batch of requests runs.

What lives here: :class:`SamplingParams` (the single check of every sampling argument, for
``Model.generate``, the server and ``exactblocks.ray``), :class:`Generation` (one sequence's
sampler, stop rules and emitted :class:`TokenEvent` s: the advance step), :func:`plan_step`
(the pure policy that decides how many tokens each row of a batch feeds next) and
:func:`run_batch` (continuous batching over one :class:`~exactblocks.ModelState` through the
public ``Model.forward``). What does not: computing logits (``exactblocks.models.model``), the
server's thread, queue, prefix cache and metrics (``exactblocks.serve.engine``).

Stop rules, one set everywhere: generation stops at the first of (1) a stop token: the model's
``eos_token_ids`` (unless ``ignore_eos``) and ``stop_token_ids``, not part of the output;
(2) a stop string: the text is cut before it, and the tokens whose text starts at or after the
cut are dropped from the emitted events (and so from reported logprobs); (3) ``max_tokens``.
A str given as ``stop`` is one stop string.

Exactness: a token is :func:`exactblocks.sampling.pick_token` of the row's float32 logits with
the row's own ``numpy.random.Generator(PCG64(seed))``; its logprob is
:func:`exactblocks.sampling.logprobs` (the library's float32 arithmetic). Neither depends on the
other rows, so the same seeded request gives the same tokens and logprob bits from every
surface, alone or batched.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from exactblocks.sampling import logprobs, pick_token
from exactblocks.text import Detokenizer

from .structured import Grammar, GrammarError

__all__ = [
    "MAX_TOP_LOGPROBS",
    "GenerateOutput",
    "GenerationStream",
    "Generation",
    "SamplingParams",
    "TokenEvent",
    "decode_one",
    "plan_step",
    "run_batch",
    "split_stop",
]

#: Most alternatives ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _is_sequence(value) -> bool:
    """A list, tuple, range or 1-D NumPy array: ordered entries (a dict, set or str is not)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def split_stop(stop, where: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Split a ``stop`` argument into (stop token ids, stop strings).

    Parameters
    ----------
    stop : None, str, int or sequence of int and str
        A str is one stop string; an int one stop id; None nothing; a sequence (list, tuple,
        1-D array) of them in order.
    where : str
        The call named in errors.

    Returns
    -------
    tuple
        ``(ids, strings)``, each a tuple in the given order.

    Raises
    ------
    TypeError
        ``stop`` of another type (a dict, a set, bytes), or an entry that is neither an int
        nor a str.
    """
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        return (), (stop,)
    if _is_int(stop):
        return (int(stop),), ()
    if not _is_sequence(stop):
        raise TypeError(
            f"{where}: stop must be a str, an int or a sequence (list or tuple) of int and "
            f"str; got {type(stop).__name__}"
        )
    ids, strs = [], []
    for s in stop:
        if isinstance(s, str):
            strs.append(s)
        elif _is_int(s):
            ids.append(int(s))
        else:
            raise TypeError(
                f"{where}: a stop entry must be an int or a str; got {type(s).__name__}"
            )
    return tuple(ids), tuple(strs)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and stops: every sampling argument, checked once.

    Parameters
    ----------
    max_tokens : int
        Most new tokens, >= 1 (``max_new_tokens`` of ``Model.generate`` and ``ray.Generate``).
    temperature : float, default=1.0
        0 = greedy (argmax, the lowest id on ties); > 0 samples from
        ``softmax(logits / temperature)``. Finite, >= 0.
    top_k : int or None, default=None
        Keep the tokens whose scaled logit is >= the k-th largest (ties kept), >= 1.
    top_p : float or None, default=None
        In (0, 1]: nucleus sampling (HF ``TopPLogitsWarper``); None or 1 keeps all.
    seed : int or None, default=None
        Seed of ``numpy.random.Generator(PCG64(seed))``, >= 0; None = fresh OS entropy.
    stop : str or sequence of str, default=()
        Stop strings; a str is one stop string. Stored as a tuple.
    stop_token_ids : sequence of int or None, default=None
        Stop tokens besides the model's end tokens. Stored as a tuple (None = ()).
    ignore_eos : bool, default=False
        True: the model's ``eos_token_ids`` do not stop (only ``stop_token_ids``, stop strings
        and ``max_tokens`` do).
    logprobs : bool, default=False
        Report each emitted token's log-probability (:func:`exactblocks.sampling.logprobs`).
    top_logprobs : int, default=0
        With ``logprobs``: also the most likely alternatives at each position, in [0, 20].
    grammar : Grammar or None, default=None
        Constrained decoding (:class:`exactblocks.models.structured.Grammar`): each token is
        picked among those the grammar allows after the tokens so far; the generation stops
        (``"stop"``) once the grammar is complete and nothing may follow.

    Raises
    ------
    TypeError
        A value of the wrong type (bool is not a number; a stop entry not a str).
    ValueError
        A value out of range, or an empty stop string.

    Notes
    -----
    :meth:`checked` builds the same object with the errors naming the caller and its own
    argument names (``Model.generate: max_new_tokens=0 must be >= 1``).
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = None

    def __post_init__(self):
        self._check("SamplingParams", {})

    @classmethod
    def checked(cls, where: str, names: dict | None = None, **values) -> SamplingParams:
        """Build a SamplingParams whose errors name ``where`` and the caller's argument names.

        Parameters
        ----------
        where : str
            The call named in errors (``"Model.generate"``).
        names : dict or None, default=None
            Field -> the caller's name for it (``{"max_tokens": "max_new_tokens"}``).
        **values
            The fields, as the constructor.

        Returns
        -------
        SamplingParams
        """
        obj = object.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.name in values:
                v = values.pop(f.name)
            elif f.default is not dataclasses.MISSING:
                v = f.default
            else:
                raise TypeError(f"{where}: {(names or {}).get(f.name, f.name)} is required")
            object.__setattr__(obj, f.name, v)
        if values:
            raise TypeError(f"{where}: unknown sampling arguments {sorted(values)}")
        obj._check(where, names or {})
        return obj

    def _check(self, where: str, names: dict) -> None:
        def name(field: str) -> str:
            return names.get(field, field)

        def put(field: str, value) -> None:
            object.__setattr__(self, field, value)

        def as_int(field, minimum, allow_none=False):
            v = getattr(self, field)
            if v is None and allow_none:
                return None
            if not _is_int(v):
                what = "an int or None" if allow_none else "an int"
                raise TypeError(f"{where}: {name(field)} must be {what}; got {type(v).__name__}")
            if int(v) < minimum:
                raise ValueError(f"{where}: {name(field)}={int(v)} must be >= {minimum}")
            return int(v)

        def as_real(field, allow_none=False):
            v = getattr(self, field)
            if v is None and allow_none:
                return None
            if not _is_real(v):
                raise TypeError(
                    f"{where}: {name(field)} must be a real number; got {type(v).__name__}"
                )
            if not math.isfinite(float(v)):
                raise ValueError(f"{where}: {name(field)}={float(v)} must be finite")
            return float(v)

        put("max_tokens", as_int("max_tokens", 1))
        temp = as_real("temperature")
        if temp < 0:
            raise ValueError(f"{where}: {name('temperature')}={temp} must be >= 0")
        put("temperature", temp)
        put("top_k", as_int("top_k", 1, allow_none=True))
        p = as_real("top_p", allow_none=True)
        if p is not None and not 0 < p <= 1:
            raise ValueError(f"{where}: {name('top_p')}={p} must be in (0, 1]")
        put("top_p", p)
        put("seed", as_int("seed", 0, allow_none=True))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not _is_sequence(stop):
            raise TypeError(
                f"{where}: {name('stop')} must be a str or a sequence (list or tuple) of str; got "
                f"{type(stop).__name__}"
            )
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"{where}: a stop string must be a str; got {type(s).__name__}")
            if not s:
                raise ValueError(f"{where}: a stop string is empty")
        put("stop", stop)
        ids = self.stop_token_ids
        if ids is not None:
            if not _is_sequence(ids):
                raise TypeError(
                    f"{where}: {name('stop_token_ids')} must be a sequence of int; got "
                    f"{type(ids).__name__}"
                )
            ids = tuple(ids)
            for i in ids:
                if not _is_int(i):
                    raise TypeError(f"{where}: a stop id must be an int; got {type(i).__name__}")
                if int(i) < 0:
                    raise ValueError(f"{where}: stop id {int(i)} must be >= 0")
            put("stop_token_ids", tuple(int(i) for i in ids))
        for flag in ("ignore_eos", "logprobs"):
            v = getattr(self, flag)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{where}: {name(flag)} must be a bool; got {type(v).__name__}")
            put(flag, bool(v))
        top = as_int("top_logprobs", 0)
        if top > MAX_TOP_LOGPROBS:
            raise ValueError(
                f"{where}: {name('top_logprobs')}={top} must be in [0, {MAX_TOP_LOGPROBS}]"
            )
        put("top_logprobs", top)
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TypeError(
                f"{where}: {name('grammar')} must be a Grammar (exactblocks.models.structured) "
                f"or None; got {type(self.grammar).__name__}"
            )


@dataclass
class TokenEvent:
    """One emitted token of a generation.

    Attributes
    ----------
    token : int
    text : str
        Text released with this token (may be empty: an incomplete character, or text held
        until it cannot start a stop string). The texts of a generation's events, then its
        final tail, join to its text.
    logprob : float or None
        ``log softmax(logits)[token]`` as a float32 value (the model's distribution, before
        temperature, top_k and top_p), when the request asked for logprobs.
    top_logprobs : list of (int, float) or None
        The most likely tokens at this position, by logprob descending then id ascending.
    text_offset : int
        Where this token's text starts in the generation's text (characters).
    """

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list | None = None
    text_offset: int = 0


class Generation:
    """One sequence's sampling, stop rules and emitted events (the advance step).

    Parameters
    ----------
    params : SamplingParams
    prompt_ids : sequence of int
    tokenizer : object or None
        ``decode(list of int) -> str``; required for stop strings.
    eos_token_ids : sequence of int
        The model's end tokens (stop unless ``params.ignore_eos``).
    vocab_size : int
    where : str
        The call named in errors.
    resume : sequence of int, default=()
        Tokens this same request already generated (a run cut short, e.g. on a lost server
        replica): they are replayed through the stop rules, the grammar and the detokenizer,
        the generator is advanced by one draw per token (``PCG64.advance``: exactly the draws
        they consumed), and their events are not emitted again, so the events that follow
        are the ones the uninterrupted run emits after them, bit for bit, once the caller
        feeds the logits of ``prompt_ids + resume``. They count in :attr:`ids` and towards
        ``max_tokens``; :attr:`logprobs` holds only the new tokens'.

    Raises
    ------
    TypeError
        Stop strings or a grammar without a tokenizer.
    ValueError
        A stop id outside the vocabulary (it could never be generated); a grammar without an
        end token (:class:`~exactblocks.models.structured.GrammarError` when it fails
        against the tokenizer); a ``resume`` token outside the vocabulary, a stop token, or
        one after which the generation would already have ended (a stop string, the
        grammar's end, ``max_tokens``), naming its index; a ``resume`` token the grammar
        does not allow (GrammarError).

    Attributes
    ----------
    ids : list of int
        Every new token accepted (a stop token is not).
    events : list of TokenEvent
        Emitted events so far (the stop string's tokens are never emitted).
    finish_reason : str or None
        ``"stop"`` or ``"length"`` once finished; ``"error"`` when :func:`run_batch` ended the
        row on its grammar's error.
    error : str or None
        That error's message (one line), else None.
    matcher : GrammarMatcher or None
        The grammar's matcher (``params.grammar``), fed every accepted token.
    """

    def __init__(self, params: SamplingParams, prompt_ids, *, tokenizer, eos_token_ids,
                 vocab_size: int, where: str, resume: Sequence[int] = ()):  # fmt: skip
        self.params = params
        self.prompt_ids = list(prompt_ids)
        if params.stop and tokenizer is None:
            raise TypeError(f"{where}: stop strings need a tokenizer; this model has none")
        for sid in params.stop_token_ids or ():
            if sid >= vocab_size:
                raise ValueError(
                    f"{where}: stop id {sid} is outside the vocabulary [0, {vocab_size}): it "
                    "could never be generated"
                )
        eos = () if params.ignore_eos else tuple(int(i) for i in eos_token_ids)
        self.stop_ids = frozenset(eos + (params.stop_token_ids or ()))
        self.matcher = None
        if params.grammar is not None:
            if tokenizer is None:
                raise TypeError(f"{where}: a grammar needs a tokenizer; this model has none")
            self.matcher = params.grammar.matcher(tokenizer, vocab_size, eos_token_ids,
                                                  allow_eos=not params.ignore_eos)  # fmt: skip
        # greedy decoding draws nothing: numpy.random (and the libcrypto its import loads,
        # about 5 MB of memory) is set up only to sample
        self.rng = (
            np.random.Generator(np.random.PCG64(params.seed)) if params.temperature > 0 else None
        )
        self.detok = None if tokenizer is None else Detokenizer(tokenizer, params.stop)
        self.ids: list[int] = []
        self.logprobs: list = []  # per accepted token, when params.logprobs
        self.events: list[TokenEvent] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._pending: list[tuple[TokenEvent, int]] = []  # (event, end of its text)
        self._carry = ""  # released text not yet attached to an event
        self._hidden = 0  # events still to drop: those of replayed tokens (already sent)
        if len(resume):
            self._replay(resume, vocab_size, where)

    def _replay(self, resume: Sequence[int], vocab_size: int, where: str) -> None:
        """Feed ``resume`` as if sampled: state, text and draws move; nothing is emitted."""
        tokens = [int(t) for t in resume]
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"{where}: resume[{i}]={t} is outside the vocabulary [0, {vocab_size})"
                )
            if t in self.stop_ids:
                raise ValueError(f"{where}: resume[{i}]={t} is a stop token: the generation "
                                 "ended there")  # fmt: skip
            if self.finished:
                raise ValueError(
                    f"{where}: resume has {len(tokens)} tokens, but the generation ends after "
                    f"{i} of them ({self.finish_reason})"
                )
            self._hidden += 1
            try:
                self.accept(t, None)  # the matcher refuses a token its grammar does not allow
            except GrammarError as exc:
                raise GrammarError(f"resume[{i}]: {exc}", exc.kind, exc.detail) from None
        if self.finished:
            raise ValueError(f"{where}: the generation ends with resume's last token "
                             f"({self.finish_reason}): there is nothing to resume")  # fmt: skip
        if self.rng is not None:
            bits = self.rng.bit_generator
            assert isinstance(bits, np.random.PCG64)
            bits.advance(len(tokens))  # one draw per sampled token

    @property
    def finished(self) -> bool:
        """bool: True once a stop rule or max_tokens ended the generation."""
        return self.finish_reason is not None

    @property
    def text(self) -> str | None:
        """str or None: the text so far (cut before a stop string); None without a tokenizer."""
        return None if self.detok is None else self.detok.text

    def pick(self, logits: np.ndarray) -> int:
        """The next token of ``logits`` (float32, (vocab_size,)) with this sequence's generator.

        With a grammar: :func:`pick_token` of the logits of the allowed ids only (in id
        order), mapped back; the same token and draw as ``pick_token`` of the logits with every
        other id at -inf (the order, top_k's threshold, top_p's sums and the draw only ever
        see the allowed ids' weights: a -inf adds an exact 0).

        Raises
        ------
        ValueError
            Non-finite logits, or a temperature too small for them (:func:`pick_token`).
        GrammarError
            The grammar's matcher failed, or allows no token here (a ValueError too, so that
            :func:`run_batch` and the server end this row only).
        """
        p = self.params
        if self.matcher is None:
            return pick_token(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                              rng=self.rng)  # fmt: skip
        allowed = self.matcher.allowed()
        if allowed.size == 0:
            raise GrammarError("the grammar allows no token here (its matcher failed)",
                               p.grammar.kind if p.grammar is not None else "")  # fmt: skip
        i = pick_token(np.ascontiguousarray(logits[allowed]), temperature=p.temperature,
                       top_k=p.top_k, top_p=p.top_p, rng=self.rng)  # fmt: skip
        return int(allowed[i])

    def accept(self, token: int, logits: np.ndarray | None) -> tuple[list[TokenEvent], str]:
        """Take the sampled ``token`` of ``logits``: stop, or append and emit.

        Parameters
        ----------
        token : int
        logits : ndarray of shape (vocab_size,), float32
            The logits it was picked from (for its logprobs).

        Returns
        -------
        tuple
            ``(events, piece)``: the events released now (in order; a token waits while its
            text could still start a stop string) and the text the detokenizer released (the
            pieces, then :meth:`close`'s tail, join to :attr:`text`).
        """
        if self.finished:
            raise RuntimeError("Generation.accept: the generation has finished")
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self._release(len(self._pending)), ""
        if self.matcher is not None:
            self.matcher.consume(token)
        p = self.params
        lp = top = None
        if p.logprobs and logits is not None:  # None: a replayed token (nothing reported)
            lp, top = logprobs(logits, token, p.top_logprobs)
            self.logprobs.append(lp)
            lp = float(lp)
            top = None if top is None else [(i, float(v)) for i, v in top]
        self.ids.append(int(token))
        piece = ""
        if self.detok is None:
            out = [TokenEvent(int(token), "", lp, top, 0)]
            self.events += out
        else:
            start = self.detok.decoded_len
            piece = self.detok.push(int(token))
            self._pending.append((TokenEvent(int(token), "", lp, top, start),
                                  self.detok.decoded_len))  # fmt: skip
            self._carry += piece
            if self.detok.stopped:
                self.finish_reason = "stop"
                cut = len(self.detok.text)
                keep = sum(1 for ev, _ in self._pending if ev.text_offset < cut)
                out = self._release(keep)
                self._pending.clear()
            else:
                sent = self.detok.released
                out = self._release(sum(1 for _, end in self._pending if end <= sent))
        if not self.finished and self.matcher is not None and self.matcher.done:
            self.finish_reason = "stop"  # the grammar is complete: only an end token may follow
        if not self.finished and len(self.ids) >= p.max_tokens:
            self.finish_reason = "length"
        return out, piece

    def _release(self, n: int) -> list[TokenEvent]:
        out = [ev for ev, _ in self._pending[:n]]
        del self._pending[:n]
        if out and self._carry:
            out[-1].text, self._carry = self._carry, ""
        if self._hidden:  # a replayed token's event (and the text it carried) was sent before
            drop = min(self._hidden, len(out))
            self._hidden -= drop
            out = out[drop:]
        self.events += out
        return out

    def close(self) -> tuple[list[TokenEvent], str]:
        """End the generation (finished, or stopped early); release what was held.

        Returns
        -------
        tuple
            ``(events, tail)``: the tokens still held (emitted now, with empty text) and the
            text not yet released.
        """
        out = self._release(len(self._pending))
        tail = self._carry + (self.detok.finish() if self.detok is not None else "")
        self._carry = ""
        return out, tail


@dataclass
class GenerateOutput:
    """What :meth:`Model.generate` produced.

    Attributes
    ----------
    ids : list of int
        The new token ids (a stop token is not included).
    text : str or None
        Their text (``tokenizer.decode(ids)``, cut before a stop string), or None without a
        tokenizer.
    prompt_ids : list of int
        The prompt as token ids.
    finish_reason : str
        ``"length"`` (max_new_tokens reached) or ``"stop"`` (a stop token or string).
    prefill_seconds, decode_seconds : float
        Wall time of the prompt's forward and of the decode steps.
    decode_steps : int
        ``step`` calls made (new tokens after the first).
    logprobs : list of numpy.float32 or None
        With ``logprobs=True``: ``log softmax(logits)[id]`` of each of ``ids``
        (:func:`exactblocks.sampling.logprobs`, the bits the server and ``exactblocks.ray``
        report); None otherwise.
    """

    ids: list = field(default_factory=list)
    text: str | None = None
    prompt_ids: list = field(default_factory=list)
    finish_reason: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    logprobs: list | None = None


class GenerationStream:
    """An iterator over the pieces of a generation, as they are decoded.

    Returned by ``Model.generate(..., stream=True)``. Yields str pieces (whose concatenation
    is the final ``text``) when the model has a tokenizer, else the new token ids (int).
    After exhaustion, :attr:`output` holds the :class:`GenerateOutput`.

    Attributes
    ----------
    output : GenerateOutput or None
        None until the iterator is exhausted.
    """

    def __init__(self, gen: Iterator, holder: list):
        self._gen = gen
        self._holder = holder

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self):
        return next(self._gen)

    @property
    def output(self) -> GenerateOutput | None:
        """GenerateOutput or None: the result, once the iterator is exhausted."""
        return self._holder[0] if self._holder else None

    def close(self) -> None:
        """Stop generating (releases the decode sessions at once)."""
        self._gen.close()


def decode_one(model, gen: Generation, capacity: int, holder: list) -> Iterator:
    """Run ``gen`` alone on ``model``: ``Model.generate``'s loop.

    Parameters
    ----------
    model : exactblocks.Model
    gen : Generation
        A fresh generation of ``model`` (:meth:`exactblocks.Model.generation`).
    capacity : int
        Positions of the state: prompt + max_tokens.
    holder : list
        The :class:`GenerateOutput` is appended to it at the end.

    Yields
    ------
    str or int
        Text pieces (their concatenation is the text), or the new ids without a tokenizer.

    Notes
    -----
    The prompt is prefilled with the layers in one native call and the head on its last
    position only; each new token is one step (every layer in one native call) on a state and a
    workspace this loop alone uses, which equals the prefill bit for bit.
    """
    from exactblocks import _ext

    res = GenerateOutput(prompt_ids=list(gen.prompt_ids))
    has_text = gen.detok is not None
    # A state this generation alone uses (nothing saved for a rollback), and one scratch
    # workspace for all its calls: the layers run one after another (one per layer held
    # ~1.6 MB each after a SmolLM2 prompt: 30 layers, 47 MB of peak memory).
    state = model.allocate_state(1, None if model._is_mamba else capacity)
    ws = _ext.core().Workspace()
    t0 = time.perf_counter()
    ids = np.asarray([gen.prompt_ids], np.int64)
    x = model._run_private(ids, None, "Model.generate", state=state, ws=ws)
    logits = model._last_logits(x, None)[0]  # the head on the last position only
    res.prefill_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    while True:
        token = gen.pick(logits)
        _, piece = gen.accept(token, logits)
        if token not in gen.stop_ids:
            if has_text:
                if piece:
                    yield piece
            else:
                yield token
        if gen.finished:
            break
        x = model._lookup(np.asarray([token]))
        x = model._run_blocks(x, state, None, step=True, where="Model.generate",
                              ws=ws)  # fmt: skip
        logits = model._head.forward(x.reshape(1, model.d_model))[0]
        res.decode_steps += 1
    res.decode_seconds = time.perf_counter() - t1
    sent = len(gen._carry)  # text already yielded as pieces, not yet attached to an event
    _, tail = gen.close()
    tail = tail[sent:]
    res.ids = list(gen.ids)
    res.finish_reason = gen.finish_reason
    res.text = gen.text
    res.logprobs = list(gen.logprobs) if gen.params.logprobs else None
    if tail:
        yield tail
    holder.append(res)


def plan_step(rows, *, chunk: int | None = None, budget: int | None = None,
              turn: int = 0) -> np.ndarray:  # fmt: skip
    """How many tokens each row of a batch feeds in the next forward call (a pure policy).

    Parameters
    ----------
    rows : sequence of (bool, int, int) or None
        Per row: None (free, or nothing to feed), or ``(decoding, prompt_left, pos)``: a
        decoding row feeds its one sampled token; otherwise ``prompt_left`` prompt tokens are
        still to feed, ``pos`` are already in the row.
    chunk : int or None, default=None
        Prompt chunks end at multiples of ``chunk`` positions (the server's prefix-cache
        boundaries); None = the whole rest of the prompt.
    budget : int or None, default=None
        Prompt tokens the step may carry over all rows; None = no limit.
    turn : int, default=0
        The row whose prompt is served first (round robin over the rows).

    Returns
    -------
    ndarray of shape (len(rows),), int64
        Tokens per row (0 = the row does not take part).
    """
    B = len(rows)
    lens = np.zeros(B, np.int64)
    left_budget = math.inf if budget is None else budget
    for row in [(turn + i) % B for i in range(B)]:
        r = rows[row]
        if r is None:
            continue
        decoding, left, pos = r
        if decoding:
            lens[row] = 1
        elif left_budget > 0 and left > 0:
            n = left if chunk is None else min(left, (pos // chunk + 1) * chunk - pos)
            n = int(min(n, left_budget))
            lens[row] = n
            left_budget -= n
    return lens


def run_batch(model, gens: list[Generation], *, max_rows: int) -> None:
    """Run ``gens`` to completion with continuous batching over one state of ``max_rows``.

    Every step feeds each busy row its prompt (first step) or its last token, in one
    ``Model.forward(..., logits="last")``; a finished row frees its slot for the next waiting
    generation. Each row's tokens and logprobs are those it gets alone (batch invariance).

    Parameters
    ----------
    model : exactblocks.Model
    gens : list of Generation
        Fresh generations; each is closed at its end.
    max_rows : int
        Rows of the state (slots), >= 1.

    Notes
    -----
    A row whose grammar's matcher fails (:class:`~exactblocks.models.structured.GrammarError`:
    past llguidance's limits) ends with ``finish_reason`` ``"error"`` and its ``error``; the
    other rows go on undisturbed.
    """
    if not gens:
        return
    n_slots = min(len(gens), max_rows)
    cap = max(len(g.prompt_ids) + g.params.max_tokens for g in gens)
    state = model.allocate_state(n_slots, None if model.max_positions is None else cap)
    waiting = list(reversed(gens))
    slot: list[Generation | None] = [None] * n_slots
    feed: list[list[int]] = [[] for _ in range(n_slots)]
    while waiting or any(s is not None for s in slot):
        for s in range(n_slots):
            if slot[s] is None and waiting:
                slot[s] = waiting.pop()
                feed[s] = slot[s].prompt_ids
        lens = plan_step([None if g is None else (False, len(f), 0) for g, f in zip(slot, feed)])
        ids = np.zeros((n_slots, int(lens.max())), np.int64)
        for s in np.flatnonzero(lens).tolist():
            ids[s, : lens[s]] = feed[s]
        logits = model.forward(ids, state, lengths=lens, logits="last")
        for s in np.flatnonzero(lens).tolist():
            g = slot[s]
            try:
                token = g.pick(logits[s])
                g.accept(token, logits[s])
            except GrammarError as exc:  # this row's matcher past its limits: this row only
                g.error, g.finish_reason = str(exc), "error"
            if g.finished:
                g.close()
                slot[s] = None
                state.reset([s])  # the slot is free for the next waiting row
            else:
                feed[s] = [token]
