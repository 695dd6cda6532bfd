"""The report: result rows, the markdown tables, the targets and the whole markdown text.

Here: :func:`layer_rows` (the per-(workload, case) rows written to ``bench.json``),
:func:`layer_table`, :func:`targets_table`, :func:`model_table` and :func:`markdown_report`,
plus the number formats they share. Not here: measuring anything, or the plot
(:mod:`benchmarks.plot`).
"""

from __future__ import annotations

import math

from .peers import PEER_LABELS, PEERS
from .timing import MIN_REPEATS, Measurement
from .workloads import CASES, Shapes, case_label, case_tokens

__all__ = [
    "LLAMA_CPP_ARITHMETIC",
    "MODEL_PEERS",
    "fmt_num",
    "fmt_ratio",
    "layer_rows",
    "layer_table",
    "markdown_report",
    "model_table",
    "targets_table",
]


def fmt_num(v: float | None, digits: int = 3) -> str:
    """Number with ``digits`` significant digits (no scientific notation for table sizes).

    Parameters
    ----------
    v : float or None
        The number; None or not finite gives ``"-"``.
    digits : int, default=3
        Significant digits (integers keep all of theirs).

    Returns
    -------
    str

    Examples
    --------
    >>> fmt_num(0.012345), fmt_num(1234.5), fmt_num(None)
    ('0.0123', '1,234', '-')
    """
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if v == 0:
        return "0"
    mag = int(math.floor(math.log10(abs(v))))
    decimals = max(0, digits - 1 - mag)
    return f"{v:,.{decimals}f}"


def fmt_ratio(v: float | None) -> str:
    """A time ratio as ``"1.23x"``; ``"-"`` when missing or not finite.

    Examples
    --------
    >>> fmt_ratio(2.345), fmt_ratio(None)
    ('2.35x', '-')
    """
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}x"


def _mk(res: dict, case: str, peer: str):
    """The Measurement of (case, peer), or None for a failed or missing one."""
    m = res.get(case, {}).get(peer)
    return m if isinstance(m, Measurement) else None


def layer_rows(results: dict, specs: dict, sh: Shapes, ceiling: dict | None) -> list[dict]:
    """One row per (layer workload, case): every peer's result, ratios, GFLOP/s, ceilings.

    Parameters
    ----------
    results : dict
        ``{workload: run_layer result}``.
    specs : dict
        ``{workload: LayerSpec}``.
    sh : Shapes
        The cases' sequence shapes.
    ceiling : dict or None
        NumPy's ceiling: its GEMM group times and read bandwidth, when measured.

    Returns
    -------
    list of dict
        JSON-ready rows: ``peers`` (``Measurement.as_dict()`` or the failure string),
        ``speed_vs`` (peer time / exactblocks time), ``gemm_gflop``,
        ``exactblocks_gflops``, ``numpy_gemm_s``, ``numpy_gflops``, ``pct_of_numpy`` and,
        for decode, ``bandwidth_time_s`` (matrix bytes / read bandwidth).
    """
    rows = []
    for wname, res in results.items():
        spec = specs[wname]
        for case in CASES:
            eb = _mk(res, case, "exactblocks")
            row = {
                "workload": spec.label,
                "name": wname,
                "case": case,
                "case_label": case_label(case, sh),
                "tokens": case_tokens(case, sh),
                "peers": {},
            }
            for p in PEERS:
                m = res[case].get(p)
                row["peers"][p] = m.as_dict() if isinstance(m, Measurement) else m
                if isinstance(m, Measurement) and eb is not None and p != "exactblocks":
                    row.setdefault("speed_vs", {})[p] = m.seconds / eb.seconds
            flops = 2.0 * row["tokens"] * spec.gemm_params()
            row["gemm_gflop"] = flops / 1e9
            if eb is not None:
                row["exactblocks_gflops"] = flops / eb.seconds / 1e9
            g = (ceiling or {}).get("groups", {}).get(f"{wname}/{case}")
            if g is not None:
                row["numpy_gemm_s"] = g["seconds"]
                row["numpy_gflops"] = g["gflops"]
                if eb is not None:
                    row["pct_of_numpy"] = 100.0 * g["seconds"] / eb.seconds
            if case.startswith("decode") and ceiling:
                floor = (
                    spec.weight_bytes() * spec.gemm_params() / (ceiling["read_bandwidth_gbs"] * 1e9)
                )
                row["bandwidth_time_s"] = floor
            rows.append(row)
    return rows


