"""Tool calls in a model's own syntax: which syntax a chat template teaches, and the calls in a
completion's text.

What lives here: :data:`TOOL_CALL_PARSERS`, :func:`detect_tool_call_parser` (a syntax from the
template's text), :class:`ToolCall`, :func:`parse_tool_calls` (a whole completion into content
and calls), :class:`ToolCallStream` (how much of a completion being generated is surely plain
content), :func:`tool_call_grammar` (a grammar of the calls, to constrain a generation to them)
and :func:`tool_template_variables`. What does not: rendering (``chat_template``),
constraining a generation to a call (``exactblocks.models``), OpenAI's shapes (the server).

The syntaxes (the names are vLLM's ``--tool-call-parser`` names where vLLM has one):

``"hermes"``
    Hermes 2 Pro, Qwen2.5, Qwen3 (NousResearch's Hermes function-calling format): each call is
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (JSON, whitespace around it
    allowed); the text outside the blocks is the content.
``"smollm3"``
    SmolLM3: the same ``<tool_call>`` JSON blocks; its template reads the tools from the
    variable ``xml_tools`` (:func:`tool_template_variables` passes them under both names).
``"llama3_json"``
    Llama 3.1 / 3.2 / 3.3 (Meta's JSON-based tool calling): the whole message is
    ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several calls
    separated by ``;``; no content beside them.
``"granite"``
    IBM Granite 3.x: ``<|tool_call|>`` then a JSON list of ``{"name", "arguments"}`` objects;
    the text before the marker is the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

__all__ = [
    "TOOL_CALL_PARSERS",
    "ToolCall",
    "ToolCallStream",
    "detect_tool_call_parser",
    "parse_tool_calls",
    "tool_call_grammar",
    "tool_template_variables",
]

#: The tool-call syntaxes this module reads (``--tool-call-parser`` of ``exactblocks serve``).
TOOL_CALL_PARSERS = ("hermes", "smollm3", "llama3_json", "granite")

#: The text that opens a call, per syntax with one (``llama3_json`` has none: see _held_from).
_MARKER = {"hermes": "<tool_call>", "smollm3": "<tool_call>", "granite": "<|tool_call|>"}
_PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made.

    Attributes
    ----------
    name : str
        The function's name.
    arguments : str
        Its arguments, a JSON object as text (``json.dumps(..., ensure_ascii=False)`` of what
        the model wrote: OpenAI's ``function.arguments``).
    """

    name: str
    arguments: str


def detect_tool_call_parser(template: str | None) -> str | None:
    """The tool-call syntax a chat template teaches, read from its text.

    Parameters
    ----------
    template : str or None
        The chat template's source.

    Returns
    -------
    str or None
        ``"granite"`` when the template writes ``<|tool_call|>``; ``"llama3_json"`` when it
        writes ``<|python_tag|>`` or ``Environment: ipython`` (Llama 3.x); ``"smollm3"`` when it
        reads ``xml_tools``; ``"hermes"`` when it writes ``<tool_call>``; None otherwise (no
        known syntax: give one explicitly).

    Examples
    --------
    >>> detect_tool_call_parser("{{ '<tool_call>' }}")
    'hermes'
    >>> detect_tool_call_parser("{{ messages[0].content }}") is None
    True
    """
    if not template:
        return None
    if "<|tool_call|>" in template:
        return "granite"
    if _PYTHON_TAG in template or "Environment: ipython" in template:
        return "llama3_json"
    if "xml_tools" in template:
        return "smollm3"
    if "<tool_call>" in template:
        return "hermes"
    return None


def tool_template_variables(parser: str | None, tools: list | None) -> dict:
    """The template variables that carry ``tools`` for a syntax's templates.

    Parameters
    ----------
    parser : str or None
        A name of :data:`TOOL_CALL_PARSERS`, or None.
    tools : list or None
        OpenAI's ``tools`` (``[{"type": "function", "function": {...}}]``), as transformers'
        ``apply_chat_template(tools=...)`` passes JSON-schema tools.

    Returns
    -------
    dict
        ``{"tools": tools}``, plus ``"xml_tools"`` for ``"smollm3"`` (SmolLM3's template
        reads that name).
    """
    out: dict = {"tools": tools}
    if parser == "smollm3":
        out["xml_tools"] = tools
    return out


