"""Side-by-side benchmark of exactblocks: ``python -m benchmarks`` from a clone's root.

The benchmark lives outside the installed package: it uses only exactblocks' public API, and
the library never imports it. One run, one process (plus one NumPy subprocess), the same
thread count for every library:

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

Modules, one job each (this file imports none of them, so that ``python -m
benchmarks.numpy_peer`` runs the NumPy worker alone):

- :mod:`benchmarks.workloads`: layer sizes, sequence shapes, cases, random weights;
- :mod:`benchmarks.checks`: output comparisons (bitwise, per-row error) and the run's recorder;
- :mod:`benchmarks.environment`: machine facts for the report (CPU, load, BLAS, versions);
- :mod:`benchmarks.numpy_peer`: the NumPy subprocess (GEMM ceiling, read bandwidth);
- :mod:`benchmarks.peers`, :mod:`benchmarks.torch_peers`, :mod:`benchmarks.mojolearn_peer`:
  the adapters of the timed libraries;
- :mod:`benchmarks.timing`: samplers and the interleaved rounds;
- :mod:`benchmarks.layer_run`, :mod:`benchmarks.model_run`: checks, then timings, of a layer
  workload and of the whole SmolLM2 model;
- :mod:`benchmarks.report`, :mod:`benchmarks.plot`: the markdown tables and ``bench.png``;
- :mod:`benchmarks.driver`: :func:`benchmarks.driver.run_bench`, one whole run;
- :mod:`benchmarks.cli`: the command line (``python -m benchmarks``);
- ``benchmarks/decode_steps.py``: per-step decode times (``python -m benchmarks.decode_steps``).
"""
