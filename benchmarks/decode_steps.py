"""Per-step decode times of consecutive steps: how a decode loop warms up after a state copy.

Usage: ``python benchmarks/decode_steps.py [WORKLOAD] [BATCH] [STEPS] [PEERS]``, e.g.
``python benchmarks/decode_steps.py smollm2-layer 8 16 exactblocks,torch_sdpa``.

WORKLOAD is one of ``exactblocks.bench``'s layer workloads (default ``smollm2-layer``), BATCH
the rows per step (default 1), STEPS the consecutive steps per repeat (default 16), PEERS a
comma-separated subset of the bench's peers for that workload (default: all it can build;
torch peers need torch and transformers). It builds the peers as ``python -m
exactblocks.bench`` does, prepares 512 cached tokens, then takes 7 repeats, peers interleaved:
each repeat copies the state (untimed) and times STEPS consecutive steps one by one. It prints
the median time of each step index, in ms, and the medians over steps 1-4 and over steps 9 on.
benchmarks/README.md ("Decode: steady state") shows a run.
"""

import sys
import time

import numpy as np

from exactblocks import bench, get_num_threads


def main(argv):
    name = argv[0] if argv else "smollm2-layer"
    batch = int(argv[1]) if len(argv) > 1 else 1
    steps = int(argv[2]) if len(argv) > 2 else 16
    if name not in bench.FULL_LAYERS:
        sys.exit(f"WORKLOAD must be one of {', '.join(bench.FULL_LAYERS)}; got {name!r}")
    if batch < 1 or steps < 9:
        sys.exit(f"BATCH must be >= 1 and STEPS >= 9 (steps 9 on are the steady state); got "
                 f"BATCH={batch}, STEPS={steps}")
    spec = bench.FULL_LAYERS[name]
    rng = np.random.default_rng(1234)
    make = bench._transformer_weights if spec.kind == "transformer" else bench._mamba2_weights
    weights = make(spec, rng)
    avail = {"torch_error": None, "mojolearn": None}
    try:
        import torch
        torch.set_num_threads(get_num_threads())
    except ImportError as exc:
        avail["torch_error"] = str(exc)
    peers = bench._build_peers(spec, weights, 1024, avail, bench._Recorder(False))
    names = argv[3].split(",") if len(argv) > 3 else list(peers)
    if not set(names) <= set(peers):
        sys.exit(f"PEERS must be among {', '.join(peers)}; got {argv[3]!r}")
    x_ctx = rng.standard_normal((1, 512, spec.d_model), dtype=np.float32)
    xs = rng.standard_normal((steps, batch, spec.d_model), dtype=np.float32)
    snaps = {}
    for p in names:
        st, _ = peers[p].prefix_state(x_ctx)
        snaps[p] = peers[p].tile(peers[p].clone(st), batch) if batch > 1 else peers[p].clone(st)
    times = {p: [] for p in names}
    for _ in range(7):
        for p in names:
            time.sleep(0.05)
            _, ts, _ = bench._run_decode(peers[p], snaps[p], xs)
            times[p].append(ts)
    print(f"{name}, B={batch}: median ms per step index, 7 repeats")
    for p in names:
        a = 1e3 * np.array(times[p])
        print(f"{p:12s}", " ".join(f"{v:.3f}" for v in np.median(a, axis=0)))
        print(f"{'':12s} steps 1-4: {np.median(a[:, :4]):.3f}   steps 9+: {np.median(a[:, 8:]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
