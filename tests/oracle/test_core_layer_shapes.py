"""The core's layer shapes of real checkpoints against HF's own layer classes.

``_core.TransformerCore`` is built directly from a typed ``_core.TransformerConfig`` and the
canonical short weight names (the Python option layer comes later), and compared with the HF
layer of each family in float32 with eager attention (SPEC 4.6: rtol = atol = 2e-4):

- Gemma2DecoderLayer, Gemma3DecoderLayer (sliding and global layers, own RoPE bases): sandwich
  norms, ``query_pre_attn_scalar`` score scale, softcap (Gemma 2), per-head qk-norm (Gemma 3).
- Olmo2DecoderLayer: post norms, q/k norms over all heads.
- SmolLM3DecoderLayer with and without RoPE (``no_rope_layers``): rope_dim = 0.
- GraniteDecoderLayer: ``attention_multiplier`` scale, ``residual_multiplier``.
- Phi3DecoderLayer: fused qkv_proj / gate_up_proj split here by rows, partial rotary, longrope
  on both sides of HF's switch (short set at L <= original max, long set above).
- LlamaDecoderLayer with yarn RoPE (plain; with mscale / mscale_all_dim and truncate off).
- NemotronHBlock attention (no RoPE) and MLP (relu2, ungated) layers: the half blocks.
- GraniteMoeHybridDecoderLayer (dense, attention type, with and without RoPE) = our
  attention-only block followed by our MLP-only block.
- StableLmDecoderLayer with ``qk_layernorm`` (StableLmLayerNormPerHead: per-head weights), with
  and without ``use_parallel_residual`` (StableLM 2 12B: the parallel placement).

Then the bit promises for every new setting, all as ``view(np.uint32)`` equality: one prefill
== token-by-token decode == a chunk split; a ragged row == that row alone; 1 == 2 == 3 threads;
every ISA the machine has == scalar.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import numpy as np
import pytest


def require(module: str, why: str):
    """Import `module`; skip this file locally if it is missing, fail under CI (``CI`` set)."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"{why}: {exc}", allow_module_level=True)


torch = require("torch", "oracle tests need torch==2.13.0 (pip install '.[test]')")
transformers = require("transformers", "oracle tests need transformers==5.23.0")
_core = require("exactblocks._core", "exactblocks (with its compiled _core) is not importable")

