"""Side-by-side benchmark: ``python -m exactblocks.bench``.

One run, one process (plus one NumPy subprocess), the same thread count for every library:

- **exactblocks**: :class:`exactblocks.TransformerBlockInference` and
  :class:`exactblocks.Mamba2BlockInference` (``forward``, ``forward(..., lengths=...)``, ``step``);
- **NumPy float32 matmul** at the block's own GEMM shapes (the 7 GEMMs q, k, v, o, gate, up, down
  of a Llama layer; in_proj and out_proj of a Mamba-2 layer): the practical GEMM ceiling of the
  machine; at decode shapes the same products as matrix-vector products; plus a STREAM-like read
  bandwidth (float32 GEMV over a 256 MiB matrix), the decode ceiling. Measured in a subprocess
  without ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` (both can force a slow OpenBLAS kernel),
  driven one sample at a time so that its matmuls are timed in the same rounds as the peers;
- **PyTorch CPU** when torch and transformers import: HF ``LlamaDecoderLayer`` with
  ``attn_implementation`` "eager" and "sdpa", HF ``Mamba2Block`` (its torch path);
- **mojolearn** CPU binding when ``mojolearn-core`` is installed and loads
  (``mojolearn.TransformerBlockInference`` / ``mojolearn.Mamba2BlockInference``).

Workloads: a SmolLM2-135M layer (d 576, 9 heads, 3 KV heads, intermediate 1536), a Llama-3.2-1B
layer (d 2048, 32/8 heads, intermediate 8192, llama3 RoPE), a mamba2-130m layer (d 768, d_state
128, head_dim 64, expand 2), each at: prefill B=1 L=512; prefill B=4 L=128 ragged (lengths 128,
96, 64, 32); decode B=1 with 512 cached tokens; decode B=8 with 512 cached tokens per row. Then
the whole SmolLM2-135M-Instruct model (the demo's loader and head) against HF ``generate``.

Before anything is timed, outputs are checked: exactblocks' decode (prefill 512 + ``step``) equals
one ``forward`` bit for bit, each ragged row equals the row run alone bit for bit (padding +0.0),
every row of the first B=8 decode step equals that row stepped alone bit for bit, and every peer
agrees with exactblocks within ``ROW_RTOL`` (per-row ``||a - b|| / ||b||``). A peer or case whose
check fails is not timed (the table says "check failed") and the exit status is 1.

Timing: the check call is the warm-up; then ``--repeats`` rounds (default 5, or 2 with
``--quick``; calls that take seconds get fewer, but at least 3, or 2 with ``--quick``). A
round takes one sample of each peer in turn. A prefill sample is one untimed call, then one
timed call of the same peer (the peer timed before it has just filled the caches); the median
sample is reported. A decode sample copies the state prepared at 512 cached tokens (untimed)
and runs 16 consecutive steps: the first 4 are not timed (they refill the caches), the other
12 are timed one by one, and the median of all timed steps of all rounds is reported: the
steady state of a decode loop. For the torch layers the causal mask and RoPE cos/sin (made once
per model call by HF, shared by all layers) are built outside the timed region; everything else
a layer does is inside it.

Outputs: a markdown report on stdout (and ``bench.md``), ``bench.json`` (every sample, every
check, the environment) and ``bench.png`` (matplotlib; skipped with a message when missing).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .cli import _cpu_ticks, _other_cpu_share, _positive_int  # shared with the CLI

__all__ = ["LayerSpec", "ROW_RTOL", "main", "run_bench"]

#: Peer agreement tolerance: per row ``||y_peer - y_eb||_2 / ||y_eb||_2`` (SPEC.md 4.6, 7.5).
ROW_RTOL = 2e-4

#: Variables that make OpenBLAS pick a slow kernel on some machines; removed for the ceiling.
OPENBLAS_SLOW_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

CASES = ("prefill_b1", "prefill_ragged", "decode_b1", "decode_b8")
PEERS = ("exactblocks", "torch_eager", "torch_sdpa", "mojolearn")
PEER_LABELS = {
    "exactblocks": "exactblocks",
    "torch_eager": "torch eager",
    "torch_sdpa": "torch sdpa",
    "mojolearn": "mojolearn",
}
WORKLOAD_NAMES = (
    "smollm2-layer",
    "smollm2-layer-bf16",
    "llama1b-layer",
    "llama1b-layer-bf16",
    "mamba2-layer",
    "smollm2-model",
)

MEASURE_BUDGET_S = 4.0  # default repeats shrink so that one measurement takes about this long
MIN_REPEATS = 3
MODEL_PROMPT = (
    "Summarize the following text in two sentences.\n\n"
    "The old lighthouse on the northern cliff had not been lit for nearly forty years, yet the "
    "people of the village still climbed the narrow path to it every spring. They carried "
    "brushes, buckets of white paint and baskets of bread, and they spent a long afternoon "
    "scraping salt from the iron railings and repainting the tower walls. Nobody remembered "
    "exactly when the custom began. Some said a fisherman had promised to keep the tower clean "
    "after the light guided him home through a winter storm; others claimed the tradition was "
    "simply an excuse for a picnic with a view of the whole bay."
)


# ============================================================================ specs


@dataclass(frozen=True)
class LayerSpec:
    """Sizes of one benchmarked layer (a Llama decoder layer or a Mamba-2 block).

    Parameters
    ----------
    name : str
        Workload name used by ``--workloads`` (e.g. ``"llama1b-layer"``).
    label : str
        Human-readable name for the report.
    kind : {"transformer", "mamba2"}
        Block type: HF ``LlamaDecoderLayer`` or HF ``Mamba2Block``.
    d_model : int
        Residual width.
    n_heads, n_kv_heads, head_dim, intermediate : int
        Transformer sizes (for "mamba2": ``n_heads`` and ``head_dim`` are the SSM heads).
    rope_theta : float
        RoPE base (transformer).
    rope_scaling : dict or None
        HF ``rope_parameters``-style scaling (``rope_type`` "llama3"), or None.
    norm_eps : float
        RMSNorm epsilon.
    d_state, expand, n_groups, conv_kernel : int
        Mamba-2 sizes (HF ``Mamba2Config`` state_size, expand, n_groups, conv_kernel).
    bf16_weights : bool
        Round every weight to a bfloat16 value (widened back to float32), as the released
        SmolLM2-135M and Llama-3.2-1B checkpoints hold them. Every peer gets the same float32
        values; exactblocks stores such matrices as bfloat16 (same bits, half the bytes).
    """

    name: str
    label: str
    kind: str
    d_model: int
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 64
    intermediate: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    d_state: int = 128
    expand: int = 2
    n_groups: int = 1
    conv_kernel: int = 4
    bf16_weights: bool = False

    @property
    def d_inner(self) -> int:
        """Mamba-2 inner width ``expand * d_model``."""
        return self.expand * self.d_model

    def gemm_shapes(self) -> list[tuple[str, int, int]]:
        """The block's matrix products as ``(name, out_features, in_features)``.

        Returns
        -------
        list of (str, int, int)
            Transformer: q, k, v, o, gate, up, down. Mamba-2: in_proj, out_proj.
        """
        d = self.d_model
        if self.kind == "transformer":
            q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            it = self.intermediate
            return [
                ("q", q, d),
                ("k", kv, d),
                ("v", kv, d),
                ("o", d, q),
                ("gate", it, d),
                ("up", it, d),
                ("down", d, it),
            ]
        n_in = 2 * self.d_inner + 2 * self.n_groups * self.d_state + self.n_heads
        return [("in_proj", n_in, d), ("out_proj", d, self.d_inner)]

    def gemm_params(self) -> int:
        """Number of matrix weights (sum of out * in over :meth:`gemm_shapes`)."""
        return sum(n * k for _, n, k in self.gemm_shapes())

    def weight_bytes(self) -> int:
        """Bytes per matrix weight that exactblocks streams: 2 for bfloat16 values, else 4."""
        return 2 if self.bf16_weights else 4

    def variant(self, name: str, label: str) -> LayerSpec:
        """The same sizes with bfloat16-valued weights, under another name and label."""
        return dataclasses.replace(self, name=name, label=label, bf16_weights=True)


@dataclass(frozen=True)
class Shapes:
    """Sequence shapes of the four cases (full run or ``--quick``)."""

    prefill_len: int = 512
    ragged_lengths: tuple = (128, 96, 64, 32)
    context: int = 512
    decode_batch: int = 8
    decode_warm_steps: int = 4  # untimed steps at the start of each decode repeat
    decode_steps: int = 12  # then this many timed steps, one by one
    model_new_tokens: int = 16
    default_repeats: int = 5
    bandwidth_mib: int = 256


_LLAMA3_1B_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

FULL_LAYERS = {
    "smollm2-layer": LayerSpec(
        "smollm2-layer",
        "SmolLM2-135M layer",
        "transformer",
        576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        intermediate=1536,
        rope_theta=100000.0,
    ),
    "llama1b-layer": LayerSpec(
        "llama1b-layer",
        "Llama-3.2-1B layer",
        "transformer",
        2048,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        intermediate=8192,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_1B_ROPE,
    ),
    "mamba2-layer": LayerSpec(
        "mamba2-layer",
        "mamba2-130m layer",
        "mamba2",
        768,
        n_heads=24,
        head_dim=64,
        d_state=128,
        expand=2,
    ),
}
# --quick: the same code paths on tiny sizes (mamba2 keeps d_state 128 / head_dim 64, the only
# sizes mojolearn's Mamba2 accepts; d_model 64 gives 2 heads).
QUICK_LAYERS = {
    "smollm2-layer": LayerSpec(
        "smollm2-layer",
        "SmolLM2-135M layer (quick: tiny)",
        "transformer",
        64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate=128,
        rope_theta=100000.0,
    ),
    "llama1b-layer": LayerSpec(
        "llama1b-layer",
        "Llama-3.2-1B layer (quick: tiny)",
        "transformer",
        128,
        n_heads=8,
        n_kv_heads=2,
        head_dim=16,
        intermediate=256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_1B_ROPE,
    ),
    "mamba2-layer": LayerSpec(
        "mamba2-layer",
        "mamba2-130m layer (quick: tiny)",
        "mamba2",
        64,
        n_heads=2,
        head_dim=64,
        d_state=128,
        expand=2,
    ),
}
# bfloat16-valued weights, as the released checkpoints: the same layers, the same peers
for _layers in (FULL_LAYERS, QUICK_LAYERS):
    for _base in ("smollm2-layer", "llama1b-layer"):
        _layers[f"{_base}-bf16"] = _layers[_base].variant(
            f"{_base}-bf16", _layers[_base].label.replace(" layer", " layer, bf16 weights", 1)
        )
FULL_SHAPES = Shapes()
QUICK_SHAPES = Shapes(
    prefill_len=32,
    ragged_lengths=(16, 12, 8, 4),
    context=32,
    decode_batch=8,
    decode_warm_steps=1,
    decode_steps=2,
    model_new_tokens=4,
    default_repeats=2,
    bandwidth_mib=16,
)


def _case_label(case: str, sh: Shapes) -> str:
    r = sh.ragged_lengths
    return {
        "prefill_b1": f"prefill B=1 L={sh.prefill_len}",
        "prefill_ragged": f"prefill B={len(r)} L={max(r)} ragged",
        "decode_b1": f"decode B=1 ctx {sh.context}",
        "decode_b8": f"decode B={sh.decode_batch} ctx {sh.context}",
    }[case]


def _case_tokens(case: str, sh: Shapes) -> int:
    """Real tokens one call processes (padding not counted)."""
    return {
        "prefill_b1": sh.prefill_len,
        "prefill_ragged": int(sum(sh.ragged_lengths)),
        "decode_b1": 1,
        "decode_b8": sh.decode_batch,
    }[case]


# ============================================================================ small helpers


def row_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Largest per-row relative error ``||got - want||_2 / ||want||_2`` (float64 sums).

    Parameters
    ----------
    got, want : ndarray of shape (..., d), float32
        Rows along the last axis.

    Returns
    -------
    float
        Max over rows; ``inf`` when shapes differ or ``got`` is not finite.
    """
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return math.inf
    num = np.linalg.norm((got - want).reshape(-1, want.shape[-1]), axis=1)
    den = np.linalg.norm(want.reshape(-1, want.shape[-1]), axis=1)
    return float((num / np.maximum(den, 1e-30)).max()) if num.size else 0.0


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _first_diff(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    idx = tuple(int(i) for i in np.argwhere(a.view(np.uint32) != b.view(np.uint32))[0])
    return f"first difference at {idx}: {a[idx]!r} vs {b[idx]!r}"


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def _fmt(v: float | None, digits: int = 3) -> str:
    """Number with ``digits`` significant digits (no scientific notation for table sizes)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if v == 0:
        return "0"
    mag = int(math.floor(math.log10(abs(v))))
    decimals = max(0, digits - 1 - mag)
    return f"{v:,.{decimals}f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}x"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


def _cpu_busy(seconds: float = 0.5) -> float | None:
    """Fraction of all CPUs busy (user + system + steal) over ``seconds`` while we sleep."""
    t0 = _cpu_ticks()
    time.sleep(seconds)
    share = _other_cpu_share(t0, _cpu_ticks())  # we sleep: everything busy is someone else
    return None if share is None else round(share, 3)


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - any lookup failure means "unknown"
        return None


def _blas_info() -> list[dict]:
    """Which BLAS NumPy loaded and the kernel it picked (threadpoolctl when installed)."""
    try:
        import threadpoolctl

        return [
            {k: v for k, v in d.items() if k != "filepath"}
            for d in threadpoolctl.threadpool_info()
            if d.get("user_api") == "blas"
        ]
    except ImportError:
        pass
    info: dict = {"note": "threadpoolctl not installed; kernel read through ctypes"}
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info.update(name=cfg.get("name"), version=cfg.get("version"))
    except Exception:  # noqa: BLE001 - older NumPy: no dict mode
        pass
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln}
        for path in sorted(libs):
            lib = ctypes.CDLL(path)
            for sym in (
                "openblas_get_corename",
                "openblas_get_corename64_",
                "scipy_openblas_get_corename64_",
                "scipy_openblas_get_corename",
            ):
                fn = getattr(lib, sym, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    info["architecture"] = fn().decode()
                    break
    except Exception:  # noqa: BLE001 - best effort only
        pass
    return [info]


# ============================================================================ NumPy ceiling


def _numpy_worker() -> None:
    """Serve NumPy timings, one JSON request per stdin line (runs in the subprocess).

    Requests (``cmd``): ``info`` (BLAS and variables); ``bandwidth`` (the STREAM-like read,
    best of ``repeats`` passes); ``prepare`` (one workload's GEMM groups: weights, inputs and a
    warm-up pass each; replaces the previous workload's); ``time`` (one sample of a group:
    seconds per pass, over enough passes to last about 2 ms); ``quit``. One JSON reply per
    request on stdout; an error is a reply with ``"error"``.
    """
    rng = np.random.default_rng(0)
    groups: dict = {}  # name -> (ops, passes per sample)

    def run(ops: list) -> None:
        for op in ops:
            op()

    def prepare(spec: dict) -> dict:
        groups.clear()
        mats: dict = {}
        warm = {}
        for name, g in spec.items():
            m = int(g["m"])
            ops = []
            for _, n, k in g["shapes"]:
                if (n, k) not in mats:
                    mats[(n, k)] = rng.standard_normal((n, k), dtype=np.float32)
                w = mats[(n, k)]
                if m == 1:  # a matrix-vector product (BLAS gemv), as a decode step needs
                    x = rng.standard_normal(k, dtype=np.float32)
                    out = np.empty(n, np.float32)
                    ops.append(lambda w=w, x=x, out=out: np.matmul(w, x, out=out))
                else:  # x (m, k) @ W^T, W in torch (out, in) layout
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    out = np.empty((m, n), np.float32)
                    ops.append(lambda w=w, x=x, out=out: np.matmul(x, w.T, out=out))
            run(ops)  # warm-up
            t0 = time.perf_counter()
            run(ops)
            one = max(time.perf_counter() - t0, 1e-7)
            groups[name] = (ops, max(1, int(math.ceil(2e-3 / one))))
            warm[name] = one
        return {"warm": warm}

    def sample(name: str) -> dict:
        ops, passes = groups[name]
        t0 = time.perf_counter()
        for _ in range(passes):
            run(ops)
        return {"seconds": (time.perf_counter() - t0) / passes}

    def bandwidth(mib: int, repeats: int) -> dict:
        # y = A @ v over a float32 matrix of `mib` MiB (A read once per pass); best pass.
        cols = 2048
        rows = max(1, int(mib) * (1 << 20) // (4 * cols))
        a = rng.standard_normal((rows, cols), dtype=np.float32)
        v = rng.standard_normal(cols, dtype=np.float32)
        y = np.empty(rows, np.float32)
        np.matmul(a, v, out=y)
        best = math.inf
        for _ in range(max(5, int(repeats))):
            t0 = time.perf_counter()
            np.matmul(a, v, out=y)
            best = min(best, time.perf_counter() - t0)
        return {"read_bandwidth_gbs": a.nbytes / best / 1e9, "read_bandwidth_bytes": int(a.nbytes)}

    for line in sys.stdin:
        req = json.loads(line)
        try:
            cmd = req["cmd"]
            if cmd == "quit":
                break
            if cmd == "info":
                reply = {
                    "blas": _blas_info(),
                    "numpy": np.__version__,
                    "env": {
                        k: os.environ.get(k) for k in (*OPENBLAS_SLOW_VARS, "OPENBLAS_NUM_THREADS")
                    },
                }
            elif cmd == "bandwidth":
                reply = bandwidth(req["mib"], req["repeats"])
            elif cmd == "prepare":
                reply = prepare(req["groups"])
            elif cmd == "time":
                reply = sample(req["group"])
            else:
                reply = {"error": f"unknown request {cmd!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the driving process
            reply = {"error": repr(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class _NumpyPeer:
    """NumPy's float32 matmuls at a block's GEMM shapes: the machine's practical GEMM ceiling.

    They run in a subprocess (:func:`_numpy_worker`) with ``threads`` BLAS threads and without
    ``OPENBLAS_SLOW_VARS``, so OpenBLAS picks its own kernel and its threads never share a
    process with exactblocks' or torch's. The process is driven one request at a time, so its
    samples are taken in the same rounds as the peers' (``_time_interleaved``): a slow spell
    of a shared machine hits NumPy and exactblocks alike, and both sides are medians.
    """

    name = "numpy"

    def __init__(self, threads: int):
        env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_SLOW_VARS}
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
        src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        self.unset = {k: os.environ[k] for k in OPENBLAS_SLOW_VARS if k in os.environ}
        self._err = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "exactblocks.bench", "--numpy-worker"],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
        )

    def request(self, **req) -> dict:
        """Send one request and return its reply; RuntimeError when the worker fails."""
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self._err.seek(0)
            raise RuntimeError(
                f"NumPy subprocess ended ({self._proc.poll()}): {self._err.read().strip()[-2000:]}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"NumPy subprocess: {reply['error']}")
        return reply

    # After a call, OpenBLAS's threads spin for 2^OPENBLAS_THREAD_TIMEOUT cycles (default 2^28,
    # about 0.1 s) before they sleep; until then they hold the cores the next peer needs.
    IDLE_AFTER_S = 0.3

    def sampler(self, group: str):
        """One timed sample of ``group`` for :func:`_time_interleaved`: (seconds, cpu = 0).
        Returns once the subprocess's BLAS threads have gone idle (``IDLE_AFTER_S``)."""

        def sample():
            seconds = self.request(cmd="time", group=group)["seconds"]
            time.sleep(self.IDLE_AFTER_S)
            return [seconds], 0.0

        return sample

    def close(self) -> None:
        """Stop the subprocess."""
        try:
            self.request(cmd="quit")
        except RuntimeError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._err.close()


# ============================================================================ weights / inputs


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bfloat16 value (ties to even), as float32 (low 16 bits zero).

    Parameters
    ----------
    x : ndarray of float32 (finite)

    Returns
    -------
    ndarray of float32, the shape of x

    Examples
    --------
    >>> bf16_round(np.array([1.0, 1.00390625, 1.01171875, 3.14159], np.float32)).tolist()
    [1.0, 1.0, 1.015625, 3.140625]
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).reshape(np.shape(x))


