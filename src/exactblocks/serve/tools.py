"""Tool calling on ``/v1/chat/completions``: the request's tools checked, the history rendered,
the model's calls in OpenAI's shapes.

What lives here: :class:`ToolSupport` (what the server's chat template can do with tools, found
once per app), :class:`ToolRequest` and :func:`check_tools` (a body's ``tools``,
``tool_choice`` and ``parallel_tool_calls``, refused before any work when they cannot work),
:func:`chat_messages` (the history as template messages: assistant ``tool_calls`` and
``tool`` results), :func:`call_id`, :func:`tool_calls_json` and :func:`stream_deltas` (the
calls as a message's ``tool_calls`` and as streamed deltas). What does not: reading the
model's syntax (``exactblocks.text.tool_calls``), constraining a generation to it
(``exactblocks.models.Grammar`` of
``exactblocks.text.tool_call_grammar``), the route (``exactblocks.serve.completions``).

Call ids are ``call_`` and 24 hex digits of a SHA-256 of the prompt's token ids, the choice's
index, the call's index and the call itself: the same request and answer give the same ids,
so a seeded answer is reproducible to the byte.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from exactblocks.text import (
    TOOL_CALL_PARSERS,
    ToolCall,
    detect_tool_call_parser,
    template_renders_tools,
    tool_call_grammar,
    tool_template_variables,
)

from .protocol import APIError

__all__ = [
    "ToolRequest",
    "ToolSupport",
    "call_id",
    "chat_messages",
    "check_tools",
    "stream_deltas",
    "tool_calls_json",
]


class ToolSupport:
    """What the server's chat template does with tools.

    Parameters
    ----------
    tok : tokenizer or None
        The model's tokenizer (renders with ``apply_chat_template``).
    chat_template : str or None, default=None
        The template source the server renders with (``--chat-template``), None for the
        model's own.
    parser : str or None, default=None
        The tool-call syntax (``--tool-call-parser``); None reads it from the template's text.

    Attributes
    ----------
    chat_template : str or None
    parser : str or None
        The syntax given or detected; None when unknown.

    Raises
    ------
    ValueError
        ``parser`` is not a name of ``TOOL_CALL_PARSERS``.
    """

    def __init__(self, tok, chat_template: str | None = None, parser: str | None = None):
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser={parser!r} must be one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        source = chat_template if chat_template is not None else getattr(tok, "chat_template", None)
        self.tok = tok
        self.chat_template = chat_template
        self.parser = parser or detect_tool_call_parser(source)
        self._renders: list = [] if tok is not None and source else [False]

    def renders(self) -> bool:
        """Whether the template puts ``tools`` into the prompt (rendered once, on the first
        request with tools: call it off the event loop)."""
        if not self._renders:
            extra = {"xml_tools": "$tools"} if self.parser == "smollm3" else {}
            self._renders.append(
                template_renders_tools(self.tok, chat_template=self.chat_template, **extra)
            )
        return self._renders[0]


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools.

    Attributes
    ----------
    tools : list of dict
        OpenAI's ``tools`` as the template gets them.
    names : tuple of str
        The functions' names, in order.
    choice : str
        ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (a named function).
    function : str or None
        The named function (``choice == "function"``).
    parallel : bool
        ``parallel_tool_calls`` (default True): more than one call allowed.
    parser : str
        The tool-call syntax.
    """

    tools: list
    names: tuple
    choice: str
    function: str | None
    parallel: bool
    parser: str

    @property
    def parses(self) -> bool:
        """bool: the answer is read for calls (every choice but ``"none"``)."""
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        """bool: the answer must be calls (``"required"`` or a named function)."""
        return self.choice in ("required", "function")

    def grammar(self) -> str:
        """The Lark grammar of an answer that is only calls (:func:`tool_call_grammar`): one
        call of the named function (as vLLM constrains it), or one or more calls of any of
        the tools (exactly one unless ``parallel``)."""
        parallel = self.parallel and self.function is None
        return tool_call_grammar(self.parser, self.tools, function=self.function,
                                 parallel=parallel)  # fmt: skip

    def template_variables(self) -> dict:
        """The template variables carrying the tools (:func:`tool_template_variables`)."""
        return tool_template_variables(self.parser, self.tools)


def _schema_problem(schema) -> str | None:
    """Why ``schema`` is not a JSON Schema of a function's parameters, or None."""
    if not isinstance(schema, dict):
        return f"expected a JSON Schema object; got {type(schema).__name__}"
    if schema.get("type", "object") != "object":
        return f"expected a schema of type 'object'; got type {schema.get('type')!r}"
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        return "'properties' must map each parameter name to a schema object"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "'required' must be a list of parameter names"
    import jsonschema  # the serve extra's; lazy: its import costs about 0.1 s

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"not a valid JSON Schema: {exc.message}"
    return None


