"""``exactblocks run MODEL --prompt ...`` and ``exactblocks chat MODEL``: any supported checkpoint
(HF folder, .safetensors with its config.json, .gguf, or a bundled model's name, see
``exactblocks models``) through :func:`exactblocks.load_model`.

``run`` streams one answer and ends with a one-line speed summary; ``chat`` reads user lines
from stdin until ``/exit`` or end of input, streaming each answer (``/help`` lists the chat
commands, ``/reset`` starts a new conversation). When the conversation outgrows the model's
context, the oldest turns are dropped, with a note on stderr. When the model's tokenizer has a
chat template, the prompt is rendered with it (``--raw`` sends the text as is).
"""

from __future__ import annotations

import sys

from .common import FlagError, load, non_negative_float, non_negative_int, probability
from .models import resolve

__all__ = ["CHAT_HELP", "add_parsers", "run_chat", "run_text"]

#: What ``/help`` prints in ``exactblocks chat``.
CHAT_HELP = (
    "/help   this list\n"
    "/reset  forget the conversation and start a new one\n"
    "/exit   end the chat (as does end of input, Ctrl-D)\n"
    "anything else is your next message; when the conversation outgrows the model's context, "
    "its oldest turns are dropped (a note says so)"
)


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
        raise FlagError(
            "--prompt",
            f"the prompt ({len(ids)} tokens with the template) fills the model's "
            f"{model.max_positions} positions",
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
    model = load(resolve(args.model), args.threads, err)
    ids = _prompt_ids(model, [{"role": "user", "content": args.prompt}], args.raw)
    res = _answer(model, ids, args, out)
    out.write(_summary(res, model) + "\n")
    return 0


def _fit_history(model, messages: list, args, err) -> list | None:
    """Prompt ids of ``messages``, dropping the oldest turns until the answer has room.

    The answer needs ``max_new_tokens`` positions after the prompt (fewer when even the
    newest message alone leaves less). Turns (a user message and its answer) are dropped
    from the front, in place, with one note on ``err`` saying how many. Returns None, with
    the newest message removed and a note, when that message alone fills the context.
    """
    ids = _prompt_ids(model, messages, args.raw)
    limit = model.max_positions
    if limit is None:  # a Mamba-2 state has no length limit
        return ids
    dropped = 0
    while len(ids) + args.max_new_tokens > limit and len(messages) > 1:
        del messages[:2]  # the oldest user message and its answer
        dropped += 1
        ids = _prompt_ids(model, messages, args.raw)
    if dropped:
        err.write(
            f"note: the conversation outgrew the model's context of {limit} positions; "
            f"dropped the oldest {dropped} turn{'s' if dropped != 1 else ''} "
            f"({len(messages) // 2} earlier turn{'s' if len(messages) // 2 != 1 else ''} "
            "kept)\n"
        )
    if len(ids) >= limit:
        messages.pop()
        err.write(
            f"note: this message ({len(ids)} tokens with the template) fills the model's "
            f"context of {limit} positions on its own; it was not sent (send a shorter one)\n"
        )
        return None
    return ids


def run_chat(args, inp=None, out=None, err=None) -> int:
    """``exactblocks chat``: an interactive loop over stdin lines (``/exit`` or EOF ends).

    Each turn renders the whole conversation with the chat template and generates the answer
    from a fresh state (the same bits as continuing one: decode == prefill). ``/help`` lists
    the commands, ``/reset`` forgets the conversation, ``/exit`` ends. When the conversation
    outgrows the model's context, its oldest turns are dropped (a note on ``err`` says how
    many) and the chat goes on.

    Parameters
    ----------
    args : argparse.Namespace
        As for :func:`run_text`, without ``prompt``.
    inp, out, err : text streams, default=sys.stdin, sys.stdout, sys.stderr

    Returns
    -------
    int
        0.
    """
    inp = inp if inp is not None else sys.stdin
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    model = load(resolve(args.model), args.threads, err)
    _need_tokenizer(model)  # before the first prompt, not after the user has typed
    messages: list = []
    err.write("type a message and press Enter; /help lists the commands, /exit or Ctrl-D ends\n")
    while True:
        out.write("user: ")
        out.flush()
        line = inp.readline()
        if not line:
            out.write("\n")
            break
        text = line.rstrip("\n")
        command = text.strip()
        if command == "/exit":
            break
        if command == "/help":
            err.write(CHAT_HELP + "\n")
            continue
        if command == "/reset":
            messages.clear()
            err.write("conversation reset\n")
            continue
        if command.startswith("/") and " " not in command:
            err.write(f"unknown command {command}; /help lists the commands\n")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": text})
        ids = _fit_history(model, messages, args, err)
        if ids is None:
            continue
        out.write("assistant: ")
        res = _answer(model, ids, args, out)
        messages.append({"role": "assistant", "content": res.text})
        err.write(_summary(res, model) + "\n")
    return 0


def add_parsers(sub, positive_int) -> None:
    """Add the ``run`` and ``chat`` subcommands to the ``exactblocks`` subparsers.

    Parameters
    ----------
    sub : argparse subparsers action
    positive_int : callable
        The CLI's argparse type for integers >= 1.
    """
    for name, helptext in (
        ("run", "stream one answer of a model (HF folder, .safetensors or .gguf) to a prompt"),
        ("chat", "chat with a model interactively (stdin lines; /help, /reset, /exit)"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument(
            "model",
            metavar="MODEL",
            help="HF folder, .safetensors file (config.json beside it), .gguf, or a bundled "
            "model's name (`exactblocks models` lists them)",
        )
        if name == "run":
            p.add_argument("--prompt", required=True, help="the user message")
        p.add_argument("--max-new-tokens", type=positive_int, default=128, help="default: 128")
        p.add_argument(
            "--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)"
        )
        p.add_argument("--top-k", type=positive_int, default=None)
        p.add_argument("--top-p", type=probability, default=None)
        p.add_argument(
            "--seed",
            type=non_negative_int,
            default=None,
            help="sampling seed (same seed, same text)",
        )
        p.add_argument("--threads", type=positive_int, default=None)
        p.add_argument(
            "--raw", action="store_true", help="do not apply the chat template to the prompt"
        )
