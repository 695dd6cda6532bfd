"""Mamba-2 (HF ``Mamba2ForCausalLM``): HF config -> :class:`Mamba2Spec`, layer stack.

The one place where a Mamba-2 config becomes block options. HF fields read (transformers 5.23
``Mamba2Config``): vocab_size, hidden_size, num_hidden_layers, num_heads, head_dim, state_size,
expand, n_groups, conv_kernel, use_bias, use_conv_bias, hidden_act (silu only),
layer_norm_epsilon (every norm, the final ``norm_f`` too), time_step_limit,
tie_word_embeddings. ``chunk_size``, ``residual_in_fp32`` and the ``time_step_*``
initialisation fields do not change float32 inference (exactblocks' scan is token-sequential).

Tensor names (HF ``Mamba2ForCausalLM.state_dict()``)::

    backbone.embeddings.weight              (vocab_size, hidden_size)
    backbone.layers.N.norm.weight           (hidden_size,)
    backbone.layers.N.mixer.in_proj.weight  (d_inner + conv_dim + num_heads, hidden_size) [.bias]
    backbone.layers.N.mixer.conv1d.weight   (conv_dim, 1, conv_kernel) [.bias (conv_dim,)]
    backbone.layers.N.mixer.{dt_bias,A_log,D}  (num_heads,)
    backbone.layers.N.mixer.norm.weight     (d_inner,)
    backbone.layers.N.mixer.out_proj.weight (hidden_size, d_inner) [.bias]
    backbone.norm_f.weight                  (hidden_size,)
    lm_head.weight                          (vocab_size, hidden_size), absent when tied
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._config import ConfigFieldError, ConfigReader
from ._decoder import TensorSpec
from ._gguf import (
    GGUFArch,
    _has,
    _Keys,
    _mamba2_convert,
    _ssm_map,
)

__all__ = [
    "ARCHITECTURES",
    "DEFAULTS",
    "GGUF",
    "MODEL_TYPES",
    "Mamba2Spec",
    "spec_from_config",
]

ARCHITECTURES = ("Mamba2ForCausalLM",)
MODEL_TYPES = ("mamba2",)

#: ``Mamba2Config`` class defaults (transformers 5.23.0), used only for omitted fields, as HF.
DEFAULTS = {
    "num_heads": 128,
    "head_dim": 64,
    "vocab_size": 32768,
    "hidden_size": 4096,
    "state_size": 128,
    "num_hidden_layers": 64,
    "layer_norm_epsilon": 1e-5,
    "expand": 2,
    "conv_kernel": 4,
    "n_groups": 8,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "time_step_limit": (0.0, math.inf),
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


@dataclass(frozen=True)
class Mamba2Spec:
    """Every size and block option of a Mamba-2 model, resolved once, frozen.

    Attributes
    ----------
    vocab_size, d_model, n_layers, n_heads, head_dim, d_state, n_groups, conv_kernel : int
    d_inner : int
        ``expand * hidden_size`` (= num_heads * head_dim, checked).
    norm_eps : float
    dt_limit : tuple of two float
    proj_bias, conv_bias, tie_embeddings : bool
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    d_inner: int
    norm_eps: float
    dt_limit: tuple
    proj_bias: bool
    conv_bias: bool
    tie_embeddings: bool

    family = "mamba2"
    embed_name = "backbone.embeddings.weight"
    norm_name = "backbone.norm_f.weight"
    head_name = "lm_head.weight"
    layer_prefix = "backbone.layers.{}."
    max_position_embeddings = None  # a recurrent state has no position limit

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """The tensors of layer ``layer`` under their full HF names."""
        d, di, nh = self.d_model, self.d_inner, self.n_heads
        conv_dim = di + 2 * self.n_groups * self.d_state
        p = self.layer_prefix.format(layer)
        m = p + "mixer."
        out = [
            TensorSpec(p + "norm.weight", (d,)),
            TensorSpec(m + "in_proj.weight", (di + conv_dim + nh, d)),
            TensorSpec(m + "conv1d.weight", (conv_dim, 1, self.conv_kernel)),
            TensorSpec(m + "dt_bias", (nh,)),
            TensorSpec(m + "A_log", (nh,)),
            TensorSpec(m + "D", (nh,)),
            TensorSpec(m + "norm.weight", (di,)),
            TensorSpec(m + "out_proj.weight", (d, di)),
        ]
        if self.conv_bias:
            out.append(TensorSpec(m + "conv1d.bias", (conv_dim,)))
        if self.proj_bias:
            out += [
                TensorSpec(m + "in_proj.bias", (di + conv_dim + nh,)),
                TensorSpec(m + "out_proj.bias", (d,)),
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

    def build_layer(self, layer: int, tensors: dict, max_positions):
        """One ``Mamba2BlockInference`` (HF ``Mamba2Block``) from the layer's tensors.

        Parameters
        ----------
        layer : int
        tensors : dict of str to ndarray
            Full HF names (``backbone.layers.N.…``), float32.
        max_positions : ignored
            A Mamba-2 state has no position limit.

        Returns
        -------
        Mamba2BlockInference
        """
        from exactblocks.mamba2 import Mamba2BlockInference

        p = self.layer_prefix.format(layer)
        weights = {name[len(p) :]: arr for name, arr in tensors.items()}  # HF Mamba2Block names
        return Mamba2BlockInference(
            weights, dt_limit=self.dt_limit, n_groups=self.n_groups, norm_eps=self.norm_eps
        )

    def final_norm(self) -> dict:
        """``norm_f`` (HF ``Mamba2RMSNorm``, the Llama RMSNorm formula) for ``HeadConfig``."""
        return {"norm": "rmsnorm", "norm_eps": self.norm_eps, "norm_bias": False}

    def head_options(self) -> dict:
        """Nothing after the projection (``HeadConfig`` fields at their neutral values)."""
        return {"logits_scaling": 1.0, "logit_softcap": 0.0}


def spec_from_config(config) -> tuple[Mamba2Spec, dict]:
    """The frozen spec of a Mamba-2 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Mamba2Config`` fields.

    Returns
    -------
    spec : Mamba2Spec
    resolved : dict

    Raises
    ------
    ValueError
        A ``hidden_act`` other than silu; ``hidden_size * expand != num_heads * head_dim``;
        n_groups not dividing num_heads; a malformed ``time_step_limit``; a quantisation config.
    """
    c = ConfigReader(config, DEFAULTS, "mamba2")
    c.choice("hidden_act", {"silu": "silu"})
    d = c.integer("hidden_size")
    expand = c.get("expand")
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) or expand <= 0:
        c._fail("expand", expand, "a number > 0")
    d_inner = int(expand * d)  # HF: int(config.expand * hidden_size)
    n_heads, head_dim = c.integer("num_heads"), c.integer("head_dim")
    if d_inner != n_heads * head_dim:
        raise ConfigFieldError(
            f"{{0}} * {{1}} = {d_inner} differs from {{2}} * {{3}} = {n_heads * head_dim}",
            [("hidden_size", "'hidden_size'", d), ("expand", "'expand'", expand),
             ("num_heads", "'num_heads'", n_heads), ("head_dim", "'head_dim'", head_dim)],
        )  # fmt: skip
    n_groups = c.integer("n_groups")
    if n_heads % n_groups:
        raise ConfigFieldError(
            "{0} is not divisible by {1}",
            [("num_heads", "'num_heads'", n_heads), ("n_groups", "'n_groups'", n_groups)],
        )
    limit = c.get("time_step_limit")
    if (
        not isinstance(limit, (list, tuple))
        or len(limit) != 2
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in limit)
    ):
        c._fail("time_step_limit", limit, "two numbers [lo, hi]")
    spec = Mamba2Spec(
        vocab_size=c.integer("vocab_size"),
        d_model=d,
        n_layers=c.integer("num_hidden_layers"),
        n_heads=n_heads,
        head_dim=head_dim,
        d_state=c.integer("state_size"),
        n_groups=n_groups,
        conv_kernel=c.integer("conv_kernel"),
        d_inner=d_inner,
        norm_eps=c.number("layer_norm_epsilon"),
        dt_limit=(float(limit[0]), float(limit[1])),
        proj_bias=c.flag("use_bias"),
        conv_bias=c.flag("use_conv_bias"),
        tie_embeddings=c.flag("tie_word_embeddings"),
    )
    c.resolved["time_step_limit"] = list(spec.dt_limit)
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


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


GGUF = GGUFArch(
    "mamba2",
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
