"""The tokenizer of a Hugging Face folder (``tokenizer.json``) and its chat template.

What lives here: :class:`HFTokenizer`, built with the ``tokenizers`` package from
``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, ``add_bos_token``-style
settings are already in ``tokenizer.json``'s post-processor), with the chat template from
``chat_template.jinja`` (transformers 5 writes it there) or ``tokenizer_config.json``'s
``chat_template``, rendered by :mod:`exactblocks.text.chat_template` the way transformers'
``render_jinja_template`` does, and rendered once on a one-message conversation when the folder
is read. Never imports torch or transformers. What does not: GGUF tokenizers
(:class:`exactblocks.text.GGUFTokenizer`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .chat_template import apply_chat_template, check_chat_template

__all__ = ["HFTokenizer"]


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a str or as an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A fast tokenizer from ``tokenizer.json``, with the folder's chat template.

    Build it with :meth:`from_folder`. ``encode``, ``decode`` and ``apply_chat_template`` give
    the ids and text transformers' ``AutoTokenizer.from_pretrained(folder)`` gives on the same
    files (tests/models checks it).

    Attributes
    ----------
    chat_template : str or None
    bos_token, eos_token, pad_token, unk_token : str or None
        Special tokens named in tokenizer_config.json.
    eos_token_id : int or None
    """

    def __init__(self, tok, config: Mapping, chat_template: str | None):
        self._tok = tok
        self.chat_template = chat_template
        for name in ("bos", "eos", "pad", "unk"):
            setattr(self, f"{name}_token", _token_text(config.get(f"{name}_token")))
        self.eos_token_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None
        # transformers' decode: clean_up_tokenization_spaces from tokenizer_config.json
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    @classmethod
    def from_folder(cls, folder: str) -> HFTokenizer | None:
        """The tokenizer of a ``save_pretrained`` folder, or None when it has no tokenizer.json.

        Parameters
        ----------
        folder : str

        Returns
        -------
        HFTokenizer or None

        Raises
        ------
        ImportError
            ``tokenizers`` is not installed.
        ValueError
            tokenizer.json or tokenizer_config.json cannot be parsed (the message names it),
            or the chat template fails to render a one-message conversation (the message names
            the template's file).
        """
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "load_model: reading tokenizer.json needs the `tokenizers` package "
                "(`pip install tokenizers`)"
            ) from exc
        try:
            tok = Tokenizer.from_file(path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the library's bare Exception, or a Rust panic
            raise ValueError(f"load_model: cannot read {path!r}: {exc}") from None
        config: dict = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"load_model: {cfg_path!r} is not valid JSON ({exc})") from None
            if not isinstance(config, dict):
                raise ValueError(f"load_model: {cfg_path!r} does not hold a JSON object")
        named_ok = isinstance(config.get("chat_template"), list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), str)
            for t in config["chat_template"]
        )
        if not (config.get("chat_template") is None
                or isinstance(config["chat_template"], str) or named_ok):  # fmt: skip
            shown = repr(config["chat_template"])
            raise ValueError(
                f"load_model: {cfg_path!r}: chat_template="
                f"{shown if len(shown) <= 60 else shown[:57] + '...'} is not a template "
                "(expected a string, or a list of {'name', 'template'} objects)"
            )
        template = None
        jinja_path = os.path.join(folder, "chat_template.jinja")
        source = f"{jinja_path!r}"
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
            source = f"chat_template of {cfg_path!r}"
        elif isinstance(config.get("chat_template"), list):  # named templates: HF's "default"
            named = {t.get("name"): t.get("template") for t in config["chat_template"]}
            template = named.get("default")
            source = f"the 'default' chat_template of {cfg_path!r}"
        self = cls(tok, config, template)
        if template:
            try:
                self._template = check_chat_template(
                    template, name=source, special_tokens=self._special_tokens()
                )
            except ValueError as exc:
                raise ValueError(f"load_model: {exc}") from None
        return self

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (int)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` as tokenizer.json spells it (``'Ġthe'``,
        ``'▁the'``, ``'<0x0A>'``), or None for an id it does not hold."""
        return self._tok.id_to_token(int(token_id))

    @property
    def special_token_ids(self) -> frozenset:
        """frozenset of int: ids of the added tokens marked special (what
        ``decode(skip_special_tokens=True)`` drops)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, as transformers' ``tokenizer(text)["input_ids"]``.

        Parameters
        ----------
        text : str
        add_special_tokens : bool, default=True
            Apply tokenizer.json's post-processor (e.g. a BOS token).

        Returns
        -------
        list of int

        Raises
        ------
        TypeError
            ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode: text must be a str; got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids (tokenizer.json's decoder).

        Parameters
        ----------
        ids : sequence of int
        skip_special_tokens : bool, default=False

        Returns
        -------
        str
        """
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:  # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                         (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                         (" 're", "'re")):  # fmt: skip
                text = text.replace(a, b)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        """Render a conversation with the folder's chat template, optionally tokenised.

        Parameters
        ----------
        messages : sequence of mapping
            E.g. ``[{"role": "user", "content": "Hi"}]``.
        add_generation_prompt : bool, default=False
        tokenize : bool, default=False
            Return ids (``encode(text, add_special_tokens=False)``, as transformers does).
        tools : sequence of mapping or None, default=None
            JSON-schema tools (``{"type": "function", "function": {...}}``), the template's
            ``tools`` (transformers' ``tools`` argument, dicts passed unchanged).
        chat_template : str or None, default=None
            A template source to render instead of the folder's (transformers'
            ``chat_template`` argument).
        **kwargs
            Extra template variables.

        Returns
        -------
        str or list of int

        Raises
        ------
        ValueError
            The folder has no chat template.
        ImportError
            ``jinja2`` is not installed.

        Notes
        -----
        Follows transformers ``render_jinja_template``: ``ImmutableSandboxedEnvironment`` with
        ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``, a ``tojson`` filter that does
        not escape HTML, globals ``raise_exception`` and ``strftime_now``; variables
        ``messages``, ``add_generation_prompt``, ``tools``, ``documents`` (None) and the special
        tokens by name.
        """
        if not self.chat_template and chat_template is None:
            raise ValueError("HFTokenizer.apply_chat_template: the folder has no chat template")
        return apply_chat_template(
            self,
            "HFTokenizer.apply_chat_template",
            messages,
            add_generation_prompt,
            tokenize,
            kwargs,
            tools=tools,
            chat_template=chat_template,
        )

    def _special_tokens(self) -> dict:
        """The template variables ``bos_token`` ... ``unk_token`` the config names."""
        return {
            f"{n}_token": getattr(self, f"{n}_token")
            for n in ("bos", "eos", "pad", "unk")
            if getattr(self, f"{n}_token") is not None
        }

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_template"] = None  # a compiled jinja2 template; compiled again on use
        return state

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"
