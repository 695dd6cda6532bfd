"""Ray Data batch generation vs one process: rows per second and Ray's overhead per row.

Run from a clone's root: ``python -m benchmarks.ray_batch`` (``--rows 200 --max-new-tokens 8
--batch-size 20`` by default). Four runs of the same rows (short prompts, greedy):

- ``alone``: one process, ``load_model`` then ``Model.generate`` row by row, 2 threads;
- ``batched``: one process, ``exactblocks.ray.Generate`` on the loaded model (rows of a batch
  together, ragged lengths), 2 threads: the same work a Ray actor does, without Ray;
- ``ray 1x2``: Ray Data, 1 actor x 2 threads; ``ray 2x1``: 2 actors x 1 thread.

Ray runs are timed from the start of execution to the last row, so they include each actor's
model load; ``rows/s (no load)`` subtracts the load time measured in-process (actors load in
parallel). Ray's overhead per row = (ray 1x2 wall - load - batched wall) / rows: scheduling,
serialisation and the object store, at equal threads. Every run's generated ids are checked
equal (the invariance the integration promises). The machine's load average is printed: on a
shared machine the figures are only indicative.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

WORDS = ["sky", "sea", "cat", "tree", "river", "moon", "bread", "city", "song", "stone"]


def _rows(n: int) -> list[dict]:
    return [{"row": i, "prompt": f"The {WORDS[i % 10]} number {i} is"} for i in range(n)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ray_batch", description=__doc__)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    args = ap.parse_args(argv)

    import ray
    import ray.data

    import exactblocks
    import exactblocks.ray as ebray
    from exactblocks.loaders.gguf import default_smollm2_path

    path = args.model or default_smollm2_path()
    rows = _rows(args.rows)
    n_new = args.max_new_tokens
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()} (before)")
    results: dict[str, dict] = {}

    exactblocks.set_num_threads(2)
    t0 = time.perf_counter()
    model = exactblocks.load_model(path)
    load = time.perf_counter() - t0

    t0 = time.perf_counter()
    alone = [model.generate(r["prompt"], max_new_tokens=n_new).ids for r in rows]
    results["alone (1 process, 2 threads)"] = {"wall": time.perf_counter() - t0}

    gen = ebray.Generate(model, max_new_tokens=n_new, num_threads=2)
    t0 = time.perf_counter()
    batched = []
    for s in range(0, len(rows), args.batch_size):
        chunk = rows[s : s + args.batch_size]
        out = gen({"row": np.asarray([r["row"] for r in chunk]),
                   "prompt": np.asarray([r["prompt"] for r in chunk], dtype=object)})  # fmt: skip
        batched += list(out["generated_ids"])
    batched_wall = time.perf_counter() - t0
    results["batched (1 process, 2 threads)"] = {"wall": batched_wall}
    assert batched == alone, "batched generation differs from rows alone"

    parent = os.path.dirname(os.path.dirname(os.path.abspath(exactblocks.__file__)))
    env = {}
    if os.path.basename(parent) not in ("site-packages", "dist-packages"):
        env = {"env_vars": {"PYTHONPATH": parent}}
    ray.init(num_cpus=2, runtime_env=env, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        for actors, threads in ((1, 2), (2, 1)):
            ds = ray.data.from_items(rows).map_batches(
                ebray.Generate,
                fn_constructor_kwargs={"model": path, "max_new_tokens": n_new},
                compute=ray.data.ActorPoolStrategy(size=actors),
                batch_size=args.batch_size,
                num_cpus=threads,
            )
            t0 = time.perf_counter()
            out = ds.take_all()
            wall = time.perf_counter() - t0
            got = {r["row"]: list(r["generated_ids"]) for r in out}
            assert [got[i] for i in range(len(rows))] == alone, "Ray output differs"
            results[f"ray {actors} actor(s) x {threads} thread(s)"] = {
                "wall": wall,
                "no_load": wall - load,
            }
    finally:
        ray.shutdown()

    print(f"rows={len(rows)} max_new_tokens={n_new} batch_size={args.batch_size} "
          f"model load (in-process)={load:.1f} s")  # fmt: skip
    print(f"{'run':36s} {'wall s':>8s} {'rows/s':>8s} {'rows/s (no load)':>17s}")
    for name, r in results.items():
        no_load = r.get("no_load", r["wall"])
        print(f"{name:36s} {r['wall']:8.1f} {len(rows) / r['wall']:8.2f} "
              f"{len(rows) / max(no_load, 1e-9):17.2f}")  # fmt: skip
    one = results["ray 1 actor(s) x 2 thread(s)"]
    overhead = (one["no_load"] - batched_wall) / len(rows)
    print(f"Ray overhead per row (ray 1x2 - load - batched) / rows: {overhead * 1e3:.1f} ms")
    print(f"load average (after): {os.getloadavg()}")
    results["overhead_per_row_s"] = overhead
    return results


if __name__ == "__main__":
    main()
