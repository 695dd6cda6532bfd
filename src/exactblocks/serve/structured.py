"""Structured outputs on the server: ``response_format`` to a :class:`~exactblocks.models.Grammar`.

What lives here: :func:`grammar_of_response_format` (a request's ``response_format`` to the
grammar its answer follows, or None for text) and :func:`grammar_or_400` (any grammar
builder's :class:`~exactblocks.models.GrammarError` as OpenAI's 400, naming the request field:
what a ``tools`` / ``tool_choice`` route uses to constrain a row to a JSON schema or a Lark
grammar). What does not: the mask and sampling (``exactblocks.models.structured`` and
``exactblocks.models.generate``: a request carries its grammar in ``SamplingParams.grammar``),
the routes (``exactblocks.serve.completions``).

Both run before the request is queued (the routes call them off the event loop: a large schema
takes milliseconds to compile), so a refused schema never reaches the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exactblocks.models import Grammar, GrammarError

from .protocol import APIError, ResponseFormat

__all__ = ["grammar_of_response_format", "grammar_or_400"]

#: Words of llguidance's messages for a schema feature it does not implement.
_UNSUPPORTED = ("unimplemented", "not supported", "unknown format", "unsupported")


def grammar_or_400(build: Callable[[], Any], param: str) -> Any:
    """``build()``, with a refused grammar answered as OpenAI's 400 naming ``param``.

    Parameters
    ----------
    build : callable
        Builds or checks a grammar, e.g. ``lambda: Grammar.json_schema(schema)``,
        ``lambda: Grammar.lark(text)`` or ``lambda: grammar.check(tokenizer, vocab_size,
        eos_token_ids)`` (:meth:`~exactblocks.models.Grammar.check`: a grammar that cannot
        start a generation).
    param : str
        The request field named in the error (``"response_format"``, ``"tools"``,
        ``"tools.0.function.parameters"``).

    Returns
    -------
    object
        What ``build`` returns.

    Raises
    ------
    APIError
        400, ``param`` set, code ``"unsupported"`` for a feature llguidance does not implement
        (``unevaluatedProperties``, an unknown ``format``, look-around in a pattern), else
        ``"invalid_value"``; the message is one line, llguidance's first.
    """
    try:
        return build()
    except (GrammarError, TypeError) as exc:
        detail = getattr(exc, "detail", str(exc)).lower()
        code = "unsupported" if any(w in detail for w in _UNSUPPORTED) else "invalid_value"
        raise APIError(400, f"{param}: {exc}", param=param, code=code) from None


def grammar_of_response_format(rf: ResponseFormat | None) -> Grammar | None:
    """The grammar a request's ``response_format`` asks for; None for none or ``text``.

    Parameters
    ----------
    rf : ResponseFormat or None

    Returns
    -------
    Grammar or None
        ``json_object``: :meth:`Grammar.json_object`; ``json_schema``:
        :meth:`Grammar.json_schema` of ``json_schema.schema`` (``strict`` or not).

    Raises
    ------
    APIError
        400 naming ``response_format``: ``json_schema`` without its ``json_schema`` object or
        its ``schema``, ``json_schema`` given with another type, or a schema llguidance
        refuses (:func:`grammar_or_400`).
    """
    if rf is None:
        return None
    if rf.type != "json_schema" and rf.json_schema is not None:
        raise APIError(400, "response_format: json_schema is only read with type 'json_schema'",
                       param="response_format", code="invalid_value")  # fmt: skip
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return grammar_or_400(Grammar.json_object, "response_format")
    js = rf.json_schema
    if js is None or js.schema_ is None:
        raise APIError(
            400,
            "response_format: type 'json_schema' needs json_schema.name and json_schema.schema",
            param="response_format",
            code="invalid_value",
        )
    schema = js.schema_
    return grammar_or_400(lambda: Grammar.json_schema(schema, name=js.name), "response_format")
