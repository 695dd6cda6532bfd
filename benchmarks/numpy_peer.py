"""NumPy's float32 matmuls at a block's GEMM shapes, in a subprocess: the machine's ceiling.

Here: :func:`serve`, the worker loop of the subprocess (``python -m benchmarks.numpy_peer``;
it imports NumPy, not exactblocks), and :class:`NumpyPeer`, the client that starts it and
takes its samples in the same rounds as the peers. Also the STREAM-like read bandwidth (a
float32 GEMV over a large matrix), the decode ceiling. Not here: how the samples are
scheduled (:mod:`benchmarks.timing`) or reported.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .environment import blas_info

__all__ = ["OPENBLAS_SLOW_VARS", "NumpyPeer", "serve"]

#: Variables that make OpenBLAS pick a slow kernel on some machines; removed for the ceiling.
OPENBLAS_SLOW_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

#: The directory that holds the ``benchmarks`` package (put on the worker's ``PYTHONPATH``).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve() -> None:
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
                    "blas": blas_info(),
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


class NumpyPeer:
    """NumPy's float32 matmuls at a block's GEMM shapes: the machine's practical GEMM ceiling.

    They run in a subprocess (:func:`serve`) with ``threads`` BLAS threads and without
    ``OPENBLAS_SLOW_VARS``, so OpenBLAS picks its own kernel and its threads never share a
    process with exactblocks' or torch's. The process is driven one request at a time, so its
    samples are taken in the same rounds as the peers' (``time_interleaved``): a slow spell
    of a shared machine hits NumPy and exactblocks alike, and both sides are medians.

    Parameters
    ----------
    threads : int
        BLAS threads of the subprocess (``OPENBLAS_NUM_THREADS`` and ``OMP_NUM_THREADS``).

    Attributes
    ----------
    unset : dict
        The ``OPENBLAS_SLOW_VARS`` this process has and the subprocess does not, with values.
    """

    name = "numpy"

    def __init__(self, threads: int):
        env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_SLOW_VARS}
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        self.unset = {k: os.environ[k] for k in OPENBLAS_SLOW_VARS if k in os.environ}
        self._err = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.numpy_peer"],
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
        """A sample function of ``group`` for :func:`benchmarks.timing.time_interleaved`.

        Parameters
        ----------
        group : str
            A group of the last ``prepare`` request (a case name).

        Returns
        -------
        callable
            ``sample() -> ([seconds per pass], 0.0)`` (the subprocess's CPU time is not
            counted); it returns once the subprocess's BLAS threads have gone idle
            (``IDLE_AFTER_S``).
        """

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


if __name__ == "__main__":  # the subprocess started by NumpyPeer
    serve()
