"""Structured outputs through real HTTP on SmolLM2 with the official client: ``.parse()`` with a
pydantic model (streamed and not), ``json_object``, 16 concurrent constrained requests equal to
each alone, ``Model.generate`` equal to the server, and bad ``response_format`` refused with
OpenAI's error before anything is queued (docs/serving-api.md "Structured outputs")."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest
from helpers import ENDLESS_AFTER_A_CHOICE, ENDLESS_SCHEMAS, PERSON_SCHEMA
from pydantic import BaseModel, Field

pytest.importorskip("llguidance")

from exactblocks.models import Grammar  # noqa: E402

MESSAGES = [{"role": "user", "content": "Give a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


SCHEMA = PERSON_SCHEMA  # what Person's fields allow
SHORT = {  # a short answer: the 32 requests of the concurrency test stay quick
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": {
        "type": "object",
        "properties": {"pet": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                       "legs": {"enum": [2, 4]}},
        "required": ["pet", "legs"],
        "additionalProperties": False,
    }},
}  # fmt: skip
TEXT = {"type": "text"}  # unconstrained, said explicitly
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


def test_parse_returns_a_valid_object_for_every_seed(srv):
    client = srv.client()
    for seed in range(4):
        r = client.chat.completions.parse(model="smollm2", messages=MESSAGES,
                                          response_format=Person, seed=seed, temperature=0.9,
                                          max_tokens=32)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_streamed_parse_equals_the_whole_answer(srv):
    client = srv.client()
    for seed in range(4):
        kw = dict(model="smollm2", messages=MESSAGES, response_format=Person, seed=seed,
                  temperature=0.9, max_tokens=32)  # fmt: skip
        pieces = []
        with client.chat.completions.stream(**kw) as stream:
            for event in stream:
                if event.type == "content.delta":
                    pieces.append(event.delta)
            final = stream.get_final_completion()
        text = "".join(pieces)
        assert Person.model_validate_json(text) == final.choices[0].message.parsed
        assert text == client.chat.completions.parse(**kw).choices[0].message.content


def test_json_object_answers_parse(srv):
    client = srv.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": 'Give a JSON object with a key "city".'}],
            response_format={"type": "json_object"},
            seed=seed,
            temperature=0.7,
            max_tokens=48,
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # cut by max_tokens: still a prefix of a JSON object
            assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model="smollm2", prompt="The JSON for a cat:", max_tokens=40,
                                  extra_body={"response_format": {"type": "json_object"}},
                                  temperature=0.0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_16_concurrent_constrained_requests_equal_each_alone(srv):
    client = srv.client()

    def ask(seed):
        r = client.chat.completions.create(model="smollm2", messages=MESSAGES,
                                           response_format=SHORT if seed % 2 else TEXT,
                                           seed=seed, temperature=0.9, max_tokens=16,
                                           logprobs=True)  # fmt: skip
        c = r.choices[0]
        lps = np.asarray([t.logprob for t in c.logprobs.content], np.float32)
        return c.message.content, c.finish_reason, lps.view(np.uint32).tolist()

    seeds = list(range(100, 116))
    alone = [ask(s) for s in seeds]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, seeds))
    assert together == alone
    for (text, reason, _), seed in zip(alone, seeds):
        if seed % 2:  # constrained
            assert reason == "stop", text
            assert set(json.loads(text)) == {"pet", "legs"}


def test_generate_equals_the_server(srv):
    model = srv.engine.model
    ids = model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    r = srv.client().chat.completions.create(model="smollm2", messages=MESSAGES,
                                             response_format=FORMAT, seed=7, temperature=0.8,
                                             max_tokens=32, logprobs=True)  # fmt: skip
    out = model.generate(ids, max_new_tokens=32, temperature=0.8, seed=7, logprobs=True,
                         grammar=Grammar.json_schema(SCHEMA))  # fmt: skip
    c = r.choices[0]
    assert c.message.content == out.text and c.finish_reason == out.finish_reason == "stop"
    got = np.asarray([t.logprob for t in c.logprobs.content], np.float32).view(np.uint32)
    assert np.array_equal(got, np.asarray(out.logprobs, np.float32).view(np.uint32))
    assert [t.token for t in c.logprobs.content] == [model.tokenizer.decode([i]) for i in out.ids]


@pytest.mark.parametrize(
    "fmt, code, needle",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
         "invalid_value", "Invalid type: foo"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "unevaluatedProperties": False}}},
         "unsupported", "unevaluatedProperties"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "format": "no-such-format"}}},
         "unsupported", "Unknown format"),
        ({"type": "json_schema"}, "invalid_value", "json_schema.schema"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "invalid_value",
         "only read with type"),
        ({"type": "xml"}, "invalid_value", "response_format.type"),
    ],
)  # fmt: skip
def test_bad_response_format_is_refused_before_queueing(srv, fmt, code, needle):
    submitted = srv.metric("exactblocks_requests_submitted_total")
    body = {"model": "smollm2", "messages": MESSAGES, "response_format": fmt, "max_tokens": 4}
    status, _, err = srv.request("POST", "/v1/chat/completions", body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"].startswith("response_format")
    assert err["error"]["code"] == code and needle in err["error"]["message"], err
    assert srv.metric("exactblocks_requests_submitted_total") == submitted  # never queued
    # the server is undisturbed: a plain request right after is answered
    r = srv.client().chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_bad_schema_through_the_client_raises_bad_request(srv):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as info:
        srv.client().chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
        )  # fmt: skip
    assert info.value.body["param"] == "response_format"


def test_mask_cost_is_counted_per_constrained_token(srv):
    srv.wait_idle()
    masks = srv.metric("exactblocks_grammar_masks_total")
    seconds = srv.metric("exactblocks_grammar_mask_seconds_total")
    r = srv.client().chat.completions.create(model="smollm2", messages=MESSAGES,
                                             response_format=FORMAT, max_tokens=32,
                                             temperature=0.0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    srv.wait_idle()
    # one mask per token picked: the grammar ended the row, so no end token was picked
    assert srv.metric("exactblocks_grammar_masks_total") - masks == r.usage.completion_tokens
    assert srv.metric("exactblocks_grammar_mask_seconds_total") > seconds


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("which", sorted(ENDLESS_SCHEMAS))
def test_a_schema_no_value_satisfies_is_a_400_before_queueing(srv, which, stream):
    submitted = srv.metric("exactblocks_requests_submitted_total")
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 8, "stream": stream,
            "response_format": schema_format(ENDLESS_SCHEMAS[which])}  # fmt: skip
    status, _, err = srv.request("POST", "/v1/chat/completions", body)
    assert status == 400, err
    needle = {"required self-reference": "Too many items (limit 50000",
              "definition of itself": "NoExtensionBias"}[which]  # fmt: skip
    e = err["error"]
    assert e["param"] == "response_format" and e["code"] == "invalid_value", e
    assert e["message"].startswith("response_format: the grammar cannot start a generation")
    assert needle in e["message"] and "\n" not in e["message"] and "<state>" not in e["message"]
    assert srv.metric("exactblocks_requests_submitted_total") == submitted  # never queued


def test_a_grammar_past_its_limits_mid_generation_ends_its_row_only(srv):
    msg = (
        "the grammar exceeded llguidance's limits at token 2 of the generation: parser error: "
        "Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes"
    )
    deep = {
        "model": "smollm2",
        "messages": MESSAGES,
        "max_tokens": 8,
        "seed": 0,
        "temperature": 1.0,
        "response_format": schema_format(ENDLESS_AFTER_A_CHOICE),
    }
    ok = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 24, "seed": 1,
          "temperature": 0.9, "response_format": FORMAT}  # fmt: skip
    alone = srv.request("POST", "/v1/chat/completions", ok)[2]["choices"][0]["message"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(srv.request, "POST", "/v1/chat/completions", b)
                for b in (deep, ok, {**deep, "stream": True}, ok)]  # fmt: skip
        (s1, _, e1), (s2, _, r2), (s3, _, t3), (s4, _, r4) = [f.result() for f in futs]
    assert s1 == 500 and e1["error"]["message"] == msg, e1
    assert e1["error"]["type"] == "server_error"
    assert s3 == 200  # streamed: the status line went out first; the last event is the error
    events = sse_events(t3)
    assert events[-1]["error"]["message"] == msg and "[DONE]" not in t3, t3
    # the other rows, batched with the failing ones, are what they are alone
    assert s2 == s4 == 200
    assert r2["choices"][0]["message"] == r4["choices"][0]["message"] == alone
