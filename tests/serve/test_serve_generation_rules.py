"""The server's side of the shared generation rules, through real HTTP on SmolLM2: OpenAI's
``max_tokens`` default, logprobs that agree with a stop-cut text, byte tokens spelled
``bytes:\\x..``, top_k, a too-long text refused before it is tokenized, ``HEAD /health`` and
``GET /v1/models/{id}``."""

from __future__ import annotations

import threading

import pytest
from serve_helpers import live_server

import exactblocks
from exactblocks.serve.api import token_text


def test_completions_default_to_16_tokens(srv):
    r = srv.client().completions.create(
        model="smollm2", prompt="Once upon a time", temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_until_stop(srv):
    r = srv.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], temperature=0.0
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0


def test_logprobs_drop_the_stop_strings_tokens(srv):
    client = srv.client()
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=12,
              temperature=0.0, logprobs=1)  # fmt: skip
    free = client.completions.create(**kw).choices[0]
    text = free.text
    assert len(text) > 6
    needle = text[4:7]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(stream=True, stop=needle, **kw))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens, offsets = [], []
            for c in chunks:
                if c.choices and c.choices[0].logprobs is not None:
                    tokens += c.choices[0].logprobs.tokens
                    offsets += c.choices[0].logprobs.text_offset
        else:
            c = client.completions.create(stop=needle, **kw).choices[0]
            got, tokens, offsets = c.text, c.logprobs.tokens, c.logprobs.text_offset
        assert got == text[: text.find(needle)]
        # every reported token starts inside the returned text; the stop's tokens are gone
        assert tokens and all(o < max(len(got), 1) for o in offsets), (tokens, offsets, got)
        assert len(tokens) < len(free.logprobs.tokens)
        assert tokens == free.logprobs.tokens[: len(tokens)]
        assert offsets == free.logprobs.text_offset[: len(tokens)]
        assert "".join(tokens).startswith(got)


def test_partial_utf8_tokens_are_spelled_by_their_bytes(smol):
    tok = smol.tokenizer
    lead = [i for i in range(smol.vocab_size) if tok.id_to_token(i) in ("â", "ð")]
    assert len(lead) == 2
    spelled = {token_text(tok, i) for i in lead}
    assert spelled == {"bytes:\\xe2", "bytes:\\xf0"}  # distinct keys, never two "\ufffd"
    assert token_text(tok, tok.encode("Hello", add_special_tokens=False)[0]) == "Hello"


def test_top_k_is_a_sampling_option(srv):
    client = srv.client()
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=6, temperature=1.5,
              seed=3)  # fmt: skip
    one = client.completions.create(extra_body={"top_k": 1}, **kw).choices[0].text
    greedy = client.completions.create(model="smollm2", prompt="Once upon a time",
                                       max_tokens=6, temperature=0.0).choices[0].text  # fmt: skip
    assert one == greedy  # top_k=1 keeps the argmax alone (no ties here)
    status, _, body = srv.request("POST", "/v1/completions",
                                  {"model": "smollm2", "prompt": "x", "top_k": 0})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "top_k"


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(srv):
    huge = "word " * 600_000  # 3 MB: at least 37k tokens for a 512-token server
    body = {"model": "smollm2", "prompt": huge, "max_tokens": 2}
    status, _, body = srv.request("POST", "/v1/completions", body)
    assert status == 400, body
    err = body["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "bytes of text" in err["message"]  # the cheap bound refused it, not a tokenization
    msgs = [{"role": "user", "content": huge}]
    status, _, body = srv.request("POST", "/v1/chat/completions",
                                  {"model": "smollm2", "messages": msgs})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "messages"
    # a prompt that fits is still answered
    r = srv.client().completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_head_health_and_one_model(srv):
    status, _, _ = srv.request("HEAD", "/health")
    assert status == 200
    status, _, body = srv.request("GET", "/v1/models/smollm2")
    assert status == 200 and body["id"] == "smollm2" and body["object"] == "model"
    assert srv.client().models.retrieve("smollm2").id == "smollm2"
    status, _, body = srv.request("GET", "/v1/models/nope")
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


@pytest.mark.parametrize("stop", ["answer", ["answer"]])
def test_a_str_stop_is_one_string_on_the_server(srv, stop):
    status, _, body = srv.request("POST", "/v1/completions",
                                  {"model": "smollm2", "prompt": "Hi", "max_tokens": 3,
                                   "temperature": 0.0, "stop": stop})  # fmt: skip
    assert status == 200, body


class _RecordingTokenizer:
    """The model's tokenizer, noting the thread of each encode and chat-template render."""

    def __init__(self, tok):
        self._tok = tok
        self.threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return self._tok.encode(*args, **kw)

    def apply_chat_template(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return self._tok.apply_chat_template(*args, **kw)


def test_prompts_are_tokenized_off_the_event_loop():
    from exactblocks.loaders.gguf import default_smollm2_path

    model = exactblocks.load_model(default_smollm2_path())  # its own: the tokenizer is wrapped
    rec = model.tokenizer = _RecordingTokenizer(model.tokenizer)
    with live_server(model, max_batch=1, max_tokens_per_sequence=128) as srv:
        client = srv.client()
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=1)
        client.chat.completions.create(model="smollm2", max_tokens=1,
                                       messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert len(rec.threads) == 2
    assert all(name.startswith("exactblocks-tokenize") for name in rec.threads), rec.threads