def _transformer_weights(spec: LayerSpec, rng: np.random.Generator) -> dict:
    """Short-name weights (SPEC.md 4.2): matrices N(0, 1/in), norms 1 + 0.1 N (bfloat16
    values when ``spec.bf16_weights``)."""
    w = {
        f"{n}_proj.weight": (
            rng.standard_normal((o, i), dtype=np.float32) * np.float32(1.0 / math.sqrt(i))
        )
        for n, o, i in spec.gemm_shapes()
    }
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        w[n] = (1.0 + 0.1 * rng.standard_normal(spec.d_model)).astype(np.float32)
    if spec.bf16_weights:
        w = {n: bf16_round(a) for n, a in w.items()}
    return w


_HF_LLAMA_PREFIX = {
    "q": "self_attn.",
    "k": "self_attn.",
    "v": "self_attn.",
    "o": "self_attn.",
    "gate": "mlp.",
    "up": "mlp.",
    "down": "mlp.",
}


def _transformer_hf_names(w: dict) -> dict:
    out = {}
    for k, v in w.items():
        head = k.split("_proj")[0]
        out[(_HF_LLAMA_PREFIX[head] + k) if k.endswith("_proj.weight") else k] = v
    return out


def _mamba2_weights(spec: LayerSpec, rng: np.random.Generator) -> dict:
    """Short-name Mamba-2 weights (mojolearn's names): HF-like init as in the oracle tests."""
    d, di, h = spec.d_model, spec.d_inner, spec.n_heads
    conv_dim = di + 2 * spec.n_groups * spec.d_state
    n_in = 2 * di + 2 * spec.n_groups * spec.d_state + h

    def mat(o, i):
        return rng.standard_normal((o, i), dtype=np.float32) * np.float32(1.0 / math.sqrt(i))

    dt = np.exp(math.log(1e-3) + rng.random(h) * (math.log(0.1) - math.log(1e-3)))
    return {
        "block_norm.weight": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "in_proj.weight": mat(n_in, d),
        "conv1d.weight": (
            rng.standard_normal((conv_dim, 1, spec.conv_kernel)) / math.sqrt(spec.conv_kernel)
        ).astype(np.float32),
        "conv1d.bias": (0.1 * rng.standard_normal(conv_dim)).astype(np.float32),
        "dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),  # inverse softplus
        "A_log": np.log(rng.uniform(1.0, 16.0, h)).astype(np.float32),
        "D": np.ones(h, np.float32),
        "norm.weight": (1.0 + 0.1 * rng.standard_normal(di)).astype(np.float32),
        "out_proj.weight": mat(d, di),
    }


