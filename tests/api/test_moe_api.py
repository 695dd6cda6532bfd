"""The MoE options of TransformerBlockInference: what is refused, and the attributes (SPEC.md
4.1, 4.2, 4.8)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import MOE_E, make_moe_weights

import exactblocks as eb

OPTS = dict(n_heads=4, qk_norm=True, num_experts=MOE_E, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def weights():
    return make_moe_weights(np.random.default_rng(0))


def test_attributes_and_params(weights):
    blk = eb.TransformerBlockInference(weights, **OPTS, norm_topk_prob=True)
    assert (blk.num_experts, blk.num_experts_per_tok, blk.norm_topk_prob) == (MOE_E, 2, True)
    assert blk.shared_expert is False and blk.intermediate == 32  # the experts' width
    twin = eb.TransformerBlockInference(weights, **blk.get_params())
    assert twin.fingerprint == blk.fingerprint
    other = eb.TransformerBlockInference(weights, **OPTS)  # norm_topk_prob changes the identity
    assert other.fingerprint != blk.fingerprint


def test_experts_live_only_in_the_core(weights):
    blk = eb.TransformerBlockInference(
        dict(weights, **make_moe_weights(np.random.default_rng(1), shared=24)),
        **OPTS,
        shared_expert=True,
    )
    kept = blk._impl.weights  # noqa: SLF001 - what the block holds besides the core
    assert set(kept._small) == {  # noqa: SLF001
        "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
        "k_norm.weight",
    }  # fmt: skip
    w = make_moe_weights(np.random.default_rng(1), shared=24)
    for name, a in w.items():  # rebuilt from the packed experts: the weights given, bit for bit
        assert np.array_equal(np.asarray(kept[name]).view(np.uint32), a.view(np.uint32)), name


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(num_experts_per_tok=7),
            r"num_experts_per_tok=7 must be an int in \[1, num_experts=6\]",
        ),
        (dict(num_experts_per_tok=None), r"num_experts_per_tok=None must be an int in \[1,"),
        (dict(num_experts=0), r"num_experts_per_tok=2 is an MoE option, but num_experts=0"),
        (dict(mlp="gelu"), r"MoE experts are gated MLPs without biases"),
        (dict(mlp_bias=True), r"MoE experts are gated MLPs without biases"),
        (
            dict(num_experts=5),
            r"experts.gate_up_proj'\] has shape \(6, 64, 64\); expected "
            r"\(num_experts=5",
        ),  # fmt: skip
    ],
)
def test_bad_options_are_refused(weights, change, match):
    with pytest.raises(ValueError, match=match):
        eb.TransformerBlockInference(weights, **{**OPTS, **change})


def test_weights_of_the_other_mlp_are_refused(weights):
    dense = dict(weights, **{"up_proj.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(ValueError, match=r"up_proj.weight"):
        eb.TransformerBlockInference(dense, **OPTS)
    missing = {k: v for k, v in weights.items() if k != "router.weight"}
    with pytest.raises(ValueError, match=r"router.weight"):
        eb.TransformerBlockInference(missing, **OPTS)
    with pytest.raises(ValueError, match=r"look like an MoE layer .*; pass num_experts=6 and"):
        eb.TransformerBlockInference(weights, n_heads=4, qk_norm=True)
    bad = dict(weights, **{"experts.down_proj": weights["experts.down_proj"][:, :, :16].copy()})
    with pytest.raises(ValueError, match=r"experts.down_proj'\] has shape \(6, 64, 16\); expected "
                                         r"\(6, 64, 32\)"):  # fmt: skip
        eb.TransformerBlockInference(bad, **OPTS)
    with pytest.raises(ValueError, match=r"shared_expert"):  # shared weights are absent
        eb.TransformerBlockInference(weights, **OPTS, shared_expert=True)
