"""A real server (uvicorn on a free loopback port) on the real model, SmolLM2-135M-Instruct,
called with the official ``openai`` client and raw HTTP: chat and completions, streamed and
not; 16 concurrent streams each equal to the same request alone (tokens and logprobs, bit for
bit); shared-prefix requests equal cold ones; a disconnecting client frees its row; a burst
beyond the queue gets 429 while every accepted request completes; a bounded load run."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import live_server, require

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Translate 'good morning' to Spanish.",
    "Name a planet with rings.",
    "What is the boiling point of water?",
    "Tell me a fun fact about cats.",
    "What language is spoken in Brazil?",
    "Suggest a name for a goldfish.",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Recommend a short book.",
]


def _chat(client, question, seed, max_tokens=8, stream=False, **kw):
    """One chat request; return (text, [(token, logprob, top)], finish_reason, usage)."""
    args = dict(model="smollm2", messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=seed, logprobs=True,
                top_logprobs=2, **kw)  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**args)
        c = r.choices[0]
        lps = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
               for t in c.logprobs.content]  # fmt: skip
        return c.message.content, lps, c.finish_reason, r.usage
    text, lps, finish, usage = "", [], None, None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                lps += [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                        for t in c.logprobs.content]  # fmt: skip
            finish = c.finish_reason or finish
    return text, lps, finish, usage


def test_models_health_metrics(srv):
    client = srv.client()
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert srv.request("GET", "/health")[:1] == (200,)
    status, headers, text = srv.request("GET", "/metrics")
    assert status == 200 and "exactblocks_running" in text
    assert headers["content-type"].startswith("text/plain")


def test_chat_and_completions_streamed_and_not(srv, smol):
    client = srv.client()
    text, lps, finish, usage = _chat(client, "What is the capital of France?", seed=1)
    s_text, s_lps, s_finish, s_usage = _chat(client, "What is the capital of France?", seed=1,
                                             stream=True)  # fmt: skip
    assert (s_text, s_lps, s_finish) == (text, lps, finish)
    assert finish in ("stop", "length") and len(lps) == usage.completion_tokens <= 8
    assert s_usage.prompt_tokens == usage.prompt_tokens and usage.total_tokens == (
        usage.prompt_tokens + usage.completion_tokens
    )
    # the same seed through Model.generate: the same tokens, so the same text
    ids = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True,
    )  # fmt: skip
    ref = smol.generate(ids, max_new_tokens=8, temperature=0.8, top_p=0.95, seed=1)
    assert text == ref.text

    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a word in Greek."}],
        max_tokens=8, seed=2, logprobs=True,
    )  # fmt: skip
    raw = b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content)
    assert raw.decode("utf-8", "replace") == r.choices[0].message.content  # the tokens' bytes

    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=6, temperature=0.0, logprobs=2)  # fmt: skip
    c = r.choices[0]
    greedy = smol.generate("The capital of France is", max_new_tokens=6)
    assert c.text == greedy.text and len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
    pieces = [
        ch.choices[0].text
        for ch in client.completions.create(model="smollm2", prompt="The capital of France is",
                                            max_tokens=6, temperature=0.0, stream=True)
    ]  # fmt: skip
    assert "".join(pieces) == c.text


def test_sixteen_concurrent_streams_equal_alone(srv):
    client = srv.client()
    alone = [_chat(client, q, seed=i, stream=True)[:3] for i, q in enumerate(QUESTIONS)]
    srv.wait_idle()
    barrier = threading.Barrier(len(QUESTIONS))

    def one(i):
        barrier.wait()
        return _chat(srv.client(), QUESTIONS[i], seed=i, stream=True)[:3]

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(one, range(len(QUESTIONS))))
    for i in range(len(QUESTIONS)):
        assert together[i] == alone[i], QUESTIONS[i]


def test_shared_prefix_equals_cold(srv, smol):
    doc = (
        "The old lighthouse on the northern cliff had not been lit for nearly forty years, yet "
        "the people of the village still climbed the narrow path to it every spring. They "
        "carried brushes, buckets of white paint and baskets of bread, and they spent a long "
        "afternoon scraping salt from the iron railings and repainting the tower walls."
    )
    asks = ["Summarise the text.", "Who climbs the path?", "What do they carry?"]
    client = srv.client()
    warm = []
    for i, ask in enumerate(asks):
        warm.append(_chat(client, f"{doc}\n\n{ask}", seed=7 + i, max_tokens=6))
    cached = [w[3].prompt_tokens_details.cached_tokens for w in warm]
    assert cached[1] >= 64 and cached[2] >= 64, cached  # the document's boundaries were reused
    with live_server(smol, max_batch=1, max_tokens_per_sequence=512, prefix_cache_mb=0) as cold:
        for i, ask in enumerate(asks):
            got = _chat(cold.client(), f"{doc}\n\n{ask}", seed=7 + i, max_tokens=6)
            assert got[:3] == warm[i][:3] and got[3].prompt_tokens_details.cached_tokens == 0


def test_disconnect_mid_stream_frees_the_row(srv):
    aborted = srv.metric("exactblocks_requests_abort_total")
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
            "temperature": 0.0}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first token arrived
    assert srv.engine.stats()["running"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    srv.wait_idle(timeout=30)  # far less than 400 tokens' time
    assert srv.metric("exactblocks_requests_abort_total") == aborted + 1
    r = srv.client().completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_burst_beyond_the_queue_gets_429(smol):
    openai = require("openai", "the tests call the server with the official client")
    with live_server(smol, max_batch=2, max_queue=2, max_tokens_per_sequence=256) as small:
        results = []

        def one(i):
            try:
                r = small.client().completions.create(
                    model="smollm2", prompt=f"Count to {i}:", max_tokens=4, seed=i
                )
                return ("ok", r.choices[0].finish_reason)
            except openai.RateLimitError as exc:
                return ("429", exc.response.headers.get("retry-after"), exc.body)

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        ok = [r for r in results if r[0] == "ok"]
        limited = [r for r in results if r[0] == "429"]
        assert len(ok) + len(limited) == 12
        assert limited and ok, results
        assert all(r[1] in ("stop", "length") for r in ok)
        assert all(r[1] == "1" and r[2]["code"] == "queue_full" for r in limited)
        small.wait_idle()


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_load_run_zero_errors_zero_mismatches(srv):
    """100 short streaming requests from 16 clients; every answer equals its reference."""
    client = srv.client()
    cases = [(QUESTIONS[i], 1000 + i) for i in range(12)]
    refs = {c: _chat(client, c[0], seed=c[1], max_tokens=4)[:3] for c in cases}
    srv.wait_idle()
    jobs = [cases[i % len(cases)] for i in range(100)]
    ttft, per_token, errors, mismatches, n_tokens = [], [], [], 0, 0
    lock = threading.Lock()

    def one(case):
        nonlocal mismatches, n_tokens
        t0 = time.perf_counter()
        stamps = []
        try:
            text, lps, finish = "", [], None
            stream = srv.client().chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": case[0]}],
                max_tokens=4, temperature=0.8, top_p=0.95, seed=case[1], logprobs=True,
                top_logprobs=2, stream=True,
            )  # fmt: skip
            for chunk in stream:
                for c in chunk.choices:
                    if c.logprobs is not None:
                        stamps.append(time.perf_counter())
                        lps += [(t.token, t.logprob, [(a.token, a.logprob)
                                                      for a in t.top_logprobs])
                                for t in c.logprobs.content]  # fmt: skip
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
        except Exception as exc:  # counted, then asserted on
            with lock:
                errors.append(repr(exc))
            return
        with lock:
            n_tokens += len(lps)
            mismatches += (text, lps, finish) != refs[case]
            if stamps:
                ttft.append(stamps[0] - t0)
                per_token.extend(b - a for a, b in zip(stamps, stamps[1:]))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    print(
        f"\nload run: {len(jobs)} requests, 16 clients, {n_tokens} tokens in {wall:.1f} s = "
        f"{n_tokens / wall:.1f} tokens/s; time to first token p50 "
        f"{statistics.median(ttft) * 1e3:.0f} ms p99 {_percentile(ttft, 0.99) * 1e3:.0f} ms; "
        f"per-token p50 {statistics.median(per_token) * 1e3:.0f} ms p99 "
        f"{_percentile(per_token, 0.99) * 1e3:.0f} ms"
    )
    assert errors == [] and mismatches == 0
