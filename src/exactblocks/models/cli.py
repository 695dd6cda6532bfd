"""``exactblocks run MODEL --prompt ...`` and ``exactblocks chat MODEL``: any supported checkpoint
(HF folder, .safetensors with its config.json, .gguf) through :func:`exactblocks.load_model`.

``run`` streams one answer and ends with a one-line speed summary; ``chat`` reads user lines
from stdin until ``/exit`` or end of input, streaming each answer. When the model's tokenizer
has a chat template, the prompt is rendered with it (``--raw`` sends the text as is).
The argument parsers are added to ``exactblocks.cli``'s by :func:`add_parsers`.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["add_parsers", "run_chat", "run_text"]


def _load(path: str, threads: int | None, err):
    import exactblocks

    if threads is not None:
        exactblocks.set_num_threads(threads)
    t0 = time.perf_counter()
    err.write(f"loading {path} ...\n")
    err.flush()
    model = exactblocks.load_model(path)
    if model.tokenizer is not None:  # `run` and `chat` encode text: build a lazily built
        model.tokenizer.encode("")  # tokenizer (a GGUF SentencePiece one) in the load time
    packed = sum(model.weight_storage().values())
    err.write(
        f"loaded {model.family} model ({len(model.blocks)} blocks, d_model {model.d_model}, "
        f"vocab {model.vocab_size}, {packed / 2**20:.0f} MB packed weights) in "
        f"{time.perf_counter() - t0:.2f} s\n"
    )
    err.flush()
    return model


def _need_tokenizer(model):
    """The model's tokenizer; ValueError when it has none (``run`` and ``chat`` encode text)."""
    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer; `run` and `chat` need one")
    return model.tokenizer


def _prompt_ids(model, messages, raw: bool) -> list:
    tok = _need_tokenizer(model)
    if not raw and getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tok.encode(messages[-1]["content"]))


def _answer(model, ids, args, out):
    """Stream one answer to ``out``; return its GenerateOutput."""
    room = None if model.max_positions is None else model.max_positions - len(ids)
    n_new = args.max_new_tokens if room is None else min(args.max_new_tokens, room)
    if n_new < 1:
        raise ValueError(
            f"the prompt ({len(ids)} tokens) fills the model's {model.max_positions} positions"
        )
    stream = model.generate(
        ids,
        max_new_tokens=n_new,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stream=True,
    )
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    return stream.output


def _summary(res, model) -> str:
    import exactblocks
    from exactblocks import runtime

    n_p, n_d = len(res.prompt_ids), res.decode_steps
    pre = f"prefill {n_p} tokens in {res.prefill_seconds:.3f} s"
    pre += f" ({n_p / res.prefill_seconds:.0f} tok/s)" if res.prefill_seconds > 0 else ""
    dec = f"decode {n_d} tokens in {res.decode_seconds:.3f} s"
    dec += f" ({n_d / res.decode_seconds:.1f} tok/s)" if n_d and res.decode_seconds > 0 else ""
    return (
        f"[{pre}; {dec}; {len(res.ids)} new tokens, finish: {res.finish_reason}; "
        f"{exactblocks.get_num_threads()} threads, {runtime.get_isa()}]"
    )


def run_text(args, out=None, err=None) -> int:
    """``exactblocks run``: one streamed answer, then a one-line speed summary.

    Parameters
    ----------
    args : argparse.Namespace
        ``model``, ``prompt``, ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
        ``seed``, ``threads``, ``raw``.
    out, err : text streams, default=sys.stdout, sys.stderr

    Returns
    -------
    int
        0.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    model = _load(args.model, args.threads, err)
    ids = _prompt_ids(model, [{"role": "user", "content": args.prompt}], args.raw)
    res = _answer(model, ids, args, out)
    out.write(_summary(res, model) + "\n")
    return 0


def run_chat(args, inp=None, out=None, err=None) -> int:
    """``exactblocks chat``: an interactive loop over stdin lines (``/exit`` or EOF ends).

    Each turn renders the whole conversation with the chat template and generates the answer
    from a fresh state (the same bits as continuing one: decode == prefill).

    Parameters
    ----------
    args : argparse.Namespace
    inp, out, err : text streams, default=sys.stdin, sys.stdout, sys.stderr

    Returns
    -------
    int
        0.
    """
    inp = inp if inp is not None else sys.stdin
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    model = _load(args.model, args.threads, err)
    _need_tokenizer(model)  # before the first prompt, not after the user has typed
    messages: list = []
    err.write("type a message and press Enter; /exit or end of input (Ctrl-D) ends the chat\n")
    while True:
        out.write("user: ")
        out.flush()
        line = inp.readline()
        if not line:
            out.write("\n")
            break
        text = line.rstrip("\n")
        if text.strip() == "/exit":
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = _prompt_ids(model, messages, args.raw)
        out.write("assistant: ")
        res = _answer(model, ids, args, out)
        messages.append({"role": "assistant", "content": res.text})
        err.write(_summary(res, model) + "\n")
    return 0


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_parsers(sub, positive_int) -> None:
    """Add the ``run`` and ``chat`` subcommands to ``exactblocks.cli``'s parser.

    Parameters
    ----------
    sub : argparse subparsers action
    positive_int : callable
        The CLI's argparse type for integers >= 1.
    """
    for name, helptext in (
        ("run", "stream one answer of a model (HF folder, .safetensors or .gguf) to a prompt"),
        ("chat", "chat with a model interactively (stdin lines; /exit or EOF ends)"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument(
            "model", help="HF folder, .safetensors file (config.json beside it) or .gguf"
        )
        if name == "run":
            p.add_argument("--prompt", required=True, help="the user message")
        p.add_argument("--max-new-tokens", type=positive_int, default=128, help="default: 128")
        p.add_argument(
            "--temperature", type=_nonneg_float, default=0.0, help="0 = greedy (default)"
        )
        p.add_argument("--top-k", type=positive_int, default=None)
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument(
            "--seed", type=int, default=None, help="sampling seed (same seed, same text)"
        )
        p.add_argument("--threads", type=positive_int, default=None)
        p.add_argument(
            "--raw", action="store_true", help="do not apply the chat template to the prompt"
        )
