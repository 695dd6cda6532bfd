"""Tool calls on a real server, called with the official ``openai`` client and langchain-openai.

SmolLM2-135M-Instruct's own template renders no tools: on it, tools are refused (400 naming
``tools``) and nothing else is disturbed. For a template that does render them the server runs
SmolLM2's weights and tokenizer with ``chat_template=`` the Hermes / Qwen-format template of
``data/hermes_tools.jinja`` (what ``exactblocks serve --chat-template FILE`` passes). A 135M
model does not call tools by itself, so the end-to-end calls use ``tool_choice`` "required" or
a named function: the answer is constrained to the template's ``<tool_call>`` syntax and the
tool's parameter schema, so even this model writes a valid call.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys

import pytest
from helpers import ENDLESS_SCHEMAS
from serve_helpers import live_server, require

from exactblocks.serve.tools import _schema_problem

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "data", "hermes_tools.jinja"), encoding="utf-8") as f:
    HERMES = f.read()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tsrv(smol):
    """A server on SmolLM2 with the Hermes-format template (tools rendered, parser detected)."""
    with live_server(smol, max_batch=8, max_tokens_per_sequence=512, chat_template=HERMES) as s:
        yield s


def chat(s, **kw):
    kw.setdefault("model", "smollm2")
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 48)
    return s.client().chat.completions.create(**kw)


def streamed(s, **kw) -> dict:
    """A streamed answer put together as a client does: content, calls by index, reason."""
    content, calls, reason, roles = "", {}, None, []
    for ch in chat(s, stream=True, **kw):
        (c,) = ch.choices
        d = c.delta
        roles += [d.role] if d.role else []
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "an id is sent once, in the call's first delta"
                slot["id"] = tc.id
                assert tc.type == "function"
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        reason = c.finish_reason or reason
    assert roles == ["assistant"]
    return {"content": content or None, "calls": [calls[k] for k in sorted(calls)],
            "reason": reason}  # fmt: skip


def whole(r) -> dict:
    (c,) = r.choices
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
             for t in c.message.tool_calls or []]  # fmt: skip
    return {"content": c.message.content, "calls": calls, "reason": c.finish_reason}


# -- the template without tools: refused, nothing disturbed ------------------------------------
def test_tools_on_a_template_without_tools_are_refused(srv):
    openai = require("openai", "the official client")
    before = chat(srv, seed=3, temperature=0.8).choices[0].message.content
    submitted = srv.engine.stats().get("requests_submitted", 0)
    for choice in (None, "auto", "required", NAMED):
        kw = {} if choice is None else {"tool_choice": choice}
        with pytest.raises(openai.BadRequestError) as exc:
            chat(srv, tools=[WEATHER], **kw)
        err = exc.value.body
        assert exc.value.status_code == 400
        assert err["param"] == "tools" and err["code"] == "tools_unsupported", err
        assert "does not render the `tools` variable" in err["message"]
        assert err["type"] == "invalid_request_error"
    assert srv.engine.stats().get("requests_submitted", 0) == submitted  # refused before queueing
    assert chat(srv, seed=3, temperature=0.8).choices[0].message.content == before


# -- bad input on the template with tools: before any work -----------------------------------
BAD = [
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("empty tools", {"tools": []}, "tools"),
    (
        "unknown named function",
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_stock"}},
        },
        "tool_choice",
    ),  # fmt: skip
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    (
        "parameters not an object schema",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools.0.function.parameters",
    ),  # fmt: skip
    (
        "parameters not a JSON Schema",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": 5}}},
                    },
                }
            ]
        },
        "tools.0.function.parameters",
    ),  # fmt: skip
    (
        "bad tool name",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
    ),
    ("bad tool_choice", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    (
        "call arguments not JSON",
        {
            "tools": [WEATHER],
            "messages": ASK
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{city: Paris"},
                        }
                    ],
                }
            ],
        },
        "messages.1.tool_calls.0.function.arguments",
    ),  # fmt: skip
    (
        "tool message without id",
        {"tools": [WEATHER], "messages": ASK + [{"role": "tool", "content": "sunny"}]},
        "messages.1.tool_call_id",
    ),  # fmt: skip
    (
        "null content on a user message",
        {"messages": [{"role": "user", "content": None}]},
        "messages.0.content",
    ),
]


@pytest.mark.parametrize("name, extra, param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_input_is_an_openai_error_before_queueing(tsrv, name, extra, param):
    submitted = tsrv.engine.stats().get("requests_submitted", 0)
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, **extra}
    status, _, payload = tsrv.request("POST", "/v1/chat/completions", body)
    assert status == 400, payload
    err = payload["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    assert tsrv.engine.stats().get("requests_submitted", 0) == submitted


# -- calls end to end ----------------------------------------------------------------------------
def test_named_function_gives_a_valid_call_streamed_or_not(tsrv):
    for kw in ({"tool_choice": NAMED}, {"tool_choice": "required", "parallel_tool_calls": False}):
        got = whole(chat(tsrv, tools=[WEATHER, TIME], temperature=0, **kw))
        assert got["reason"] == "tool_calls" and got["content"] is None, got
        (call,) = got["calls"]
        assert call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        assert call["id"].startswith("call_") and len(call["id"]) == 29
        assert streamed(tsrv, tools=[WEATHER, TIME], temperature=0, **kw) == got
    # the id is a function of the request and the answer: the same request, the same id
    again = whole(chat(tsrv, tools=[WEATHER, TIME], temperature=0, tool_choice=NAMED))
    assert again == whole(chat(tsrv, tools=[WEATHER, TIME], temperature=0, tool_choice=NAMED))


def test_a_named_enum_argument_follows_the_schema(tsrv):
    named = {"type": "function", "function": {"name": "get_time"}}
    got = whole(chat(tsrv, tools=[WEATHER, TIME], temperature=0.9, seed=11, tool_choice=named))
    (call,) = got["calls"]
    assert call["name"] == "get_time"
    assert json.loads(call["arguments"])["zone"] in ("UTC", "CET", "PST")


def test_auto_and_none_answer_plain_text_alike(tsrv):
    # the tiny model answers in prose: auto reads no call, and none does not read at all;
    # both render the tools, so the texts are the same tokens
    auto = whole(chat(tsrv, tools=[WEATHER], temperature=0, max_tokens=24))
    none = whole(chat(tsrv, tools=[WEATHER], temperature=0, max_tokens=24, tool_choice="none"))
    assert auto == none and auto["calls"] == [] and auto["content"]
    assert "<tool_call>" not in auto["content"]
    assert streamed(tsrv, tools=[WEATHER], temperature=0, max_tokens=24) == auto
    plain = whole(chat(tsrv, temperature=0, max_tokens=24))  # no tools: another prompt
    assert plain["content"] != auto["content"]


def test_history_with_calls_and_results_is_rendered_by_the_template(tsrv, smol):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
         "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "c": 21}'},
    ]  # fmt: skip
    got = chat(tsrv, messages=history, tools=[WEATHER], temperature=0, max_tokens=16)
    # what the template gets: the arguments as a JSON object, null content as ""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    as_given = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [call]}, history[2]]
    rendered = smol.tokenizer.apply_chat_template(
        as_given, add_generation_prompt=True, tools=[WEATHER], chat_template=HERMES
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\n" + history[2]["content"] in rendered
    plain = tsrv.client().completions.create(model="smollm2", prompt=rendered, max_tokens=16,
                                             temperature=0)  # fmt: skip
    assert got.choices[0].message.content == plain.choices[0].text
    assert got.usage.prompt_tokens == len(smol.tokenizer.encode(rendered, add_special_tokens=False))


# -- bit for bit under load ------------------------------------------------------------------
def test_tool_answers_alone_equal_answers_among_16(tsrv):
    """16 requests at once (tool calls constrained and not, streamed and not, sampled with
    seeds, with logprobs) each equal the same request alone: calls, ids, content, logprob
    bits."""

    choices = [NAMED, "required", "auto", {"type": "function", "function": {"name": "get_time"}}]

    def one(i):
        choice = choices[i % 4]
        kw = {"tools": [WEATHER, TIME], "temperature": 0.7, "seed": 100 + i,
              "tool_choice": choice, "parallel_tool_calls": False,
              "max_tokens": 16 if choice == "auto" else 48}  # fmt: skip
        if i % 2:
            return streamed(tsrv, **kw)
        r = chat(tsrv, logprobs=True, **kw)
        lps = [t.logprob for t in r.choices[0].logprobs.content]
        return {**whole(r), "logprobs": lps}

    alone = [one(i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, range(16)))
    assert together == alone
    for i, a in enumerate(alone):  # constrained: a call each; auto: this model's prose
        assert bool(a["calls"]) == (choices[i % 4] != "auto"), (i, a)


# -- a third-party client ------------------------------------------------------------------------
def test_langchain_bind_tools_invoke_and_stream(tsrv):
    require("langchain_openai", "langchain-openai is the third-party client")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(base_url=tsrv.url + "/v1", api_key="none", model="smollm2", temperature=0,
                     max_tokens=48, max_retries=0)  # fmt: skip
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    msg = bound.invoke("What is the weather in Paris?")
    assert isinstance(msg, AIMessage)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    assert call["id"].startswith("call_")
    chunks = list(bound.stream("What is the weather in Paris?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.tool_calls == msg.tool_calls
    # the call's result goes back as a tool message; the model then answers in prose
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather]).invoke(
        [HumanMessage("What is the weather in Paris?"), msg, result]
    )
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


# -- the other syntaxes, end to end ------------------------------------------------------------
@pytest.mark.parametrize("parser", ["llama3_json", "granite"])
def test_tool_call_parser_flag_constrains_and_reads_that_syntax(smol, parser):
    # the Hermes-format template renders the tools; --tool-call-parser picks the syntax the
    # answer is constrained to and read in
    with live_server(smol, max_batch=2, max_tokens_per_sequence=512, chat_template=HERMES,
                     tool_call_parser=parser) as s:  # fmt: skip
        r = chat(s, tools=[WEATHER, TIME], temperature=0, tool_choice=NAMED, logprobs=True)
        text = "".join(t.token for t in r.choices[0].logprobs.content)
        if parser == "llama3_json":
            assert text.startswith('{"name": "get_weather", "parameters": {"city": ')
        else:
            assert text.startswith('<|tool_call|>[{"name": "get_weather", "arguments": {')
        got = whole(r)
        (call,) = got["calls"]
        assert call["name"] == "get_weather" and got["reason"] == "tool_calls"
        assert set(json.loads(call["arguments"])) == {"city"}
        assert streamed(s, tools=[WEATHER, TIME], temperature=0, tool_choice=NAMED) == got


def test_a_template_reading_xml_tools_renders_them(smol):
    from exactblocks.serve.tools import ToolSupport

    # SmolLM3's template reads the tools from `xml_tools`; detected as "smollm3", the server
    # passes them under that name too
    xml = (
        "{% for t in xml_tools or [] %}{{ t | tojson }}{% endfor %}"
        "<tool_call>{{ messages[0].content }}"
    )
    support = ToolSupport(smol.tokenizer, xml)
    assert support.parser == "smollm3" and support.renders()
    assert not ToolSupport(smol.tokenizer, xml, "hermes").renders()  # `tools` alone: unseen
    assert not ToolSupport(smol.tokenizer).renders()  # SmolLM2's own template
    assert ToolSupport(smol.tokenizer).parser is None


# -- a tool's parameters that llguidance refuses, or that no value satisfies ------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "schema, code, needle",
    [
        (ENDLESS_SCHEMAS["required self-reference"], "invalid_value",
         "the grammar cannot start a generation: parser error: Too many items (limit 50000"),
        (ENDLESS_SCHEMAS["definition of itself"], "invalid_value",
         "the grammar cannot start a generation: NoExtensionBias"),
        ({"type": "object", "unevaluatedProperties": False}, "unsupported",
         'the JSON schema is invalid or unsupported: Unimplemented keys: '
         '["unevaluatedProperties"]'),
    ],
)  # fmt: skip
def test_a_tool_schema_llguidance_cannot_follow_is_a_400_naming_it(tsrv, schema, code, needle,
                                                                    stream):  # fmt: skip
    submitted = tsrv.engine.stats().get("requests_submitted", 0)
    bad = {"type": "function", "function": {"name": "bad", "parameters": schema}}
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, "stream": stream,
                "tools": [WEATHER, bad], "tool_choice": choice}  # fmt: skip
        status, _, payload = tsrv.request("POST", "/v1/chat/completions", body)
        assert status == 400, payload
        err = payload["error"]
        assert err["param"] == "tools.1.function.parameters" and err["code"] == code, err
        assert err["message"] == f"tools.1.function.parameters: {needle}" or (
            err["message"].startswith(f"tools.1.function.parameters: {needle}")
            and "\n" not in err["message"]
            and "<state>" not in err["message"]
        ), err
    assert tsrv.engine.stats().get("requests_submitted", 0) == submitted
    # not constrained ("auto"): the schema is never compiled, the request is answered
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 4, "tools": [WEATHER, bad]}
    assert tsrv.request("POST", "/v1/chat/completions", body)[0] == 200


def test_tool_schemas_are_checked_without_a_fallback(monkeypatch):
    # jsonschema is a dependency of the serve extra: its absence is an ImportError, never a
    # schema left unchecked
    bad = {"type": "object", "properties": {"a": {"type": "nope"}}}
    assert _schema_problem(bad).startswith("not a valid JSON Schema: ")
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(ImportError):
        _schema_problem(bad)
