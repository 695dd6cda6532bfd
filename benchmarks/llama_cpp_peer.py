"""llama.cpp as a whole-model peer: its own ``llama-bench`` program on the same GGUF file.

Here: finding a ``llama-bench`` binary (:func:`find_llama_bench`) and :class:`LlamaBench`,
which times one prompt prefill and one greedy-length decode per call, each in a fresh
``llama-bench`` process, so that the whole-model workloads can put one llama.cpp sample in
every interleaved round. Not here: exactblocks' side, the rounds and the report
(:mod:`benchmarks.model_run`, :mod:`benchmarks.report`).

What is timed is llama-bench's own timed region (``tools/llama-bench/llama-bench.cpp``): for
prefill, ``llama_decode`` of ``n_prompt`` tokens into an empty cache, logits for the last token
only; for decode, ``n_gen`` consecutive one-token ``llama_decode`` calls after ``n_depth`` cached
tokens (the depth prompt is processed before the clock starts). Loading the model, creating
the context and a warm-up run are outside it, as exactblocks' load and state allocation are
outside its own; llama-bench samples nothing (it feeds random token ids), and exactblocks'
timed decode step includes only a greedy argmax over the logits. Threads: ``-t`` = the run's
thread count; everything else is llama-bench's default (batch 2048, micro-batch 512, f16 KV
cache, flash attention auto, 50% polling), recorded from its JSON output.

Why a subprocess and not the ``llama-cpp-py-sync`` wheel in-process: that wheel's prebuilt
``libllama.so`` needs glibc 2.38 (Debian 12 has 2.36), and its CFFI declarations match only
its own library's structs (``llama_context_params`` differs between llama.cpp versions), so it
cannot be pointed at another build either. A ``llama-bench`` binary has neither problem.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

__all__ = ["LlamaBench", "find_llama_bench"]

ENV_VAR = "LLAMA_BENCH"


def find_llama_bench(explicit: str | None = None) -> tuple[str | None, str]:
    """Locate a ``llama-bench`` executable.

    Parameters
    ----------
    explicit : str or None, default=None
        A path given on the command line (``--llama-bench``); wins over the rest.

    Returns
    -------
    path : str or None
        The executable, or None when none was found.
    how : str
        Where it came from, or (path None) why the peer is skipped, for the report.
    """
    for path, how in ((explicit, "--llama-bench"), (os.environ.get(ENV_VAR), f"${ENV_VAR}")):
        if path:
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return os.path.abspath(path), how
            return None, f"{how}={path!r} is not an executable file"
    found = shutil.which("llama-bench")
    if found:
        return found, "PATH"
    return None, (
        "no llama-bench found (give --llama-bench PATH, set $LLAMA_BENCH, or put llama.cpp's "
        "build/bin on PATH)"
    )


class LlamaBench:
    """One llama.cpp model, timed by ``llama-bench`` processes.

    Parameters
    ----------
    exe : str
        The ``llama-bench`` executable.
    model_path : str
        The GGUF file (the one exactblocks loads).
    threads : int
        ``-t``: threads of every llama.cpp test (prefill and decode).

    Attributes
    ----------
    info : dict
        llama-bench's description of the last test (build commit, CPU, backend, model
        type and size, batch sizes, KV types, flash attention, threads), for ``bench.json``.
    """

    def __init__(self, exe: str, model_path: str, threads: int):
        self.exe = exe
        self.model_path = model_path
        self.threads = int(threads)
        self.info: dict = {}

    def _run(self, *args: str) -> dict:
        cmd = [self.exe, "-m", self.model_path, "-t", str(self.threads), "-r", "1", "-o", "json"]
        cmd += list(args)
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {' | '.join(tail)}")
        try:
            tests = json.loads(res.stdout)
        except json.JSONDecodeError as exc:
            raise RuntimeError(f"{' '.join(cmd)}: output is not JSON ({exc})") from None
        if not tests or not tests[0].get("samples_ns"):
            raise RuntimeError(f"{' '.join(cmd)}: no sample in its output")
        test = tests[0]
        keep = ("build_commit", "build_number", "cpu_info", "backends", "model_type",
                "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads",
                "type_k", "type_v", "flash_attn", "poll", "use_mmap")  # fmt: skip
        self.info = {k: test[k] for k in keep if k in test}
        return test

    def prefill(self, n_prompt: int) -> float:
        """Seconds of one prefill of ``n_prompt`` tokens into an empty cache (one sample)."""
        test = self._run("-p", str(n_prompt), "-n", "0")
        return test["samples_ns"][0] / 1e9

    def decode(self, n_gen: int, n_depth: int) -> float:
        """Mean seconds per token of ``n_gen`` one-token steps after ``n_depth`` cached tokens
        (one sample: the steps' total / ``n_gen``)."""
        test = self._run("-p", "0", "-n", str(n_gen), "-d", str(n_depth))
        return test["samples_ns"][0] / 1e9 / n_gen
