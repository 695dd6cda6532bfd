"""StarCoder2 (HF ``Starcoder2ForCausalLM``): HF config -> :class:`DecoderSpec`.

Llama's pre-norm layer with LayerNorms (weights and biases, ``norm_epsilon``, the final norm
too), biases on q/k/v/o and on the MLP (``use_bias``), an ungated MLP ``c_proj(act(c_fc(x)))``
(HF ``Starcoder2MLP``: the block's ``up_proj`` / ``down_proj``) and one sliding window on every
layer (``sliding_window``, null = causal). HF fields read (transformers 5.23
``Starcoder2Config``): vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, hidden_act, max_position_embeddings, norm_epsilon,
rope_parameters (or rope_theta/rope_scaling), sliding_window, use_bias, tie_word_embeddings.
The dropout fields do not change inference. GGUF: ``general.architecture ==
"starcoder2"`` (its ``GGUF`` record below).
"""

from __future__ import annotations

from ._config import ConfigReader
from ._decoder import DecoderSpec, heads_and_dims, rope_fields
from ._gguf import (
    _ATTN,
    _ATTN_BIAS,
    _PRE_NORMS,
    _TOP_LN,
    GGUFArch,
    _common,
    _Keys,
    _rope,
)

__all__ = ["ARCHITECTURES", "DEFAULTS", "GGUF", "MODEL_TYPES", "spec_from_config"]

ARCHITECTURES = ("Starcoder2ForCausalLM",)
MODEL_TYPES = ("starcoder2",)

#: ``Starcoder2Config`` class defaults (transformers 5.23.0), used only for omitted fields.
DEFAULTS = {
    "vocab_size": 49152,
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "num_hidden_layers": 30,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": None,
    "hidden_act": "gelu_pytorch_tanh",
    "max_position_embeddings": 4096,
    "norm_epsilon": 1e-5,
    "sliding_window": None,
    "use_bias": True,
    "tie_word_embeddings": True,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}

#: HF ``hidden_act`` -> the block's ungated MLP (``Starcoder2MLP``: c_proj(act(c_fc(x)))).
UNGATED_MLP = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

#: The block's MLP names -> StarCoder2's.
RENAMES = (("mlp.up_proj.", "mlp.c_fc."), ("mlp.down_proj.", "mlp.c_proj."))


def spec_from_config(config) -> tuple[DecoderSpec, dict]:
    """The frozen spec of a StarCoder2 model, and the resolved HF-style config.

    Parameters
    ----------
    config : Mapping
        HF ``Starcoder2Config`` fields.

    Returns
    -------
    spec : DecoderSpec
    resolved : dict

    Raises
    ------
    ValueError
        A ``hidden_act`` other than gelu_pytorch_tanh/gelu, a RoPE type the blocks do not
        compute, a ``sliding_window`` that is not null or an integer >= 1, bad sizes.
    """
    c = ConfigReader(config, DEFAULTS, "starcoder2")
    sizes = heads_and_dims(c, eps_key="norm_epsilon", acts=UNGATED_MLP)
    window = c.integer("sliding_window", allow_none=True)
    bias = c.flag("use_bias")
    spec = DecoderSpec(
        family="starcoder2",
        **sizes,
        **rope_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        qk_norm=False,
        windows=(window or 0,) * sizes["n_layers"],
        norm="layernorm",
        norm_bias=True,
        renames=RENAMES,
    )
    return spec, c.resolved


# -- GGUF: llama.cpp's metadata keys and tensor names -> this family ----------------------------


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


GGUF = GGUFArch(
    "starcoder2",
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
