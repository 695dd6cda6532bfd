"""Per-step decode times of consecutive steps: how a decode loop warms up after a state copy.

Usage, from a clone's root: ``python -m benchmarks.decode_steps [WORKLOAD] [BATCH] [STEPS]
[PEERS]``, e.g. ``python -m benchmarks.decode_steps smollm2-layer 8 16 exactblocks,torch_sdpa``.

WORKLOAD is one of the benchmark's full-size layer workloads (default
``smollm2-layer``), BATCH the rows per step (default 1), STEPS the consecutive steps per
repeat (9 to 480, default 16), PEERS a comma-separated subset of the bench's peers for that
workload (default: every peer it can build; the torch peers need torch and transformers,
mojolearn needs mojolearn-core). It builds the peers as ``python -m benchmarks`` does
and prepares 512 cached tokens. Then it takes 7 repeats, the peers interleaved: each repeat
copies the state (untimed) and times STEPS consecutive steps one by one. It prints, per peer,
the median over the repeats of each step's time in ms, and the median of all steps 1-4 and
of all steps from 9 on. benchmarks/README.md ("Decode: steady state") shows a run.
"""

import argparse
import gc
import sys
import time

import numpy as np

from benchmarks.checks import Recorder
from benchmarks.mojolearn_peer import import_mojolearn
from benchmarks.peers import build_peers
from benchmarks.timing import run_decode
from benchmarks.workloads import FULL_LAYERS, mamba2_weights, transformer_weights
from exactblocks import get_num_threads

CONTEXT = 512  # cached tokens before the timed steps
MAX_STEPS = 480  # the peers are built for CONTEXT + MAX_STEPS + 32 positions
REPEATS = 7


def _peer_names(spec) -> list[str]:
    """The bench's peers for a workload (mojolearn's time does not depend on the weights'
    values, so the bench times it on the float32 workloads only)."""
    names = ["exactblocks", "torch_eager"] + (["torch_sdpa"] if spec.kind == "transformer" else [])
    return names + ([] if spec.bf16_weights else ["mojolearn"])


def parse_args(argv):
    """Parse and check the command line; exits with a one-line message on bad input."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_steps",
        description="Median time of each of STEPS consecutive decode steps after a state copy.",
    )
    ap.add_argument(
        "workload",
        nargs="?",
        default="smollm2-layer",
        choices=list(FULL_LAYERS),
        help="a full-size layer workload of the benchmark",
    )
    ap.add_argument("batch", nargs="?", type=int, default=1, help="rows per step (>= 1)")
    ap.add_argument(
        "steps",
        nargs="?",
        type=int,
        default=16,
        help=f"consecutive steps per repeat (9 to {MAX_STEPS})",
    )
    ap.add_argument(
        "peers",
        nargs="?",
        default=None,
        help="comma-separated peers (default: all that can be built)",
    )
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"BATCH must be >= 1; got {args.batch}")
    if not 9 <= args.steps <= MAX_STEPS:
        ap.error(
            f"STEPS must be in [9, {MAX_STEPS}] (steps 9 on are the steady state); got {args.steps}"
        )
    spec = FULL_LAYERS[args.workload]
    if args.peers is not None:
        names = list(dict.fromkeys(p.strip() for p in args.peers.split(",")))
        bad = [p for p in names if p not in _peer_names(spec)]
        if bad or not names:
            ap.error(
                f"PEERS for {args.workload} must be among {', '.join(_peer_names(spec))}; "
                f"got {args.peers!r}"
            )
        args.peers = names
    return args


def main(argv):
    """Build the peers, time the steps and print the per-step medians (``argv`` without the
    program name)."""
    args = parse_args(argv)
    spec = FULL_LAYERS[args.workload]
    rng = np.random.default_rng(1234)
    make = transformer_weights if spec.kind == "transformer" else mamba2_weights
    weights = make(spec, rng)
    avail = {"torch_error": None, "mojolearn": None}
    try:
        import torch
        import transformers  # noqa: F401 - the HF layers

        torch.set_num_threads(get_num_threads())
    except ImportError as exc:
        avail["torch_error"] = str(exc)
    if args.peers is None or "mojolearn" in args.peers:
        avail["mojolearn"], _ = import_mojolearn()
    rec = Recorder(False)
    peers = build_peers(spec, weights, CONTEXT + MAX_STEPS + 32, avail, rec)
    names = args.peers or list(peers)
    missing = [p for p in names if p not in peers]
    if missing:
        why = "; ".join(rec.notes) or avail["torch_error"] or "not installed"
        sys.exit(f"python -m benchmarks.decode_steps: cannot build {', '.join(missing)} ({why})")
    x_ctx = rng.standard_normal((1, CONTEXT, spec.d_model), dtype=np.float32)
    xs = rng.standard_normal((args.steps, args.batch, spec.d_model), dtype=np.float32)
    snaps = {}
    for p in names:
        st, _ = peers[p].prefix_state(x_ctx)
        snap = peers[p].clone(st)
        snaps[p] = peers[p].tile(snap, args.batch) if args.batch > 1 else snap
    times = {p: [] for p in names}
    for _ in range(REPEATS):
        for p in names:
            time.sleep(0.05)
            _, ts, _ = run_decode(peers[p], snaps[p], xs)
            times[p].append(ts)
    print(f"{args.workload}, B={args.batch}: median ms of each step over {REPEATS} repeats")
    for p in names:
        a = 1e3 * np.array(times[p])
        print(f"{p:12s}", " ".join(f"{v:.3f}" for v in np.median(a, axis=0)))
        print(
            f"{'':12s} all steps 1-4: {np.median(a[:, :4]):.3f}   all steps 9 on: "
            f"{np.median(a[:, 8:]):.3f}"
        )
    # Free the peers before the interpreter shuts down: the mojolearn peer's objects otherwise
    # outlive the extension's leak check, which then reports exactblocks objects as leaked.
    del peers, snaps
    gc.collect()


if __name__ == "__main__":
    main(sys.argv[1:])