def layer_table(rows: list[dict], avail_peers: list[str]) -> str:
    """The main markdown table: one line per :func:`layer_rows` row.

    Parameters
    ----------
    rows : list of dict
        :func:`layer_rows`.
    avail_peers : list of str
        Peers with a column (those that ran at all).

    Returns
    -------
    str
    """
    head = ["workload", "case", "exactblocks ms/call", "exactblocks ms/token", "exactblocks tok/s"]
    peers = [p for p in PEERS[1:] if p in avail_peers]
    head += [f"{PEER_LABELS[p]} tok/s" for p in peers]
    head += [f"vs {PEER_LABELS[p]}" for p in peers]
    head += ["NumPy GEMMs ms", "% of NumPy", "read-bw ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        eb = r["peers"].get("exactblocks")
        ebm = eb if isinstance(eb, dict) else None
        cells = [
            r["workload"],
            r["case_label"],
            fmt_num(ebm["ms_per_call"]) if ebm else (eb or "-"),
            fmt_num(ebm["ms_per_token"]) if ebm else "-",
            fmt_num(ebm["tokens_per_s"]) if ebm else "-",
        ]
        for p in peers:
            m = r["peers"].get(p)
            cells.append(fmt_num(m["tokens_per_s"]) if isinstance(m, dict) else (m or "n/a"))
        for p in peers:
            cells.append(fmt_ratio(r.get("speed_vs", {}).get(p)))
        cells.append(fmt_num(1e3 * r["numpy_gemm_s"]) if "numpy_gemm_s" in r else "-")
        cells.append(f"{r['pct_of_numpy']:.0f}%" if "pct_of_numpy" in r else "-")
        cells.append(fmt_num(1e3 * r["bandwidth_time_s"]) if "bandwidth_time_s" in r else "-")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def targets_table(rows: list[dict], models: dict | None, ceiling: dict | None) -> str:
    """The "Targets" markdown table: the figures the project tracks.

    Parameters
    ----------
    rows : list of dict
        :func:`layer_rows`.
    models : dict or None
        The whole-model results by workload name (:func:`benchmarks.model_run.run_model`).
    ceiling : dict or None
        NumPy's ceiling (for the read-bandwidth line).

    Returns
    -------
    str
        Prefill GFLOP/s (and % of NumPy), decode speed vs torch sdpa, Llama-1B decode vs
        NumPy's GEMVs and vs the bandwidth bound, B=8 / B=1 decode time, speed vs mojolearn,
        and each model's prefill and decode rates against HF generate and llama.cpp.
    """
    lines = ["| target | value |", "|---|---|"]
    by = {(r["name"], r["case"]): r for r in rows}
    for r in rows:
        if r["case"].startswith("prefill") and "exactblocks_gflops" in r:
            extra = (
                f" = {r['pct_of_numpy']:.0f}% of NumPy's {r['numpy_gflops']:.1f} GFLOP/s"
                if "pct_of_numpy" in r
                else ""
            )
            lines.append(
                f"| prefill GEMM GFLOP/s, {r['workload']}, {r['case_label']} | "
                f"{r['exactblocks_gflops']:.1f}{extra} |"
            )
    for r in rows:
        if r["case"] == "decode_b1" and "torch_sdpa" in r.get("speed_vs", {}):
            lines.append(
                f"| decode B=1 speed vs torch sdpa, {r['workload']} | "
                f"{fmt_ratio(r['speed_vs']['torch_sdpa'])} |"
            )
    for lname in ("llama1b-layer", "llama1b-layer-bf16"):
        r = by.get((lname, "decode_b1"))
        if not (r and "numpy_gemm_s" in r and isinstance(r["peers"].get("exactblocks"), dict)):
            continue
        t = r["peers"]["exactblocks"]["seconds"]
        lines.append(
            f"| {r['workload']} decode B=1 time / NumPy's 7 GEMVs alone | "
            f"{t / r['numpy_gemm_s']:.2f} ({1e3 * t:.2f} ms vs "
            f"{1e3 * r['numpy_gemm_s']:.2f} ms) |"
        )
        if "bandwidth_time_s" in r:
            lines.append(
                f"| {r['workload']} decode B=1 time / (matrix bytes / read "
                "bandwidth) | "
                f"{t / r['bandwidth_time_s']:.2f} ("
                f"{1e3 * r['bandwidth_time_s']:.2f} ms at "
                f"{ceiling['read_bandwidth_gbs']:.1f} GB/s) |"
            )
    for name in dict.fromkeys(r["name"] for r in rows):
        r1, r8 = by.get((name, "decode_b1")), by.get((name, "decode_b8"))
        if not (r1 and r8):
            continue
        parts = []
        for p in PEERS:
            m1, m8 = r1["peers"].get(p), r8["peers"].get(p)
            if isinstance(m1, dict) and isinstance(m8, dict):
                parts.append(f"{PEER_LABELS[p]} {m8['seconds'] / m1['seconds']:.2f}")
        if parts:
            lines.append(
                f"| decode B={r8['tokens']} time / B=1 time, {r1['workload']} | "
                f"{', '.join(parts)} |"
            )
    for r in rows:
        if "mojolearn" in r.get("speed_vs", {}):
            lines.append(
                f"| speed vs mojolearn, {r['workload']}, {r['case_label']} | "
                f"{fmt_ratio(r['speed_vs']['mojolearn'])} |"
            )
    for model in (models or {}).values():
        e = model.get("exactblocks")
        if not e:
            continue
        short = model["label"].split(" (")[0]
        pre = f"{e['prefill']['tokens_per_s']:.1f} tok/s"
        dec = f"{e['decode']['ms_per_token']:.1f} ms/token"
        for key, name, goal_pre, goal_dec in (
            ("hf_generate", "HF generate", "", ""),
            ("llama_cpp", "llama.cpp", "; target >= 3x", "; target >= 1.5x"),
        ):
            h = model.get(key)
            if not h:
                continue
            pre += (
                f" vs {name} {h['prefill']['tokens_per_s']:.1f} tok/s "
                f"({h['prefill']['seconds'] / e['prefill']['seconds']:.2f}x{goal_pre})"
            )
            dec += (
                f" vs {name} {h['decode']['ms_per_token']:.1f} ms/token "
                f"({h['decode']['seconds'] / e['decode']['seconds']:.2f}x{goal_dec})"
            )
        lines.append(f"| {short} model prefill ({model['prompt_tokens']}-token prompt) | {pre} |")
        lines.append(f"| {short} model decode (greedy, {model['new_tokens']} tokens) | {dec} |")
    return "\n".join(lines)


#: Whole-model peers besides exactblocks: result key -> column label.
MODEL_PEERS = {"hf_generate": "HF generate", "llama_cpp": "llama.cpp"}


def model_table(models: dict) -> str:
    """The whole-model markdown table: one row per model, exactblocks and every peer that ran.

    Parameters
    ----------
    models : dict
        Workload name -> :func:`benchmarks.model_run.run_model`'s result.

    Returns
    -------
    str
        Prompt tokens, exactblocks' prefill tok/s and decode ms/token, then per peer its
        prefill tok/s, decode ms/token and the ratios (peer time / exactblocks time: > 1
        means exactblocks is faster).
    """
    peers = [k for k in MODEL_PEERS if any(m.get(k) for m in models.values())]
    head = ["model", "prompt tokens", "exactblocks prefill tok/s", "exactblocks decode ms/token"]
    for k in peers:
        lab = MODEL_PEERS[k]
        if k == "hf_generate":
            impls = {m.get("hf_attn_implementation") for m in models.values() if m.get(k)}
            lab += f" ({'/'.join(sorted(str(i) for i in impls))})"
        head += [
            f"{lab} prefill tok/s",
            f"{lab} decode ms/token",
            f"prefill vs {MODEL_PEERS[k]}",
            f"decode vs {MODEL_PEERS[k]}",
        ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models.values():
        e = model.get("exactblocks")
        cells = [
            model["label"],
            str(model["prompt_tokens"]),
            fmt_num(e["prefill"]["tokens_per_s"]) if e else "check failed",
            fmt_num(e["decode"]["ms_per_token"]) if e else "check failed",
        ]
        for k in peers:
            h = model.get(k)
            if not h:
                cells += ["-"] * 4
                continue
            cells += [fmt_num(h["prefill"]["tokens_per_s"]), fmt_num(h["decode"]["ms_per_token"])]
            cells += [
                fmt_ratio(h["prefill"]["seconds"] / e["prefill"]["seconds"]) if e else "-",
                fmt_ratio(h["decode"]["seconds"] / e["decode"]["seconds"]) if e else "-",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: What the report says under the model table when llama.cpp ran.
LLAMA_CPP_ARITHMETIC = (
    "llama.cpp computes Q4_1 (and the other quantised types) with 8-bit quantised activations "
    "(each activation row rounded to Q8_1 blocks before the dot products), while exactblocks "
    "computes float32 on the exact weights; its logits therefore differ from exactblocks' and "
    "HF's, and its times are for that cheaper arithmetic."
)


def markdown_report(
    meta: dict,
    sh: Shapes,
    ceiling: dict | None,
    rows: list[dict],
    peers_present: list[str],
    models: dict | None,
    checks: list[dict],
    notes: list[str],
) -> str:
    """The whole markdown report (printed, and written to ``bench.md``).

    Parameters
    ----------
    meta : dict
        The run's ``bench.json`` meta (command, CPU, threads, load, versions, repeats, quick).
    sh : Shapes
        The cases' sequence shapes.
    ceiling : dict or None
        NumPy's ceiling (BLAS, read bandwidth, GEMM groups), or None when not measured.
    rows : list of dict
        :func:`layer_rows`.
    peers_present : list of str
        Peers that ran on some layer workload (their columns are shown).
    models : dict or None
        Workload name -> :func:`benchmarks.model_run.run_model`'s result.
    checks, notes : list
        The run's :class:`benchmarks.checks.Recorder` record.

    Returns
    -------
    str
        Header, layer table, model table, targets, column legend, checks and notes.
    """
    n_threads, quick = meta["threads"], meta["quick"]
    load_start, busy_start = meta["loadavg_start"], meta["cpu_busy_start"]
    repeats, explicit = meta["repeats"], meta["repeats_explicit"]
    quick_note = " (--quick: tiny shapes, a smoke run: its times and ratios are noise)"
    fewest = min(MIN_REPEATS, repeats)  # rounds a long call gets at least (n_repeats)
    rounds = (
        f"{repeats} rounds"
        if explicit or fewest == repeats
        else f"{repeats} rounds (at least {fewest} for long calls)"
    )
    md = [
        f"## exactblocks benchmark{quick_note if quick else ''}",
        "",
        f"- command: `{meta['command']}`",
        f"- CPU: {meta['cpu']}; ISA path: {meta['isa']}; threads: {n_threads} for exactblocks, "
        f"torch and NumPy's BLAS (CPUs available: {meta['cpus_available']})",
        f"- load average at start / end: {load_start} / {meta['loadavg_end']}; CPUs busy "
        f"with other work just before the run: "
        f"{'?' if busy_start is None else f'{100 * busy_start:.0f}%'}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        f"- repeats: {rounds}, peers interleaved round by round; prefill: the median "
        f"call; decode: {sh.decode_warm_steps} untimed then {sh.decode_steps} timed "
        "consecutive steps per round, the median of all timed steps",
    ]
    if ceiling:
        blas = ceiling["blas"][0] if ceiling["blas"] else {}
        md.append(
            f"- NumPy ceiling: NumPy {ceiling['numpy']}, "
            f"{blas.get('internal_api', blas.get('name', 'BLAS'))} "
            f"{blas.get('version', '')} kernel {blas.get('architecture', '?')}, read "
            f"bandwidth {ceiling['read_bandwidth_gbs']:.1f} GB/s (GEMV over "
            f"{ceiling['read_bandwidth_bytes'] >> 20} MiB)"
            + (f"; measured without {sorted(ceiling['unset'])}" if ceiling["unset"] else "")
        )
    md += ["", layer_table(rows, peers_present) if rows else "(no layer workload)", ""]
    sides = ("exactblocks", *MODEL_PEERS)
    timed = {k: m for k, m in (models or {}).items() if any(p in m for p in sides)}
    if timed:
        md += [model_table(timed), ""]
        for m in timed.values():
            if "same_leading_tokens" in m:
                md += [
                    f"{m['label']}: greedy tokens {m['same_leading_tokens']}/"
                    f"{len(m['exactblocks_tokens'])} leading tokens identical to HF generate.",
                    "",
                ]
        lc = next((m["llama_cpp_info"] for m in timed.values() if "llama_cpp_info" in m), None)
        if lc:
            md += [
                f"llama.cpp: `llama-bench` build {lc.get('build_number', '?')} "
                f"({lc.get('build_commit', '?')}), {lc.get('backends', '?')}, "
                f"{lc.get('n_threads', '?')} threads, batch {lc.get('n_batch', '?')}/"
                f"{lc.get('n_ubatch', '?')}, KV {lc.get('type_k', '?')}, flash attention "
                f"{lc.get('flash_attn', '?')}; its load and warm-up runs are not timed. "
                + LLAMA_CPP_ARITHMETIC,
                "",
            ]
    md += ["### Targets", "", targets_table(rows, models, ceiling), ""]
    md += [
        "Columns: ms/call is one `forward` (prefill) or one `step` of all B rows (decode); "
        "ms/token = ms/call / real tokens; tok/s = real tokens / s (ragged padding not "
        "counted). `vs <peer>` = peer time / exactblocks time for the same work (> 1: "
        "exactblocks faster). `NumPy GEMMs ms` = median time of NumPy's float32 matmuls alone "
        "(sampled in the same rounds as the peers) at the block's GEMM shapes (7 for a Llama "
        "layer, in_proj + out_proj for Mamba-2; "
        "B=1 decode as matrix-vector products); `% of NumPy` = that time / exactblocks' "
        "whole-block time. `read-bw ms` = the block's matrix bytes / the STREAM-like read "
        "bandwidth: about the least time a decode step can take.",
        "",
    ]
    failed = [c for c in checks if not c["ok"]]
    md.append(f"Checks: {len(checks) - len(failed)} passed, {len(failed)} failed.")
    for c in failed:
        md.append(f"- FAILED {c['workload']} {c['case']} {c['peer']}: {c['what']} ({c['detail']})")
    for n in notes:
        md.append(f"- note: {n}")
    return "\n".join(md)
