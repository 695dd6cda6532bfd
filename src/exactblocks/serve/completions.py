"""The OpenAI completions routes: ``/v1/chat/completions`` and ``/v1/completions``.

What lives here: :func:`add_routes` (the two routes: a body to prompt ids, its choices
submitted, the events shaped as OpenAI JSON or server-sent chunks; ``/v1/completions`` with
echo and prompt logprobs, batched prompts and ``n`` choices). What does not: what the routes
share (``exactblocks.serve.handling``: body checks, submission, collection, streaming), the
logprobs' and echo's shapes (``exactblocks.serve.echo``), the app (``exactblocks.serve.api``).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from types import SimpleNamespace

from fastapi import FastAPI, Request

from exactblocks.models import Grammar
from exactblocks.text import ToolCallStream, ll_tokenizer, parse_tool_calls

from .echo import (
    _prompt_text,
    chat_logprobs,
    legacy_logprobs,
    prompt_logprobs,
    token_text,
)
from .engine import PromptEvent, TokenEvent
from .handling import _encode
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, check_token_ids
from .structured import grammar_or_400
from .tools import ToolSupport, chat_messages, check_tools, stream_deltas, tool_calls_json

__all__ = ["add_routes"]

#: Most choices (prompts x ``n``) of one ``/v1/completions`` request.
MAX_CHOICES = 64
#: ``max_tokens`` of a ``/v1/completions`` request that gives none (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16


def add_routes(app: FastAPI, h: SimpleNamespace, model_name: str, fingerprint: str,
               tools: ToolSupport) -> None:  # fmt: skip
    """Add the completions routes to ``app``, with the helpers ``h`` of
    :func:`exactblocks.serve.handling.shared`; ``fingerprint`` is the responses'
    ``system_fingerprint``; ``tools`` is the chat template's tool support (its template
    renders every chat)."""
    model, tok = h.model, h.tok
    parse, params_of, choices_of, usage = h.parse, h.params_of, h.choices_of, h.usage
    submit, collect, stream = h.submit, h.collect, h.stream
    off_loop, refuse_if_too_long = h.off_loop, h.refuse_if_too_long

    def token_str(i: int) -> str:
        return str(i) if tok is None else token_text(tok, i)

    def chat_lp(ev: TokenEvent) -> dict:
        return chat_logprobs(tok, token_str, ev)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatCompletionRequest)
        if tok is None or not (tools.chat_template or getattr(tok, "chat_template", None)):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both")
        renders = bool(body.tools) and await off_loop(tools.renders)
        treq = check_tools(body, tools, renders)
        messages = chat_messages(body)
        text_bytes = sum(len(m["content"].encode("utf-8")) for m in messages)
        if treq is not None:
            text_bytes += len(json.dumps(treq.tools, ensure_ascii=False).encode("utf-8"))
        await refuse_if_too_long(text_bytes, "messages")
        variables = {} if treq is None else treq.template_variables()
        try:
            ids = await off_loop(_render_chat, tok, messages, tools.chat_template, variables)
        except Exception as exc:
            raise APIError(
                400, f"the chat template refused the messages: {exc}", param="messages"
            ) from None
        max_tokens = body.max_tokens or body.max_completion_tokens
        grammar = await h.grammar_of(body)
        if treq is not None and treq.constrained:  # the answer is calls, by construction
            if grammar is not None:
                raise APIError(400, f"tool_choice {treq.choice!r} constrains the answer to tool "
                               "calls; it cannot also follow response_format",
                               param="response_format", code="invalid_value")  # fmt: skip
            grammar = await off_loop(_tool_grammar, model, treq)
        params = params_of(body, len(ids), max_tokens, body.logprobs, body.top_logprobs or 0,
                           "messages", grammar)  # fmt: skip
        n = body.n or 1
        handles, events = await submit([(ids, p, None, False) for p in choices_of(body, params)])
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        base = {"id": rid, "created": now, "model": model_name, "system_fingerprint": fingerprint}
        reading = treq if treq is not None and treq.parses else None

        def calls_of(calls: list) -> list:
            return calls if reading is None or reading.parallel else calls[:1]

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            streams = None
            if reading is not None:
                streams = [ToolCallStream(reading.parser, reading.names) for _ in range(n)]

            def one(index, delta, lp, finish):
                out = {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [
                        {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                    ],
                }
                if include_usage:
                    out["usage"] = None
                return out

            def chunk(index, text, evs, finish, prompt=None):
                evs = [e for e in evs if e is not None and finish is None]  # no stop token
                lp = {"content": [chat_lp(e) for e in evs]} if body.logprobs and evs else None
                if streams is None or (not text and not evs and finish is None):
                    return one(index, {"content": text} if text or finish is None else {}, lp,
                               finish)  # fmt: skip
                if finish is None:  # content that cannot begin a call, as it comes
                    piece = streams[index].push(text)
                    return [one(index, {"content": piece}, lp, None)] if piece or lp else []
                rest, calls = streams[index].finish(text)
                calls = calls_of(calls)
                out = [one(index, {"content": rest}, None, None)] if rest else []
                out += [one(index, d, None, None) for d in stream_deltas(calls, ids, index)]
                reason = "tool_calls" if calls and finish == "stop" else finish
                return out + [one(index, {}, None, reason)]

            heads = []
            for index in range(n):
                head = chunk(index, "", [], None)
                head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                heads.append(head)
            return await stream(request, handles, events, chunk, include_usage, n, heads)

        done = await collect(request, handles, events)

        def answer(index, fin) -> tuple[dict, str]:
            message = {"role": "assistant", "content": fin.text}
            if reading is None:
                return message, fin.finish_reason
            content, calls = parse_tool_calls(reading.parser, fin.text, reading.names)
            calls = calls_of(calls)
            if not calls:
                return message, fin.finish_reason
            message = {"role": "assistant", "content": content,
                       "tool_calls": tool_calls_json(calls, ids, index)}  # fmt: skip
            return message, "tool_calls" if fin.finish_reason == "stop" else fin.finish_reason

        choices = []
        for index, c in enumerate(done):
            message, reason = answer(index, c["fin"])
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": (
                        {"content": [chat_lp(e) for e in c["toks"]]} if body.logprobs else None
                    ),
                    "finish_reason": reason,
                }
            )
        return {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage([c["fin"] for c in done], n),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; at most "
                f"{MAX_CHOICES} per request",
                param="prompt",
                code="invalid_value",
            )
        id_lists = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(prompt, str):
                if tok is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", param=where)
                await refuse_if_too_long(len(prompt.encode("utf-8")), where)
                ids = await off_loop(_encode, tok, prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise APIError(400, f"the {where.replace('.', ' ')} is empty", param=where)
            check_token_ids(ids, model.vocab_size, where)
            id_lists.append(ids)
        k = body.logprobs
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        only = max_tokens == 0
        plp = k if body.echo and k is not None else None
        grammar = await h.grammar_of(body)
        jobs = []
        for i, ids in enumerate(id_lists):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            params = params_of(body, len(ids), max_tokens, k is not None, k or 0, where, grammar)
            jobs += [(ids, p, plp, only) for p in choices_of(body, params)]
        echoes = []
        if body.echo:
            echoes = [await off_loop(_prompt_text, tok, ids) for ids in id_lists]
        handles, events = await submit(jobs)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        base = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "system_fingerprint": fingerprint,
        }

        def legacy_lp(evs, shift=0, out=None):
            return legacy_logprobs(token_str, evs, shift, out)

        def prompt_lp(index, pev: PromptEvent) -> dict:
            return prompt_logprobs(token_str, id_lists[index // n], echoes[index // n][1], pev)

        def echo_text(index) -> str:
            return echoes[index // n][0] if body.echo else ""

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(index, text, evs, finish, prompt=None):
                if prompt is not None:  # the echo, with the prompt's logprobs
                    text, lp = echo_text(index), prompt_lp(index, prompt)
                else:
                    shift = len(echo_text(index))
                    lp = legacy_lp(evs, shift) if k is not None and evs else None
                out = {
                    **base,
                    "choices": [
                        {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
                    ],
                }
                if include_usage:
                    out["usage"] = None
                return out

            heads = []
            if body.echo and plp is None:  # the echo first (with logprobs: once they are in)
                heads = [chunk(index, echo_text(index), [], None) for index in range(len(jobs))]
            return await stream(request, handles, events, chunk, include_usage, n, heads)

        done = await collect(request, handles, events)
        choices = []
        for index, c in enumerate(done):
            fin, lp = c["fin"], None
            toks = c["toks"] + ([fin.stop_token] if fin.stop_token is not None else [])
            if k is not None:
                head = prompt_lp(index, c["prompt"]) if body.echo else None
                lp = legacy_lp(toks, len(echo_text(index)), head)
            choices.append(
                {
                    "index": index,
                    "text": echo_text(index) + fin.text,
                    "logprobs": lp,
                    "finish_reason": fin.finish_reason,
                }
            )
        return {**base, "choices": choices, "usage": usage([c["fin"] for c in done], n)}


def _tool_grammar(model, treq) -> Grammar:
    """The grammar of a constrained tool choice (:meth:`ToolRequest.grammar` compiled) checked
    against the model's tokenizer (its llguidance tokenizer built once); 400 naming
    ``tools.N.function.parameters`` for a tool's schema that llguidance refuses or that cannot
    start a generation, ``tools`` for the whole grammar."""
    if model.tokenizer is None or not model.eos_token_ids:
        raise APIError(400, "tool_choice needs a model with a tokenizer and an end token",
                       param="tool_choice", code="unsupported")  # fmt: skip
    against = (model.tokenizer, model.vocab_size, model.eos_token_ids)
    ll_tokenizer(*against)
    for i, tool in enumerate(treq.tools):
        fn = tool["function"]
        schema = fn.get("parameters")
        if schema is None or treq.function not in (None, fn["name"]):
            continue
        grammar_or_400(functools.partial(_checked_schema, schema, against),
                       f"tools.{i}.function.parameters")  # fmt: skip
    return grammar_or_400(lambda: _checked(Grammar.lark(treq.grammar()), against), "tools")


def _checked(grammar: Grammar, against: tuple) -> Grammar:
    grammar.check(*against)
    return grammar


def _checked_schema(schema: dict, against: tuple) -> Grammar:
    return _checked(Grammar.json_schema(schema), against)


def _render_chat(tok, messages: list, chat_template: str | None, variables: dict) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        chat_template=chat_template, **variables))  # fmt: skip