def check_tools(body, support: ToolSupport, renders: bool) -> ToolRequest | None:
    """A body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked.

    Parameters
    ----------
    body : ChatCompletionRequest
    support : ToolSupport
    renders : bool
        ``support.renders()``.

    Returns
    -------
    ToolRequest or None
        None when the body gives no tools.

    Raises
    ------
    APIError
        400 naming the field: ``tool_choice`` without tools; an empty ``tools``; a template
        that does not render tools, or whose call syntax is unknown; two tools of one name; a
        ``parameters`` that is not a JSON Schema of an object; a named ``tool_choice`` that
        is not among the tools.
    """
    choice = body.tool_choice
    if body.tools is None:
        if choice not in (None, "none"):
            raise APIError(
                400,
                "tool_choice needs tools; the request gives none",
                param="tool_choice",
                code="invalid_value",
            )
        return None
    if not body.tools:
        raise APIError(
            400, "tools: expected at least one tool; got []", param="tools", code="invalid_value"
        )
    if not renders:
        raise APIError(
            400,
            "tools are not supported by this model's chat template: it does not render the "
            "`tools` variable, so the model would never see them; serve the model with "
            "`--chat-template FILE`, a template that renders tools",
            param="tools",
            code="tools_unsupported",
        )
    names: list[str] = []
    for i, tool in enumerate(body.tools):
        fn = tool.function
        if fn.name in names:
            raise APIError(
                400,
                f"tools.{i}: a second tool named {fn.name!r}",
                param=f"tools.{i}.function.name",
                code="invalid_value",
            )
        names.append(fn.name)
        if fn.parameters is not None and (why := _schema_problem(fn.parameters)):
            raise APIError(
                400,
                f"tools.{i}.function.parameters: {why}",
                param=f"tools.{i}.function.parameters",
                code="invalid_value",
            )
    function = None
    if choice is None:
        mode = "auto"
    elif isinstance(choice, str):
        mode = choice
    else:
        mode, function = "function", choice.function.name
        if function not in names:
            raise APIError(
                400,
                f"tool_choice names the function {function!r}, which is not among the tools "
                f"({', '.join(repr(n) for n in names)})",
                param="tool_choice",
                code="invalid_value",
            )
    if support.parser is None and mode != "none":
        raise APIError(
            400,
            "the tool-call syntax of this model's chat template is not known, so its calls "
            "cannot be read; start the server with `--tool-call-parser` "
            f"({', '.join(TOOL_CALL_PARSERS)})",
            param="tools",
            code="tools_unsupported",
        )
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolRequest(tools, tuple(names), mode, function, parallel, support.parser or "hermes")


def chat_messages(body) -> list[dict]:
    """The body's messages as the chat template gets them.

    ``developer`` becomes ``system``; an assistant's ``tool_calls`` keep their ids and carry
    the arguments as a parsed JSON object (what templates such as Llama 3's ``tojson``); a
    ``tool`` message keeps ``tool_call_id`` (and ``name`` when given); null content is "".

    Raises
    ------
    APIError
        400 naming the message's field: null content outside an assistant message with tool
        calls, ``tool_calls`` on a message that is not the assistant's, arguments that are
        not a JSON object, a ``tool`` message without ``tool_call_id``.
    """
    out = []
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(
                400,
                f"{where}.content: null is allowed only on an assistant message with tool_calls",
                param=f"{where}.content",
            )
        msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise APIError(
                    400,
                    f"{where}.tool_calls: only an assistant message has tool "
                    f"calls; this one is {m.role!r}",
                    param=f"{where}.tool_calls",
                )
            calls = []
            for j, tc in enumerate(m.tool_calls):
                try:
                    args = json.loads(tc.function.arguments)
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    param = f"{where}.tool_calls.{j}.function.arguments"
                    raise APIError(
                        400,
                        f"{param}: expected a JSON object as text; got "
                        f"{tc.function.arguments[:80]!r}",
                        param=param,
                    )
                calls.append(
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": tc.function.name, "arguments": args},
                    }
                )
            msg["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(
                    400,
                    f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                    param=f"{where}.tool_call_id",
                )
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        out.append(msg)
    return out


def call_id(prompt_ids, index: int, k: int, call: ToolCall) -> str:
    """The id of choice ``index``'s call ``k``: ``call_`` + 24 hex digits of a SHA-256."""
    h = hashlib.sha256(
        json.dumps(
            [list(prompt_ids), index, k, call.name, call.arguments], ensure_ascii=False
        ).encode("utf-8")
    )
    return "call_" + h.hexdigest()[:24]


def tool_calls_json(calls: list[ToolCall], prompt_ids, index: int) -> list[dict]:
    """A message's ``tool_calls``: ``[{id, type: "function", function: {name, arguments}}]``."""
    return [
        {
            "id": call_id(prompt_ids, index, k, c),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for k, c in enumerate(calls)
    ]


def stream_deltas(calls: list[ToolCall], prompt_ids, index: int) -> list[dict]:
    """The streamed deltas of the calls, as OpenAI streams them: per call one delta with its
    ``index``, ``id``, ``type`` and ``function.name`` (``arguments`` ""), then one with the
    ``arguments``."""
    out = []
    for k, tc in enumerate(tool_calls_json(calls, prompt_ids, index)):
        fn = tc["function"]
        out.append(
            {
                "tool_calls": [
                    {
                        "index": k,
                        "id": tc["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            }
        )
        out.append({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
    return out