def _mamba2_hf_names(w: dict) -> dict:
    return {("norm.weight" if k == "block_norm.weight" else "mixer." + k): v for k, v in w.items()}


# ============================================================================ peers
#
# Every peer adapter offers the same small surface; `make_*` does the untimed preparation and
# returns the function that is timed:
#   make_prefill(x, lengths) -> fn()            fn returns (B, L, d) float32
#   prefix_state(x_ctx) -> (state, y)           state after a (1, C, d) prefill (untimed)
#   tile(state, B) -> state                     B identical rows (untimed)
#   clone(state) -> state                       independent copy (untimed)
#   make_step(state, x_tok) -> fn()             x_tok (B, d); fn returns (B, d), advances state


class _EbPeer:
    """exactblocks block (transformer or Mamba-2)."""

    name = "exactblocks"

    def __init__(self, spec: LayerSpec, weights: dict, max_positions: int):
        import exactblocks as eb

        self.spec = spec
        self.max_tokens = max_positions
        if spec.kind == "transformer":
            self.blk = eb.TransformerBlockInference(
                weights,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim,
                rope_theta=spec.rope_theta,
                rope_scaling=copy.deepcopy(spec.rope_scaling),
                norm_eps=spec.norm_eps,
                max_positions=max_positions,
            )
        else:
            self.blk = eb.Mamba2BlockInference(
                weights, n_groups=spec.n_groups, norm_eps=spec.norm_eps
            )

    def make_prefill(self, x, lengths):
        blk = self.blk
        return lambda: blk.forward(x, lengths=lengths)

    def allocate(self, batch: int):
        if self.spec.kind == "transformer":
            return self.blk.allocate_state(batch, self.max_tokens)
        return self.blk.allocate_state(batch)

    def prefix_state(self, x_ctx):
        st = self.allocate(1)
        return st, self.blk.forward(x_ctx, st)

    def tile(self, st1, batch: int):
        st = self.allocate(batch)
        if self.spec.kind == "transformer":
            st.k_cache[:] = st1.k_cache
            st.v_cache[:] = st1.v_cache
        else:
            st.h[:] = st1.h
            st.conv_window[:] = st1.conv_window
        st.row_tokens[:] = st1.row_tokens[0]
        return st

    def clone(self, st):
        return copy.deepcopy(st)

    def make_step(self, st, x_tok):
        blk = self.blk
        return lambda: blk.step(x_tok, st)[:, 0]


class _TorchLlamaPeer:
    """HF ``LlamaDecoderLayer`` (float32, CPU), attention implementation ``impl``."""

    def __init__(self, shared: dict, impl: str):
        self.name = f"torch_{impl}"
        self.impl = impl
        self.sh = shared  # {"torch", "layer", "rotary", "config", "mask_fn", "cache_cls"}

    @staticmethod
    def build(spec: LayerSpec, weights: dict, max_positions: int) -> dict:
        import torch
        from transformers import LlamaConfig
        from transformers.cache_utils import DynamicCache
        from transformers.masking_utils import create_causal_mask
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        rope = dict(spec.rope_scaling) if spec.rope_scaling else {"rope_type": "default"}
        rope["rope_theta"] = spec.rope_theta
        cfg = LlamaConfig(
            hidden_size=spec.d_model,
            intermediate_size=spec.intermediate,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=spec.norm_eps,
            hidden_act="silu",
            num_hidden_layers=1,
            max_position_embeddings=max(
                max_positions, int(rope.get("original_max_position_embeddings", 0)) + 1
            ),
            rope_parameters=rope,
        )
        cfg._attn_implementation = "eager"
        layer = LlamaDecoderLayer(cfg, 0)
        sd = {k: torch.from_numpy(v) for k, v in _transformer_hf_names(weights).items()}
        layer.load_state_dict(sd, strict=True)
        layer.eval()
        return {
            "torch": torch,
            "layer": layer,
            "rotary": LlamaRotaryEmbedding(cfg),
            "config": cfg,
            "mask_fn": create_causal_mask,
            "cache_cls": DynamicCache,
        }

    def _prep(self, xt, pos, attn_2d, cache):
        s = self.sh
        s["config"]._attn_implementation = self.impl
        mask = s["mask_fn"](
            config=s["config"],
            inputs_embeds=xt,
            attention_mask=attn_2d,
            past_key_values=cache,
            position_ids=pos,
        )
        return mask, s["rotary"](xt, pos)

    def _call(self, xt, mask, pos, cos_sin, cache):
        s = self.sh
        s["config"]._attn_implementation = self.impl
        with s["torch"].no_grad():
            out = s["layer"](
                xt,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=cache is not None,
                position_embeddings=cos_sin,
            )
        return out[0] if isinstance(out, tuple) else out

    def make_prefill(self, x, lengths):
        torch = self.sh["torch"]
        b, n, _ = x.shape
        xt = torch.from_numpy(np.ascontiguousarray(x))
        pos = torch.arange(n)[None, :].expand(b, n)
        attn = None
        if lengths is not None:
            attn = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
        with torch.no_grad():
            mask, cos_sin = self._prep(xt, pos, attn, None)
        return lambda: self._call(xt, mask, pos, cos_sin, None).numpy()

    def prefix_state(self, x_ctx):
        torch = self.sh["torch"]
        cache = self.sh["cache_cls"](config=self.sh["config"])
        xt = torch.from_numpy(np.ascontiguousarray(x_ctx))
        pos = torch.arange(x_ctx.shape[1])[None, :]
        with torch.no_grad():
            mask, cos_sin = self._prep(xt, pos, None, cache)
            y = self._call(xt, mask, pos, cos_sin, cache).numpy()
        return {"cache": cache, "pos": x_ctx.shape[1]}, y

    def tile(self, st, batch: int):
        torch = self.sh["torch"]
        cache = copy.deepcopy(st["cache"])
        cache.reorder_cache(torch.zeros(batch, dtype=torch.long))
        return {"cache": cache, "pos": st["pos"]}

    def clone(self, st):
        return {"cache": copy.deepcopy(st["cache"]), "pos": st["pos"]}

    def make_step(self, st, x_tok):
        torch = self.sh["torch"]
        b = x_tok.shape[0]
        xt = torch.from_numpy(np.ascontiguousarray(x_tok)[:, None, :])
        pos = torch.full((b, 1), st["pos"], dtype=torch.long)
        with torch.no_grad():
            mask, cos_sin = self._prep(xt, pos, None, st["cache"])

        def fn():
            y = self._call(xt, mask, pos, cos_sin, st["cache"])
            st["pos"] += 1
            return y[:, 0].numpy()

        return fn


