"""The shared base of the decoder-only Transformer families.

What lives here: the config fields every decoder family reads alike (:func:`heads_and_dims`,
:func:`rope_fields`, :func:`layer_windows`), :class:`DecoderSpec`, the ONE frozen config a
family file builds from the HF config (every block option and size, per layer where they
differ, and everything outside the blocks: embedding scale, final norm, logit scaling and
softcap), the tensor names of HF's
``<Family>ForCausalLM.state_dict()`` it implies, and the layer stack of
:class:`exactblocks.TransformerBlockInference` it builds. What does not: how a family reads
its HF config (one file per family), the embedding lookup and the output head (``base.py``).

Tensor names (HF ``LlamaForCausalLM`` and its copies, transformers 5.23); a family whose
file spells a tensor differently lists the renames in ``DecoderSpec.renames`` (StarCoder2's
``mlp.c_fc`` is the block's ``mlp.up_proj``, StableLM's ``self_attn.q_layernorm.norms.H`` are
the rows of the block's per-head ``self_attn.q_norm``)::

    model.embed_tokens.weight                      (vocab_size, hidden_size)
    model.layers.N.input_layernorm.weight          (hidden_size,)
    model.layers.N.self_attn.{q,k,v}_proj.weight   (heads * head_dim, hidden_size) [.bias]
    model.layers.N.self_attn.o_proj.weight         (hidden_size, heads * head_dim) [.bias]
    model.layers.N.self_attn.qkv_proj.weight       (q + 2 kv rows, hidden_size)  fused (Phi-3)
    model.layers.N.self_attn.{q,k}_norm.weight     (head_dim,) per head | (heads * head_dim,)
                                                   all heads (OLMo 2)
    model.layers.N.post_attention_layernorm.weight (hidden_size,) [.bias]  (absent: parallel)
    model.layers.N.{pre,post}_feedforward_layernorm.weight  (hidden_size,)  sandwich / post
    model.layers.N.mlp.gate_proj.weight            (intermediate_size, hidden_size) [.bias] gated
    model.layers.N.mlp.up_proj.weight              (intermediate_size, hidden_size) [.bias]
    model.layers.N.mlp.gate_up_proj.weight         (2 * intermediate_size, hidden_size) fused
    model.layers.N.mlp.down_proj.weight            (hidden_size, intermediate_size) [.bias]
    model.norm.weight                              (hidden_size,) [.bias]
    lm_head.weight                                 (vocab_size, hidden_size), absent when tied

``input_layernorm`` is absent under the ``post`` placement (OLMo 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._config import ConfigFieldError, ConfigReader

__all__ = [
    "GATED_MLP",
    "GATED_MLPS",
    "DecoderSpec",
    "TensorSpec",
    "block_tensors",
    "freeze",
    "heads_and_dims",
    "layer_windows",
    "rope_fields",
    "thaw",
]

#: The block's gated MLP kinds (gate_proj present).
GATED_MLPS = ("swiglu", "geglu", "geglu_tanh")


def freeze(scaling: dict | None) -> tuple | None:
    """A RoPE scaling dict as sorted ``(key, value)`` items, lists as tuples (frozen)."""
    if scaling is None:
        return None
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(scaling.items()))


def thaw(items: tuple | None) -> dict | None:
    """The dict :func:`freeze` froze (tuples back to lists), for the block option."""
    if items is None:
        return None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in items}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a model reads: its HF name, shape and whether the file must hold it."""

    name: str
    shape: tuple
    required: bool = True


