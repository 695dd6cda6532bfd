"""Chat templates: compiled and rendered as transformers renders them, in one place.

What lives here: :func:`compile_chat_template` (a sandboxed ``jinja2`` environment set up as
transformers' ``render_jinja_template``), :func:`render_chat_template` (the one renderer both
tokenizers call) and :func:`check_chat_template` (renders a one-message conversation when a
tokenizer is loaded, so that a template that cannot render is refused at load and not at the
first request). What does not: tokenizing the text (the tokenizers' ``apply_chat_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["check_chat_template", "compile_chat_template", "render_chat_template"]

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
    ``add_generation_prompt``, ``tools`` and ``documents`` (None) and the special tokens by
    name.
    """
    variables = dict(special_tokens)
    variables.update(kwargs)
    return template.render(
        messages=[dict(m) for m in messages],
        tools=None,
        documents=None,
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


def apply_chat_template(tokenizer, where: str, messages, add_generation_prompt: bool,
                        tokenize: bool, kwargs: Mapping[str, Any]):  # fmt: skip
    """``tokenizer.apply_chat_template``'s body, shared by both tokenizers: compile the
    template once (kept on ``tokenizer._template``), render it with the tokenizer's special
    tokens, and encode the text without adding special tokens when ``tokenize``.

    Parameters
    ----------
    tokenizer : GGUFTokenizer or HFTokenizer
        Holds ``chat_template`` (already checked to be non-empty), ``_template``,
        ``_special_tokens()`` and ``encode``.
    where : str
        The public call, named in a compile error.
    messages, add_generation_prompt, tokenize, kwargs
        As the tokenizers' ``apply_chat_template`` takes them.

    Returns
    -------
    str or list of int
    """
    if tokenizer._template is None:
        tokenizer._template = compile_chat_template(tokenizer.chat_template, where)
    text = render_chat_template(
        tokenizer._template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tokenizer._special_tokens(),
        **kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False) if tokenize else text
