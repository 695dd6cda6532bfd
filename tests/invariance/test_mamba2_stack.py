"""A stack of Mamba-2 blocks decoding a batch with continuous batching (SPEC.md 3.1, 8, 9).

Several Mamba2BlockInference layers with random weights (fixed seed) serve more sequences than
batch slots. Each tick, every slot either prefills a chunk of its prompt, decodes one token,
or stays idle (``lengths[b] = 0``); a finished sequence leaves its slot through
``state.reset([slot])`` in every layer and the next sequence joins there. Every sequence's
outputs must be bitwise equal to that sequence run alone through the stack in one
``forward`` per layer, idle rows must stay byte-identical, and padding must come out +0.0.
"""

from __future__ import annotations

import numpy as np
from helpers import assert_bitwise_equal

import exactblocks as eb

N_LAYERS, D, SLOTS = 3, 20, 3
# (d_inner, n_heads, d_state, n_groups, conv kernel, conv bias, projection biases) per layer.
LAYERS = [
    (40, 4, 6, 2, 4, True, False),
    (30, 5, 3, 1, 3, False, True),
    (24, 6, 4, 3, 2, True, True),
]


def make_layer(rng, di, nh, ns, ng, k, conv_bias, proj_bias):
    cd = di + 2 * ng * ns

    def r(*shape, s=0.2):
        return (s * rng.standard_normal(shape)).astype(np.float32)

    dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), nh))
    w = {
        "block_norm.weight": 1 + r(D, s=0.1),
        "in_proj.weight": r(di + cd + nh, D, s=D**-0.5),
        "conv1d.weight": r(cd, 1, k, s=0.5),
        "dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),
        "A_log": np.log(rng.uniform(1, 16, nh)).astype(np.float32),
        "D": 1 + r(nh, s=0.1),
        "norm.weight": 1 + r(di, s=0.1),
        "out_proj.weight": r(D, di, s=di**-0.5),
    }
    if conv_bias:
        w["conv1d.bias"] = r(cd)
    if proj_bias:
        w["in_proj.bias"], w["out_proj.bias"] = r(di + cd + nh), r(D)
    return eb.Mamba2BlockInference(w, n_groups=ng, dt_limit=(0.0, 0.08))


def run_stack(layers, x, states=None, lengths=None):
    for i, blk in enumerate(layers):
        x = blk.forward(x, None if states is None else states[i], lengths=lengths)
    return x


def test_stack_continuous_batching_equals_sequences_alone():
    rng = np.random.default_rng(2024)
    layers = [make_layer(rng, *cfg) for cfg in LAYERS]
    # 7 sequences of different lengths (prompt + generated tokens), more than the 3 slots.
    seq_lens = [9, 3, 14, 1, 6, 11, 5]
    seqs = [rng.standard_normal((n, D)).astype(np.float32) for n in seq_lens]
    alone = [run_stack(layers, s[None])[0] for s in seqs]

    states = [blk.allocate_state(SLOTS) for blk in layers]
    slot_seq = [-1] * SLOTS  # which sequence occupies each slot (-1: empty)
    pos = [0] * SLOTS  # tokens of that sequence already fed
    queue = list(range(len(seqs)))
    outs = {i: [] for i in range(len(seqs))}
    ticks = joins = idle_checks = 0
    while queue or any(s >= 0 for s in slot_seq):
        ticks += 1
        for b in range(SLOTS):  # free slots take the next waiting sequence
            if slot_seq[b] < 0 and queue and rng.random() < 0.7:
                for st in states:
                    st.reset([b])
                slot_seq[b], pos[b] = queue.pop(0), 0
                joins += 1
        lc = int(rng.integers(1, 5))  # this tick's width: a prefill chunk or a decode step
        lens = np.zeros(SLOTS, np.int64)
        x = np.full((SLOTS, lc, D), np.nan, np.float32)  # padding: never read
        for b in range(SLOTS):
            if slot_seq[b] < 0 or rng.random() < 0.25:
                continue  # empty or deliberately idle this tick
            s = seqs[slot_seq[b]]
            n = min(int(rng.integers(1, lc + 1)), len(s) - pos[b])
            lens[b] = n
            x[b, :n] = s[pos[b] : pos[b] + n]
        idle = {
            b: [(st.conv_window[b].tobytes(), st.h[b].tobytes()) for st in states]
            for b in range(SLOTS)
            if lens[b] == 0
        }
        before_rt = [st.row_tokens.copy() for st in states]
        y = run_stack(layers, x, states, lengths=lens)
        for b in range(SLOTS):
            assert (y[b, lens[b] :].view(np.uint32) == 0).all(), "padding must be +0.0"
            for li, st in enumerate(states):
                assert st.row_tokens[b] == before_rt[li][b] + lens[b]
            if b in idle:
                idle_checks += 1
                assert idle[b] == [
                    (st.conv_window[b].tobytes(), st.h[b].tobytes()) for st in states
                ], f"idle slot {b} touched"
                continue
            outs[slot_seq[b]].append(y[b, : lens[b]])
            pos[b] += int(lens[b])
            if pos[b] == len(seqs[slot_seq[b]]):
                slot_seq[b] = -1  # the sequence leaves; its slot is reset on reuse
        assert ticks < 500
    assert joins == len(seqs) and idle_checks > 0
    for i, s in enumerate(seqs):
        got = np.concatenate(outs[i], axis=0)
        assert_bitwise_equal(got, alone[i], f"sequence {i} (length {len(s)})")


def test_stack_step_decode_after_batched_prefill():
    """Prefill ragged prompts in one call per layer, then decode with step: == alone."""
    rng = np.random.default_rng(7)
    layers = [make_layer(rng, *cfg) for cfg in LAYERS]
    prompts = [4, 1, 6]
    total = 9
    x = rng.standard_normal((SLOTS, total, D)).astype(np.float32)
    alone = [run_stack(layers, x[b : b + 1, :total]) for b in range(SLOTS)]
    states = [blk.allocate_state(SLOTS) for blk in layers]
    y0 = run_stack(layers, x[:, : max(prompts)], states, lengths=prompts)
    for b, p in enumerate(prompts):
        assert_bitwise_equal(y0[b, :p], alone[b][0, :p], f"prefill row {b}")
    # Rows then advance one token per call; rows whose prompt was shorter catch up with
    # lengths (1 where the row still has tokens, else 0) until all have consumed `total`.
    pos = list(prompts)
    got = [[y0[b, :p]] for b, p in enumerate(prompts)]
    while min(pos) < total:
        lens = [1 if p < total else 0 for p in pos]
        xt = np.stack([x[b, min(pos[b], total - 1)] for b in range(SLOTS)])[:, None]
        if all(lens):
            y = xt
            for blk, st in zip(layers, states):
                y = blk.step(y, st)
        else:
            y = run_stack(layers, xt, states, lengths=lens)
        for b in range(SLOTS):
            if lens[b]:
                got[b].append(y[b, :1])
                pos[b] += 1
    for b in range(SLOTS):
        assert_bitwise_equal(np.concatenate(got[b]), alone[b][0], f"row {b}")
