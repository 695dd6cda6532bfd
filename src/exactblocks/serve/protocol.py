"""Request models of the OpenAI-compatible API, and the OpenAI error body.

What lives here: the typed (pydantic, strict, unknown fields refused) bodies of
``/v1/completions`` and ``/v1/chat/completions``, :class:`APIError` and
:func:`error_body`. Responses are plain dicts built by the routes (``exactblocks.serve.api``,
``completions``, ``embeddings``) in the shapes the ``openai`` client parses. What does not:
the engine, HTTP routing.

Strictness: a JSON string is not a number, ``true`` is not an int and ``3.0`` is not an int;
every field the server does not know is an error (the ``openai`` client only sends the fields
its caller set), and accepted-but-unsupported features (penalties, ``suffix``) are refused
with a message instead of being ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
    "FunctionCall",
    "FunctionDefinition",
    "JSONSchemaFormat",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "Tool",
    "ToolCallIn",
    "error_body",
]


class APIError(Exception):
    """An error answered with an OpenAI error body.

    Parameters
    ----------
    status : int
        HTTP status (400, 401, 404, 413, 429, 500, 503).
    message : str
    type : str, default="invalid_request_error"
    param : str or None, default=None
        The offending request field.
    code : str or None, default=None
    headers : dict or None, default=None
        Extra response headers (``Retry-After``).
    """

    def __init__(self, status, message, type="invalid_request_error", param=None, code=None,
                 headers=None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    """The OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the answer must follow (OpenAI's shape).

    ``strict`` is accepted either way: the answer is always constrained to the schema.
    """

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (unconstrained), ``json_object`` (any JSON object) or
    ``json_schema`` (a JSON value valid under ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class TextPart(_Strict):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """``function`` of an assistant message's tool call: its name and JSON arguments text."""

    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A tool call of an assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of a conversation.

    ``tool_calls`` (assistant) are calls the model made; a ``tool`` message answers the call
    ``tool_call_id``. The content may be null only on an assistant message with tool calls.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; null content is "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    """``function`` of a tool: a name, a description and a JSON Schema of its parameters."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    """``function`` of a named ``tool_choice``."""

    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    type: Literal["function"]
    function: NamedFunction


class _Common(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    ignore_eos: bool = False
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    response_format: ResponseFormat | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``: a prompt as text or token ids, or a batch of either.

    ``max_tokens=0`` runs the prompt only (with ``echo`` and ``logprobs``: scores it).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_Common):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class EmbeddingRequest(_Strict):
    """Body of ``POST /v1/embeddings``: texts or token ids, one embedding each.

    ``pooling`` (an exactblocks option): ``"last"`` (the default, the last token's final
    hidden state: what a decoder LM's next-token prediction reads) or ``"mean"`` (the mean
    over the input's tokens).
    """

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["last", "mean"] = "last"
    user: str | None = None
