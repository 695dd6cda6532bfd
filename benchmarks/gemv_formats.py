"""Decode GEMV time per weight storage format: float32 panels vs q8_0, q4_1, q5_1 and q6_k.

``python -m benchmarks.gemv_formats [--rounds N] [--threads T ...]`` times y = x W^T for one
row x (a decode step's linear layer) on the SmolLM2-135M down_proj shape (576 x 1536) and the
Gemma 3 270M one (640 x 2048), with W holding values that each compact format stores exactly
(``gguf``'s Q8_0, Q4_1 and Q5_1 quantiser; random Q6_K blocks, which ``gguf`` cannot
quantise). Every format gets the same values, and before timing the compact outputs are checked
bit for bit against float32 panels of the same matrix. Two cases per shape:

- ``hot``: one matrix, called again and again (it stays in cache);
- ``streamed``: ``COPIES`` matrices called in turn, more bytes than the last-level cache, as a
  decode step that reads every layer's weights once.

Rounds are interleaved (one sample of every format per round), so a slow spell of a shared
machine hits every format alike; the table gives medians and the ratio float32 / format.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from exactblocks import _ext

from .environment import cpu_model, loadavg

SHAPES = [(576, 1536), (640, 2048)]
COPIES = 24  # float32: 24 x 3.5-5.2 MB, past a 32 MB L3
CALLS = 50  # GEMVs per sample


def format_values(kind: str, w: np.ndarray, rng) -> np.ndarray:
    """float32 values of ``w`` (n, k) that the compact format ``kind`` stores exactly."""
    import gguf
    from gguf.quants import dequantize, quantize

    t = gguf.GGMLQuantizationType
    if kind == "float32":
        return np.ascontiguousarray(w, np.float32)
    if kind in ("q8_0", "q4_1", "q5_1"):
        qt = {"q8_0": t.Q8_0, "q4_1": t.Q4_1, "q5_1": t.Q5_1}[kind]
        return np.ascontiguousarray(dequantize(quantize(w, qt), qt), np.float32)
    # q6_k: random Q6_K blocks with binary16 d of a trained matrix's size
    n, k = w.shape
    raw = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
    d = (np.abs(rng.standard_normal(len(raw))) * 2e-4).astype(np.float16)
    raw[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(dequantize(raw.reshape(-1), t.Q6_K).reshape(n, k), np.float32)


def main(argv=None) -> None:
    """Print the table (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    core = _ext.core()
    rng = np.random.default_rng(0)
    kinds = ["float32", "q8_0", "q4_1", "q5_1", "q6_k"]
    print(f"cpu: {cpu_model()}, isa: {core.get_isa()}, loadavg before: {loadavg()}")
    print("| shape | case | threads | " + " | ".join(f"{k} us" for k in kinds) + " | ", end="")
    print(" | ".join(f"f32/{k}" for k in kinds[1:]) + " |")
    print("|" + "---|" * (3 + 2 * len(kinds) - 1))
    for n, k in SHAPES:
        mats = {}
        for kind in kinds:
            lins = []
            for c in range(COPIES):
                w = (0.02 * np.random.default_rng(c).standard_normal((n, k))).astype(np.float32)
                v = format_values(kind, w, rng)
                lin = core.PackedLinear(v)
                assert lin.format == kind, (kind, lin.format)
                if c == 0:  # bits before timing: the same values in float32 panels
                    x = rng.standard_normal((1, k)).astype(np.float32)
                    want = core.gemm(x, v, None, compact=False)[0]
                    assert np.array_equal(lin.forward(x).view(np.uint32), want.view(np.uint32))
                lins.append(lin)
            mats[kind] = lins
        x = rng.standard_normal((1, k)).astype(np.float32)
        saved = core.get_num_threads()
        for nt in args.threads:
            core.set_num_threads(nt)
            for case in ("hot", "streamed"):
                samples = {kind: [] for kind in kinds}
                for _ in range(args.rounds):
                    for kind in kinds:
                        lins = mats[kind] if case == "streamed" else mats[kind][:1]
                        t0 = time.perf_counter_ns()
                        for i in range(CALLS):
                            lins[i % len(lins)].forward(x)
                        samples[kind].append((time.perf_counter_ns() - t0) / CALLS / 1e3)
                med = {kind: statistics.median(s) for kind, s in samples.items()}
                cells = [f"{med[kind]:.1f}" for kind in kinds]
                cells += [f"{med['float32'] / med[kind]:.2f}" for kind in kinds[1:]]
                print(f"| {n}x{k} | {case} | {nt} | " + " | ".join(cells) + " |")
        core.set_num_threads(saved)
    print(f"loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