def _check_parser(parser: str) -> None:
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"parser={parser!r} must be one of {', '.join(TOOL_CALL_PARSERS)}")


def _call(obj, key: str, names: Collection[str] | None) -> ToolCall | None:
    """A ToolCall of a parsed JSON object ``{"name": ..., key: {...}}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}) if key != "arguments" else {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    if names is not None and obj["name"] not in names:
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _content(text: str) -> str | None:
    """Content beside calls: trailing whitespace dropped, None when only whitespace is left."""
    text = text.rstrip()
    return text if text.strip() else None


def _parse_blocks(text: str, names) -> tuple[str | None, list[ToolCall]] | None:
    calls, outside, end = [], [], 0
    for m in _BLOCK.finditer(text):
        outside.append(text[end : m.start()])
        end = m.end()
        calls.append(m.group(1))
    start = text.find("<tool_call>", end)
    if start >= 0:  # a last block the model did not close: a call only if its JSON is whole
        outside.append(text[end:start])
        calls.append(text[start + len("<tool_call>") :])
        end = len(text)
    outside.append(text[end:])
    if not calls:
        return None
    parsed = []
    for body in calls:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = _call(obj, "arguments", names)
        if call is None:
            return None
        parsed.append(call)
    return _content("".join(outside)), parsed


def _parse_llama3(text: str, names) -> tuple[str | None, list[ToolCall]] | None:
    s = text.lstrip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG) :]
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if i == len(s):
            break
        try:
            obj, i = decoder.raw_decode(s, i)
        except ValueError:
            return None
        call = _call(obj, "parameters", names)
        if call is None:
            return None
        calls.append(call)
        while i < len(s) and s[i].isspace():
            i += 1
        if i < len(s) and s[i] == ";":
            i += 1
    return (None, calls) if calls else None


def _parse_granite(text: str, names) -> tuple[str | None, list[ToolCall]] | None:
    at = text.find("<|tool_call|>")
    if at < 0:
        return None
    rest = text[at + len("<|tool_call|>") :].strip()
    try:
        objs = json.loads(rest)
    except ValueError:
        return None
    if isinstance(objs, dict):
        objs = [objs]
    if not isinstance(objs, list) or not objs:
        return None
    calls = [_call(o, "arguments", names) for o in objs]
    if any(c is None for c in calls):
        return None
    return _content(text[:at]), calls  # type: ignore[return-value]


def parse_tool_calls(
    parser: str, text: str, names: Collection[str] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """Split a completion into its content and its tool calls.

    Parameters
    ----------
    parser : str
        A name of :data:`TOOL_CALL_PARSERS`.
    text : str
        The whole completion text.
    names : collection of str or None, default=None
        The functions the request offered; a call of another name makes the text plain content.

    Returns
    -------
    tuple
        ``(content, calls)``. With calls: ``content`` is the text outside them (trailing
        whitespace dropped; None when only whitespace). Without (no call in the text, a call
        whose JSON does not parse, whose ``name`` is not offered or whose arguments are not a
        JSON object): ``(text, [])``, the whole text as content.

    Raises
    ------
    ValueError
        An unknown ``parser``.

    Examples
    --------
    >>> parse_tool_calls("hermes", 'Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}'
    ...                  '\\n</tool_call>')
    ('Sure.', [ToolCall(name='f', arguments='{"x": 1}')])
    >>> parse_tool_calls("hermes", "No call here.")
    ('No call here.', [])
    """
    _check_parser(parser)
    if parser == "llama3_json":
        got = _parse_llama3(text, names)
    elif parser == "granite":
        got = _parse_granite(text, names)
    else:
        got = _parse_blocks(text, names)
    return (text, []) if got is None else got


def _held_from(parser: str, text: str) -> int:
    """The length of ``text``'s prefix that is plain content whatever follows."""
    if parser == "llama3_json":  # calls are the whole message: hold while it may be one
        s = text.lstrip()
        if not s or s.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(s):
            return 0
        return len(text)
    marker = _MARKER[parser]
    at = text.find(marker)
    if at < 0:  # hold a tail that may begin the marker
        at = len(text)
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                at = len(text) - k
                break
    return len(text[:at].rstrip())  # trailing whitespace is dropped before a call


