"""Llama (HF ``LlamaForCausalLM``; SmolLM2 is one): HF config -> :class:`DecoderSpec`.

The one place where a Llama config becomes block options. HF fields read (transformers 5.23
``LlamaConfig``): vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads (default: num_attention_heads), head_dim (default:
hidden_size // num_attention_heads), hidden_act, max_position_embeddings, rms_norm_eps,
tie_word_embeddings, rope_parameters (or legacy rope_theta/rope_scaling), attention_bias
(q/k/v and o biases), mlp_bias. GGUF: ``general.architecture == "llama"`` (Mistral GGUFs too).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import (
    _ATTN,
    _ATTN_BIAS,
    _GLU,
    _GLU_BIAS,
    _PRE_NORMS,
    _TOP,
    GGUFArch,
    _has,
    _Keys,
    _unpermute_qk,
)

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)

#: ``LlamaConfig`` class defaults (transformers 5.23.0): used only for a field the file omits,
#: as transformers itself does when it reads the same file.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Llama model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``LlamaConfig`` fields (``config.json``, ``to_dict()``, or the GGUF loader's dict).

    Returns
    -------
    spec : DecoderSpec
    resolved : dict
        ``config`` with HF's defaults filled in.

    Raises
    ------
    ValueError
        A field value the blocks cannot compute as HF does (the message names the field): a
        ``hidden_act`` other than silu/gelu/gelu_pytorch_tanh, a RoPE type other than
        default/linear/llama3, partial RoPE, a quantisation config, bad sizes.
    """
    c = ConfigReader(config, DEFAULTS, "llama")
    sizes = heads_and_dims(c)
    bias = c.flag("attention_bias")
    spec = DecoderSpec(
        family="llama",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=c.flag("mlp_bias"),
        qk_norm=False,
        windows=(0,) * sizes["n_layers"],
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


def _llama_config(k: _Keys, names, *, experts: bool = False) -> dict:
    """src/models/llama.cpp with the refusals of a Llama read as HF ``LlamaConfig``: partial
    RoPE, RoPE scaling and ``rope_freqs.weight`` (llama3-style scaling) are refused; the
    optional biases conversion/llama.py permutes with their rows are read. A file stating
    ``expert_count`` >= 1 is Mixtral's (``mixtral.GGUF_AS_LLAMA``, which reads its expert keys
    and calls this with ``experts=True``); a stray ``expert_used_count`` is refused. The
    llama.* keys it does not know are ignored (llama.cpp files of Llama fine-tunes carry
    many)."""
    d = k.need("embedding_length")
    n_heads = k.need("attention.head_count", minimum=1)
    if isinstance(n_heads, list) or isinstance(k.get("attention.head_count_kv"), list):
        k.fail("attention.head_count", n_heads, "one head count for every layer")
    n_kv = k.get("attention.head_count_kv", n_heads, minimum=1)
    k.heads_divide(n_heads, n_kv)
    head_dim = k.head_width(d, n_heads)
    rope_dim = k.get("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        k.fail("rope.dimension_count", rope_dim, f"head_dim={head_dim}: partial RoPE is not a "
               "Llama feature")  # fmt: skip
    scaling = k.get("rope.scaling.type", "none")
    if scaling not in ("none", ""):
        k.fail("rope.scaling.type", scaling, "'none': unscaled RoPE only")
    if "rope_freqs.weight" in names:
        raise ValueError(
            "load_gguf_model: the llama GGUF file holds rope_freqs.weight (llama3-style RoPE "
            "scaling), which is not supported"
        )
    ff = k.need("feed_forward_length")
    if isinstance(ff, list):
        k.fail("feed_forward_length", ff, "one width for every layer")
    for key in () if experts else ("expert_count", "expert_used_count"):
        if k.get(key, 0):  # (an expert_count >= 1 makes the file Mixtral's: record_for)
            k.fail(key, k.get(key), "0 without llama.expert_count >= 1 (a dense Llama)")
    c = {
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": k.need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rope_theta": float(k.get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(k.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": k.need("context_length"),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "rope_scaling": None,
        "attention_bias": _has(names, "attn_q.bias"),
        "mlp_bias": _has(names, "ffn_up.bias"),
    }
    k.get("vocab_size")  # checked against the embedding's rows
    k.read |= k.present
    return c


GGUF = GGUFArch(
    "llama",
    "LlamaForCausalLM",
    "llama",
    _llama_config,
    {**_ATTN, **_ATTN_BIAS, **_GLU, **_GLU_BIAS, **_PRE_NORMS},
    _TOP,
    convert=_unpermute_qk,
)
# llama.cpp's converter permutes q/k rows for the llama architecture only (LlamaModel and its