class _TorchMamba2Peer:
    """HF ``Mamba2Block`` (float32, CPU, torch path: chunked SSD scan / selective update)."""

    name = "torch_eager"

    def __init__(self, spec: LayerSpec, weights: dict):
        import torch
        from transformers import Mamba2Config
        from transformers.cache_utils import DynamicCache
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Block

        cfg = Mamba2Config(
            hidden_size=spec.d_model,
            expand=spec.expand,
            head_dim=spec.head_dim,
            num_heads=spec.n_heads,
            state_size=spec.d_state,
            n_groups=spec.n_groups,
            conv_kernel=spec.conv_kernel,
            use_bias=False,
            use_conv_bias=True,
            chunk_size=256,
            layer_norm_epsilon=spec.norm_eps,
            num_hidden_layers=1,
            hidden_act="silu",
        )
        block = Mamba2Block(cfg, 0)
        sd = {k: torch.from_numpy(v) for k, v in _mamba2_hf_names(weights).items()}
        block.load_state_dict(sd, strict=True)
        block.eval()
        self.torch, self.block, self.config, self.cache_cls = torch, block, cfg, DynamicCache

    def _call(self, xt, cache=None, attn=None):
        with self.torch.no_grad():
            out = self.block(xt, cache_params=cache, attention_mask=attn)
        return out[0] if isinstance(out, tuple) else out

    def make_prefill(self, x, lengths):
        torch = self.torch
        xt = torch.from_numpy(np.ascontiguousarray(x))
        attn = None
        if lengths is not None:
            attn = (torch.arange(x.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
        return lambda: self._call(xt, None, attn).numpy()

    def prefix_state(self, x_ctx):
        cache = self.cache_cls(config=self.config)
        y = self._call(self.torch.from_numpy(np.ascontiguousarray(x_ctx)), cache).numpy()
        return cache, y

    def tile(self, st, batch: int):
        cache = copy.deepcopy(st)
        cache.reorder_cache(self.torch.zeros(batch, dtype=self.torch.long))
        return cache

    def clone(self, st):
        return copy.deepcopy(st)

    def make_step(self, st, x_tok):
        xt = self.torch.from_numpy(np.ascontiguousarray(x_tok)[:, None, :])
        return lambda: self._call(xt, st)[:, 0].numpy()


_MOJOLEARN: dict = {}


def _import_mojolearn():
    """Import mojolearn, or return ``(None, reason)``.

    The mojolearn-core 0.8.62 wheel's host bindings carry a RUNPATH of the machine they were
    built on, so their runtime libraries (``mojolearn/.libs``) are not found; they are preloaded
    here with ``RTLD_GLOBAL`` when the plain import fails for that reason.
    """
    if "result" in _MOJOLEARN:
        return _MOJOLEARN["result"]
    spec = importlib.util.find_spec("mojolearn")
    if spec is None:
        res = (None, "mojolearn-core not installed")
    else:
        try:
            res = (importlib.import_module("mojolearn"), "")
        except ImportError as exc:
            if "cannot open shared object" not in str(exc):
                res = (None, f"mojolearn-core not usable: {exc}")
            else:
                for k in [k for k in sys.modules if k == "mojolearn" or k.startswith("mojolearn.")]:
                    del sys.modules[k]
                libdir = os.path.join(list(spec.submodule_search_locations)[0], ".libs")
                pending = (
                    sorted(f for f in os.listdir(libdir) if f.endswith(".so"))
                    if os.path.isdir(libdir)
                    else []
                )
                for _ in range(len(pending) + 1):  # load in dependency order, whatever it is
                    left = []
                    for f in pending:
                        try:
                            ctypes.CDLL(os.path.join(libdir, f), mode=ctypes.RTLD_GLOBAL)
                        except OSError:
                            left.append(f)
                    if not left or left == pending:
                        break
                    pending = left
                try:
                    res = (
                        importlib.import_module("mojolearn"),
                        "runtime libraries in mojolearn/.libs preloaded (the wheel's RUNPATH "
                        "points at its build machine)",
                    )
                except ImportError as exc2:
                    res = (None, f"mojolearn-core not usable: {exc2}")
    _MOJOLEARN["result"] = res
    return res


class _MojolearnPeer:
    """mojolearn CPU binding (``TransformerBlockInference`` / ``Mamba2BlockInference``)."""

    name = "mojolearn"

    def __init__(self, ml, spec: LayerSpec, weights: dict, max_positions: int):
        self.spec = spec
        self.max_tokens = max_positions
        if spec.kind == "transformer":
            self.blk = ml.TransformerBlockInference(
                weights,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim,
                rope_theta=spec.rope_theta,
                rope_scaling=copy.deepcopy(spec.rope_scaling),
                norm_eps=spec.norm_eps,
                max_positions=max_positions,
            )
        else:
            self.blk = ml.Mamba2BlockInference(weights)

    def make_prefill(self, x, lengths):
        blk = self.blk
        if lengths is None:
            return lambda: np.asarray(blk.forward(x))
        lens = [int(n) for n in lengths]
        return lambda: np.asarray(blk.forward(x, lengths=lens))

    def allocate(self, batch: int):
        if self.spec.kind == "transformer":
            return self.blk.allocate_state(batch, self.max_tokens)
        return self.blk.allocate_state(batch)

    def prefix_state(self, x_ctx):
        st = self.allocate(1)
        return st, np.asarray(self.blk.forward(x_ctx, st))

    def tile(self, st1, batch: int):
        st = self.allocate(batch)
        if self.spec.kind == "transformer":
            # flat buffers, packed [B, KV, cached_tokens, HD] at stride cached_tokens
            n = st1.n_kv_heads * st1.cached_tokens * st1.head_dim
            for name in ("k_cache", "v_cache"):
                src = np.asarray(getattr(st1, name)).reshape(-1)[:n]
                np.asarray(getattr(st, name)).reshape(-1)[: batch * n] = np.tile(src, batch)
            st.cached_tokens = st1.cached_tokens
        else:
            for name in ("conv_window", "h", "buffer_xbc", "buffer_dtraw"):
                np.asarray(getattr(st, name))[:] = np.asarray(getattr(st1, name))
            st.buffered_tokens = st1.buffered_tokens
        return st

    def clone(self, st):
        return copy.deepcopy(st)

    def make_step(self, st, x_tok):
        blk = self.blk
        b, d = x_tok.shape
        return lambda: np.asarray(blk.step(x_tok, st)).reshape(b, d)


# ============================================================================ measuring


@dataclass
class Measurement:
    """Timing of one (workload, case, peer).

    Attributes
    ----------
    seconds : float
        Median seconds per call (per step for decode).
    tokens : int
        Real tokens per call (``B`` for a decode step).
    samples : list of float
        Every timed sample, seconds.
    cpu_util : float
        Process CPU time / wall time over the samples (about the threads kept busy).
    """

    seconds: float
    tokens: int
    samples: list = field(default_factory=list)
    cpu_util: float = math.nan

    @property
    def tokens_per_s(self) -> float:
        """Real tokens per second."""
        return self.tokens / self.seconds

    def as_dict(self) -> dict:
        """JSON-ready dict with the derived rates."""
        d = asdict(self)
        d.update(
            ms_per_call=1e3 * self.seconds,
            ms_per_token=1e3 * self.seconds / self.tokens,
            tokens_per_s=self.tokens_per_s,
        )
        return d


def _n_repeats(t_warm: float, opts: dict) -> int:
    if opts["repeats_explicit"]:
        return opts["repeats"]
    fit = int(MEASURE_BUDGET_S / max(t_warm, 1e-9))
    return max(min(MIN_REPEATS, opts["repeats"]), min(opts["repeats"], fit))


def _run_decode(peer, snap, xs: np.ndarray, warm: int = 0) -> tuple[np.ndarray, list[float], float]:
    """Decode ``len(xs)`` consecutive steps from a copy of ``snap``: (outputs (K, B, d), the
    seconds of each step from step ``warm`` on, their cpu seconds)."""
    st = peer.clone(snap)
    outs, times, cpu = [], [], 0.0
    for t in range(xs.shape[0]):
        fn = peer.make_step(st, xs[t])
        c0, t0 = time.process_time(), time.perf_counter()
        y = fn()
        dt = time.perf_counter() - t0
        if t >= warm:
            times.append(dt)
            cpu += time.process_time() - c0
        outs.append(np.array(y, dtype=np.float32, copy=True))
    return np.stack(outs), times, cpu


def _prefill_sampler(fn):
    """One untimed, then one timed prefill call: returns (seconds, cpu seconds).

    The untimed call first, as for decode (:func:`_decode_sampler`): right after another peer
    has run (mojolearn most of all), the next ~0.1 s of any peer's calls run up to 1.3x slower
    (measured: a SmolLM2 layer's prefill takes 22 instead of 17 ms for its first few calls).
    Each peer is thus timed warm, as when it serves requests back to back."""

    def sample():
        fn()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return [time.perf_counter() - t0], time.process_time() - c0

    return sample


def _decode_sampler(peer, snap, xs: np.ndarray, warm: int):
    """``len(xs)`` consecutive decode steps from a copy of ``snap``, the first ``warm`` of them
    untimed: (seconds of each later step, their cpu seconds).

    The steady state of a decode loop is what a serving loop sees, so the first steps are not
    counted: the peer timed just before (and the state copy) has evicted this peer's weights
    from the caches, and a decode step, unlike a prefill, is short enough for that refill to
    dominate it. Measured on the SmolLM2 layer at B=8 (benchmarks/decode_steps.py: each step's
    median over 7 repeats), our steps took 1.05, 0.75, 0.68, 0.64, 0.67, 0.59, then about
    0.57 ms; torch sdpa's 2.5, 2.3, 2.0, 2.1, then about 1.85 ms. Every peer is timed alike."""

    def sample():
        _, times, cpu = _run_decode(peer, snap, xs, warm)
        return times, cpu

    return sample


def _time_interleaved(jobs: dict, opts: dict, rec, workload: str, case: str) -> dict:
    """Time every peer of one case in rounds: each round takes one sample of each peer in
    turn (after a short pause that lets the previous peer's worker threads go idle), so all
    peers see the same machine. Every peer gets the same number of rounds, the least any
    peer's budget allows (at least MIN_REPEATS); a peer that fails is reported, not fatal."""
    if not jobs:
        return {}
    n = min(_n_repeats(t_w, opts) for _, t_w, _ in jobs.values())
    samples = {p: [] for p in jobs}
    cpu = {p: 0.0 for p in jobs}
    out: dict = {}
    for _ in range(n):
        for pname, (sample, _, _) in jobs.items():
            if pname in out:
                continue
            time.sleep(0.05)
            try:
                ts, c = sample()
            except Exception as exc:  # noqa: BLE001
                if pname == "exactblocks":
                    raise
                if pname == _NumpyPeer.name:  # the ceiling is context, not a check
                    rec.note(f"{workload} {case}: NumPy matmuls not measured: {exc}")
                else:
                    rec.check(workload, case, pname, "runs", False, repr(exc))
                out[pname] = f"error: {type(exc).__name__}"
                continue
            samples[pname] += ts
            cpu[pname] += c
    for pname, (_, _, tokens) in jobs.items():
        if pname not in out:
            out[pname] = Measurement(
                _median(samples[pname]), tokens, samples[pname], cpu[pname] / sum(samples[pname])
            )
    return out


class _Recorder:
    """Collects checks and notes of one run."""

    def __init__(self, verbose: bool):
        self.checks: list[dict] = []
        self.notes: list[str] = []
        self.verbose = verbose

    def check(self, workload: str, case: str, peer: str, what: str, ok: bool, detail: str) -> bool:
        self.checks.append(
            dict(workload=workload, case=case, peer=peer, what=what, ok=bool(ok), detail=detail)
        )
        self.log(f"  check {'ok  ' if ok else 'FAIL'} {workload} {case} {peer}: {what} ({detail})")
        return bool(ok)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
        self.log(f"  note: {text}")

    def log(self, text: str) -> None:
        if self.verbose:
            print(text, file=sys.stderr, flush=True)


# ============================================================================ a layer workload


def _build_peers(
    spec: LayerSpec, weights: dict, max_positions: int, avail: dict, rec: _Recorder
) -> dict:
    peers = {"exactblocks": _EbPeer(spec, weights, max_positions)}
    if avail["torch_error"] is None:
        if spec.kind == "transformer":
            shared = None
            try:
                shared = _TorchLlamaPeer.build(spec, weights, max_positions)
            except Exception as exc:  # noqa: BLE001 - a broken peer is reported, not fatal
                rec.note(f"{spec.name}: HF LlamaDecoderLayer could not be built: {exc!r}")
            if shared is not None:
                peers["torch_eager"] = _TorchLlamaPeer(shared, "eager")
                peers["torch_sdpa"] = _TorchLlamaPeer(shared, "sdpa")
        else:
            try:
                peers["torch_eager"] = _TorchMamba2Peer(spec, weights)
            except Exception as exc:  # noqa: BLE001
                rec.note(f"{spec.name}: HF Mamba2Block could not be built: {exc!r}")
    if avail["mojolearn"] is not None and not spec.bf16_weights:  # its time does not
        try:  # depend on the values
            peers["mojolearn"] = _MojolearnPeer(avail["mojolearn"], spec, weights, max_positions)
        except Exception as exc:  # noqa: BLE001
            rec.note(f"{spec.name}: mojolearn block could not be built: {exc!r}")
    return peers


def _run_layer(
    spec: LayerSpec,
    sh: Shapes,
    avail: dict,
    opts: dict,
    rec: _Recorder,
    numpy_peer: _NumpyPeer | None = None,
    ceiling: dict | None = None,
) -> dict:
    """Checks, then timings, of one layer workload: ``{case: {peer: Measurement | str}}``.

    With ``numpy_peer``, NumPy's matmuls at the block's GEMM shapes are timed in the same
    rounds, and ``ceiling["groups"]["<workload>/<case>"]`` gets their median (``seconds``),
    best pass (``best_seconds``) and GFLOP/s."""
    rng = np.random.default_rng(1234)
    d, L, C, B8 = spec.d_model, sh.prefill_len, sh.context, sh.decode_batch
    W, K = sh.decode_warm_steps, sh.decode_warm_steps + sh.decode_steps  # K steps per repeat
    lens = np.asarray(sh.ragged_lengths, np.int64)
    weights = (_transformer_weights if spec.kind == "transformer" else _mamba2_weights)(spec, rng)
    x_pre = rng.standard_normal((1, L, d), dtype=np.float32)
    x_ctx = x_pre if C == L else rng.standard_normal((1, C, d), dtype=np.float32)
    x_rag = rng.standard_normal((len(lens), int(lens.max()), d), dtype=np.float32)
    xs1 = rng.standard_normal((K, 1, d), dtype=np.float32)
    xs8 = rng.standard_normal((K, B8, d), dtype=np.float32)
    xs8[:, 0] = xs1[:, 0]
    max_pos = max(L, C + K) + 8

    rec.log(f"[{spec.name}] building peers ...")
    peers = _build_peers(spec, weights, max_pos, avail, rec)
    eb = peers["exactblocks"]
    storage = sorted({f for _, f, _ in eb.blk.weight_storage()})
    rec.note(
        f"{spec.name}: exactblocks stores its matrices as {', '.join(storage)} "
        f"({sum(b for *_, b in eb.blk.weight_storage()) / 2**20:.1f} MiB)"
    )
    res: dict = {c: {} for c in CASES}
    name = spec.name

    # ---- exactblocks: the reference outputs, checked bit for bit against itself
    t0 = time.perf_counter()
    y_pre = eb.make_prefill(x_pre, None)()
    t_pre = time.perf_counter() - t0
    st1, y_ctx = eb.prefix_state(x_ctx)
    snap1 = eb.clone(st1)
    y_dec1, dec_times, _ = _run_decode(eb, snap1, xs1)
    x_full = np.concatenate([x_ctx, xs1[:, 0][None]], axis=1)
    y_full = eb.make_prefill(x_full, None)()
    ok_dec = _bits_equal(y_full[:, :C], y_ctx) and _bits_equal(y_full[0, C:], y_dec1[:, 0])
    rec.check(
        name,
        "decode_b1",
        "exactblocks",
        f"prefill {C} + {K} x step == one forward over {C + K} tokens, bitwise",
        ok_dec,
        "equal" if ok_dec else _first_diff(np.concatenate([y_ctx[0], y_dec1[:, 0]]), y_full[0]),
    )
    ok_pre = True
    if C == L:
        ok_pre = rec.check(
            name,
            "prefill_b1",
            "exactblocks",
            "forward without state == forward with state, bitwise",
            _bits_equal(y_pre, y_ctx),
            "equal" if _bits_equal(y_pre, y_ctx) else _first_diff(y_pre, y_ctx),
        )
    t0 = time.perf_counter()
    y_rag = eb.make_prefill(x_rag, lens)()
    t_rag = time.perf_counter() - t0
    bad = []
    for b, n in enumerate(lens.tolist()):
        alone = eb.make_prefill(np.ascontiguousarray(x_rag[b : b + 1, :n]), None)()
        if not _bits_equal(y_rag[b : b + 1, :n], alone):
            bad.append(f"row {b}: {_first_diff(y_rag[b : b + 1, :n], alone)}")
        if not _bits_equal(y_rag[b, n:], np.zeros_like(y_rag[b, n:])):
            bad.append(f"row {b}: padding is not +0.0")
    ok_rag = rec.check(
        name,
        "prefill_ragged",
        "exactblocks",
        "each ragged row == the row alone, padding +0.0, bitwise",
        not bad,
        "; ".join(bad) or "equal",
    )
    snap8 = eb.tile(snap1, B8)
    y_dec8, _, _ = _run_decode(eb, snap8, xs8)
    bad = []
    for b in range(B8):
        alone, _, _ = _run_decode(eb, snap1, xs8[:1, b : b + 1])
        if not _bits_equal(y_dec8[0, b], alone[0, 0]):
            bad.append(f"row {b}: {_first_diff(y_dec8[0, b], alone[0, 0])}")
    ok_dec8 = rec.check(
        name,
        "decode_b8",
        "exactblocks",
        f"each row of a B={B8} step == that row stepped alone, bitwise",
        not bad,
        "; ".join(bad) or "equal",
    )
    ref = {"prefill_b1": y_pre, "prefill_ragged": y_rag, "decode_b1": y_dec1, "decode_b8": y_dec8}
    warm_eb = {"prefill_b1": t_pre, "prefill_ragged": t_rag, "decode_b1": _median(dec_times)}

    def agree(case, peer, got) -> bool:
        want = ref[case]
        if case == "prefill_ragged":
            got = np.concatenate([got[b, :n] for b, n in enumerate(lens.tolist())])
            want = np.concatenate([want[b, :n] for b, n in enumerate(lens.tolist())])
        err = row_rel_err(got, want)
        return rec.check(
            name,
            case,
            peer,
            f"vs exactblocks, per-row rel. error <= {ROW_RTOL:g}",
            err <= ROW_RTOL,
            f"max {err:.2e}",
        )

    # ---- checks and warm-up, peer by peer; then the timed samples of each case, interleaved
    # across peers round by round (a slow spell of a shared machine then hits every peer
    # alike, so the ratios stay meaningful).
    jobs: dict = {c: {} for c in CASES}  # case -> peer -> (sample function, warm s, tokens)
    for pname, peer in peers.items():
        rec.log(f"[{name}] {pname} ...")
        try:
            # prefill B=1 and ragged
            for case, xc, lc, ok_eb in (
                ("prefill_b1", x_pre, None, ok_pre),
                ("prefill_ragged", x_rag, lens, ok_rag),
            ):
                fn = (eb if pname == "exactblocks" else peer).make_prefill(xc, lc)
                if pname == "exactblocks":
                    t_w, ok = warm_eb[case], ok_eb
                else:
                    t0 = time.perf_counter()
                    got = fn()
                    t_w = time.perf_counter() - t0
                    ok = agree(case, pname, got)
                if ok:
                    jobs[case][pname] = (_prefill_sampler(fn), t_w, _case_tokens(case, sh))
                else:
                    res[case][pname] = "check failed"
            # decode B=1 and B=8 from the same 512-token prefix
            if pname == "exactblocks":
                p_snap1, p_snap8 = snap1, snap8
                t_w, ok1, ok8 = warm_eb["decode_b1"], ok_dec, ok_dec8
                _, times8, _ = _run_decode(eb, snap8, xs8[:1])
                t_w8 = times8[0]
            else:
                p_st1, _ = peer.prefix_state(x_ctx)
                p_snap1 = peer.clone(p_st1)
                p_snap8 = peer.tile(p_snap1, B8)
                got1, times1, _ = _run_decode(peer, p_snap1, xs1)
                got8, times8, _ = _run_decode(peer, p_snap8, xs8)
                t_w, t_w8 = _median(times1), _median(times8)
                ok1 = agree("decode_b1", pname, got1)
                ok8 = agree("decode_b8", pname, got8)
            for case, ok_c, snap_c, xs_c, tw_c in (
                ("decode_b1", ok1, p_snap1, xs1, t_w),
                ("decode_b8", ok8, p_snap8, xs8, t_w8),
            ):
                if ok_c:
                    jobs[case][pname] = (
                        _decode_sampler(peer, snap_c, xs_c, W),
                        tw_c * xs_c.shape[0],
                        xs_c.shape[1],
                    )
                else:
                    res[case][pname] = "check failed"
        except Exception as exc:  # noqa: BLE001 - one broken peer must not end the run
            if pname == "exactblocks":
                raise
            rec.check(name, "-", pname, "runs", False, repr(exc))
            for c in CASES:
                jobs[c].pop(pname, None)
                res[c].setdefault(pname, f"error: {type(exc).__name__}")
    gemm_shapes = spec.gemm_shapes()
    if numpy_peer is not None and ceiling is not None:
        try:
            warm = numpy_peer.request(
                cmd="prepare",
                groups={c: {"m": _case_tokens(c, sh), "shapes": gemm_shapes} for c in CASES},
            )["warm"]
            time.sleep(numpy_peer.IDLE_AFTER_S)  # its BLAS threads go idle before the rounds
            for c in CASES:
                jobs[c][numpy_peer.name] = (numpy_peer.sampler(c), warm[c], _case_tokens(c, sh))
        except RuntimeError as exc:
            rec.note(f"{name}: NumPy matmuls not measured: {exc}")
    for case in CASES:
        rec.log(f"[{name}] timing {case}, peers interleaved ...")
        for pname, m in _time_interleaved(jobs[case], opts, rec, name, case).items():
            if pname != _NumpyPeer.name:
                res[case][pname] = m
            elif isinstance(m, Measurement):
                flops = 2.0 * m.tokens * sum(n * k for _, n, k in gemm_shapes)
                ceiling["groups"][f"{name}/{case}"] = {
                    "m": m.tokens,
                    "seconds": m.seconds,
                    "best_seconds": min(m.samples),
                    "samples": m.samples,
                    "gflops": flops / m.seconds / 1e9,
                }
    for c in CASES:
        for pname, m in res[c].items():
            if isinstance(m, Measurement):
                rec.log(
                    f"  {name} {c} {pname}: {1e3 * m.seconds:.3f} ms "
                    f"({m.tokens_per_s:.1f} tok/s, cpu {m.cpu_util:.2f})"
                )
    return res


# ============================================================================ the whole model


def _run_model(sh: Shapes, avail: dict, opts: dict, rec: _Recorder) -> dict:
    """SmolLM2-135M-Instruct: exactblocks blocks + NumPy head vs HF ``generate`` (sdpa)."""
    from exactblocks.cli import final_logits, pack_head
    from exactblocks.loaders.gguf import build_blocks, hf_state_dict, load_gguf_llama, open_gguf
    from exactblocks.tokenizer import GGUFTokenizer

    out: dict = {"label": "SmolLM2-135M-Instruct model (30 blocks + head)"}
    rec.log("[smollm2-model] loading the GGUF ...")
    reader = open_gguf(None)
    config, layers, top = load_gguf_llama(reader)
    tok = GGUFTokenizer.from_gguf(reader)
    del reader
    ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": MODEL_PROMPT}], add_generation_prompt=True, tokenize=True
        )
    )
    n_new = sh.model_new_tokens
    T = len(ids)
    out.update(prompt_tokens=T, new_tokens=n_new, prompt=MODEL_PROMPT)
    blocks = build_blocks(config, layers, max_positions=T + n_new + 1)
    embed, norm_w, head_w = top["embed_tokens.weight"], top["norm.weight"], top["lm_head.weight"]
    head_packed = pack_head(head_w)  # as the demo: the head on exactblocks' GEMV
    eps = config["rms_norm_eps"]

    def eb_prefill():
        states = [blk.allocate_state(1, T + n_new + 1) for blk in blocks]
        x = embed[np.asarray(ids)][None]
        for blk, st in zip(blocks, states):
            x = blk.forward(x, st)
        token = int(final_logits(x[0, -1:], norm_w, head_packed, eps).argmax())
        return states, x, token

    def eb_decode(states, token, n):
        toks, rows, times = [], [], []
        for _ in range(n):
            toks.append(token)
            t0 = time.perf_counter()
            h = embed[token][None]
            for blk, st in zip(blocks, states):
                h = blk.step(h, st)
            token = int(final_logits(h[0], norm_w, head_packed, eps).argmax())
            times.append(time.perf_counter() - t0)
            rows.append(h[0])
        return toks + [token], rows, times

    rounds: dict = {}  # side -> one timed round: (prefill seconds, decode step seconds)
    # exactblocks: check run (decode == one prefill, bitwise), then timing
    states, x_prompt, first = eb_prefill()
    gen, rows, _ = eb_decode(states, first, n_new)
    fed = ids + gen[:n_new]
    x = embed[np.asarray(fed)][None]
    for blk in blocks:
        x = blk.forward(x)
    decoded = np.concatenate([x_prompt[0]] + rows, axis=0)
    ok = rec.check(
        "smollm2-model",
        "model",
        "exactblocks",
        f"prefill {T} + {n_new} x step through 30 blocks == one forward, bitwise",
        _bits_equal(decoded, x[0]),
        "equal" if _bits_equal(decoded, x[0]) else _first_diff(decoded, x[0]),
    )
    eb_logits = final_logits(x_prompt[0], norm_w, head_packed, eps)
    out["exactblocks_tokens"] = gen

    hf_model = None
    if avail["torch_error"] is None:
        try:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(
                vocab_size=int(config["vocab_size"]),
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=config["num_attention_heads"],
                num_key_value_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"],
                rms_norm_eps=eps,
                hidden_act="silu",
                max_position_embeddings=config["max_position_embeddings"],
                rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
                tie_word_embeddings=bool(config["tie_word_embeddings"]),
                bos_token_id=config["bos_token_id"],
                eos_token_id=config["eos_token_id"],
            )
            hf_model = LlamaForCausalLM(cfg)
            sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(layers, top).items()}
            hf_model.load_state_dict(sd, strict=True)
            hf_model.eval()
            out["hf_attn_implementation"] = hf_model.config._attn_implementation
        except Exception as exc:  # noqa: BLE001
            rec.note(f"smollm2-model: HF LlamaForCausalLM could not be built: {exc!r}")
            hf_model = None
    del layers

    if hf_model is not None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        ids_t = torch.tensor([ids])
        with torch.no_grad():
            hf_logits = hf_model(ids_t).logits[0].numpy()
        top2 = np.sort(hf_logits, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1e-2
        agree = eb_logits.argmax(-1)[clear] == hf_logits.argmax(-1)[clear]
        ok_hf = rec.check(
            "smollm2-model",
            "model",
            "hf_generate",
            "prompt logits: argmax equal where HF's top-2 margin > 1e-2 (>= 90% of positions)",
            bool(agree.all()) and clear.sum() >= 0.9 * len(clear),
            f"{int(agree.sum())}/{int(clear.sum())} clear positions agree; max |logit diff| "
            f"{float(np.abs(eb_logits - hf_logits).max()):.2e}",
        )

        class _Stamp(LogitsProcessor):
            def __init__(self):
                self.t = []

            def __call__(self, input_ids, scores):
                self.t.append(time.perf_counter())
                return scores

        def hf_generate(n):
            stamp = _Stamp()
            t0 = time.perf_counter()
            with torch.no_grad():
                seq = hf_model.generate(
                    ids_t,
                    attention_mask=torch.ones_like(ids_t),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    logits_processor=LogitsProcessorList([stamp]),
                    pad_token_id=config["eos_token_id"],
                )
            return seq[0, T:].tolist(), stamp.t[0] - t0, list(np.diff(stamp.t))

        hf_tokens, _, _ = hf_generate(n_new + 1)  # warm-up and the token check
        same = 0
        for a, b in zip(gen, hf_tokens):
            if a != b:
                break
            same += 1
        out["hf_tokens"] = hf_tokens
        out["same_leading_tokens"] = same
        rec.log(f"  model: {same}/{len(gen)} leading greedy tokens identical to HF generate")
        if ok_hf:

            def hf_round():
                _, tp, td = hf_generate(n_new + 1)
                return tp, td

            rounds["hf_generate"] = hf_round
    if ok:

        def eb_round():
            t0 = time.perf_counter()
            states, _, first = eb_prefill()
            tp = time.perf_counter() - t0
            _, _, td = eb_decode(states, first, n_new)
            return tp, td

        rounds["exactblocks"] = eb_round
    # Timed rounds, interleaved: each round runs every side once (prompt prefill, then the
    # greedy decode), so a slow spell of the machine hits both alike.
    n = (
        max(MIN_REPEATS, min(opts["repeats"], 5))
        if not opts["repeats_explicit"]
        else opts["repeats"]
    )
    pre: dict = {k: [] for k in rounds}
    dec: dict = {k: [] for k in rounds}
    for _ in range(n):
        for key, fn in rounds.items():
            time.sleep(0.05)
            tp, td = fn()
            pre[key].append(tp)
            dec[key] += td
    for key in rounds:
        out[key] = {
            "prefill": Measurement(_median(pre[key]), T, pre[key]).as_dict(),
            "decode": Measurement(_median(dec[key]), 1, dec[key]).as_dict(),
        }
    return out


# ============================================================================ the report


def _mk(res: dict, case: str, peer: str):
    m = res.get(case, {}).get(peer)
    return m if isinstance(m, Measurement) else None


def _layer_rows(results: dict, specs: dict, sh: Shapes, ceiling: dict | None) -> list[dict]:
    rows = []
    for wname, res in results.items():
        spec = specs[wname]
        for case in CASES:
            eb = _mk(res, case, "exactblocks")
            row = {
                "workload": spec.label,
                "name": wname,
                "case": case,
                "case_label": _case_label(case, sh),
                "tokens": _case_tokens(case, sh),
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


def _table(rows: list[dict], avail_peers: list[str]) -> str:
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
            _fmt(ebm["ms_per_call"]) if ebm else (eb or "-"),
            _fmt(ebm["ms_per_token"]) if ebm else "-",
            _fmt(ebm["tokens_per_s"]) if ebm else "-",
        ]
        for p in peers:
            m = r["peers"].get(p)
            cells.append(_fmt(m["tokens_per_s"]) if isinstance(m, dict) else (m or "n/a"))
        for p in peers:
            cells.append(_ratio(r.get("speed_vs", {}).get(p)))
        cells.append(_fmt(1e3 * r["numpy_gemm_s"]) if "numpy_gemm_s" in r else "-")
        cells.append(f"{r['pct_of_numpy']:.0f}%" if "pct_of_numpy" in r else "-")
        cells.append(_fmt(1e3 * r["bandwidth_time_s"]) if "bandwidth_time_s" in r else "-")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _targets(rows: list[dict], model: dict | None, ceiling: dict | None) -> str:
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
                f"{_ratio(r['speed_vs']['torch_sdpa'])} |"
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
                f"{_ratio(r['speed_vs']['mojolearn'])} |"
            )
    if model and "exactblocks" in model:
        e = model["exactblocks"]
        h = model.get("hf_generate")
        pre = f"{e['prefill']['tokens_per_s']:.1f} tok/s"
        dec = f"{e['decode']['ms_per_token']:.1f} ms/token"
        if h:
            pre += (
                f" vs HF generate {h['prefill']['tokens_per_s']:.1f} tok/s "
                f"({e['prefill']['tokens_per_s'] / h['prefill']['tokens_per_s']:.2f}x)"
            )
            dec += (
                f" vs HF generate {h['decode']['ms_per_token']:.1f} ms/token "
                f"({h['decode']['seconds'] / e['decode']['seconds']:.2f}x)"
            )
        lines.append(f"| SmolLM2 model prefill ({model['prompt_tokens']}-token prompt) | {pre} |")
        lines.append(f"| SmolLM2 model decode (greedy, {model['new_tokens']} tokens) | {dec} |")
    return "\n".join(lines)


