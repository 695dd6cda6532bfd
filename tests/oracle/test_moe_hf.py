"""The MoE MLP block against HF and a float64 reference (SPEC.md 4.6, 4.8).

HF layers (transformers 5.23, float32, eager attention) built from their own ``state_dict()``:
``Qwen3MoeDecoderLayer`` (top-k renormalised or not, top-k = every expert) and
``Qwen2MoeDecoderLayer`` (shared expert with its sigmoid gate), within rtol = atol = 2e-4.
Routing edge cases against a float64 reference of SPEC.md 4.8 whose routing the test asserts:
tied router logits (equal values pick the lower expert index: a stable descending sort; HF's
torch.topk leaves the order of exact ties to its implementation, SPEC.md 4.8), an expert no
token chooses and one every token chooses, top-k = every expert.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import MOE_E as E
from helpers import make_moe_weights, routed_moe_inputs
from reference.moe_ref import moe_mlp_ref

import exactblocks as eb

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = ATOL = 2e-4
D = 64


def _hf_layer(kind: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    base = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                num_hidden_layers=1, vocab_size=32)  # fmt: skip
    base.update(kw)
    if kind == "qwen3":
        mod = transformers.models.qwen3_moe.modeling_qwen3_moe
        cfg = transformers.Qwen3MoeConfig(**base)
        layer_cls, rope_cls = mod.Qwen3MoeDecoderLayer, mod.Qwen3MoeRotaryEmbedding
    else:
        mod = transformers.models.qwen2_moe.modeling_qwen2_moe
        cfg = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=48, **base)
        layer_cls, rope_cls = mod.Qwen2MoeDecoderLayer, mod.Qwen2MoeRotaryEmbedding
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    layer = layer_cls(cfg, 0).float().eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.2)
            if "norm" in name:
                p.add_(1.0)
    return layer, rope_cls(cfg), cfg


def _hf_forward(layer, rope, x: np.ndarray) -> np.ndarray:
    b, n, _ = x.shape
    xt = torch.from_numpy(x)
    pos = torch.arange(n)[None].expand(b, n)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None].expand(b, 1, n, n)
    with torch.no_grad():
        out = layer(xt, attention_mask=mask, position_embeddings=rope(xt, pos), position_ids=pos)
    return (out[0] if isinstance(out, tuple) else out).numpy()


def _block(layer, cfg, **extra):
    sd = {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
    opts = dict(n_heads=cfg.num_attention_heads, num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                max_positions=64)  # fmt: skip
    opts.update(extra)
    return eb.TransformerBlockInference(sd, **opts), sd


CASES = {
    "qwen3_top2_norm": ("qwen3", {}),
    "qwen3_top3_raw": ("qwen3", dict(num_experts_per_tok=3, norm_topk_prob=False)),
    "qwen3_top_all": ("qwen3", dict(num_experts_per_tok=6)),
    "qwen3_top1": ("qwen3", dict(num_experts_per_tok=1, norm_topk_prob=False)),
    "qwen2_shared": ("qwen2", dict(num_experts_per_tok=2, norm_topk_prob=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_block_matches_hf_layer(name):
    kind, kw = CASES[name]
    layer, rope, cfg = _hf_layer(kind, **kw)
    extra = dict(qk_norm=True) if kind == "qwen3" else dict(qkv_bias=True, shared_expert=True)
    blk, _ = _block(layer, cfg, **extra)
    x = np.random.default_rng(1).standard_normal((2, 9, D)).astype(np.float32)
    got, want = blk.forward(x), _hf_forward(layer, rope, x)
    print(f"{name}: max |y - HF| = {float(np.abs(got - want).max()):.3g}")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------- float64 reference, MLP only


@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_expert_chosen_by_none_and_by_all_match_reference(top_k):
    w = make_moe_weights(np.random.default_rng(0), block_parts="mlp", router_eye=True)
    x = routed_moe_inputs()
    blk = eb.TransformerBlockInference(w, block_parts="mlp", num_experts=E,
                                       num_experts_per_tok=top_k, norm_topk_prob=True)  # fmt: skip
    want, order = moe_mlp_ref(w, x, top_k, True)
    chosen = set(order.reshape(-1).tolist())
    if top_k < E:
        assert E - 1 not in chosen  # expert 5: chosen by no token
        assert (order[[0, 3]] == 0).any(-1).all()  # expert 0: every token of rows 0 and 3
    else:
        assert chosen == set(range(E))
    got = blk.forward(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 3])
def test_tied_router_logits_pick_the_lower_expert_index(top_k):
    # router = 4 * identity: x[..., 4] = x[..., 1] makes experts 1 and 4 tie exactly (one
    # product each), above the others; with a zero router every expert ties
    w = make_moe_weights(np.random.default_rng(4), block_parts="mlp", router_eye=True)
    n = w["post_attention_layernorm.weight"]
    n[4] = n[1]  # h = rmsnorm(x) * n: equal x and n give equal h, so equal logits
    x = routed_moe_inputs()
    x[..., 1] = 5.0
    x[..., 4] = 5.0
    opts = dict(block_parts="mlp", num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=False)
    got = eb.TransformerBlockInference(w, **opts).forward(x)
    want, order = moe_mlp_ref(w, x, top_k, False)
    assert (order[..., 0] == 1).all()
    if top_k > 1:
        assert (order[..., 1] == 4).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if top_k == 1:  # experts 1 and 4 exchanged: the output changes, the tie was decided
        swapped = dict(w)
        for k in ("experts.gate_up_proj", "experts.down_proj"):
            swapped[k] = w[k][[0, 4, 2, 3, 1, 5]].copy()
        other = eb.TransformerBlockInference(swapped, **opts).forward(x)
        assert np.abs(other - got).max() > 1e-3
    zero = dict(w, **{"router.weight": np.zeros_like(w["router.weight"])})
    want, order = moe_mlp_ref(zero, x, top_k, False)
    assert (order == np.arange(top_k)).all()  # experts 0 .. top_k - 1
    got = eb.TransformerBlockInference(zero, **opts).forward(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
