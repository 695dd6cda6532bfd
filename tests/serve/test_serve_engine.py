"""The engine without HTTP, on tiny random models of three state kinds (a plain KV cache, a
sliding-window ring, Mamba-2): seeded answers equal ``Model.generate``; tokens and logprobs
are the same bits alone or batched, in any slot, with or without a prefix-cache hit; the cache
stays within its budget; a cancelled request frees its row."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from serve_helpers import tiny_model

from exactblocks.serve import Engine, QueueFull, SamplingParams

FAMILIES = ["llama", "mistral", "mamba2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


def _prompts(n, seed=0, lo=3, hi=40, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(0, 300, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _params(i, **kw):
    base = dict(max_tokens=6, temperature=0.9, top_p=0.95, seed=100 + i, stop_token_ids=(),
                logprobs=True, top_logprobs=3)  # fmt: skip
    base.update(kw)
    return SamplingParams(**base)


def _answer(result):
    toks, fin = result
    return [(t.token, t.logprob, t.top_logprobs) for t in toks], fin.finish_reason


def _run(model, prompts, params, **engine_kw):
    with Engine(model, **engine_kw) as eng:
        handles = [eng.submit(p, q) for p, q in zip(prompts, params)]
        out = [h.result(timeout=120) for h in handles]
        stats = eng.stats()
    return out, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_generate_and_alone(models, family):
    model = models(family)
    prompts = _prompts(7, seed=1)
    params = [_params(i) for i in range(len(prompts))]
    # the batch's rows are picked on a pool of 3 threads, the lone request's on the loop thread
    batched, _ = _run(model, prompts, params, max_batch=3, prefill_chunk=8, prefill_budget=12,
                      sample_threads=3)  # fmt: skip
    for i, (p, q) in enumerate(zip(prompts, params)):
        ref = model.generate(p, max_new_tokens=6, temperature=0.9, top_p=0.95, seed=100 + i,
                             stop=())  # fmt: skip
        assert [t.token for t in batched[i][0]] == ref.ids, i
        alone, _ = _run(model, [p], [q], max_batch=1, prefix_cache_mb=0, sample_threads=1)
        assert _answer(alone[0]) == _answer(batched[i]), i


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hit_equals_cold(models, family):
    model = models(family)
    shared = _prompts(1, seed=2, lo=21, hi=22)[0]  # 21 tokens: boundaries 8 and 16 inside
    prompts = _prompts(5, seed=3, lo=2, hi=12, prefix=shared)
    prompts.append(list(prompts[0]))  # the same prompt again: a whole-prompt hit
    params = [_params(i, temperature=0.7) for i in range(len(prompts))]
    cold = [_run(model, [p], [q], max_batch=1, prefix_cache_mb=0)[0][0]
            for p, q in zip(prompts, params)]  # fmt: skip
    # one row: requests run one after another, each after the previous one was cached
    warm, stats = _run(model, prompts, params, max_batch=1, prefill_chunk=8)
    for i in range(len(prompts)):
        assert _answer(warm[i]) == _answer(cold[i]), i
    cached = [fin.cached_tokens for _, fin in warm]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached
    assert cached[-1] == len(prompts[-1])  # nothing left to prefill: the saved logits serve
    assert stats["prefix_cache_hits"] >= 5


def test_prefix_cache_stays_within_budget(models):
    model = models("llama")
    prompts = _prompts(12, seed=4, lo=20, hi=60)
    params = [_params(i, max_tokens=3) for i in range(len(prompts))]
    budget_mb = 0.08
    with Engine(model, max_batch=2, prefill_chunk=8, prefix_cache_mb=budget_mb) as eng:
        out = [eng.submit(p, q).result(120) for p, q in zip(prompts, params)]
        again = [eng.submit(p, q).result(120) for p, q in zip(prompts, params)]
        assert eng.cache.nbytes <= budget_mb * 2**20
        assert eng.cache.evictions > 0
    assert [_answer(r) for r in again] == [_answer(r) for r in out]


def test_cancel_frees_the_row_and_queue_bound(models):
    model = models("llama")
    with Engine(model, max_batch=1, max_queue=1) as eng:
        long = eng.submit([1, 2, 3], _params(0, max_tokens=100))
        events = long.events(timeout=60)
        next(events)  # the first token: the request holds the only row
        waiting = eng.submit([4, 5, 6], _params(1, max_tokens=2))
        with pytest.raises(QueueFull):
            eng.submit([7, 8], _params(2, max_tokens=2))
        long.cancel()
        rest = list(events)
        assert rest[-1].finish_reason == "abort" and len(rest) < 99
        toks, fin = waiting.result(60)
        assert fin.finish_reason == "length" and len(toks) == 2
        assert eng.stats()["running"] == 0


def test_stop_strings_and_tokens(models):
    model = models("llama")
    prompt = model.tokenizer.encode("Hello world! How are you")
    free = _run(model, [prompt], [_params(0, max_tokens=12, temperature=0.0)])[0][0]
    ids = [t.token for t in free[0]]
    # stop at the 4th token: it is not part of the answer
    stopped = _run(model, [prompt], [_params(0, max_tokens=12, temperature=0.0,
                                             stop_token_ids=(ids[3],))])[0][0]  # fmt: skip
    first = ids.index(ids[3])
    assert [t.token for t in stopped[0]] == ids[:first]
    assert stopped[1].finish_reason == "stop"
    text = free[1].text
    if len(text) > 3:  # a stop string cuts the text before it
        needle = text[2:4]
        cut = _run(model, [prompt], [_params(0, max_tokens=12, temperature=0.0,
                                             stop=(needle,))])[0][0]  # fmt: skip
        assert cut[1].text == text[: text.find(needle)] and cut[1].finish_reason == "stop"


def test_long_prompt_prefills_in_chunks_beside_decodes(models):
    """A long prompt is prefilled 8 tokens a step while a running request decodes each step."""
    model = models("mamba2")  # no position limit: a 120-token prompt
    order = []
    with Engine(model, max_batch=2, prefill_chunk=8, prefill_budget=8) as eng:
        short = eng.submit([5, 6, 7], _params(0, max_tokens=40), sink=lambda ev: order.append(
            ("short", ev)))  # fmt: skip
        while not order:
            time.sleep(0.001)
        eng.submit(list(range(1, 121)), _params(1, max_tokens=2),
                   sink=lambda ev: order.append(("long", ev)))  # fmt: skip
        while short.finished is None or len([o for o in order if o[0] == "long"]) < 3:
            time.sleep(0.001)
    first_long = next(i for i, (who, _) in enumerate(order) if who == "long")
    # 120 tokens / 8 per step = 15 steps before the long prompt's first token; the short
    # request got a token in (nearly) every one of them
    assert sum(1 for who, _ in order[:first_long] if who == "short") >= 14


class _Recorder:
    """The real model, noting per forward/step call the rows that decode and the prompt
    tokens carried beside them (read from the engine's rows at call time)."""

    def __init__(self, model, engine):
        self._model, self._engine, self.calls = model, engine, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _note(self, lens):
        decoding = [r for r, s in enumerate(self._engine._rows) if s is not None
                    and s.next_token is not None]  # fmt: skip
        prompt = int(sum(int(n) for r, n in enumerate(lens) if r not in decoding))
        self.calls.append((len(decoding), prompt))

    def forward(self, ids, state, *, lengths, logits):
        self._note(lengths)
        return self._model.forward(ids, state, lengths=lengths, logits=logits)

    def step(self, ids, state):
        self._note([1] * len(ids))
        return self._model.step(ids, state)


@pytest.mark.parametrize("ratio", [0.0, 1.0, 3.0])
def test_prefill_beside_decodes_is_bounded_by_the_ratio(models, ratio):
    """While rows decode, a step carries at most max(16, ratio * decoding rows) prompt tokens;
    with no row decoding, up to prefill_budget. The answers stay those of the requests alone."""
    from exactblocks.serve.engine import MIN_PREFILL_TOKENS

    model = models("mamba2")
    prompts = _prompts(6, seed=7, lo=2, hi=5) + _prompts(3, seed=8, lo=90, hi=130)
    params = [_params(i, max_tokens=24 if i < 6 else 3) for i in range(len(prompts))]
    kw = dict(max_batch=9, prefill_chunk=64, prefill_budget=128)
    eng = Engine(model, prefill_ratio=ratio, **kw)
    rec = eng.model = _Recorder(model, eng)
    with eng:
        short = [eng.submit(p, q) for p, q in zip(prompts[:6], params[:6])]
        while sum(s is not None and s.next_token is not None for s in eng._rows) < 6:
            time.sleep(0.001)  # the short ones decode: now the long prompts arrive
        long = [eng.submit(p, q) for p, q in zip(prompts[6:], params[6:])]
        got = [_answer(h.result(timeout=120)) for h in short + long]
    assert eng.prefill_allowance(0) == 128
    mixed = [(d, p) for d, p in rec.calls if d and p]
    assert mixed, rec.calls  # the long prompts were prefilled beside decodes

    def bound(d):
        return 128 if d == 0 else min(128, max(MIN_PREFILL_TOKENS, int(ratio * d)))

    assert all(p <= bound(d) for d, p in rec.calls), rec.calls
    assert any(p == bound(d) for d, p in mixed), rec.calls  # the bound is what limited them
    alone = [_answer(_run(model, [p], [q], **kw)[0][0]) for p, q in zip(prompts, params)]
    assert got == alone


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(prefill_ratio=-1.0), "prefill_ratio=-1.0 must be finite and >= 0"),
        (dict(prefill_ratio=float("nan")), "prefill_ratio=nan must be finite and >= 0"),
        (dict(prefill_budget=0), "prefill_budget=0 must be >= 1 or None"),
        (dict(sample_threads=0), "sample_threads=0 must be >= 1 or None"),
    ],
)
def test_engine_options_are_checked(models, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(models("mamba2"), **kw)
