"""Where one SmolLM2-135M decode step spends its time: GEMVs, the rest of the blocks, the head.

``python -m benchmarks.decode_profile [--rounds N] [--threads T] [--context P]`` loads
SmolLM2-135M-Instruct from its GGUF (``exactblocks.load_model``), fills a state with a
``--context``-token prompt, and times, interleaved round by round (one sample of each per
round; the table gives the best sample and the median, in ms per decode token):

- ``Model.step``: one whole decode step (B = 1);
- ``layers in one native call``: the model's 30 layers as ``Model.step`` runs them (one
  ``_core.layer_stack`` call, ``Model._stack_run``), so ``step - layers`` is the head,
  the embedding row and the model's own Python;
- ``blocks``: the model's 30 blocks stepped one after the other through their public
  ``block.step`` (states filled with ``--context`` positions), with each call's Python checks;
- ``  GEMVs``: the four projections of a layer (q|k|v fused 960 x 576, o 576 x 576, gate|up
  fused 3072 x 576, down 576 x 1536; q4_1 ``PackedLinear``, 30 distinct copies of each, as the
  30 layers: streamed, not cached), i.e. the weight part of ``blocks``;
- ``  call overhead``: 30 ``step`` calls of a tiny block (d_model 32: no arithmetic to speak
  of), i.e. the Python checks and dispatch of each block call;
- ``  rest of blocks``: ``blocks - GEMVs - call overhead``: attention over the cache, norms,
  RoPE, SwiGLU and residual adds;
- ``head GEMV``: the tied head's GEMV alone (q8_0 49152 x 576 ``PackedLinear``).

The GEMV and head rows hold the same compact formats and shapes as the model (its weights are
``gguf``'s Q4_1 and Q8_0 blocks) with values ``gguf``'s quantiser gives; their time does not
depend on the values. A shared machine's other load only slows samples down: compare the best
samples, and rerun when best and median are far apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import exactblocks
from exactblocks import _ext

from .environment import cpu_model, loadavg
from .gemv_cache import at_least, quantised

LAYER_GEMVS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _tiny_block(max_positions: int):
    rng = np.random.default_rng(3)
    d = 32
    w = {
        f"{n}_proj.weight": (0.1 * rng.standard_normal(s)).astype(np.float32)
        for n, s in [("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d))]
        + [("gate", (d, d)), ("up", (d, d)), ("down", (d, d))]
    }
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        w[n] = np.ones(d, np.float32)
    return exactblocks.TransformerBlockInference(
        w, n_heads=1, n_kv_heads=1, head_dim=d, max_positions=max_positions
    )


def _q4_1(n: int, k: int, rng) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize, quantize

    t = gguf.GGMLQuantizationType.Q4_1
    w = (0.02 * rng.standard_normal((n, k))).astype(np.float32)
    return np.ascontiguousarray(dequantize(quantize(w, t), t), np.float32)


def main(argv=None) -> None:
    """Print the table (see the module docstring)."""
    from exactblocks.loaders.gguf import default_smollm2_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=at_least(1), default=9)
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--context", type=at_least(1), default=128, help="cached tokens")
    ap.add_argument("--steps", type=at_least(1), default=4, help="decode steps per sample")
    args = ap.parse_args(argv)
    exactblocks.set_num_threads(args.threads)
    core = _ext.core()
    rng = np.random.default_rng(0)
    model = exactblocks.load_model(default_smollm2_path())
    cap = args.context + (args.rounds + 1) * args.steps + 1
    prompt = rng.integers(0, model.vocab_size, (1, args.context))
    state = model.allocate_state(1, cap)
    model.forward(prompt, state)
    sstate = model.allocate_state(1, cap)
    model.forward(prompt, sstate)
    d = model.config["hidden_size"]
    blocks = model.blocks
    hidden = rng.standard_normal((1, args.context, d)).astype(np.float32)
    bstates = []
    for blk in blocks:
        st = blk.allocate_state(1, cap)
        blk.forward(hidden, st)
        bstates.append(st)
    tiny = _tiny_block(cap * len(blocks))
    tstate = tiny.allocate_state(1, cap * len(blocks))
    gemvs = {
        name: [core.PackedLinear(_q4_1(n, k, rng)) for _ in blocks]
        for name, (n, k) in LAYER_GEMVS.items()
    }
    assert all(g[0].format == "q4_1" for g in gemvs.values())
    head = core.PackedLinear(quantised("q8_0", model.vocab_size, rng))
    assert head.format == "q8_0" and head.k_in == d
    ids = np.array([42])
    x = rng.standard_normal((1, d)).astype(np.float32)
    xs = {
        name: rng.standard_normal((1, k)).astype(np.float32) for name, (_, k) in LAYER_GEMVS.items()
    }
    xt = rng.standard_normal((1, 32)).astype(np.float32)

    def t_step():
        model.step(ids, state)

    def t_stack():
        _, done = model._stack_run(x, sstate, None, 0, undo=None, workspace=None)
        assert done == len(blocks)

    def t_blocks():
        for blk, st in zip(blocks, bstates):
            blk.step(x, st)

    def t_gemvs():
        for i in range(len(blocks)):
            for name, lins in gemvs.items():
                lins[i].forward(xs[name])

    def t_over():
        for _ in blocks:
            tiny.step(xt, tstate)

    def t_head():
        head.forward(x)

    parts = {
        "Model.step": t_step,
        "layers": t_stack,
        "blocks": t_blocks,
        "GEMVs": t_gemvs,
        "call overhead": t_over,
        "head GEMV": t_head,
    }
    samples = {k: [] for k in parts}
    for f in parts.values():  # warm-up
        f()
    for _ in range(args.rounds):
        for name, f in parts.items():
            t0 = time.perf_counter_ns()
            for _ in range(args.steps):
                f()
            samples[name].append((time.perf_counter_ns() - t0) / args.steps / 1e6)
    best = {k: min(v) for k, v in samples.items()}
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"cpu: {cpu_model()}, isa: {core.get_isa()}, threads: {args.threads}, "
        f"context: {args.context}, loadavg before: {loadavg()}"
    )
    print("| part | ms best | ms median |")
    print("|---|---|---|")
    rows = [
        ("Model.step", best["Model.step"], med["Model.step"]),
        ("layers in one native call (Model.step's path)", best["layers"], med["layers"]),
        ("blocks (30 public block.step calls)", best["blocks"], med["blocks"]),
        ("  GEMVs (4 per layer)", best["GEMVs"], med["GEMVs"]),
        ("  call overhead (30 tiny block.step)", best["call overhead"], med["call overhead"]),
        (
            "  rest of blocks (attention, norms, rope, swiglu)",
            best["blocks"] - best["GEMVs"] - best["call overhead"],
            med["blocks"] - med["GEMVs"] - med["call overhead"],
        ),
        ("head GEMV", best["head GEMV"], med["head GEMV"]),
        (
            "step - layers - head GEMV (head norm, embedding, Model's Python)",
            best["Model.step"] - best["layers"] - best["head GEMV"],
            med["Model.step"] - med["layers"] - med["head GEMV"],
        ),
    ]
    for label, b, m in rows:
        print(f"| {label} | {b:.3f} | {m:.3f} |")
    print(f"loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
