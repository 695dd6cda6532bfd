"""Tool-call syntaxes (exactblocks.text.tool_calls): detection from a template's text, parsing
per syntax, streaming that equals the whole parse, and the constraining grammar's shape.

The strings are written the way each family's chat template shows the model its calls:
Hermes / Qwen2.5 / Qwen3 and SmolLM3 ``<tool_call>{json}</tool_call>``, Llama 3.x
``{"name": ..., "parameters": ...}`` (optionally after ``<|python_tag|>``, several joined by
``;``), Granite 3.x ``<|tool_call|>[{...}]``.
"""

from __future__ import annotations

import json

import pytest

from exactblocks.text import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStream,
    detect_tool_call_parser,
    parse_tool_calls,
    tool_call_grammar,
    tool_template_variables,
)

W = ToolCall("get_weather", '{"city": "Paris"}')
T = ToolCall("get_time", '{"zone": "UTC", "hour24": true}')
NAMES = ("get_weather", "get_time")


# -- detection ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "snippet, parser",
    [
        ("{{- '<tool_call>\\n' + tool_call.name }}", "hermes"),  # Qwen2.5 / Qwen3 / Hermes
        ("{%- if xml_tools %}<tool_call>{% endif %}", "smollm3"),  # SmolLM3 reads xml_tools
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),  # Llama 3.1
        ("{{- 'Environment: ipython\\n' }}", "llama3_json"),  # Llama 3.2 / 3.3
        ("{{- '<|tool_call|>' + tools | tojson }}", "granite"),  # Granite 3.x
        ("{{ messages[0].content }}", None),  # SmolLM2: no tools
        (None, None),
    ],
)
def test_detect_tool_call_parser(snippet, parser):
    assert detect_tool_call_parser(snippet) == parser


def test_smollm3_tools_also_go_as_xml_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tool_template_variables("smollm3", tools) == {"tools": tools, "xml_tools": tools}
    assert tool_template_variables("hermes", tools) == {"tools": tools}


# -- parsing, per syntax -----------------------------------------------------------------------
HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", '
    '"hour24": true}}\n</tool_call>'
)
CASES = [
    ("hermes", HERMES, "Let me look.", [W, T]),
    ("smollm3", HERMES, "Let me look.", [W, T]),
    # arguments written as a JSON string, no content, no newlines
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [W],
    ),  # fmt: skip
    # a last block the model did not close (it stopped at its end token)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', None, [W]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [W]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC", "hour24": true}}',
        None,
        [W, T],
    ),  # fmt: skip
    (
        "granite",
        'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC", "hour24": true}}]',
        "Sure.",
        [W, T],
    ),  # fmt: skip
    ("granite", '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [W]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parse_tool_calls(parser, text, content, calls):
    assert parse_tool_calls(parser, text, NAMES) == (content, calls)


PLAIN = [
    ("hermes", "The weather is fine."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut short
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not offered
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'),  # not an object
    ("hermes", "<tool_call>not json</tool_call>"),
    ("llama3_json", "Paris is sunny today."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
    ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
    ("granite", "No calls."),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa'),
]


@pytest.mark.parametrize("parser, text", PLAIN)
def test_not_a_call_is_plain_content(parser, text):
    assert parse_tool_calls(parser, text, NAMES) == (text, [])


def test_without_names_any_function_is_a_call():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls("hermes", text) == (None, [ToolCall("rm_rf", "{}")])


def test_arguments_are_json_text_with_unicode_kept():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    _, [call] = parse_tool_calls("hermes", text, NAMES)
    assert call.arguments == '{"city": "Zürich"}'
    assert json.loads(call.arguments) == {"city": "Zürich"}


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match=r"parser='mistral' must be one of hermes"):
        parse_tool_calls("mistral", "x")
    with pytest.raises(ValueError, match="parser='mistral'"):
        ToolCallStream("mistral")


# -- streaming: the pieces join to the whole parse ---------------------------------------------
def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    "parser, text",
    [(p, t) for p, t, _, _ in CASES] + PLAIN + [("hermes", "  Hi <tool_call"), ("hermes", "a\n\n")],
)
def test_stream_equals_whole_parse(parser, text, size):
    stream = ToolCallStream(parser, NAMES)
    released = [stream.push(p) for p in _pieces(text, size)]
    rest, calls = stream.finish()
    content, whole_calls = parse_tool_calls(parser, text, NAMES)
    assert "".join(released) + rest == (content or "")
    assert calls == whole_calls


def test_stream_releases_content_before_a_call_as_it_comes():
    stream = ToolCallStream("hermes", NAMES)
    assert stream.push("Let me ") == "Let me"  # the space may precede a call: held
    assert stream.push("look.\n<tool") == " look."  # "<tool" may begin <tool_call>: held
    assert stream.push('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == ""
    assert stream.finish("</tool_call>") == ("", [W])


def test_llama3_stream_holds_only_an_answer_that_opens_like_a_call():
    stream = ToolCallStream("llama3_json", NAMES)
    assert stream.push("  ") == ""
    assert stream.push("Paris") == "  Paris"  # cannot be a call any more: all released
    assert stream.push(" {x}") == " {x}"
    held = ToolCallStream("llama3_json", NAMES)
    assert held.push('{"name": "get_weather", ') == ""
    assert held.finish('"parameters": {"city": "Paris"}}') == ("", [W])


# -- the grammar of required / named tool_choice ---------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_grammar_compiles_in_llguidance(parser):
    llguidance = pytest.importorskip("llguidance")
    for function, parallel in ((None, True), ("get_time", False)):
        grammar = tool_call_grammar(parser, TOOLS, function=function, parallel=parallel)
        lark = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(lark) == ""


def test_grammar_names_only_the_chosen_function():
    grammar = tool_call_grammar("hermes", TOOLS, function="get_time", parallel=False)
    assert '\\"get_time\\"' in grammar and "get_weather" not in grammar
    assert grammar.splitlines()[0] == "start: one"
    assert tool_call_grammar("hermes", TOOLS).splitlines()[0] == 'start: one ("\\n" one)*'
    with pytest.raises(ValueError, match="function='nope' is not among the tools"):
        tool_call_grammar("hermes", TOOLS, function="nope")
