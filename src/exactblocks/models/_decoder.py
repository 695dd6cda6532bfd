"""The shared base of the decoder-only Transformer families (Llama, Mistral, Qwen2, Qwen3).

What lives here: :class:`DecoderSpec`, the ONE frozen config a family file builds from the HF
config (every block option and size, per layer where they differ), the tensor names of HF's
``<Family>ForCausalLM.state_dict()`` it implies, and the layer stack of
:class:`exactblocks.TransformerBlockInference` it builds. What does not: how a family reads
its HF config (``llama.py``, ``mistral.py``, ``qwen2.py``, ``qwen3.py``), the embedding and the
output head (``base.py``).

Tensor names (HF ``LlamaForCausalLM`` and its Mistral/Qwen2/Qwen3 copies, transformers 5.23)::

    model.embed_tokens.weight                      (vocab_size, hidden_size)
    model.layers.N.input_layernorm.weight          (hidden_size,)
    model.layers.N.self_attn.{q,k,v}_proj.weight   (heads * head_dim, hidden_size) [.bias]
    model.layers.N.self_attn.o_proj.weight         (hidden_size, heads * head_dim) [.bias]
    model.layers.N.self_attn.{q,k}_norm.weight     (head_dim,)          Qwen3 only
    model.layers.N.post_attention_layernorm.weight (hidden_size,)
    model.layers.N.mlp.{gate,up}_proj.weight       (intermediate_size, hidden_size) [.bias]
    model.layers.N.mlp.down_proj.weight            (hidden_size, intermediate_size) [.bias]
    model.norm.weight                              (hidden_size,)
    lm_head.weight                                 (vocab_size, hidden_size), absent when tied
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecoderSpec", "TensorSpec"]


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
    each family's builder says which HF field fills which.

    Attributes
    ----------
    family : str
        ``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"qwen3"``.
    vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, intermediate : int
    norm_eps : float
        Every RMSNorm's epsilon, the final norm's too.
    rope_theta : float
    rope_scaling : tuple of (key, value) pairs or None
        The HF scaling dict as sorted items (frozen); None = unscaled.
    max_position_embeddings : int
    tie_embeddings : bool
        The output head is the embedding matrix (HF ``tie_word_embeddings``).
    qkv_bias, o_bias, mlp_bias, qk_norm : bool
    mlp : str
        ``'swiglu'``, ``'geglu'`` or ``'geglu_tanh'`` (from ``hidden_act``).
    windows : tuple of int
        Per layer: 0 = full causal attention, W = sliding window of W tokens.
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

    embed_name = "model.embed_tokens.weight"
    norm_name = "model.norm.weight"
    head_name = "lm_head.weight"
    layer_prefix = "model.layers.{}."

    def block_options(self, layer: int, max_positions: int) -> dict:
        """Keyword options of ``TransformerBlockInference`` for layer ``layer``.

        Parameters
        ----------
        layer : int
        max_positions : int
            Longest sequence the model serves.

        Returns
        -------
        dict
        """
        return {
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "window": self.windows[layer],
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_positions": max_positions,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "norm": "rmsnorm",
            "norm_eps": self.norm_eps,
            "mlp": self.mlp,
            "mlp_bias": self.mlp_bias,
            "qk_norm": self.qk_norm,
        }

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """The tensors of layer ``layer`` under their full HF names."""
        d, hd, it = self.d_model, self.head_dim, self.intermediate
        qw, kw = self.n_heads * hd, self.n_kv_heads * hd
        p = self.layer_prefix.format(layer)
        out = [
            TensorSpec(p + "input_layernorm.weight", (d,)),
            TensorSpec(p + "post_attention_layernorm.weight", (d,)),
            TensorSpec(p + "self_attn.q_proj.weight", (qw, d)),
            TensorSpec(p + "self_attn.k_proj.weight", (kw, d)),
            TensorSpec(p + "self_attn.v_proj.weight", (kw, d)),
            TensorSpec(p + "self_attn.o_proj.weight", (d, qw)),
            TensorSpec(p + "mlp.gate_proj.weight", (it, d)),
            TensorSpec(p + "mlp.up_proj.weight", (it, d)),
            TensorSpec(p + "mlp.down_proj.weight", (d, it)),
        ]
        if self.qkv_bias:
            out += [
                TensorSpec(p + "self_attn.q_proj.bias", (qw,)),
                TensorSpec(p + "self_attn.k_proj.bias", (kw,)),
                TensorSpec(p + "self_attn.v_proj.bias", (kw,)),
            ]
        if self.o_bias:
            out.append(TensorSpec(p + "self_attn.o_proj.bias", (d,)))
        if self.qk_norm:
            out += [
                TensorSpec(p + "self_attn.q_norm.weight", (hd,)),
                TensorSpec(p + "self_attn.k_norm.weight", (hd,)),
            ]
        if self.mlp_bias:
            out += [
                TensorSpec(p + "mlp.gate_proj.bias", (it,)),
                TensorSpec(p + "mlp.up_proj.bias", (it,)),
                TensorSpec(p + "mlp.down_proj.bias", (d,)),
            ]
        return out

    def top_tensors(self) -> list[TensorSpec]:
        """Embedding, final norm and (optional when tied) output head."""
        v, d = self.vocab_size, self.d_model
        return [
            TensorSpec(self.embed_name, (v, d)),
            TensorSpec(self.norm_name, (d,)),
            TensorSpec(self.head_name, (v, d), required=not self.tie_embeddings),
        ]

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
        from exactblocks import TransformerBlockInference

        p = self.layer_prefix.format(layer)
        weights = {name[len(p) :]: arr for name, arr in tensors.items()}
        return TransformerBlockInference(weights, **self.block_options(layer, max_positions))

    def final_norm(self) -> dict:
        """The final norm's kind, epsilon and bias flag (``HeadConfig`` fields)."""
        return {"norm": "rmsnorm", "norm_eps": self.norm_eps, "norm_bias": False}