class ToolCallStream:
    """The content of a completion being generated, released as soon as it cannot be a call.

    Feed the completion's text with :meth:`push`; each call returns the new content that is
    surely plain text (text that may still begin a call, and whitespace that would be dropped
    before one, is held). :meth:`finish` parses the whole text with :func:`parse_tool_calls`
    and returns the content still to send and the calls; the pieces joined equal the content
    :func:`parse_tool_calls` gives, so a streamed answer equals the unstreamed one.

    Parameters
    ----------
    parser : str
        A name of :data:`TOOL_CALL_PARSERS`.
    names : collection of str or None, default=None
        As :func:`parse_tool_calls`.

    Raises
    ------
    ValueError
        An unknown ``parser``.

    Examples
    --------
    >>> s = ToolCallStream("hermes", ["f"])
    >>> s.push("Sure. <tool"), s.push('_call>{"name": "f", "arguments": {}}</tool_call>')
    ('Sure.', '')
    >>> s.finish()
    ('', [ToolCall(name='f', arguments='{}')])
    """

    def __init__(self, parser: str, names: Collection[str] | None = None):
        _check_parser(parser)
        self.parser = parser
        self.names = names
        self.text = ""
        self.sent = 0  # characters of self.text released as content

    def push(self, piece: str) -> str:
        """Append ``piece``; return the content released now (possibly "")."""
        self.text += piece
        safe = max(self.sent, _held_from(self.parser, self.text))
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def finish(self, tail: str = "") -> tuple[str, list[ToolCall]]:
        """Append the last ``tail``; return ``(content not yet released, calls)``."""
        self.text += tail
        content, calls = parse_tool_calls(self.parser, self.text, self.names)
        content = content or ""
        return content[self.sent :], calls


def tool_call_grammar(
    parser: str, tools: list, *, function: str | None = None, parallel: bool = True
) -> str:
    """A Lark grammar (llguidance's dialect) of an answer that is only tool calls.

    Each call is written as the syntax writes it, its arguments constrained to the function's
    ``parameters`` schema (``%json``; no schema: an empty object; ``additionalProperties``
    false unless the schema sets it; compact ``json.dumps`` spacing). With ``parallel`` one or
    more calls, else exactly one. :func:`parse_tool_calls` reads every answer of it.

    Parameters
    ----------
    parser : str
        A name of :data:`TOOL_CALL_PARSERS`.
    tools : list of dict
        OpenAI's ``tools`` (``{"type": "function", "function": {"name", "parameters"}}``).
    function : str or None, default=None
        Only calls of this function (a named ``tool_choice``).
    parallel : bool, default=True

    Returns
    -------
    str

    Raises
    ------
    ValueError
        An unknown ``parser``; ``function`` not among ``tools``.

    Notes
    -----
    ``hermes`` / ``smollm3``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``
    calls joined by ``\\n``; ``llama3_json``: ``{"name": "f", "parameters": {...}}`` joined by
    ``; ``; ``granite``: ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]``. Markers are
    matched as text (a tokenizer that holds one as a special token writes it from its bytes).
    """
    _check_parser(parser)
    fns = [t["function"] for t in tools]
    if function is not None:
        fns = [f for f in fns if f["name"] == function]
        if not fns:
            raise ValueError(f"function={function!r} is not among the tools")
    key = "parameters" if parser == "llama3_json" else "arguments"
    lines = []
    for i, fn in enumerate(fns):
        schema = dict(fn.get("parameters") or {"type": "object"})
        # the declared parameters only (OpenAI's strict mode), unless the schema says otherwise
        schema.setdefault("additionalProperties", False)
        # compact JSON as json.dumps writes it: no whitespace for a model to ramble in
        schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}  # fmt: skip
        head = json.dumps(f'{{"name": {json.dumps(fn["name"])}, "{key}": ')
        lines.append(f'fn{i}: {head} args{i} "}}"')
        lines.append(f"args{i}: %json {json.dumps(schema)}")
    lines.append("call: " + " | ".join(f"fn{i}" for i in range(len(fns))))
    if parser == "llama3_json":
        wrap, sep = "call", '"; "'
    elif parser == "granite":
        wrap, sep = "call", '", "'
    else:
        wrap, sep = '"<tool_call>\\n" call "\\n</tool_call>"', '"\\n"'
    lines.append(f"one: {wrap}")
    calls = f"one ({sep} one)*" if parallel else "one"
    if parser == "granite":
        calls = f'"<|tool_call|>[" {calls} "]"'
    return "\n".join([f"start: {calls}"] + lines) + "\n"
