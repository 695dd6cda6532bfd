"""Echo and prompt logprobs, batched prompts, ``n > 1``, embeddings and the vLLM gauges of a real
server on loopback, called with raw HTTP and the official ``openai`` client.

Bitwise claims are checked on the float32 bits (``view(np.uint32)``): the values of the JSON
floats the server sends are float32 values, so they convert back exactly.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from serve_helpers import live_server

from exactblocks.sampling import logprobs as lib_logprobs

PROMPT = "The capital of France is Paris. The capital of Italy is"


def f32(values) -> np.ndarray:
    """JSON numbers (None kept out) as float32 bits."""
    return np.asarray(values, np.float32).view(np.uint32)


def complete(srv, **body):
    status, _, out = srv.request("POST", "/v1/completions", {"model": "smollm2", **body})
    assert status == 200, out
    return out


def oracle_prompt_logprobs(model, ids, k):
    """Prompt logprobs in-process: ``Model.forward`` logits of every position, the library's
    float32 log-softmax (``exactblocks.sampling.logprobs``)."""
    logits = model.forward(np.asarray([ids], np.int64))[0]
    lps, tops = [None], [None]
    for t in range(1, len(ids)):
        lp, top = lib_logprobs(logits[t - 1], ids[t], k)
        lps.append(float(lp))
        tops.append([(i, float(v)) for i, v in top or []])
    return lps, tops


def test_echo_logprobs_match_forward_and_text(srv, smol):
    tok = smol.tokenizer
    ids = list(tok.encode(PROMPT))
    out = complete(srv, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    # offsets index the echoed text: each token's text starts there
    for t, off in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][off : off + len(t)] == t
    want, tops = oracle_prompt_logprobs(smol, ids, 2)
    np.testing.assert_array_equal(f32(lp["token_logprobs"][1:]), f32(want[1:]))
    for got, top in zip(lp["top_logprobs"][1:], tops[1:]):
        assert list(got) == [tok.decode([i]) for i, _ in top]
        np.testing.assert_array_equal(f32(list(got.values())), f32([v for _, v in top]))


def test_prompt_logprobs_alone_batch_chunked_and_cached(smol, monkeypatch):
    """The same bits alone, in a batch of 5 (ids and text prompts mixed in order), with
    another chunk size, and after the prompt is in the prefix cache."""
    tok = smol.tokenizer
    texts = [
        PROMPT,
        "Hello there, how are you today?",
        "1 2 3 4 5 6 7 8 9 10 11 12",
        "def f(x):\n    return x * 2",
        PROMPT + " Rome.",
    ]
    id_lists = [list(tok.encode(t)) for t in texts]
    with live_server(smol, max_batch=4, max_tokens_per_sequence=256, prefill_chunk=8) as s:
        alone = [
            complete(s, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
            for ids in id_lists
        ]
        batch = complete(s, prompt=id_lists, echo=True, logprobs=1, max_tokens=1, temperature=0)
        cached_before = s.metric("exactblocks_prefix_cache_hits_total")
        complete(s, prompt=id_lists[0], max_tokens=1)  # a plain request: a prefix-cache hit
        assert s.metric("exactblocks_prefix_cache_hits_total") > cached_before
        again = complete(s, prompt=id_lists[0], echo=True, logprobs=1, max_tokens=1, temperature=0)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # scores restored
        # PROMPT + " Rome." shares PROMPT's scored prefix: restored, then computed on
        hit = complete(s, prompt=id_lists[4], echo=True, logprobs=1, max_tokens=1, temperature=0)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        full = complete(s, prompt=id_lists[0], echo=True, logprobs=0, max_tokens=0)
        assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == len(id_lists[0])
        assert full["usage"]["completion_tokens"] == 0 and full["choices"][0]["text"] == texts[0]
    with live_server(smol, max_batch=2, max_tokens_per_sequence=256, prefill_chunk=64) as s:
        other = complete(s, prompt=texts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    # scored rows cut to 3 logits positions a step: other chunk splits, the same bits
    from exactblocks.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "SCORED_LOGITS_BYTES", 3 * 4 * smol.vocab_size)
    with live_server(smol, max_batch=3, max_tokens_per_sequence=256, prefill_chunk=16) as s:
        cut = complete(s, prompt=texts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c["index"] for c in batch["choices"]] == list(range(5))
    for i, ids in enumerate(id_lists):
        ref = alone[i]["choices"][0]["logprobs"]
        assert len(ref["tokens"]) == len(ids) + 1  # the prompt, then the new token
        want, _ = oracle_prompt_logprobs(smol, ids, 1)
        np.testing.assert_array_equal(f32(ref["token_logprobs"][1 : len(ids)]), f32(want[1:]))
        for res in (batch["choices"][i], other["choices"][i], cut["choices"][i]):
            assert res["logprobs"]["tokens"] == ref["tokens"]
            np.testing.assert_array_equal(
                f32(res["logprobs"]["token_logprobs"][1:]), f32(ref["token_logprobs"][1:])
            )
            assert res["text"] == alone[i]["choices"][0]["text"]
    lp = full["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None and all(d == {} for d in lp["top_logprobs"][1:])
    np.testing.assert_array_equal(
        f32(lp["token_logprobs"][1:]),
        f32(alone[0]["choices"][0]["logprobs"]["token_logprobs"][1 : len(id_lists[0])]),
    )
    got = hit["choices"][0]["logprobs"]
    ref = alone[4]["choices"][0]["logprobs"]
    assert got["tokens"] == ref["tokens"] and got["top_logprobs"] == ref["top_logprobs"]
    np.testing.assert_array_equal(f32(got["token_logprobs"][1:]), f32(ref["token_logprobs"][1:]))
    got = again["choices"][0]["logprobs"]["token_logprobs"]
    np.testing.assert_array_equal(
        f32(got[1:]), f32(alone[0]["choices"][0]["logprobs"]["token_logprobs"][1:])
    )


def test_openai_client_echo_and_n(srv):
    client = srv.client()
    out = client.completions.create(
        model="smollm2", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0
    )
    (c,) = out.choices
    assert c.text.startswith(PROMPT) and c.logprobs.token_logprobs[0] is None
    assert len(c.logprobs.tokens) == len(c.logprobs.text_offset) == len(c.logprobs.top_logprobs)
    # n=3 with a seed: choice j is the request with seed + j, alone
    many = client.completions.create(
        model="smollm2", prompt=PROMPT, n=3, seed=7, max_tokens=8, temperature=1.0
    )
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    for j, ch in enumerate(many.choices):
        one = client.completions.create(
            model="smollm2", prompt=PROMPT, seed=7 + j, max_tokens=8, temperature=1.0
        )
        assert ch.text == one.choices[0].text
    assert len({ch.text for ch in many.choices}) > 1
    # streamed: the same texts, per index
    texts = ["", "", ""]
    for chunk in client.completions.create(
        model="smollm2", prompt=PROMPT, n=3, seed=7, max_tokens=8, temperature=1.0, stream=True
    ):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in many.choices]
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hi"}],
        n=2,
        seed=3,
        max_tokens=6,
        temperature=1.0,
    )
    assert [ch.index for ch in chat.choices] == [0, 1]
    for j, ch in enumerate(chat.choices):
        one = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Say hi"}],
            seed=3 + j,
            max_tokens=6,
            temperature=1.0,
        )
        assert ch.message.content == one.choices[0].message.content
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    streamed = ["", ""]
    for chunk in client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hi"}],
        n=2,
        seed=3,
        max_tokens=6,
        temperature=1.0,
        stream=True,
    ):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [ch.message.content for ch in chat.choices]


def test_embeddings_float_base64_and_batch_invariant(srv, smol):
    tok = smol.tokenizer
    texts = ["exact embeddings", "a vector index that is reproducible", "x"]
    client = srv.client()
    floats = client.embeddings.create(model="smollm2", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="smollm2", input=texts)  # the client asks for base64
    assert floats.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    for i, text in enumerate(texts):
        ids = list(tok.encode(text))
        hidden = smol.hidden_states(np.asarray([ids], np.int64))[0]
        want = hidden[len(ids) - 1]
        np.testing.assert_array_equal(f32(floats.data[i].embedding), want.view(np.uint32))
        np.testing.assert_array_equal(f32(b64.data[i].embedding), want.view(np.uint32))
        status, _, alone = srv.request(
            "POST",
            "/v1/embeddings",
            {"model": "smollm2", "input": ids, "pooling": "mean", "encoding_format": "base64"},
        )
        assert status == 200, alone
        raw = np.frombuffer(base64.b64decode(alone["data"][0]["embedding"]), "<f4")
        acc = np.zeros(hidden.shape[1], np.float64)
        for t in range(len(ids)):
            acc += hidden[t]
        np.testing.assert_array_equal(
            raw.view(np.uint32), (acc / len(ids)).astype(np.float32).view(np.uint32)
        )
    status, _, batch = srv.request(
        "POST",
        "/v1/embeddings",
        {"model": "smollm2", "input": [list(tok.encode(t)) for t in texts], "pooling": "mean"},
    )
    assert status == 200, batch
    for i, text in enumerate(texts):
        status, _, one = srv.request(
            "POST", "/v1/embeddings", {"model": "smollm2", "input": text, "pooling": "mean"}
        )
        np.testing.assert_array_equal(
            f32(batch["data"][i]["embedding"]), f32(one["data"][0]["embedding"])
        )


def test_vllm_gauges(srv):
    status, _, text = srv.request("GET", "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:gpu_cache_usage_perc",
    ):
        assert values[name + '{model_name="smollm2"}'] == 0.0
        assert f"# TYPE {name} gauge" in text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        (
            "/v1/completions",
            {"prompt": [1, 2, 3], "echo": True, "logprobs": 1, "max_tokens": 510},
            "max_tokens",
        ),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt.1"),
        ("/v1/embeddings", {"input": "hi", "pooling": "cls"}, "pooling"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
    ],
)
def test_bad_input_is_refused_and_harmless(srv, path, body, param):
    base = complete(srv, prompt=PROMPT, max_tokens=4, temperature=0)
    status, _, out = srv.request("POST", path, {"model": "smollm2", **body})
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    assert out["error"]["message"]
    after = complete(srv, prompt=PROMPT, max_tokens=4, temperature=0)
    assert after["choices"][0]["text"] == base["choices"][0]["text"]


def test_streamed_echo_and_stop_token_logprobs(srv, smol):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0}
    whole = complete(srv, **body)["choices"][0]
    client = srv.client()
    text, tokens, lps = "", [], []
    for chunk in client.completions.create(model="smollm2", stream=True, **body):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert lps[0] is None and whole["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_array_equal(f32(lps[1:]), f32(whole["logprobs"]["token_logprobs"][1:]))
    # a completion ended by the end token lists it last (lm-eval drops the last entry)
    tok = smol.tokenizer
    ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": "Say yes."}], add_generation_prompt=True, tokenize=True
        )
    )
    ids += list(tok.encode("Yes."))
    logits = smol.forward(np.asarray([ids], np.int64))[0, -1]
    eos = int(np.argmax(logits))
    assert eos in smol.eos_token_ids  # greedy, the model ends its answer here
    out = complete(srv, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
    assert ch["text"] == tok.decode(ids)  # the stop token's text is not in the text
    assert len(ch["logprobs"]["tokens"]) == len(ids) + 1
    assert ch["logprobs"]["tokens"][-1] == tok.decode([eos])
    assert ch["logprobs"]["text_offset"][-1] == len(ch["text"])
    want, _ = lib_logprobs(logits, eos, 1)
    np.testing.assert_array_equal(f32(ch["logprobs"]["token_logprobs"][-1:]), f32([want]))


@pytest.mark.parametrize("family", ["mamba2", "mistral"])
def test_prompt_logprobs_of_a_recurrent_and_a_windowed_model(family, tmp_path):
    """A Mamba-2 state and a sliding-window ring: the same bits alone, batched, with small
    chunks, and after the prompts are cached, equal to ``Model.forward``."""
    from serve_helpers import tiny_model

    model = tiny_model(family, tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (5, 13, 9)]
    with live_server(model, model_name="smollm2", max_batch=2, max_tokens_per_sequence=32,
                     prefill_chunk=4) as s:  # fmt: skip
        body = {"echo": True, "logprobs": 2, "max_tokens": 0}
        batch = complete(s, prompt=prompts, **body)
        for ids in prompts:
            complete(s, prompt=ids, max_tokens=1)  # now cached
        for i, ids in enumerate(prompts):
            alone = complete(s, prompt=ids, **body)["choices"][0]["logprobs"]
            want, tops = oracle_prompt_logprobs(model, ids, 2)
            got = batch["choices"][i]["logprobs"]
            assert got["tokens"] == alone["tokens"] == [str(t) for t in ids]
            for lp in (got, alone):
                np.testing.assert_array_equal(f32(lp["token_logprobs"][1:]), f32(want[1:]))
                assert [list(d) for d in lp["top_logprobs"][1:]] == [
                    [str(t) for t, _ in top] for top in tops[1:]
                ]
