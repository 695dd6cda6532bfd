"""Bitwise invariance of the MoE MLP block (SPEC.md 3.1, 4.8).

Outputs compared as ``view(np.uint32)``: forward == steps == chunk splits; a row in a batch ==
that row alone when the rows route to disjoint, overlapping and identical experts (so a
token's output does not depend on which tokens shared its experts); 1 thread == 2, 3, 8;
every SIMD path == scalar; compact expert storage == float32 panels.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import MOE_D, MOE_E, force_num_threads, make_moe_weights, routed_moe_inputs

import exactblocks as eb
from exactblocks import _ext

D, E, H = MOE_D, MOE_E, 4


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bits(a, b, what=""):
    assert a.shape == b.shape, what
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} elements differ"


def moe_block(*, shared=0, top_k=2, norm_topk=True, block_parts="full", seed=0, **kw):
    w = make_moe_weights(np.random.default_rng(seed), shared=shared, block_parts=block_parts, **kw)
    opts = dict(num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=norm_topk,
                shared_expert=bool(shared), block_parts=block_parts)  # fmt: skip
    if block_parts == "full":
        opts.update(n_heads=H, qk_norm=True)
    return eb.TransformerBlockInference(w, **opts)


BLOCKS = {
    "top2_norm": dict(),
    "top1": dict(top_k=1, norm_topk=False),
    "top_all": dict(top_k=E),  # every expert on every token
    "shared": dict(shared=24, top_k=3, norm_topk=False),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_forward_equals_steps_and_chunks(name):
    blk = moe_block(**BLOCKS[name])
    x = np.random.default_rng(1).standard_normal((3, 13, D)).astype(np.float32)
    ref = blk.forward(x)
    st = blk.allocate_state(3, 13)
    steps = np.concatenate([blk.step(x[:, t], st) for t in range(13)], axis=1)
    assert_bits(ref, steps, f"{name}: steps")
    st = blk.allocate_state(3, 13)
    chunks = [blk.forward(x[:, a:b], st) for a, b in ((0, 5), (5, 6), (6, 13))]
    assert_bits(ref, np.concatenate(chunks, axis=1), f"{name}: chunks")


def test_rows_with_disjoint_overlapping_and_same_experts_equal_rows_alone():
    blk = moe_block(block_parts="mlp", router_eye=True)
    x = routed_moe_inputs()
    batch = blk.forward(x)
    for b in range(4):
        assert_bits(batch[b], blk.forward(x[b : b + 1])[0], f"row {b}")
        for t in range(5):  # and each token alone
            assert_bits(batch[b, t], blk.forward(x[b : b + 1, t : t + 1])[0, 0], f"({b},{t})")
    lengths = [5, 2, 0, 3]  # ragged: padding rows and tokens change nothing either
    ragged = blk.forward(x, lengths=lengths)
    for b, n in enumerate(lengths):
        assert_bits(ragged[b, :n], batch[b, :n], f"ragged row {b}")
        assert not ragged[b, n:].any()


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_threads_do_not_change_bits(name):
    blk = moe_block(**BLOCKS[name])
    x = np.random.default_rng(6).standard_normal((3, 21, D)).astype(np.float32)
    saved = eb.get_num_threads()
    try:
        got = []
        for n in (1, 2, 3, 8):
            force_num_threads(n)
            st = blk.allocate_state(3, 22)
            got.append((blk.forward(x, st), blk.step(x[:, 0], st)))
    finally:
        eb.set_num_threads(saved)
    for (y, s), n in zip(got[1:], (2, 3, 8)):
        assert_bits(got[0][0], y, f"{name}: 1 vs {n} threads")
        assert_bits(got[0][1], s, f"{name}: step 1 vs {n} threads")


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_every_isa_equals_scalar(name):
    core = _ext.core()
    blk = moe_block(**BLOCKS[name])
    x = np.random.default_rng(7).standard_normal((2, 9, D)).astype(np.float32)
    saved = core.get_isa()
    got = {}
    try:
        for isa in core.available_isas():
            core.set_isa(isa)
            st = blk.allocate_state(2, 10)
            got[isa] = (blk.forward(x, st), blk.step(x[:, 0], st))
    finally:
        core.set_isa(saved)
    for isa, (y, s) in got.items():
        assert_bits(got["scalar"][0], y, f"{name}: {isa} vs scalar")
        assert_bits(got["scalar"][1], s, f"{name}: step {isa} vs scalar")


def test_bf16_experts_are_stored_compactly_with_the_same_bits():
    rng = np.random.default_rng(8)
    w = make_moe_weights(rng, shared=24)
    for k in ("experts.gate_up_proj", "experts.down_proj", "shared_expert.up_proj.weight"):
        w[k] = (w[k].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bf16 values
    opts = dict(n_heads=H, qk_norm=True, num_experts=E, num_experts_per_tok=2, shared_expert=True)
    blk = eb.TransformerBlockInference(w, **opts)
    storage = {n: f for n, f, _ in blk.weight_storage()}
    assert storage["experts.0.gate_up_proj"] == "bf16" and storage["experts.5.down_proj"] == "bf16"
    assert storage["router"] == "float32" and storage["shared_expert.down_proj"] == "float32"
    f32 = blk._float32_storage_copy()  # noqa: SLF001 - the test hook for storage bits
    assert {f for _, f, _ in f32.weight_storage()} == {"float32"}
    x = rng.standard_normal((2, 7, D)).astype(np.float32)
    assert_bits(blk.forward(x), f32.forward(x), "bf16 vs float32 panels")
    st, st32 = blk.allocate_state(2, 8), f32.allocate_state(2, 8)
    blk.forward(x, st)
    f32.forward(x, st32)
    assert_bits(blk.step(x[:, 0], st), f32.step(x[:, 0], st32), "bf16 vs float32 step")