@dataclass(frozen=True)
class DecoderSpec:
    """Every size and block option of a decoder-only Transformer, resolved once, frozen.

    Built by a family file's ``spec_from_config`` and nowhere else; ``model.config`` keeps the
    HF-style mapping it came from. Field names are exactblocks' (STYLE.md 3); the comment of
    each family's builder says which HF field fills which. Fields after ``windows`` default to
    the plain Llama layer.

    Attributes
    ----------
    family : str
        The family file's name (``"llama"``, ``"gemma2"``, ...).
    vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, intermediate : int
    norm_eps : float
        Every block norm's epsilon (q/k norms too), the final norm's too.
    rope_theta : float
    rope_scaling : tuple of (key, value) pairs or None
        The HF scaling dict as sorted items (frozen); None = unscaled.
    max_position_embeddings : int
    tie_embeddings : bool
        The output head is the embedding matrix (HF ``tie_word_embeddings``).
    qkv_bias, o_bias, mlp_bias, qk_norm : bool
    mlp : str
        The block's MLP kind (``'swiglu'``, ``'geglu'``, ``'geglu_tanh'``, ``'gelu_tanh'``, ...).
    windows : tuple of int
        Per layer: 0 = full causal attention, W = sliding window of W tokens.
    norm : str
        Block and final norm kind: ``'rmsnorm'``, ``'layernorm'``, ``'rmsnorm_offset'`` (Gemma).
    norm_bias : bool
        LayerNorm biases on every block norm and the final norm.
    norm_placement : str
        ``'pre'``, ``'sandwich'`` (Gemma 2/3), ``'post'`` (OLMo 2), ``'parallel'`` (StableLM).
    qk_norm_scope : str
        ``'head'``, ``'all_heads'`` (OLMo 2) or ``'per_head_weights'`` (StableLM).
    attn_scale : float or None
        The score scale as HF's binary64 value (None = head_dim ** -0.5).
    attn_softcap : float or None
    residual_multiplier : float
    rope_dim : int or None
        Rotated dims per head (None = all).
    layer_ropes : tuple
        Per layer ``(rope_theta, rope_scaling items or None)`` when layers differ (Gemma 3);
        empty = ``rope_theta`` / ``rope_scaling`` everywhere.
    nope_layers : tuple of int
        Layers without RoPE (SmolLM3 ``no_rope_layers``).
    embed_scale : float or None
        The float32 multiplier of every embedding row (None = none): Gemma's
        ``sqrt(hidden_size)``, Granite's ``embedding_multiplier``.
    logits_scaling : float
        Logits are divided by it (Granite), 1 = not.
    logit_softcap : float or None
        ``tanh(z / c) * c`` on the logits (Gemma 2 ``final_logit_softcapping``).
    fused_qkv, fused_gate_up : bool
        The file stores ``qkv_proj`` / ``gate_up_proj`` (Phi-3); the block splits them.
    renames : tuple of (str, str)
        ``(block name prefix, file name prefix)`` pairs inside a layer (StarCoder2's MLP).
    num_experts, num_experts_per_tok : int
        Routed experts of an MoE MLP and the experts chosen per token (0 = dense model).
    norm_topk_prob : bool
        The chosen experts' weights are renormalised (HF ``norm_topk_prob``).
    moe_intermediate : int
        Each expert's intermediate width (HF ``moe_intermediate_size``).
    moe_layers : tuple of int
        The layers whose MLP is the MoE MLP; the others are dense (``intermediate``).
    shared_intermediate : int
        The width of the shared expert of every MoE layer (Qwen2-MoE), 0 = none.
    moe_files : tuple of str
        How checkpoint files name an MoE layer's tensors: the module prefix (its router is
        ``<prefix>gate.weight``, expert e's matrices ``<prefix>experts.e.<leaf>.weight``) and
        the gate, up and down leaves (Mixtral: ``block_sparse_moe.``, ``w1``, ``w3``, ``w2``).
    stacked_experts : bool
        The source holds transformers 5's in-memory stacks (``mlp.experts.gate_up_proj``) rather
        than one tensor per expert (checkpoint files); set by :meth:`for_tensors`.
    """

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    mlp: str
    windows: tuple
    norm: str = "rmsnorm"
    norm_bias: bool = False
    norm_placement: str = "pre"
    qk_norm_scope: str = "head"
    attn_scale: float | None = None
    attn_softcap: float | None = None
    residual_multiplier: float = 1.0
    rope_dim: int | None = None
    layer_ropes: tuple = ()
    nope_layers: tuple = ()
    embed_scale: float | None = None
    logits_scaling: float = 1.0
    logit_softcap: float | None = None
    fused_qkv: bool = False
    fused_gate_up: bool = False
    renames: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate: int = 0
    moe_layers: tuple = ()
    moe_files: tuple = ("mlp.", "gate_proj", "up_proj", "down_proj")
    shared_intermediate: int = 0
    stacked_experts: bool = False

    embed_name = "model.embed_tokens.weight"
    norm_name = "model.norm.weight"
    head_name = "lm_head.weight"
    layer_prefix = "model.layers.{}."

    def block_options(self, layer: int, max_positions: int) -> dict:
        """Keyword options of ``TransformerBlockInference`` for layer ``layer``.

        Options at the block's default are left out, so a spec of the plain Llama layer asks
        nothing of the block beyond what it always had.

        Parameters
        ----------
        layer : int
        max_positions : int
            Longest sequence the model serves.

        Returns
        -------
        dict
        """
        theta, scaling = self.layer_ropes[layer] if self.layer_ropes else (
            self.rope_theta, self.rope_scaling)  # fmt: skip
        out = {
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "window": self.windows[layer],
            "rope_theta": theta,
            "rope_scaling": thaw(scaling),
            "max_positions": max_positions,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "norm": self.norm,
            "norm_eps": self.norm_eps,
            "mlp": self.mlp,
            "mlp_bias": self.mlp_bias,
            "qk_norm": self.qk_norm,
        }
        optional = {
            "norm_bias": (self.norm_bias, False),
            "norm_placement": (self.norm_placement, "pre"),
            "qk_norm_scope": (self.qk_norm_scope if self.qk_norm else "head", "head"),
            "attn_scale": (self.attn_scale, None),
            "attn_softcap": (self.attn_softcap, None),
            "residual_multiplier": (self.residual_multiplier, 1.0),
            "rope_dim": (0 if layer in self.nope_layers else self.rope_dim, None),
        }
        out.update({k: v for k, (v, default) in optional.items() if v != default})
        if layer in self.moe_layers:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       norm_topk_prob=self.norm_topk_prob)  # fmt: skip
            if self.shared_intermediate:
                out["shared_expert"] = True
        if layer in self.nope_layers:
            out["rope_scaling"] = None
        return out

    def _block_tensors(self, layer: int = -1) -> list[tuple[str, tuple]]:
        """The block's tensors (HF spelling) and shapes for these options (layer ``layer``'s:
        its MoE MLP in place of the dense one when it is one of ``moe_layers``)."""
        qw, kw = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qk_norm = {  # (q_norm, k_norm) shapes per qk_norm_scope (check_shapes)
            "head": ((self.head_dim,), (self.head_dim,)),
            "all_heads": ((qw,), (kw,)),
            "per_head_weights": ((self.n_heads, self.head_dim), (self.n_kv_heads, self.head_dim)),
        }.get(self.qk_norm_scope)
        options = {
            "block_parts": "full",
            "norm_placement": self.norm_placement,
            "norm_bias": self.norm_bias,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "qk_norm": self.qk_norm,
            "mlp": self.mlp,
            "mlp_bias": self.mlp_bias,
        }
        sizes = {"d": self.d_model, "QW": qw, "KW": kw, "IT": self.intermediate}
        if layer in self.moe_layers:
            options["num_experts"] = self.num_experts
            options["shared_expert"] = self.shared_intermediate > 0
            it = self.moe_intermediate
            sizes.update(E=self.num_experts, IT=it, IT2=2 * it, SIT=self.shared_intermediate, ONE=1)
        return block_tensors(
            options, sizes, qk_norm, fused_qkv=self.fused_qkv, fused_gate_up=self.fused_gate_up
        )

    def _file_name(self, block_name: str) -> str:
        for ours, theirs in self.renames:
            if block_name.startswith(ours):
                return theirs + block_name[len(ours) :]
        return block_name

    def for_tensors(self, names) -> DecoderSpec:
        """This spec for a source holding tensors ``names``: an MoE model given as a
        transformers object or its ``state_dict()`` holds the experts stacked."""
        if not self.moe_layers:
            return self
        stacked = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
        return dataclasses.replace(self, stacked_experts=stacked)

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """The tensors of layer ``layer`` under their full HF names (an MoE layer's experts
        one by one and the router under ``moe_files``' names, as checkpoints store them)."""
        p = self.layer_prefix.format(layer)
        out = []
        for name, shape in self._block_tensors(layer):
            fname = self._file_name(name)
            if name in _MOE_STACKS and not self.stacked_experts:
                for e in range(shape[0]):
                    out += [
                        TensorSpec(p + n, rows) for n, rows in self._expert_files(name, e, shape)
                    ]
                continue
            if name == _ROUTER and not self.stacked_experts:
                fname = self.moe_files[0] + "gate.weight"
            if self.qk_norm_scope == "per_head_weights" and len(shape) == 2 and "_norm" in name:
                # StableLmLayerNormPerHead: one LayerNorm module per head, ``norms.H.weight``
                stem = fname[: -len(".weight")]
                rows = range(shape[0])
                out += [TensorSpec(f"{p}{stem}.norms.{h}.weight", shape[1:]) for h in rows]
            else:
                out.append(TensorSpec(p + fname, shape))
        return out

    def top_tensors(self) -> list[TensorSpec]:
        """Embedding, final norm (its bias with ``norm_bias``) and the output head (optional
        when tied)."""
        v, d = self.vocab_size, self.d_model
        out = [
            TensorSpec(self.embed_name, (v, d)),
            TensorSpec(self.norm_name, (d,)),
            TensorSpec(self.head_name, (v, d), required=not self.tie_embeddings),
        ]
        if self.norm_bias:
            out.append(TensorSpec(self.norm_bias_name, (d,)))
        return out

    @property
    def norm_bias_name(self) -> str:
        """The final norm's bias tensor (read only with ``norm_bias``)."""
        return self.norm_name[: -len("weight")] + "bias"

    def build_layer(self, layer: int, tensors: dict, max_positions: int):
        """One ``TransformerBlockInference`` from the layer's tensors (full HF names).

        Parameters
        ----------
        layer : int
        tensors : dict of str to ndarray
            The layer's float32 tensors, full HF names (``model.layers.N.…``).
        max_positions : int

        Returns
        -------
        TransformerBlockInference
        """
        import numpy as np

        from exactblocks.transformer import TransformerBlockInference

        p = self.layer_prefix.format(layer)
        weights = {}
        for name, shape in self._block_tensors(layer):
            fname = p + self._file_name(name)
            if name in _MOE_STACKS and not self.stacked_experts:  # stacked once at load
                weights[name] = self._stack_experts(tensors, p, name, shape)
            elif name == _ROUTER and not self.stacked_experts:
                weights[name] = tensors[p + self.moe_files[0] + "gate.weight"]
            elif self.qk_norm_scope == "per_head_weights" and len(shape) == 2 and "_norm" in name:
                stem = fname[: -len(".weight")]
                rows = [tensors[f"{stem}.norms.{h}.weight"] for h in range(shape[0])]
                weights[name] = np.stack(rows)  # one (head_dim,) row per head, once at load
            else:
                weights[name] = tensors[fname]
        return TransformerBlockInference(weights, **self.block_options(layer, max_positions))

    def _expert_files(self, name: str, e: int, shape: tuple) -> list[tuple[str, tuple]]:
        """Expert e's file tensors (name inside the layer, shape) of a stack ``name``."""
        prefix, gate, up, down = self.moe_files
        leaves = (gate, up) if name == "mlp.experts.gate_up_proj" else (down,)
        rows = shape[1] // len(leaves)
        return [(f"{prefix}experts.{e}.{leaf}.weight", (rows, shape[2])) for leaf in leaves]

    def _stack_experts(self, tensors: dict, p: str, name: str, shape: tuple):
        """The (E, rows, cols) float32 stack of a layer's per-expert file tensors."""
        import numpy as np

        out = np.empty(shape, dtype=np.float32)
        for e in range(shape[0]):
            parts = [np.asarray(tensors[p + n], dtype=np.float32)
                     for n, _ in self._expert_files(name, e, shape)]  # fmt: skip
            out[e] = np.concatenate(parts, axis=0)
        return out

    def final_norm(self) -> dict:
        """The final norm's kind, epsilon and bias flag (``HeadConfig`` fields)."""
        return {"norm": self.norm, "norm_eps": self.norm_eps, "norm_bias": self.norm_bias}

    def head_options(self) -> dict:
        """What the head does after the projection (``HeadConfig`` fields)."""
        return {
            "logits_scaling": self.logits_scaling,
            "logit_softcap": 0.0 if self.logit_softcap is None else self.logit_softcap,
        }