def _model_table(model: dict) -> str:
    e, h = model.get("exactblocks"), model.get("hf_generate")
    head = ["model", "prompt tokens", "exactblocks prefill tok/s", "exactblocks decode ms/token"]
    if h:
        impl = model.get("hf_attn_implementation", "?")
        head += [
            f"HF generate ({impl}) prefill tok/s",
            f"HF generate ({impl}) decode ms/token",
            "prefill vs HF",
            "decode vs HF",
        ]
    cells = [
        model["label"],
        str(model["prompt_tokens"]),
        _fmt(e["prefill"]["tokens_per_s"]) if e else "check failed",
        _fmt(e["decode"]["ms_per_token"]) if e else "check failed",
    ]
    if h:
        cells += [_fmt(h["prefill"]["tokens_per_s"]), _fmt(h["decode"]["ms_per_token"])]
        cells += [
            _ratio(h["prefill"]["seconds"] / e["prefill"]["seconds"]) if e else "-",
            _ratio(h["decode"]["seconds"] / e["decode"]["seconds"]) if e else "-",
        ]
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"]
    )


def _plot(rows: list[dict], model: dict | None, sh: Shapes, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: bench.png skipped (pip install matplotlib)"
    colors = {
        "exactblocks": "#1f77b4",
        "torch_eager": "#ff7f0e",
        "torch_sdpa": "#2ca02c",
        "mojolearn": "#9467bd",
        "hf_generate": "#2ca02c",
    }
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    names = list(dict.fromkeys(r["name"] for r in rows))
    labels = {
        r["name"]: r["workload"].replace(" layer", "\nlayer").replace(", ", "\n") for r in rows
    }
    for ax, case in zip(axes.flat, CASES):
        sub = {r["name"]: r for r in rows if r["case"] == case}
        width = 0.8 / len(PEERS)
        for j, p in enumerate(PEERS):
            xs, ys = [], []
            for i, n in enumerate(names):
                m = sub.get(n, {}).get("peers", {}).get(p)
                if isinstance(m, dict):
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(m["tokens_per_s"])
            if xs:
                ax.bar(xs, ys, width, label=PEER_LABELS[p], color=colors[p])
        for i, n in enumerate(names):  # the ceiling as tokens/s
            r = sub.get(n, {})
            t = r.get("numpy_gemm_s")
            if t:
                ax.hlines(
                    r["tokens"] / t,
                    i - 0.45,
                    i + 0.45,
                    colors="k",
                    linestyles="--",
                    label="NumPy GEMMs alone" if i == 0 else None,
                )
            fl = r.get("bandwidth_time_s")
            if fl:
                ax.hlines(
                    r["tokens"] / fl,
                    i - 0.45,
                    i + 0.45,
                    colors="r",
                    linestyles=":",
                    label="read-bandwidth bound" if i == 0 else None,
                )
        ax.set_xticks(range(len(names)), [labels[n] for n in names], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (higher is better)")
        ax.set_title(_case_label(case, sh))
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = {}
    for ax in axes.flat[:4]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    axes.flat[5].axis("off")
    axes.flat[5].legend(
        list(handles.values()),
        list(handles.keys()),
        loc="center",
        fontsize=10,
        title="tokens/s per case (log scale)",
    )
    ax = axes.flat[4]
    if model and ("exactblocks" in model or "hf_generate" in model):
        for j, (key, lab) in enumerate(
            (("exactblocks", "exactblocks"), ("hf_generate", "HF generate"))
        ):
            m = model.get(key)
            if m:
                ax.bar(
                    [j * 0.4 - 0.2, 1 + j * 0.4 - 0.2],
                    [m["prefill"]["tokens_per_s"], m["decode"]["tokens_per_s"]],
                    0.4,
                    label=lab,
                    color=colors[key],
                )
        ax.set_xticks([0, 1], ["prefill", "decode (B=1)"])
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"SmolLM2-135M model ({model['prompt_tokens']}-token prompt)")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    fig.suptitle("exactblocks side by side (same threads for every library)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# ============================================================================ driver


def run_bench(
    workloads: Sequence[str] = WORKLOAD_NAMES,
    *,
    quick: bool = False,
    repeats: int | None = None,
    threads: int | None = None,
    out_dir: str = ".",
    verbose: bool = True,
    command: str | None = None,
) -> dict:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png``.

    Parameters
    ----------
    workloads : sequence of str, default=all
        Subset of ``"smollm2-layer"``, ``"llama1b-layer"``, ``"mamba2-layer"``,
        ``"smollm2-model"``.
    quick : bool, default=False
        Tiny shapes (same code paths, seconds instead of minutes); the whole-model workload is
        left out unless named in ``workloads`` explicitly.
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
        Command line recorded in the report.

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
    rec = _Recorder(verbose)
    t_start = time.perf_counter()
    load_start = _loadavg()
    busy_start = _cpu_busy()
    if threads is not None:
        exactblocks.set_num_threads(threads)
    n_threads = exactblocks.get_num_threads()
    opts = {"repeats": repeats or sh.default_repeats, "repeats_explicit": repeats is not None}

    avail: dict = {"torch_error": None, "mojolearn": None}
    try:
        import torch
        import transformers  # noqa: F401 - the HF layers

        torch.set_num_threads(n_threads)
    except ImportError as exc:
        avail["torch_error"] = f"torch/transformers not installed ({exc}): PyTorch peers skipped"
        rec.note(avail["torch_error"])
    ml, why = _import_mojolearn()
    avail["mojolearn"] = ml
    if ml is None:
        rec.note(f"{why}: mojolearn peer skipped")
    elif why:
        rec.note(f"mojolearn: {why}")
    if ml is not None:
        rec.note("mojolearn: runs on its own threads (not settable); see cpu_util in bench.json")

    layer_names = [w for w in workloads if w in layer_specs]
    specs = {w: layer_specs[w] for w in layer_names}
    run_model = "smollm2-model" in workloads and (not quick or explicit)
    if quick and "smollm2-model" in workloads and not run_model:
        rec.note("--quick: the whole-model workload is left out (name it in --workloads to run it)")

    rec.log(f"NumPy subprocess ({n_threads} BLAS threads) ...")
    ceiling, numpy_peer = None, None
    try:
        numpy_peer = _NumpyPeer(n_threads)
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
            results[w] = _run_layer(specs[w], sh, avail, opts, rec, numpy_peer, ceiling)
    finally:
        if numpy_peer is not None:
            numpy_peer.close()
    model = None
    if run_model:
        try:
            model = _run_model(sh, avail, opts, rec)
        except (FileNotFoundError, ImportError) as exc:
            rec.note(f"smollm2-model skipped: {exc}")

    rows = _layer_rows(results, specs, sh, ceiling)
    peers_present = [
        p for p in PEERS if any(p in res[c] for res in results.values() for c in CASES)
    ]
    ok = all(c["ok"] for c in rec.checks)
    meta = {
        "command": command or "python -m exactblocks.bench",
        "cpu": _cpu_model(),
        "isa": runtime.get_isa(),
        "threads": n_threads,
        "cpus_available": (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        ),
        "loadavg_start": load_start,
        "loadavg_end": _loadavg(),
        "cpu_busy_start": busy_start,
        "python": platform.python_version(),
        "versions": {
            "exactblocks": exactblocks.__version__,
            "arithmetic": exactblocks.arithmetic_version(),
            "numpy": np.__version__,
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "mojolearn-core": _version("mojolearn-core"),
            "matplotlib": _version("matplotlib"),
        },
        "blas_in_process": _blas_info(),
        "openblas_env_in_process": {k: os.environ.get(k) for k in OPENBLAS_SLOW_VARS},
        "quick": quick,
        "repeats": opts["repeats"],
        "repeats_explicit": opts["repeats_explicit"],
        "shapes": asdict(sh),
        "seconds": None,
    }
    meta["seconds"] = round(time.perf_counter() - t_start, 1)

    quick_note = " (--quick: tiny shapes, a smoke run: its times and ratios are noise)"
    fewest = min(MIN_REPEATS, opts["repeats"])  # rounds a long call gets at least (_n_repeats)
    rounds = (
        f"{opts['repeats']} rounds"
        if opts["repeats_explicit"] or fewest == opts["repeats"]
        else f"{opts['repeats']} rounds (at least {fewest} for long calls)"
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
    md += ["", _table(rows, peers_present) if rows else "(no layer workload)", ""]
    if model and ("exactblocks" in model or "hf_generate" in model):
        md += [_model_table(model), ""]
        if "same_leading_tokens" in model:
            md += [
                f"Greedy tokens: {model['same_leading_tokens']}/"
                f"{len(model['exactblocks_tokens'])} leading tokens identical to HF "
                "generate.",
                "",
            ]
    md += ["### Targets", "", _targets(rows, model, ceiling), ""]
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
    if busy_start is not None and busy_start > 0.2:
        rec.note(
            f"other processes kept {100 * busy_start:.0f}% of the CPUs busy just before "
            "the run: timings are unreliable, rerun on an idle machine"
        )
    failed = [c for c in rec.checks if not c["ok"]]
    md.append(f"Checks: {len(rec.checks) - len(failed)} passed, {len(failed)} failed.")
    for c in failed:
        md.append(f"- FAILED {c['workload']} {c['case']} {c['peer']}: {c['what']} ({c['detail']})")
    for n in rec.notes:
        md.append(f"- note: {n}")
    report = "\n".join(md)

    os.makedirs(out_dir, exist_ok=True)
    data = {
        "ok": ok,
        "meta": meta,
        "numpy_ceiling": ceiling,
        "rows": rows,
        "model": model,
        "checks": rec.checks,
        "notes": rec.notes,
    }
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as f:
        f.write(report + "\n")
    plot_msg = _plot(rows, model, sh, os.path.join(out_dir, "bench.png"))
    print(report)
    print(
        f"\n{plot_msg}; wrote {os.path.join(out_dir, 'bench.json')} and "
        f"{os.path.join(out_dir, 'bench.md')} ({meta['seconds']} s)"
    )
    data["report"] = report
    return data


def _workload_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in WORKLOAD_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {bad or text!r}; choose from {', '.join(WORKLOAD_NAMES)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m exactblocks.bench``.

    Parameters
    ----------
    argv : sequence of str or None, default=None
        Arguments without the program name; None = ``sys.argv[1:]``.

    Returns
    -------
    int
        0 when every check passed, 1 when a check failed (that case was not timed), 2 on a
        usage error or when exactblocks cannot be imported.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--numpy-worker"]:  # internal: the NumPy subprocess (_NumpyPeer)
        _numpy_worker()
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m exactblocks.bench",
        description="exactblocks vs NumPy matmul, PyTorch (HF layers) and mojolearn, same "
        "threads; checks outputs before timing; prints a markdown table and writes "
        "bench.json and bench.png.",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, 2 repeats (a smoke run of every code path)",
    )
    ap.add_argument(
        "--workloads",
        type=_workload_list,
        default=list(WORKLOAD_NAMES),
        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default: all)",
    )
    ap.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timed repeats per measurement, median reported (default 5, down to 3 for long calls)",
    )
    ap.add_argument(
        "--out-dir",
        default=".",
        help="directory for bench.json/.md/.png (default: current directory)",
    )
    ap.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="threads for exactblocks, torch and NumPy (default: exactblocks' "
        "default, the CPUs available)",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args(argv)
    command = "python -m exactblocks.bench" + ("" if not argv else " " + " ".join(argv))
    try:
        data = run_bench(
            args.workloads,
            quick=args.quick,
            repeats=args.repeats,
            threads=args.threads,
            out_dir=args.out_dir,
            verbose=not args.quiet,
            command=command,
        )
    except ImportError as exc:
        print(f"exactblocks.bench: error: {exc}", file=sys.stderr)
        return 2
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
