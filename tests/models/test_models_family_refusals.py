"""Configs the families cannot follow exactly are refused, naming the field (no weights read)."""

from __future__ import annotations

import pytest

import exactblocks


def _refused(config: dict, match: str):
    # an empty state dict: the family's config reader refuses before any tensor is looked at
    with pytest.raises(ValueError, match=match):
        exactblocks.load_model({}, config=config)


def test_granite_4_h_moe_is_refused():
    _refused(
        {"architectures": ["GraniteMoeHybridForCausalLM"], "num_local_experts": 4},
        r"num_local_experts=4: .*MoE is out of scope",
    )
    # the class default (8 experts) is MoE too
    _refused({"model_type": "granitemoehybrid"}, r"num_local_experts=8")


def test_nemotron_h_pattern_letters():
    _refused(
        {"model_type": "nemotron_h", "hybrid_override_pattern": "M*X-"},
        r"hybrid_override_pattern\[2\]='X' is not supported by the nemotron_h family",
    )
    _refused(
        {"model_type": "nemotron_h", "hybrid_override_pattern": "M*E-"},
        r"hybrid_override_pattern\[2\]='E' is an MoE layer; MoE is out of scope",
    )
    _refused(
        {"model_type": "nemotron_h", "layers_block_type": ["mamba", "cross_attention"]},
        r"layers_block_type\[1\]='cross_attention' is not supported",
    )
    _refused(
        {"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "mamba_hidden_act": "gelu"},
        r"'mamba_hidden_act'='gelu' is not supported",
    )


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"model_type": "phi3", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            r"rope_parameters\['rope_type'\]='linear' is not supported by the phi3 family",
        ),
        (
            {
                "model_type": "gemma3_text",
                "rope_parameters": {
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0},
                    "sliding_attention": {"rope_type": "default"},
                },
            },
            r"rope_parameters\['full_attention'\]\['rope_type'\]='dynamic' is not supported",
        ),
        (
            {"model_type": "olmo2", "rope_scaling": {"rope_type": "ntk", "factor": 2.0}},
            r"rope_scaling\['rope_type'\]='ntk' is not supported by the olmo2 family",
        ),
        (
            {"model_type": "smollm3", "rope_parameters": {"rope_type": "yarn", "foo": 1}},
            r"rope_parameters keys \['foo'\]",
        ),
        (
            {"model_type": "granite", "partial_rotary_factor": 0.5},
            r"'partial_rotary_factor'=0.5 is not supported by the granite family",
        ),
    ],
)
def test_unsupported_rope(config, match):
    _refused(config, match)


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"model_type": "gemma2", "use_bidirectional_attention": True},
            r"'use_bidirectional_attention'=True is not supported",
        ),  # fmt: skip
        (
            {"model_type": "gemma2", "hidden_activation": "relu"},
            r"'hidden_activation'='relu' is not supported by the gemma2 family",
        ),  # fmt: skip
        (
            {"model_type": "starcoder2", "hidden_act": "silu"},
            r"'hidden_act'='silu' is not supported by the starcoder2 family",
        ),  # fmt: skip
        (
            {"model_type": "smollm3", "num_hidden_layers": 2, "no_rope_layers": [1, 2]},
            r"'no_rope_layers'=\[1, 2\] is not supported",
        ),  # fmt: skip
        (
            {"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": ["local", "x"]},
            r"layer_types\[0\]='local' is not supported",
        ),  # fmt: skip
        (
            {"model_type": "granite", "logits_scaling": 0},
            r"'logits_scaling'=0 is not supported by the granite family",
        ),  # fmt: skip
    ],
)
def test_other_field_refusals(config, match):
    _refused(config, match)


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"model_type": "qwen3_moe", "capacity_factor": 1.25},
            r"'capacity_factor'=1.25 is not supported by the qwen3_moe family: the MoE block "
            r"routes every token",
        ),
        (
            {"model_type": "mixtral", "router_jitter_noise": 0.01},
            r"'router_jitter_noise'=0.01 is not supported by the mixtral family",
        ),
        (
            {"model_type": "olmoe", "n_group": 4},
            r"'n_group'=4 is not supported by the olmoe family",
        ),
        (
            {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 5},
            r"num_experts_per_tok=5 exceeds the 4 experts \(num_experts\)",
        ),
        (
            {"model_type": "mixtral", "num_experts": 4, "num_local_experts": 8},
            r"num_experts=4 and num_local_experts=8 disagree",
        ),
        (
            {"model_type": "olmoe", "clip_qkv": 8.0},
            r"'clip_qkv'=8.0 is not supported by the olmoe family",
        ),
        (
            {"model_type": "qwen3_moe", "use_sliding_window": True},
            r"'use_sliding_window'=True is not supported by the qwen3_moe family yet",
        ),
        (
            {"model_type": "qwen3_moe", "mlp_only_layers": [99]},
            r"'mlp_only_layers'=\[99\] must list layer indices in \[0, 24\)",
        ),
    ],
)
def test_moe_options_the_blocks_cannot_follow(config, match):
    _refused(config, match)
