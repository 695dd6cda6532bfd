"""Chat templates: compiled and rendered as transformers renders them, in one place.

What lives here: :func:`compile_chat_template` (a sandboxed ``jinja2`` environment set up as
transformers' ``render_jinja_template``), :func:`render_chat_template` (the one renderer both
tokenizers call) and :func:`check_chat_template` (renders a one-message conversation when a
tokenizer is loaded, so that a template that cannot render is refused at load and not at the
first request). What does not: tokenizing the text (the tokenizers' ``apply_chat_template``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = [
    "check_chat_template",
    "compile_chat_template",
    "render_chat_template",
    "template_renders_tools",
]

#: The conversation :func:`check_chat_template` renders: one user turn, then the assistant
#: opener (what every chat request renders at least).
_PROBE = ({"role": "user", "content": "Hello"},)


def compile_chat_template(source: str, where: str):
    """Compile a Hugging Face chat template as transformers does (a sandboxed jinja2 environment
    with ``trim_blocks``, ``lstrip_blocks``, loop controls, ``tojson``, ``raise_exception`` and
    ``strftime_now``), so rendered chats equal ``apply_chat_template``'s.

    Parameters
    ----------
    source : str
        The template text (``tokenizer.chat_template`` of a GGUF, ``chat_template`` of
        tokenizer_config.json).
    where : str
        ``"Class.method"`` for the error message.

    Returns
    -------
    jinja2.Template

    Raises
    ------
    ImportError
        ``jinja2`` is not installed.
    """
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{where}: needs the `jinja2` package; install it with `pip install jinja2`"
        ) from exc

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat_template(
    template,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render a conversation with a compiled chat template, with transformers' variables.

    Parameters
    ----------
    template : jinja2.Template
        From :func:`compile_chat_template`.
    messages : sequence of mapping
        E.g. ``[{"role": "user", "content": "Hi"}]``; each is copied into a dict.
    add_generation_prompt : bool
        Append the assistant turn opener.
    special_tokens : mapping of str to str
        The special tokens by template name (``bos_token``, ``eos_token``, ``unk_token``,
        ``pad_token``); absent ones are left out.
    tools : sequence of mapping or None, default=None
        JSON-schema tools (``{"type": "function", "function": {"name", "description",
        "parameters"}}``), passed to the template as ``tools`` unchanged (transformers passes
        dict tools so).
    documents : sequence of mapping or None, default=None
        Retrieval documents, the template's ``documents``.
    **kwargs
        Extra template variables (they override ``special_tokens``).

    Returns
    -------
    str

    Raises
    ------
    jinja2.TemplateError
        The template raised (``raise_exception``) or failed while rendering.

    Notes
    -----
    Follows transformers ``render_jinja_template``: the variables are ``messages``,
    ``add_generation_prompt``, ``tools`` and ``documents`` and the special tokens by name.
    """
    variables = dict(special_tokens)
    variables.update(kwargs)
    return template.render(
        messages=[dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        documents=None if documents is None else [dict(d) for d in documents],
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


def check_chat_template(source: str, *, name: str, special_tokens: Mapping[str, str]):
    """Compile a chat template and render a one-message conversation with it, once.

    Parameters
    ----------
    source : str
        The template text.
    name : str
        Where it came from, for the error (e.g. ``"tokenizer.chat_template of 'model.gguf'"``).
    special_tokens : mapping of str to str
        As :func:`render_chat_template` takes them.

    Returns
    -------
    jinja2.Template or None
        The compiled template, or None when ``jinja2`` is not installed (nothing can be
        rendered then; ``apply_chat_template`` says how to install it).

    Raises
    ------
    ValueError
        The template does not compile, or raises or fails when rendering
        ``[{"role": "user", "content": "Hello"}]`` with ``add_generation_prompt=True``; the
        message names the template and gives jinja2's error.

    Examples
    --------
    >>> template = check_chat_template("{{ messages[0].content }}", name="demo", special_tokens={})
    >>> template.render(messages=[{"content": "Hi"}])
    'Hi'
    >>> check_chat_template("{{ raise_exception('no') }}", name="demo", special_tokens={})
    Traceback (most recent call last):
        ...
    ValueError: the chat template (demo) fails to render a one-message conversation: no
    """
    try:
        import jinja2
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    try:
        template = compile_chat_template(source, "check_chat_template")
        render_chat_template(
            template, _PROBE, add_generation_prompt=True, special_tokens=special_tokens
        )
    except jinja2.TemplateError as exc:
        raise ValueError(
            f"the chat template ({name}) fails to render a one-message conversation: {exc}"
        ) from None
    except Exception as exc:  # a template can fail in Python itself (a TypeError, ...)
        raise ValueError(
            f"the chat template ({name}) fails to render a one-message conversation: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return template


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    """A compiled template of ``source``, kept for a few sources (a server's own template)."""
    return compile_chat_template(source, "apply_chat_template")


def template_renders_tools(tokenizer, *, chat_template: str | None = None, **variables) -> bool:
    """Whether a chat template puts the ``tools`` it is given into the prompt.

    Renders a one-message conversation with one probe tool (named
    ``exactblocks_probe_tool``) and looks for that name in the text: a template that ignores
    ``tools`` (SmolLM2's, most templates made before tool calling) cannot show a model its
    tools.

    Parameters
    ----------
    tokenizer : GGUFTokenizer or HFTokenizer
        Renders with its ``apply_chat_template``.
    chat_template : str or None, default=None
        A template source instead of the tokenizer's.
    **variables
        Extra template variables; a value that is the string ``"$tools"`` is replaced by the
        probe tools (``xml_tools="$tools"`` for SmolLM3's template).

    Returns
    -------
    bool
        False also when there is no template or it fails to render with the tool.
    """
    probe = [{"type": "function", "function": {
        "name": "exactblocks_probe_tool", "description": "A probe.",
        "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    extra = {k: probe if v == "$tools" else v for k, v in variables.items()}
    try:
        text = tokenizer.apply_chat_template(list(_PROBE), add_generation_prompt=True,
                                             tools=probe, chat_template=chat_template,
                                             **extra)  # fmt: skip
    except Exception:  # a template that cannot render tools does not render them
        return False
    return "exactblocks_probe_tool" in text


def apply_chat_template(tokenizer, where: str, messages, add_generation_prompt: bool,
                        tokenize: bool, kwargs: Mapping[str, Any], *, tools=None,
                        chat_template: str | None = None):  # fmt: skip
    """``tokenizer.apply_chat_template``'s body, shared by both tokenizers: compile the
    template once (kept on ``tokenizer._template``), render it with the tokenizer's special
    tokens, and encode the text without adding special tokens when ``tokenize``.

    Parameters
    ----------
    tokenizer : GGUFTokenizer or HFTokenizer
        Holds ``chat_template`` (already checked to be non-empty unless ``chat_template`` is
        given), ``_template``, ``_special_tokens()`` and ``encode``.
    where : str
        The public call, named in a compile error.
    messages, add_generation_prompt, tokenize, kwargs
        As the tokenizers' ``apply_chat_template`` takes them.
    tools : list of mapping or None, default=None
        JSON-schema tools (:func:`render_chat_template`).
    chat_template : str or None, default=None
        A template source used instead of the tokenizer's (transformers' ``chat_template``
        argument); compiled once per source.

    Returns
    -------
    str or list of int
    """
    if chat_template is not None:
        template = _compiled(chat_template)
    else:
        if tokenizer._template is None:
            tokenizer._template = compile_chat_template(tokenizer.chat_template, where)
        template = tokenizer._template
    text = render_chat_template(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tokenizer._special_tokens(),
        tools=tools,
        **kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False) if tokenize else text
