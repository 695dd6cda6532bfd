"""Text: tokenizers, chat templates and the streaming detokenizer.

What lives here: :class:`GGUFTokenizer` (the tokenizer a GGUF file stores: byte-level BPE with
its original pre-tokenizer, or a SentencePiece-style vocabulary), :class:`HFTokenizer` (a
Hugging Face folder's ``tokenizer.json``), the chat-template renderer both use
(:mod:`exactblocks.text.chat_template`, checked once when a tokenizer is loaded), the
tool-call syntaxes of chat templates (:mod:`exactblocks.text.tool_calls`),
:class:`Detokenizer` (the text of a growing list of generated ids, for streaming) and
:func:`ll_tokenizer` (a tokenizer's byte vocabulary for llguidance's constrained
decoding). What does not: reading files (``exactblocks.loaders``) and generation
(``exactblocks.models``).
docs/text.md says which tokenizers and pre-tokenizers are supported and what each follows.
"""

from .byte_level import (
    DIGITS_FIRST,
    KNOWN_PRE_TOKENIZERS,
    LLAMA_CPP_PRE_TOKENIZERS,
    PRE_TOKENIZER_SPLITS,
    byte_level_pre_tokenizer,
    bytes_to_unicode,
)
from .chat_template import (
    check_chat_template,
    compile_chat_template,
    render_chat_template,
    template_renders_tools,
)
from .detokenizer import Detokenizer
from .gguf_tokenizer import GGUFTokenizer, UnsupportedTokenizerError
from .grammar import ll_tokenizer, token_byte_vocabulary
from .hf_tokenizer import HFTokenizer
from .tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStream,
    detect_tool_call_parser,
    parse_tool_calls,
    tool_call_grammar,
    tool_template_variables,
)

__all__ = [
    "DIGITS_FIRST",
    "KNOWN_PRE_TOKENIZERS",
    "LLAMA_CPP_PRE_TOKENIZERS",
    "PRE_TOKENIZER_SPLITS",
    "TOOL_CALL_PARSERS",
    "Detokenizer",
    "GGUFTokenizer",
    "HFTokenizer",
    "ToolCall",
    "ToolCallStream",
    "byte_level_pre_tokenizer",
    "bytes_to_unicode",
    "check_chat_template",
    "compile_chat_template",
    "detect_tool_call_parser",
    "ll_tokenizer",
    "parse_tool_calls",
    "render_chat_template",
    "template_renders_tools",
    "token_byte_vocabulary",
    "tool_call_grammar",
    "tool_template_variables",
    "UnsupportedTokenizerError",
]