# -- MoE experts: one tensor per expert in checkpoints, one stack in the block ------------------

#: The block's MoE tensors in HF spelling: transformers 5's in-memory stacks (``gate_up_proj`` =
#: [gate_e; up_e] per expert) and the router; checkpoint files (and transformers 5's
#: ``save_pretrained``) store each expert's matrices apart (``DecoderSpec.moe_files``).
_MOE_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_ROUTER = "mlp.gate.weight"


# -- config fields every decoder family reads the same way ---------------------------------------

#: HF ``hidden_act`` -> the block's gated MLP (``LlamaMLP``: down(act(gate(x)) * up(x))).
GATED_MLP = {"silu": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}


def heads_and_dims(
    c: ConfigReader,
    *,
    eps_key: str = "rms_norm_eps",
    act_key: str = "hidden_act",
    acts: dict = GATED_MLP,
) -> dict:
    """The size fields every decoder family reads the same way (HF ``__post_init__`` rules).

    ``eps_key`` names the norm epsilon field, ``act_key`` the activation field and ``acts``
    maps its values to the block's MLP kind (the family's MLP class decides gated or not).
    """
    d = c.integer("hidden_size")
    n_heads = c.integer("num_attention_heads")
    n_kv = c.integer("num_key_value_heads", allow_none=True)
    head_dim = c.integer("head_dim", allow_none=True)
    if head_dim is None:  # HF: hidden_size // num_attention_heads
        head_dim = d // n_heads
    if n_kv is None:  # HF: num_attention_heads
        n_kv = n_heads
    if n_heads % n_kv:
        raise ConfigFieldError(
            "{0} is not divisible by {1}",
            [("num_attention_heads", "'num_attention_heads'", n_heads),
             ("num_key_value_heads", "'num_key_value_heads'", n_kv)],
        )  # fmt: skip
    c.resolved.update(head_dim=head_dim, num_key_value_heads=n_kv)
    return {
        "vocab_size": c.integer("vocab_size"),
        "d_model": d,
        "n_layers": c.integer("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": head_dim,
        "intermediate": c.integer("intermediate_size"),
        "norm_eps": c.number(eps_key),
        "max_position_embeddings": c.integer("max_position_embeddings"),
        "tie_embeddings": c.flag("tie_word_embeddings"),
        "mlp": c.choice(act_key, acts),
    }


def rope_fields(c: ConfigReader) -> dict:
    """``rope_theta`` and the frozen scaling items (``RotaryEmbeddingConfigMixin.default_theta``
    = 10000.0 when the file states no base, as HF)."""
    theta, scaling, _ = c.rope(default_theta=10000.0)
    return {
        "rope_theta": theta,
        "rope_scaling": freeze(scaling),
    }


def layer_windows(c: ConfigReader, n_layers: int) -> tuple:
    """Per-layer windows from HF ``layer_types`` and ``sliding_window`` (Qwen2/Qwen3 rule:
    ``sliding_window if layer_types[i] == "sliding_attention" else None``)."""
    types = c.get("layer_types")
    if not isinstance(types, list) or len(types) != n_layers:
        raise ValueError(
            f"load_model: config field 'layer_types'={types!r} must list {n_layers} layer types "
            "(num_hidden_layers)"
        )
    window = c.get("sliding_window")
    out = []
    for i, t in enumerate(types):
        if t == "full_attention":
            out.append(0)
        elif t == "sliding_attention":
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(
                    f"load_model: config layer_types[{i}]='sliding_attention' needs an integer "
                    f"sliding_window >= 1; got sliding_window={window!r}"
                )
            out.append(window)
        else:
            raise ValueError(
                f"load_model: config layer_types[{i}]={t!r} is not supported (expected "
                "'full_attention' or 'sliding_attention')"
            )
    return tuple(out)


def block_tensors(
    options: dict,
    sizes: dict,
    qk_norm: tuple | None = None,
    *,
    fused_qkv: bool = False,
    fused_gate_up: bool = False,
) -> list[tuple[str, tuple]]:
    """A ``TransformerBlockInference``'s tensors for ``options``, from the block's own table
    (``exactblocks.transformer.weights.TENSORS``): HF spelling inside the layer, and shapes.

    Parameters
    ----------
    options : dict
        ``block_parts``, ``norm_placement``, ``norm_bias``, ``qkv_bias``, ``o_bias``,
        ``qk_norm``, ``mlp``, ``mlp_bias``.
    sizes : dict
        The table's shape symbols: ``d``, ``QW``, ``KW``, ``IT``.
    qk_norm : tuple of two shapes or None
        Of ``q_norm`` and ``k_norm`` (they depend on ``qk_norm_scope``).
    fused_qkv, fused_gate_up : bool
        Phi-3's stacked ``qkv_proj`` / ``gate_up_proj`` in place of the rows they hold.

    Returns
    -------
    list of (str, tuple)
    """
    from exactblocks.transformer.weights import TENSORS

    out = []
    for t in TENSORS:
        test = t.presence.test if t.presence is not None else None
        if test is not None and not test(options):
            continue
        if t.name in ("q_norm.weight", "k_norm.weight"):
            shape = qk_norm[t.name[0] == "k"]
        else:
            shape = tuple(sizes[s] for s in t.shape)
        out.append((t.hf, shape))
    d, qw, kw, it = sizes["d"], sizes["QW"], sizes["KW"], sizes["IT"]
    stacks = []
    if fused_qkv:
        qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        stacks.append((qkv, ("self_attn.qkv_proj.weight", (qw + 2 * kw, d))))
    if fused_gate_up and options["mlp"] in GATED_MLPS:
        stacks.append((("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                       ("mlp.gate_up_proj.weight", (2 * it, d))))  # fmt: skip
    for parts, stacked in stacks:  # one tensor in place of its parts, where the first was
        at = next((i for i, (n, _) in enumerate(out) if n in parts), None)
        if at is not None:
            out = [x for x in out if x[0] not in parts]
            out.insert(at, stacked)
    return out