from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteMoeHybridConfig,
    LlamaConfig,
    NemotronHConfig,
    Olmo2Config,
    Phi3Config,
    SmolLM3Config,
    StableLmConfig,
)
from transformers.masking_utils import (  # noqa: E402
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.models.gemma2.modeling_gemma2 import (  # noqa: E402
    Gemma2DecoderLayer,
    Gemma2RotaryEmbedding,
)
from transformers.models.gemma3.modeling_gemma3 import (  # noqa: E402
    Gemma3DecoderLayer,
    Gemma3RotaryEmbedding,
)
from transformers.models.granite.modeling_granite import (  # noqa: E402
    GraniteDecoderLayer,
    GraniteRotaryEmbedding,
)
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (  # noqa: E402
    GraniteMoeHybridDecoderLayer,
    GraniteMoeHybridRotaryEmbedding,
)
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import (  # noqa: E402
    Olmo2DecoderLayer,
    Olmo2RotaryEmbedding,
)
from transformers.models.phi3.modeling_phi3 import (  # noqa: E402
    Phi3DecoderLayer,
    Phi3RotaryEmbedding,
)
from transformers.models.smollm3.modeling_smollm3 import (  # noqa: E402
    SmolLM3DecoderLayer,
    SmolLM3RotaryEmbedding,
)
from transformers.models.stablelm.modeling_stablelm import (  # noqa: E402
    StableLmDecoderLayer,
    StableLmRotaryEmbedding,
)

RTOL = ATOL = 2e-4  # SPEC 4.6
D, IT, NH, NKV, HD = 64, 96, 4, 2, 16
MAX_POS = 256
SEQ = 24

# TransformerConfig fields that take a _core enum, by the enum's Python names.
ENUMS = {
    "norm": _core.NormKind,
    "mlp": _core.MlpKind,
    "rope_scaling": _core.RopeScaling,
    "norm_placement": _core.NormPlacement,
    "block_parts": _core.BlockParts,
    "qk_norm_scope": _core.QkNormScope,
}


@dataclass
class Shape:
    """One HF layer (or a pair of our blocks standing for it) and the core configs for it."""

    name: str
    hf: object  # callable: (x (B, L, d) float32) -> (B, L, d) float32, positions 0..L-1
    cores: list  # [(fields, weights)]: our blocks, applied in order
    seq_len: int = SEQ
    rope_set: int = 0
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- building


def _eager(cfg):
    cfg._attn_implementation = "eager"
    return cfg


def _perturb(module, seed: int) -> None:
    """Seeded values: 2-D N(0, 1/in), norm weights 1 + 0.1 N (Gemma: 0.1 N), biases 0.1 N."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 2:
                p.copy_(noise / float(np.sqrt(p.shape[1])))
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:  # norm weights
                p.copy_(1.0 + 0.1 * noise)
    module.eval()


def _state(module) -> dict:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def _short(sd: dict, rename: dict | None = None) -> dict:
    """HF layer keys -> canonical short names: the module prefix stripped, then `rename`."""
    out = {}
    for k, v in sd.items():
        for pre in ("self_attn.", "mlp.", "mixer."):
            if k.startswith(pre):
                k = k[len(pre) :]
                break
        out[(rename or {}).get(k, k)] = v
    return out


def _attn_sizes(**kw) -> dict:
    f = dict(
        d_model=D,
        n_heads=NH,
        n_kv_heads=NKV,
        head_dim=HD,
        intermediate=IT,
        rope_dim=HD,
        max_positions=MAX_POS,
    )
    f.update(kw)
    return f


def _mask(config, xt, pos, window: bool):
    fn = create_sliding_window_causal_mask if window else create_causal_mask
    return fn(
        config=config, inputs_embeds=xt, attention_mask=None, past_key_values=None, position_ids=pos
    )


def _decoder_hf(layer, config, rotary=None, window=False, layer_type=None):
    """The HF call of a decoder layer as its model makes it (mask, cos/sin), no cache."""

    def run(x):
        xt = torch.from_numpy(np.ascontiguousarray(x))
        pos = torch.arange(x.shape[1])[None, :]
        mask = _mask(config, xt, pos, window)
        kw = {}
        if rotary is not None:
            kw["position_embeddings"] = (
                rotary(xt, pos, layer_type) if layer_type else rotary(xt, pos)
            )
        with torch.no_grad():
            out = layer(xt, attention_mask=mask, position_ids=pos, **kw)
        out = out[0] if isinstance(out, tuple) else out
        assert out.dtype == torch.float32
        return out.numpy()

    return run


def _gemma2(layer_idx: int) -> Shape:
    cfg = _eager(
        Gemma2Config(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            head_dim=HD,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            sliding_window=8,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=MAX_POS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )
    layer = Gemma2DecoderLayer(cfg, layer_idx)
    _perturb(layer, 200 + layer_idx)
    sliding = layer_idx == 0
    fields = _attn_sizes(
        norm="rmsnorm_offset",
        norm_placement="sandwich",
        mlp="geglu_tanh",
        attn_scale=24**-0.5,
        attn_softcap=50.0,
        window=8 if sliding else 0,
        norm_eps=cfg.rms_norm_eps,
    )
    hf = _decoder_hf(layer, cfg, Gemma2RotaryEmbedding(cfg), window=sliding)
    return Shape(
        f"gemma2_{'sliding' if sliding else 'global'}",
        hf,
        [(fields, _short(_state(layer)))],
        extra=dict(layer=layer, config=cfg),
    )


def _gemma3(layer_idx: int) -> Shape:
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    }
    cfg = _eager(
        Gemma3TextConfig(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            head_dim=HD,
            query_pre_attn_scalar=24,
            sliding_window=8,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=MAX_POS,
            rope_parameters=rope,
        )
    )
    layer = Gemma3DecoderLayer(cfg, layer_idx)
    _perturb(layer, 300 + layer_idx)
    sliding = layer_idx == 0
    kind = cfg.layer_types[layer_idx]
    fields = _attn_sizes(
        norm="rmsnorm_offset",
        norm_placement="sandwich",
        mlp="geglu_tanh",
        attn_scale=24**-0.5,
        qk_norm=True,
        window=8 if sliding else 0,
        rope_theta=rope[kind]["rope_theta"],
        norm_eps=cfg.rms_norm_eps,
    )
    if not sliding:
        fields.update(rope_scaling="linear", rope_factor=8.0)
    hf = _decoder_hf(layer, cfg, Gemma3RotaryEmbedding(cfg), window=sliding, layer_type=kind)
    return Shape(
        f"gemma3_{'sliding' if sliding else 'global'}",
        hf,
        [(fields, _short(_state(layer)))],
        extra=dict(layer=layer, config=cfg),
    )


def _olmo2() -> Shape:
    cfg = _eager(
        Olmo2Config(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_hidden_layers=1,
            rms_norm_eps=1e-6,
            max_position_embeddings=MAX_POS,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )
    )
    layer = Olmo2DecoderLayer(cfg, 0)
    _perturb(layer, 400)
    fields = _attn_sizes(
        norm_placement="post",
        qk_norm=True,
        qk_norm_scope="all_heads",
        rope_theta=500000.0,
        norm_eps=1e-6,
    )
    hf = _decoder_hf(layer, cfg, Olmo2RotaryEmbedding(cfg))
    return Shape(
        "olmo2", hf, [(fields, _short(_state(layer)))], extra=dict(layer=layer, config=cfg)
    )


def _smollm3(layer_idx: int) -> Shape:
    cfg = _eager(
        SmolLM3Config(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_hidden_layers=2,
            no_rope_layers=[1, 0],  # 1 = this layer uses RoPE
            use_sliding_window=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=MAX_POS,
            rope_parameters={"rope_type": "default", "rope_theta": 2000000.0},
        )
    )
    layer = SmolLM3DecoderLayer(cfg, layer_idx)
    _perturb(layer, 500 + layer_idx)
    use_rope = bool(cfg.no_rope_layers[layer_idx])
    assert layer.self_attn.use_rope == use_rope
    fields = _attn_sizes(rope_theta=2000000.0, rope_dim=HD if use_rope else 0, norm_eps=1e-6)
    hf = _decoder_hf(layer, cfg, SmolLM3RotaryEmbedding(cfg))
    return Shape(
        f"smollm3_{'rope' if use_rope else 'nope'}",
        hf,
        [(fields, _short(_state(layer)))],
        extra=dict(layer=layer, config=cfg),
    )


def _granite() -> Shape:
    cfg = _eager(
        GraniteConfig(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_hidden_layers=1,
            rms_norm_eps=1e-6,
            attention_multiplier=0.3,
            residual_multiplier=0.22,
            max_position_embeddings=MAX_POS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )
    layer = GraniteDecoderLayer(cfg, 0)
    _perturb(layer, 600)
    fields = _attn_sizes(attn_scale=0.3, residual_multiplier=0.22, norm_eps=1e-6)
    hf = _decoder_hf(layer, cfg, GraniteRotaryEmbedding(cfg))
    return Shape(
        "granite", hf, [(fields, _short(_state(layer)))], extra=dict(layer=layer, config=cfg)
    )


PHI3_SHORT = [1.0, 1.1, 1.3, 1.7]
PHI3_LONG = [1.0, 2.0, 3.5, 6.0]
PHI3_ORIGINAL = 16


def _phi3(long: bool) -> Shape:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": PHI3_SHORT,
        "long_factor": PHI3_LONG,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": PHI3_ORIGINAL,
    }
    cfg = _eager(
        Phi3Config(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_hidden_layers=1,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            original_max_position_embeddings=PHI3_ORIGINAL,
            partial_rotary_factor=0.5,
            rope_parameters=rope,
            pad_token_id=0,
        )
    )
    layer = Phi3DecoderLayer(cfg, 0)
    _perturb(layer, 700)
    sd = _short(_state(layer))
    qkv = sd.pop("qkv_proj.weight")
    sd["q_proj.weight"] = qkv[: NH * HD]
    sd["k_proj.weight"] = qkv[NH * HD : (NH + NKV) * HD]
    sd["v_proj.weight"] = qkv[(NH + NKV) * HD :]
    gu = sd.pop("gate_up_proj.weight")  # chunk(2): gate first, then up
    sd["gate_proj.weight"], sd["up_proj.weight"] = gu[:IT], gu[IT:]
    sd = {k: np.ascontiguousarray(v) for k, v in sd.items()}
    fields = _attn_sizes(
        rope_dim=HD // 2,
        rope_scaling="longrope",
        rope_factor=64 / PHI3_ORIGINAL,  # HF: max_position_embeddings / original when no factor
        rope_original_max=PHI3_ORIGINAL,
        rope_short_factor=PHI3_SHORT,
        rope_long_factor=PHI3_LONG,
        norm_eps=1e-5,
        max_positions=64,
    )
    # HF switches to the long set when the sequence is longer than the original maximum.
    seq = 24 if long else 12
    assert (seq > PHI3_ORIGINAL) == long
    hf = _decoder_hf(layer, cfg, Phi3RotaryEmbedding(cfg))
    return Shape(
        f"phi3_longrope_{'long' if long else 'short'}",
        hf,
        [(fields, sd)],
        seq_len=seq,
        rope_set=int(long),
        extra=dict(layer=layer, config=cfg, rope=rope),
    )


def _llama_yarn(variant: str) -> Shape:
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    fields = _attn_sizes(rope_scaling="yarn", rope_factor=4.0, rope_original_max=32, norm_eps=1e-5)
    if variant == "mscale":
        rope.update(beta_fast=16.0, beta_slow=2.0, mscale=0.9, mscale_all_dim=0.6, truncate=False)
        fields.update(
            rope_beta_fast=16.0,
            rope_beta_slow=2.0,
            rope_mscale=0.9,
            rope_mscale_all_dim=0.6,
            rope_truncate=False,
        )
    cfg = _eager(
        LlamaConfig(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_hidden_layers=1,
            rms_norm_eps=1e-5,
            max_position_embeddings=4 * 32,  # factor * original (HF warns otherwise)
            rope_parameters=dict(rope),
        )
    )
    layer = LlamaDecoderLayer(cfg, 0)
    _perturb(layer, 800)
    rotary = LlamaRotaryEmbedding(cfg)
    assert rotary.attention_scaling != 1.0
    hf = _decoder_hf(layer, cfg, rotary)
    return Shape(
        f"llama_yarn_{variant}",
        hf,
        [(fields, _short(_state(layer)))],
        seq_len=48,
        extra=dict(layer=layer, config=cfg, rope=rope),
    )


def _nemotron_h(kind: str) -> Shape:
    cfg = _eager(
        NemotronHConfig(
            hidden_size=D,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            head_dim=HD,
            intermediate_size=IT,
            layers_block_type=["full_attention", "mlp"],
            num_hidden_layers=2,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=1,
            ssm_state_size=16,
            layer_norm_epsilon=1e-5,
            max_position_embeddings=MAX_POS,
        )
    )
    idx = 0 if kind == "attention" else 1
    block = NemotronHBlock(cfg, idx)
    _perturb(block, 900 + idx)
    assert block.block_type == cfg.layers_block_type[idx]
    if kind == "attention":
        fields = _attn_sizes(
            block_parts="attention_only", rope_dim=0, intermediate=0, norm_eps=1e-5
        )
        w = _short(_state(block), {"norm.weight": "input_layernorm.weight"})
    else:
        assert cfg.mlp_hidden_act == "relu2"
        fields = dict(
            d_model=D, intermediate=IT, block_parts="mlp_only", mlp="relu2", norm_eps=1e-5
        )
        w = _short(_state(block), {"norm.weight": "post_attention_layernorm.weight"})

    def run(x):
        xt = torch.from_numpy(np.ascontiguousarray(x))
        pos = torch.arange(x.shape[1])[None, :]
        mask = _mask(cfg, xt, pos, False) if kind == "attention" else None
        with torch.no_grad():
            return block(xt, attention_mask=mask, position_ids=pos).numpy()

    return Shape(f"nemotron_h_{kind}", run, [(fields, w)], extra=dict(layer=block, config=cfg))


def _granite_hybrid(rope: bool) -> Shape:
    cfg = _eager(
        GraniteMoeHybridConfig(
            hidden_size=D,
            shared_intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_local_experts=0,
            layer_types=["full_attention"],
            num_hidden_layers=1,
            position_embedding_type="rope" if rope else None,
            attention_multiplier=0.3,
            residual_multiplier=0.22,
            rms_norm_eps=1e-6,
            mamba_n_heads=8,
            max_position_embeddings=MAX_POS,
        )
    )
    layer = GraniteMoeHybridDecoderLayer(cfg, 0)
    _perturb(layer, 1000 + int(rope))
    assert layer.self_attn is not None and not layer.has_experts
    sd = _state(layer)
    attn_w = {
        k.split(".", 1)[1] if k.startswith("self_attn.") else k: v
        for k, v in sd.items()
        if k.startswith("self_attn.") or k == "input_layernorm.weight"
    }
    gu = sd["shared_mlp.input_linear.weight"]  # chunk(2): act(first) * second
    mlp_w = {
        "post_attention_layernorm.weight": sd["post_attention_layernorm.weight"],
        "gate_proj.weight": np.ascontiguousarray(gu[:IT]),
        "up_proj.weight": np.ascontiguousarray(gu[IT:]),
        "down_proj.weight": sd["shared_mlp.output_linear.weight"],
    }
    attn_f = _attn_sizes(
        block_parts="attention_only",
        rope_dim=HD if rope else 0,
        intermediate=0,
        attn_scale=0.3,
        residual_multiplier=0.22,
        norm_eps=1e-6,
    )
    mlp_f = dict(
        d_model=D, intermediate=IT, block_parts="mlp_only", residual_multiplier=0.22, norm_eps=1e-6
    )
    rotary = GraniteMoeHybridRotaryEmbedding(cfg) if rope else None
    hf = _decoder_hf(layer, cfg, rotary)
    return Shape(
        f"granite_hybrid_{'rope' if rope else 'nope'}",
        hf,
        [(attn_f, attn_w), (mlp_f, mlp_w)],
        extra=dict(layer=layer, config=cfg),
    )


def _stablelm_qk_layernorm(parallel: bool) -> Shape:
    cfg = _eager(
        StableLmConfig(
            hidden_size=D,
            intermediate_size=IT,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            num_hidden_layers=1,
            layer_norm_eps=1e-5,
            partial_rotary_factor=0.25,
            use_qkv_bias=True,
            qk_layernorm=True,
            use_parallel_residual=parallel,
            max_position_embeddings=MAX_POS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )
    layer = StableLmDecoderLayer(cfg, 0)
    _perturb(layer, 1100 + int(parallel))
    sd = _short(_state(layer))
    for qk, n in (("q", NH), ("k", NKV)):
        rows = [sd.pop(f"{qk}_layernorm.norms.{h}.weight") for h in range(n)]
        sd[f"{qk}_norm.weight"] = np.ascontiguousarray(np.stack(rows))
    fields = _attn_sizes(
        norm="layernorm",
        norm_bias=True,
        qkv_bias=True,
        qk_norm=True,
        qk_norm_scope="per_head_weights",
        rope_dim=HD // 4,
        norm_eps=1e-5,
        norm_placement="parallel" if parallel else "pre",
    )
    hf = _decoder_hf(layer, cfg, StableLmRotaryEmbedding(cfg))
    name = "stablelm2_12b_parallel" if parallel else "stablelm_qk_layernorm"
    return Shape(name, hf, [(fields, sd)], extra=dict(layer=layer, config=cfg))


BUILDERS = {
    "gemma2_sliding": lambda: _gemma2(0),
    "gemma2_global": lambda: _gemma2(1),
    "gemma3_sliding": lambda: _gemma3(0),
    "gemma3_global": lambda: _gemma3(1),
    "olmo2": _olmo2,
    "smollm3_rope": lambda: _smollm3(0),
    "smollm3_nope": lambda: _smollm3(1),
    "granite": _granite,
    "phi3_longrope_short": lambda: _phi3(False),
    "phi3_longrope_long": lambda: _phi3(True),
    "llama_yarn_plain": lambda: _llama_yarn("plain"),
    "llama_yarn_mscale": lambda: _llama_yarn("mscale"),
    "nemotron_h_attention": lambda: _nemotron_h("attention"),
    "nemotron_h_mlp": lambda: _nemotron_h("mlp"),
    "granite_hybrid_rope": lambda: _granite_hybrid(True),
    "granite_hybrid_nope": lambda: _granite_hybrid(False),
    "stablelm_qk_layernorm": lambda: _stablelm_qk_layernorm(False),
    "stablelm2_12b_parallel": lambda: _stablelm_qk_layernorm(True),
}
_CACHE: dict = {}


def get_shape(name: str) -> Shape:
    if name not in _CACHE:
        torch.manual_seed(0)
        _CACHE[name] = BUILDERS[name]()
    return _CACHE[name]


# --------------------------------------------------------------------------- the core


def make_core(fields: dict, weights: dict, compact: bool = True):
    cfg = _core.TransformerConfig()
    for k, v in fields.items():
        setattr(cfg, k, getattr(ENUMS[k], v) if k in ENUMS else v)
    cfg.compact_weights = compact
    w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    return _core.TransformerCore(cfg, w)


class Block:
    """One core and its K/V cache for a batch (a decode session's state, by hand)."""

    def __init__(self, core, fields: dict, batch: int, max_tokens: int, rope_set: int = 0):
        self.core, self.rope_set = core, rope_set
        n_kv, hd = fields.get("n_kv_heads", 0), fields.get("head_dim", 0)
        window = fields.get("window", 0)
        cap = min(window, max_tokens) if window else max_tokens
        if fields.get("block_parts") == "mlp_only":
            n_kv = hd = cap = 0
        self.k = np.zeros((batch, n_kv, cap, hd), np.float32)
        self.v = np.zeros_like(self.k)
        self.start = np.zeros(batch, np.int64)

    def __call__(self, x: np.ndarray, lengths=None) -> np.ndarray:
        B, L, _ = x.shape
        lens = np.full(B, L, np.int64) if lengths is None else np.asarray(lengths, np.int64)
        y = self.core.forward(
            np.ascontiguousarray(x, np.float32),
            lens,
            self.start.copy(),
            self.k,
            self.v,
            rope_set=self.rope_set,
        )
        assert y is not None
        self.start += lens
        return y


def core_forward(shape: Shape, x: np.ndarray, chunks=None, lengths=None, compact=True):
    """Our block(s) on x; each core gets its own state; chunks split the call along L."""
    B, L, _ = x.shape
    blocks = [
        Block(make_core(f, w, compact), f, B, f.get("max_positions", MAX_POS), shape.rope_set)
        for f, w in shape.cores
    ]
    bounds = np.cumsum([0] + list(chunks or [L]))
    assert bounds[-1] == L
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        h = x[:, a:b]
        lens = None
        if lengths is not None:
            lens = np.clip(np.asarray(lengths) - a, 0, b - a)
        for blk in blocks:
            h = blk(h, lens)
        outs.append(h)
    return np.concatenate(outs, axis=1)


def make_x(batch: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, D)).astype(np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shapes {a.shape} != {b.shape}"
    diff = bits(a) != bits(b)
    if diff.any():
        idx = tuple(int(i) for i in np.argwhere(diff)[0])
        raise AssertionError(f"{what}: {int(diff.sum())} elements differ, first at {idx}")


# --------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_matches_hf(name):
    shape = get_shape(name)
    x = make_x(2, shape.seq_len, seed=7)
    want = shape.hf(x)
    got = core_forward(shape, x)
    err = float(np.max(np.abs(got - want)))
    print(f"{name}: max |core - HF| = {err:.3g}")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


def test_settings_have_effect():
    """Each new setting changes the output (a setting silently ignored would pass the rest)."""
    x = make_x(1, 12, seed=3)
    base_f, w = get_shape("olmo2").cores[0]
    ref = core_forward(Shape("t", None, [(base_f, w)]), x)
    variants = {
        "qk_norm_scope": dict(qk_norm_scope="head"),
        "rope_dim": dict(rope_dim=0),
        "attn_scale": dict(attn_scale=0.2),
        "residual_multiplier": dict(residual_multiplier=0.5),
    }
    for name, change in variants.items():
        f = dict(base_f, **change)
        ww = dict(w)
        if name == "qk_norm_scope":
            ww["q_norm.weight"] = w["q_norm.weight"][:HD].copy()
            ww["k_norm.weight"] = w["k_norm.weight"][:HD].copy()
        got = core_forward(Shape("t", None, [(f, ww)]), x)
        assert not np.array_equal(got, ref), name
    # longrope: the two sets differ (both built in the core)
    core = make_core(*get_shape("phi3_longrope_long").cores[0])
    sets, factor = core.rope_tables
    assert len(sets) == 2 and sets[0] != sets[1] and factor != 1.0


def _hf_rope_tables(name: str):
    """HF's float32 inv_freq set(s) and attention factor for the same RoPE parameters."""
    if name.startswith("llama_yarn"):
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        if name.endswith("mscale"):
            rope.update(
                beta_fast=16.0, beta_slow=2.0, mscale=0.9, mscale_all_dim=0.6, truncate=False
            )
        cfg = LlamaConfig(
            hidden_size=D,
            num_attention_heads=NH,
            num_key_value_heads=NKV,
            max_position_embeddings=4 * 32,
            rope_parameters=rope,
        )
        rot = LlamaRotaryEmbedding(cfg)
        return [rot.inv_freq.numpy()], rot.attention_scaling
    cfg = Phi3Config(
        hidden_size=D,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        max_position_embeddings=64,
        original_max_position_embeddings=PHI3_ORIGINAL,
        partial_rotary_factor=0.5,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": PHI3_SHORT,
            "long_factor": PHI3_LONG,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": PHI3_ORIGINAL,
        },
    )
    rot = Phi3RotaryEmbedding(cfg)
    short = rot.inv_freq.numpy().copy()
    rot(torch.zeros(1, 1, D), torch.arange(PHI3_ORIGINAL + 4)[None, :])  # HF switches to long
    return [short, rot.inv_freq.numpy()], rot.attention_scaling


@pytest.mark.parametrize("name", ["llama_yarn_plain", "llama_yarn_mscale", "phi3_longrope_long"])
def test_rope_tables_match_hf(name):
    """yarn / longrope inv_freq within a float32 ulp or so of HF's tables; the same factor."""
    sets, factor = make_core(*get_shape(name).cores[0]).rope_tables
    want, want_factor = _hf_rope_tables(name)
    assert len(sets) == len(want)
    for got_set, want_set in zip(sets, want):
        np.testing.assert_allclose(np.array(got_set, np.float32), want_set, rtol=3e-7)
    assert np.float32(factor) == np.float32(want_factor)


# --------------------------------------------------------------------------- bits

BIT_SHAPES = sorted(BUILDERS)


def _threads(n: int):
    class _T:
        def __enter__(self):
            self.before = _core.get_num_threads()
            _core.set_num_threads(n)

        def __exit__(self, *exc):
            _core.set_num_threads(self.before)

    return _T()


def _isa(name: str):
    class _I:
        def __enter__(self):
            self.before = _core.get_isa()
            _core.set_isa(name)

        def __exit__(self, *exc):
            _core.set_isa(self.before)

    return _I()


@pytest.mark.parametrize("name", BIT_SHAPES)
def test_decode_prefill_chunks_bitwise(name):
    shape = get_shape(name)
    L = shape.seq_len
    x = make_x(2, L, seed=11)
    full = core_forward(shape, x)
    steps = core_forward(shape, x, chunks=[1] * L)
    assert_bits(steps, full, f"{name}: token by token vs prefill")
    split = core_forward(shape, x, chunks=[5, 7, L - 12])
    assert_bits(split, full, f"{name}: chunks 5/7/rest vs prefill")
    other = core_forward(shape, x, compact=False)
    assert_bits(other, full, f"{name}: float32 panels vs compact")


@pytest.mark.parametrize("name", BIT_SHAPES)
def test_ragged_row_equals_row_alone(name):
    shape = get_shape(name)
    L = shape.seq_len
    x = make_x(3, L, seed=13)
    lengths = [L, L - 6, 0]
    both = core_forward(shape, x, lengths=lengths, chunks=[9, L - 9])
    for b, n in enumerate(lengths):
        alone = core_forward(shape, x[b : b + 1, :n]) if n else None
        if n:
            assert_bits(both[b : b + 1, :n], alone, f"{name}: row {b} in a ragged batch")
        assert not bits(both[b, n:]).any(), f"{name}: padding of row {b} not +0.0"


@pytest.mark.parametrize("name", BIT_SHAPES)
def test_threads_and_isas_bitwise(name):
    shape = get_shape(name)
    x = make_x(2, shape.seq_len, seed=17)
    with _threads(1):
        with _isa("scalar"):
            ref = core_forward(shape, x)
            ref_steps = core_forward(shape, x[:, :6], chunks=[1] * 6)
    for isa in _core.available_isas():
        for n in (1, 2, 3):
            with _threads(n), _isa(isa):
                got = core_forward(shape, x)
                steps = core_forward(shape, x[:, :6], chunks=[1] * 6)
            assert_bits(got, ref, f"{name}: {isa} with {n} threads vs scalar, 1 thread")
            assert_bits(steps, ref_steps, f"{name}: {isa} decode with {n} threads")


def test_arithmetic_version_unchanged():
    assert _core.arithmetic_version() == "fp32-identical-1"
