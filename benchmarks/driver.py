"""One whole benchmark run: :func:`run_bench`.

Here: the order of a run (which peers import, the NumPy subprocess and its ceiling, every
layer workload, the whole model), the environment recorded with it, and writing
``bench.json``, ``bench.md`` and ``bench.png``. Not here: the command line
(:mod:`benchmarks.cli`), and how one workload is checked and timed (:mod:`benchmarks.layer_run`,
:mod:`benchmarks.model_run`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from .backward_run import backward_table, run_mamba2_backward
from .checks import Recorder
from .environment import blas_info, cpu_busy, cpu_model, loadavg, package_version
from .layer_run import run_layer
from .llama_cpp_peer import find_llama_bench
from .model_run import MODEL_WORKLOADS, run_model
from .mojolearn_peer import import_mojolearn
from .numpy_peer import OPENBLAS_SLOW_VARS, NumpyPeer
from .peers import PEERS
from .plot import write_plot
from .report import layer_rows, markdown_report
from .workloads import (
    CASES,
    FULL_LAYERS,
    FULL_SHAPES,
    QUICK_LAYERS,
    QUICK_SHAPES,
    WORKLOAD_NAMES,
)

__all__ = ["run_bench"]


def run_bench(
    workloads: Sequence[str] = WORKLOAD_NAMES,
    *,
    quick: bool = False,
    repeats: int | None = None,
    threads: int | None = None,
    out_dir: str = ".",
    verbose: bool = True,
    command: str | None = None,
    llama_bench: str | None = None,
) -> dict:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png``.

    Parameters
    ----------
    workloads : sequence of str, default=all
        Subset of :data:`benchmarks.workloads.WORKLOAD_NAMES`: ``"smollm2-layer"``,
        ``"smollm2-layer-bf16"``, ``"llama1b-layer"``, ``"llama1b-layer-bf16"``,
        ``"mamba2-layer"``, ``"smollm2-model"``, ``"gemma3-model"``.
    quick : bool, default=False
        Tiny shapes (same code paths, seconds instead of minutes); the whole-model workloads
        are left out unless named in ``workloads`` explicitly.
    repeats : int or None, default=None
        Timed repeats per measurement (median reported). None: 5 (2 with ``quick``), reduced
        down to 3 for calls long enough that a measurement would exceed about 4 s.
    threads : int or None, default=None
        Threads for every library (exactblocks, torch, NumPy's BLAS); None = exactblocks'
        current value. mojolearn's threads are its own.
    out_dir : str, default="."
        Directory of the three output files (created if missing).
    verbose : bool, default=True
        Progress and every check on stderr.
    command : str or None, default=None
        Command line recorded in the report; None: ``python -m benchmarks``.
    llama_bench : str or None, default=None
        llama.cpp's ``llama-bench`` executable, the whole models' llama.cpp peer; None: the
        ``$LLAMA_BENCH`` variable, else ``llama-bench`` on PATH, else llama.cpp is skipped
        (with a note).

    Returns
    -------
    dict
        Everything written to ``bench.json``; ``"ok"`` is False when a check failed.

    Raises
    ------
    ValueError
        Unknown workload name, ``repeats < 1`` or ``threads < 1``.
    ImportError
        exactblocks' compiled extension is missing.
    """
    import exactblocks
    from exactblocks import runtime

    unknown = [w for w in workloads if w not in WORKLOAD_NAMES]
    if unknown:
        raise ValueError(
            f"run_bench: unknown workloads {unknown}; expected a subset of {list(WORKLOAD_NAMES)}"
        )
    if repeats is not None and repeats < 1:
        raise ValueError(f"run_bench: repeats must be >= 1; got {repeats}")
    if threads is not None and threads < 1:
        raise ValueError(f"run_bench: threads must be >= 1; got {threads}")
    explicit = tuple(workloads) != WORKLOAD_NAMES
    sh = QUICK_SHAPES if quick else FULL_SHAPES
    layer_specs = QUICK_LAYERS if quick else FULL_LAYERS
    rec = Recorder(verbose)
    t_start = time.perf_counter()
    load_start = loadavg()
    busy_start = cpu_busy()
    if threads is not None:
        exactblocks.set_num_threads(threads)
    n_threads = exactblocks.get_num_threads()
    opts = {
        "repeats": repeats or sh.default_repeats,
        "repeats_explicit": repeats is not None,
        "threads": n_threads,
    }

    avail: dict = {"torch_error": None, "mojolearn": None}
    try:
        import torch
        import transformers  # noqa: F401 - the HF layers

        torch.set_num_threads(n_threads)
    except ImportError as exc:
        avail["torch_error"] = f"torch/transformers not installed ({exc}): PyTorch peers skipped"
        rec.note(avail["torch_error"])
    ml, why = import_mojolearn()
    avail["mojolearn"] = ml
    if ml is None:
        rec.note(f"{why}: mojolearn peer skipped")
    elif why:
        rec.note(f"mojolearn: {why}")
    if ml is not None:
        rec.note("mojolearn: runs on its own threads (not settable); see cpu_util in bench.json")

    layer_names = [w for w in workloads if w in layer_specs]
    specs = {w: layer_specs[w] for w in layer_names}
    model_names = [w for w in workloads if w in MODEL_WORKLOADS and (not quick or explicit)]
    if quick and not explicit and any(w in MODEL_WORKLOADS for w in workloads):
        rec.note("--quick: the whole-model workloads are left out (name them in --workloads)")

    rec.log(f"NumPy subprocess ({n_threads} BLAS threads) ...")
    ceiling, numpy_peer = None, None
    try:
        numpy_peer = NumpyPeer(n_threads)
        ceiling = {
            **numpy_peer.request(cmd="info"),
            **numpy_peer.request(cmd="bandwidth", mib=sh.bandwidth_mib, repeats=opts["repeats"]),
            "unset": numpy_peer.unset,
            "groups": {},
        }
        if ceiling["unset"]:
            rec.note(f"NumPy ceiling measured in a subprocess without {ceiling['unset']}")
    except Exception as exc:  # noqa: BLE001 - the ceiling is context, not a check
        rec.note(f"NumPy ceiling not measured: {exc}")
        if numpy_peer is not None:
            numpy_peer.close()
        numpy_peer = None

    results = {}
    try:
        for w in layer_names:
            results[w] = run_layer(specs[w], sh, avail, opts, rec, numpy_peer, ceiling)
        backward = None
        if "mamba2-layer" in layer_names:  # the backward row (benchmarks/backward_run.py)
            backward = run_mamba2_backward(specs["mamba2-layer"], sh, avail, opts, rec)
    finally:
        if numpy_peer is not None:
            numpy_peer.close()
    models: dict = {}
    lb = find_llama_bench(llama_bench) if model_names else (None, "")
    for w in model_names:
        try:
            models[w] = run_model(w, sh, avail, opts, rec, lb)
        except (FileNotFoundError, ImportError, ValueError) as exc:
            rec.note(f"{w} skipped: {exc}")

    rows = layer_rows(results, specs, sh, ceiling)
    peers_present = [
        p for p in PEERS if any(p in res[c] for res in results.values() for c in CASES)
    ]
    ok = all(c["ok"] for c in rec.checks)
    meta = {
        "command": command or "python -m benchmarks",
        "cpu": cpu_model(),
        "isa": runtime.get_isa(),
        "threads": n_threads,
        "cpus_available": (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        ),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "cpu_busy_start": busy_start,
        "python": platform.python_version(),
        "versions": {
            "exactblocks": exactblocks.__version__,
            "arithmetic": exactblocks.arithmetic_version(),
            "numpy": np.__version__,
            "torch": package_version("torch"),
            "transformers": package_version("transformers"),
            "mojolearn-core": package_version("mojolearn-core"),
            "matplotlib": package_version("matplotlib"),
        },
        "blas_in_process": blas_info(),
        "openblas_env_in_process": {k: os.environ.get(k) for k in OPENBLAS_SLOW_VARS},
        "quick": quick,
        "repeats": opts["repeats"],
        "repeats_explicit": opts["repeats_explicit"],
        "shapes": asdict(sh),
        "seconds": None,
    }
    meta["seconds"] = round(time.perf_counter() - t_start, 1)

    if busy_start is not None and busy_start > 0.2:
        rec.note(
            f"other processes kept {100 * busy_start:.0f}% of the CPUs busy just before "
            "the run: timings are unreliable, rerun on an idle machine"
        )
    report = markdown_report(meta, sh, ceiling, rows, peers_present, models, rec.checks, rec.notes)
    if backward is not None:
        head, sep, tail = report.partition("\n### Targets\n")
        table = backward_table(backward, specs["mamba2-layer"].label)
        report = f"{head}\n{table}\n{sep}{tail}" if sep else f"{report}\n\n{table}"

    os.makedirs(out_dir, exist_ok=True)
    data = {
        "ok": ok,
        "meta": meta,
        "numpy_ceiling": ceiling,
        "rows": rows,
        "models": models,
        "checks": rec.checks,
        "notes": rec.notes,
        "backward": None
        if backward is None
        else {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in backward.items()},
    }
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as f:
        f.write(report + "\n")
    plot_msg = write_plot(rows, models.get("smollm2-model"), sh, os.path.join(out_dir, "bench.png"))
    print(report)
    print(
        f"\n{plot_msg}; wrote {os.path.join(out_dir, 'bench.json')} and "
        f"{os.path.join(out_dir, 'bench.md')} ({meta['seconds']} s)"
    )
    data["report"] = report
    return data
