"""The shared base of the Mamba-2 / Transformer hybrids (Nemotron-H, Granite-4.0-H).

What lives here: :class:`HybridSpec`, the ONE frozen config a hybrid family file builds from
the HF config: per HF layer, the blocks it becomes (a :class:`BlockPlan` each: a
:class:`exactblocks.Mamba2BlockInference`, or a :class:`exactblocks.TransformerBlockInference`
whole or half, ``block_parts='attention'`` / ``'mlp'``), their options and which file tensor
feeds which block weight. What does not: reading a family's HF config (``nemotron_h.py``,
``granitemoehybrid.py``), the embedding and the head (``base.py``).

An HF layer may become more than one block: a Granite-4.0-H layer is its mixer (Mamba-2 or
attention, with the layer's first norm and residual) followed by an MLP-only block (the second
norm, the dense MLP and its residual); the model's ``blocks`` list is flat, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._decoder import TensorSpec, block_tensors

__all__ = ["BlockPlan", "HybridSpec", "mamba2_tensors", "transformer_tensors"]


def _renamed(name: str, renames: dict) -> str:
    """``name`` with the first matching ``renames`` prefix replaced (block -> file)."""
    for ours, theirs in renames.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def transformer_tensors(options: dict, sizes: dict, renames: dict, **fused) -> tuple:
    """``BlockPlan.tensors`` of a transformer block (whole or half) from the block's own table.

    Parameters
    ----------
    options : dict
        The block options the table's presence depends on (:func:`._decoder.block_tensors`).
    sizes : dict
        ``d``, ``QW``, ``KW``, ``IT``.
    renames : dict of str to str
        Block name prefix -> the family's file name prefix (Nemotron-H's ``self_attn.`` is
        ``mixer.``); the rest is spelled as the block's table spells it.
    **fused
        ``fused_gate_up=True``: the gate and up rows as one stacked tensor.

    Returns
    -------
    tuple of (str, str, tuple)
        ``(block weight name, file name inside the layer, shape)``.
    """
    return tuple((n, _renamed(n, renames), s) for n, s in block_tensors(options, sizes, **fused))


def mamba2_tensors(sizes: dict, renames: dict, *, conv_bias: bool, proj_bias: bool) -> tuple:
    """``BlockPlan.tensors`` of a Mamba-2 block from the block's own table
    (``exactblocks.mamba2.weights.TENSORS``).

    Parameters
    ----------
    sizes : dict
        ``d`` (d_model), ``d_inner``, ``conv_dim``, ``n_heads``, ``kernel``.
    renames : dict of str to str
        Block name prefix -> the family's file name prefix (Granite-4.0-H's ``mixer.`` is
        ``mamba.``).
    conv_bias, proj_bias : bool
        Whether the conv1d bias and the in/out projection biases are there.

    Returns
    -------
    tuple of (str, str, tuple)
    """
    from exactblocks.mamba2.weights import TENSORS

    d, di, cd, mh = sizes["d"], sizes["d_inner"], sizes["conv_dim"], sizes["n_heads"]
    n_in = di + cd + mh
    shapes = {
        "norm.weight": (d,),
        "mixer.in_proj.weight": (n_in, d),
        "mixer.in_proj.bias": (n_in,),
        "mixer.conv1d.weight": (cd, 1, sizes["kernel"]),
        "mixer.conv1d.bias": (cd,),
        "mixer.dt_bias": (mh,),
        "mixer.A_log": (mh,),
        "mixer.D": (mh,),
        "mixer.norm.weight": (di,),
        "mixer.out_proj.weight": (d, di),
        "mixer.out_proj.bias": (d,),
    }
    present = {"in_proj.bias": proj_bias, "out_proj.bias": proj_bias, "conv1d.bias": conv_bias}
    return tuple(
        (t.hf, _renamed(t.hf, renames), shapes[t.hf]) for t in TENSORS if present.get(t.name, True)
    )


@dataclass(frozen=True)
class BlockPlan:
    """One block of a hybrid layer.

    Attributes
    ----------
    kind : str
        ``'mamba2'`` (``Mamba2BlockInference``) or ``'transformer'``
        (``TransformerBlockInference``).
    options : tuple of (str, object)
        The block's keyword options, sorted items (frozen); ``max_positions`` is added at build
        for a transformer block.
    tensors : tuple of (str, str, tuple)
        ``(block weight name, file name inside the layer, shape)``.
    out_scale : float or None
        Mamba-2 only: the residual branch is ``x + m * mixer(x)`` in HF (Granite-4.0-H
        ``residual_multiplier``). ``Mamba2BlockInference`` adds the branch unscaled, so ``m``
        (rounded to float32) multiplies ``out_proj`` (weight and bias) once at load: the same
        function, each product rounded once in another order than HF's.
    """

    kind: str
    options: tuple
    tensors: tuple
    out_scale: float | None = None


@dataclass(frozen=True)
class HybridSpec:
    """Every size and block option of a Mamba-2 / Transformer hybrid, resolved once, frozen.

    Attributes
    ----------
    family : str
    vocab_size, d_model, n_layers : int
        ``n_layers`` counts HF layers (``len(layers)``), not blocks.
    norm_eps : float
        The final norm's epsilon (RMSNorm).
    max_position_embeddings : int
        Positions the attention layers' caches may hold (default of ``max_positions``).
    tie_embeddings : bool
    layers : tuple of tuple of BlockPlan
        Per HF layer, its blocks in order.
    embed_scale : float or None
        Float32 multiplier of the embedding rows (Granite ``embedding_multiplier``).
    logits_scaling : float
        Logits are divided by it (Granite), 1 = not.
    embed_name, norm_name, head_name, layer_prefix : str
        HF names of the embedding, final norm, output head and a layer's prefix.
    prefix_aliases : tuple of (str, str)
        ``(saved prefix, in-memory prefix)``: a source whose names use none of the saved
        prefixes is read with the in-memory ones renamed (Nemotron-H: ``backbone.`` /
        ``model.``).
    """

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    norm_eps: float
    max_position_embeddings: int
    tie_embeddings: bool
    layers: tuple
    embed_scale: float | None = None
    logits_scaling: float = 1.0
    embed_name: str = "model.embed_tokens.weight"
    norm_name: str = "model.norm.weight"
    head_name: str = "lm_head.weight"
    layer_prefix: str = "model.layers.{}."
    prefix_aliases: tuple = ()

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """The tensors of HF layer ``layer`` under their full HF names (each once)."""
        p = self.layer_prefix.format(layer)
        seen: dict = {}
        for plan in self.layers[layer]:
            for _, fname, shape in plan.tensors:
                seen.setdefault(p + fname, TensorSpec(p + fname, tuple(shape)))
        return list(seen.values())

    def top_tensors(self) -> list[TensorSpec]:
        """Embedding, final norm and (optional when tied) output head."""
        v, d = self.vocab_size, self.d_model
        return [
            TensorSpec(self.embed_name, (v, d)),
            TensorSpec(self.norm_name, (d,)),
            TensorSpec(self.head_name, (v, d), required=not self.tie_embeddings),
        ]

    def build_layer(self, layer: int, tensors: dict, max_positions: int) -> list:
        """The blocks of HF layer ``layer`` from its tensors (full HF names).

        Parameters
        ----------
        layer : int
        tensors : dict of str to ndarray
            Float32, full HF names.
        max_positions : int
            Capacity limit of the attention blocks.

        Returns
        -------
        list of Mamba2BlockInference or TransformerBlockInference
        """
        from exactblocks import Mamba2BlockInference, TransformerBlockInference

        p = self.layer_prefix.format(layer)
        out = []
        for plan in self.layers[layer]:
            weights = {name: tensors[p + fname] for name, fname, _ in plan.tensors}
            opts = dict(plan.options)
            if plan.kind == "mamba2":
                if plan.out_scale is not None:
                    m = np.float32(plan.out_scale)
                    for name in ("mixer.out_proj.weight", "mixer.out_proj.bias"):
                        if name in weights:
                            weights[name] = np.asarray(weights[name], np.float32) * m
                out.append(Mamba2BlockInference(weights, **opts))
            else:
                out.append(TransformerBlockInference(weights, max_positions=max_positions, **opts))
        return out

    def final_norm(self) -> dict:
        """The final RMSNorm (``HeadConfig`` fields)."""
        return {"norm": "rmsnorm", "norm_eps": self.norm_eps, "norm_bias": False}

    def head_options(self) -> dict:
        """What the head does after the projection (``HeadConfig`` fields)."""
        return {"logits_scaling": self.logits_scaling, "logit_softcap": 0.0}
