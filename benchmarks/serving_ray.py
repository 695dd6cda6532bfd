"""``python -m benchmarks.serving --ray-replicas 1,2``: a fleet on Ray Serve against one server.

On the same GGUF, with the same CPUs in total: one ``exactblocks serve`` process with
``--threads T`` (T = the CPUs available) and, for each replica count N, a fleet
``exactblocks serve --ray-replicas N --ray-cpus-per-replica T/N`` (a local Ray runtime). For
each server and client count (16 and 32 by default), the clients of
:func:`benchmarks.serving.run_clients` stream seeded ``/v1/completions``; it prints aggregate
tokens/s and the ratio of each fleet to the single process. Then the shared-prefix time to
first token: for each of 6 long prefixes one request, then 4 concurrent followers (their
time to first token), on the largest fleet with
prefix-affinity routing and with Ray Serve's power-of-two choices (``--ray-routing pow2``),
and on the single process. The machine's load is printed beside every round.
"""

from __future__ import annotations

import os
import sys

from .environment import loadavg
from .serving import MODES, _free_port, _ms, _ratio, _Server, run_clients

__all__ = ["run_ray"]


def shared_prefix(k: int) -> str:
    """Prefix ``k`` of the shared-prefix round: about 500 tokens, distinct per k."""
    notes = " ".join(
        f"Note {i}: harbour office {k} records the tide, the wind and the boats of day {i}."
        for i in range(24)
    )
    return f"Background {k} for every answer below. {notes} Question: "


#: Distinct prefixes of the shared-prefix round (each cached by one request, then 4 followers).
N_PREFIXES = 6


def _shared_round(server: _Server) -> dict:
    """For each prefix: one request (it caches the prefix on a replica), then 4 concurrent
    followers; the median over the prefixes of the followers' TTFT p50."""
    ttft, errors = [], []
    for k in range(N_PREFIXES):
        for clients in (1, 4):
            r = run_clients(server.port, "model", clients, 1, 4, prompt_prefix=shared_prefix(k),
                            sampling=MODES["seeded"])  # fmt: skip
            errors += r["errors"]
        ttft.append(r["ttft_p50"])
    p50 = sorted(ttft)[len(ttft) // 2]
    print(f"{server.name:24s} shared prefix: followers' TTFT p50 {_ms(p50)} ms, errors "
          f"{len(errors)}, load {loadavg()}", flush=True)  # fmt: skip
    return {"ttft_p50": p50, "errors": errors}


def _command(model: str, port: int, slots: int, ctx: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "exactblocks", "serve", model, "--port", str(port),
            "--max-batch", str(slots), "--max-tokens-per-sequence", str(ctx),
            "--model-name", "model", *extra]  # fmt: skip


def _round(server: _Server, clients: int, requests: int, max_tokens: int, tag: str,
           prefix: str = "") -> dict:  # fmt: skip
    r = run_clients(server.port, "model", clients, requests, max_tokens,
                    prompt_prefix=prefix or f"[{tag}] ", sampling=MODES["seeded"])  # fmt: skip
    print(f"{server.name:24s} {clients:3d} clients: {r['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
          f"{_ms(r['ttft_p50'])} ms p99 {_ms(r['ttft_p99'])} ms, errors {len(r['errors'])}, "
          f"load {loadavg()}", flush=True)  # fmt: skip
    for e in r["errors"][:3]:
        print(f"    {e}")
    return r


def run_ray(model: str, replicas: list[int], counts: list[int], requests: int,
            max_tokens: int, ctx: int) -> int:  # fmt: skip
    """Run the Ray Serve rounds (module docstring); return the exit status (1 on errors)."""
    cpus = len(os.sched_getaffinity(0))
    bad = [n for n in replicas if n < 1 or cpus % n]
    if bad:
        print(f"--ray-replicas: each count must divide the {cpus} CPUs available; got {bad}")
        return 2
    slots = max(counts)
    failed = False
    tps: dict = {}
    ttft: dict = {}

    def start(name, extra):
        port = _free_port()
        s = _Server(name, _command(model, port, slots, ctx, *extra), port, "/health")
        s.start()
        warm = run_clients(s.port, "model", 1, 1, 4, prompt_prefix="Warm-up. ")
        if warm["errors"]:
            raise RuntimeError(f"{name} warm-up failed: {warm['errors'][:3]}")
        return s

    plan = [("1 process", ["--threads", str(cpus)], None)]
    plan += [(f"{n} replica(s) x {cpus // n} CPU", ["--ray-replicas", str(n),
              "--ray-cpus-per-replica", str(cpus // n)], n) for n in replicas]  # fmt: skip
    top = max(replicas)
    plan.append(
        (
            f"{top} replica(s), pow2 routing",
            [
                "--ray-replicas",
                str(top),
                "--ray-cpus-per-replica",
                str(cpus // top),
                "--ray-routing",
                "pow2",
            ],
            -top,
        )
    )
    for name, extra, key in plan:
        s = start(name, extra)
        try:
            if key is None or key > 0:
                for n in counts:
                    r = _round(s, n, requests, max_tokens, f"{name}, {n} clients")
                    tps[(name, n)] = r["tokens_per_s"]
                    failed |= bool(r["errors"])
            if key is None or key == top or key == -top:
                r = _shared_round(s)
                ttft[name] = r["ttft_p50"]
                failed |= bool(r["errors"])
        finally:
            s.stop()

    single = plan[0][0]
    print("\n| server | clients | tokens/s | ratio to 1 process |\n|---|---|---|---|")
    for (name, n), v in tps.items():
        print(f"| {name} | {n} | {v:.1f} | {_ratio(v, tps[(single, n)])} |")
    print(
        f"\nshared-prefix time to first token: the median over {N_PREFIXES} ~500-token "
        "prefixes of the TTFT p50 of 4 concurrent followers after one request cached it"
    )
    print("\n| server | TTFT p50 ms |\n|---|---|")
    for name, v in ttft.items():
        print(f"| {name} | {_ms(v)} |")
    return 1 if failed else 0
