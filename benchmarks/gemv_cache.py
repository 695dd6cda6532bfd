"""Decode GEMV speed with the weights in cache vs streamed from memory: is decode bandwidth-bound?

``python -m benchmarks.gemv_cache [--rounds N] [--threads T ...]`` times y = x W^T for one row x
(a decode step's linear layer, K = 576 as every SmolLM2-135M projection but down_proj) on the
compact formats SmolLM2-135M-Instruct's GGUF holds: q4_1 (its layers) and q8_0 (its tied head),
with values ``gguf``'s quantiser gives (so the packer picks that format), and float32 panels as
the control (one FMA per weight where the compact formats run two). Three cases per format,
by where the weights live when the kernel reads them:

- ``L2``: one matrix of about 0.5 MB of compact bytes, called again and again;
- ``L3``: 16 copies of it called in turn (about 8 MB, past L2, inside a 32 MB L3);
- ``DRAM``: ``--dram-mb`` MB of copies called in turn (past any cache): a decode step, which
  reads every layer's weights once.

Speed is given in GB/s of compact bytes (codes + scales, as ``PackedLinear.nbytes``), in
weights per ns and in lane FMAs per ns (two per weight for q4_1 and q8_0: the rebuild
fma(d, q, m) or d * q, then the chain's FMA; one for float32). The time of one call minus that
of a call on a tiny matrix of the same K (the Python and dispatch overhead, printed) is the
kernel's. If the L2 speed is close to the DRAM one, the kernel is bound by its instructions per
weight, not by the memory. float32 is the reference with no rebuild (4 bytes per weight: its
L2 case is bound by L2's bandwidth, its DRAM case by memory's). The read bandwidth of the same
process (float32 ``numpy.matmul`` GEMV over 256 MiB, as ``benchmarks``' own ``read bandwidth``
row; NumPy's BLAS picks its own threads) is printed for comparison.

Rounds are interleaved (a few short samples of every case per round); the table gives the best
sample (the shared machine's other load only slows a sample down) and the median. With two
threads, a sample that another process's time slice on the second core overlaps waits for it:
short samples keep some clean.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from exactblocks import _ext

from .environment import cpu_model, loadavg

K = 576
# about 0.5 MB each: q4_1 0.75 bytes per weight, q8_0 1.125, float32 4
ROWS = {"q4_1": 1152, "q8_0": 768, "float32": 192}
L3_COPIES = 16
CALLS = 32  # GEMVs per sample
SAMPLES = 4  # samples per case per round


def quantised(kind: str, n: int, rng) -> np.ndarray:
    """float32 (n, K) values that ``kind`` stores exactly (``gguf``'s quantiser)."""
    import gguf
    from gguf.quants import dequantize, quantize

    w = (0.02 * rng.standard_normal((n, K))).astype(np.float32)
    if kind == "float32":
        return w
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[kind]
    return np.ascontiguousarray(dequantize(quantize(w, qt), qt), np.float32)


def at_least(low: int):
    """argparse type: an int >= ``low`` (else a usage error naming the bound and the value)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}; got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: ..."
    return parse


def read_bandwidth_gbs(mib: int = 256) -> float:
    """Best-of-6 float32 GEMV read speed over ``mib`` MiB (benchmarks' STREAM-like read)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((mib * (1 << 20) // (4 * 2048), 2048), dtype=np.float32)
    v = rng.standard_normal(2048, dtype=np.float32)
    y = np.empty(a.shape[0], np.float32)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        np.matmul(a, v, out=y)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def main(argv=None) -> None:
    """Print the table (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=at_least(1), default=9)
    ap.add_argument("--threads", type=at_least(1), nargs="+", default=[1, 2])
    ap.add_argument(
        "--dram-mb", type=at_least(1), default=160, help="bytes of the DRAM case (past the L3)"
    )
    args = ap.parse_args(argv)
    core = _ext.core()
    rng = np.random.default_rng(0)
    print(f"cpu: {cpu_model()}, isa: {core.get_isa()}, loadavg before: {loadavg()}")
    print(f"read bandwidth (numpy float32 GEMV, 256 MiB): {read_bandwidth_gbs():.1f} GB/s")
    sets = {}
    for kind, n in ROWS.items():
        v = quantised(kind, n, rng)
        first = core.PackedLinear(v)
        assert first.format == kind, (kind, first.format)
        x = rng.standard_normal((1, K)).astype(np.float32)
        want = core.gemm(x, v, None, compact=False)[0]  # bits before timing
        assert np.array_equal(first.forward(x).view(np.uint32), want.view(np.uint32))
        copies = max(L3_COPIES, args.dram_mb * 1_000_000 // first.nbytes)
        lins = [first] + [core.PackedLinear(v) for _ in range(copies - 1)]
        sets[(kind, "L2")] = lins[:1]
        sets[(kind, "L3")] = lins[:L3_COPIES]
        sets[(kind, "DRAM")] = lins
    tiny = core.PackedLinear(quantised("q8_0", 48, rng))
    x = rng.standard_normal((1, K)).astype(np.float32)
    print("| format | case | threads | MB read | kernel us | median | GB/s | weights/ns | FMA/ns |")
    print("|---|---|---|---|---|---|---|---|---|")
    saved = core.get_num_threads()
    for nt in args.threads:
        core.set_num_threads(nt)
        samples = {key: [] for key in sets}
        nxt = {key: 0 for key in sets}  # DRAM: the copy the next call reads (a cold one)
        over = []
        for _ in range(args.rounds):
            t0 = time.perf_counter_ns()
            for _ in range(256):
                tiny.forward(x)
            over.append((time.perf_counter_ns() - t0) / 256 / 1e3)
            for key, lins in sets.items():
                if key[1] != "DRAM":
                    for lin in lins:  # one pass first: the cache holds this case's bytes
                        lin.forward(x)
                for _ in range(SAMPLES):  # short samples: a time slice of another process
                    t0 = time.perf_counter_ns()  # on the other core spoils only some
                    for _ in range(CALLS):
                        lins[nxt[key]].forward(x)
                        nxt[key] = (nxt[key] + 1) % len(lins)
                    samples[key].append((time.perf_counter_ns() - t0) / CALLS / 1e3)
        ovh = min(over)
        print(f"| (tiny call) | | {nt} | | {ovh:.2f} | {statistics.median(over):.2f} ||||")
        for (kind, case), s in samples.items():
            lin = sets[(kind, case)][0]
            us, med = min(s) - ovh, statistics.median(s) - ovh  # the kernel's share
            mb = lin.nbytes * len(sets[(kind, case)]) / 1e6
            cells = [kind, case, str(nt), f"{mb:.1f}", f"{us:.2f}", f"{med:.2f}"]
            if us <= 0:  # the overhead's best sample was slower than this call's: no figure
                print("| " + " | ".join(cells) + " | n/a | n/a | n/a |")
                continue
            gbs = lin.nbytes / us / 1e3
            wns = lin.n_out * lin.k_in / us / 1e3
            fmas = wns * (1 if kind == "float32" else 2)  # lane FMAs (and d * q) per ns
            print("| " + " | ".join(cells) + f" | {gbs:.1f} | {wns:.1f} | {fmas:.1f} |")
    core.set_num_threads(saved)
    print(f"loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
