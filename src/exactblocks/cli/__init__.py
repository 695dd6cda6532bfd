"""Command line: ``exactblocks demo`` (also ``python -m exactblocks demo``), ``run`` and
``chat`` for any supported checkpoint, ``models`` (the bundled models' names and files) and
``serve`` (the OpenAI-compatible server).

An app on top of the library: it uses the public names of ``exactblocks`` and
``exactblocks.models`` only. One module per command: ``demo``, ``run`` (run and chat),
``models``, ``serve``; ``common`` holds the argument types and the model loading they share.
This module builds the parser, dispatches, and turns errors, a closed pipe and Ctrl-C into one
line and an exit status.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Sequence

from .common import positive_int as _positive_int
from .demo import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPT, run_demo

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PROMPT",
    "main",
    "run_demo",
]


def _parser() -> argparse.ArgumentParser:
    import exactblocks

    from . import demo, models, run, serve

    ap = argparse.ArgumentParser(
        prog="exactblocks", description="exactblocks: bit-exact CPU inference blocks."
    )
    ap.add_argument("--version", action="version", version=f"exactblocks {exactblocks.__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_parser(sub, _positive_int)
    run.add_parsers(sub, _positive_int)  # `run` and `chat`
    models.add_parser(sub)
    serve.add_parser(sub, _positive_int)
    return ap


# A library message starts with the function that raised it ("open_gguf: ", "load_model: "):
# the CLI names its command and argument instead.
_INTERNAL_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*: )+")


# The subcommands (for the one-line report of an interrupt).
_COMMANDS = ("demo", "run", "chat", "models", "serve")


def _count(n: int, noun: str) -> str:
    """``"1 CPU"``, ``"2 CPUs"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _error(command: str, exc: BaseException, argument: str | None = None) -> int:
    """Print ``exactblocks <command>: error: [<argument>: ]<message>`` on stderr; return 2."""
    msg = _INTERNAL_PREFIX.sub("", str(exc))
    lead = f"{argument}: " if argument else ""
    print(f"\nexactblocks {command}: error: {lead}{msg}", file=sys.stderr)
    return 2


def _path_error(command: str, argument: str, path: str, want_file: bool) -> int | None:
    """Check a path argument before anything loads; print the error and return 2, or None."""
    if not os.path.exists(path):
        return _error(command, FileNotFoundError(f"{path!r} does not exist"), argument)
    if want_file and not os.path.isfile(path):
        return _error(command, FileNotFoundError(f"{path!r} is not a file"), argument)
    return None


def _quiet_broken_pipe() -> int:
    """stdout's reader has gone (``exactblocks demo | head -1``): end quietly, as Unix tools do.

    Later writes (the interpreter flushes stdout at exit) go to /dev/null, so no second
    BrokenPipeError is reported. Returns 128 + SIGPIPE, a shell's status of a tool killed by
    SIGPIPE.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no real file descriptor (tests)
        pass
    return 128 + getattr(signal, "SIGPIPE", 13)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``exactblocks`` console script and ``python -m exactblocks``.

    Parameters
    ----------
    argv : sequence of str or None, default=None
        Arguments without the program name; None = ``sys.argv[1:]``.

    Returns
    -------
    int
        Exit status: 0 success, 1 the demo's bitwise check failed or (``run``, ``chat``,
        ``serve``) MODEL exists but cannot be loaded (malformed or unsupported, a part
        missing, out of memory, a reader not installed), 2 a usage error (a flag's value,
        a MODEL that does not exist; the demo's missing model or dependency), each one line
        naming the command and the argument (and what to install), 141 (128 + SIGPIPE)
        when stdout's reader went away, as in ``exactblocks demo | head -1`` (nothing is
        printed then), 130 (128 + SIGINT) when interrupted by Ctrl-C (one line,
        ``exactblocks <command>: interrupted``, on stderr).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        # a long call stops within about 100 ms of Ctrl-C (SPEC.md 2.5); a traceback would
        # only show where: one line, and the status a shell gives a tool killed by SIGINT
        command = next((a for a in argv if not a.startswith("-")), None)
        name = f"exactblocks {command}" if command in _COMMANDS else "exactblocks"
        try:
            sys.stdout.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    threads = getattr(args, "threads", None)
    if threads is not None:
        from exactblocks.runtime import usable_cpus

        cpus = usable_cpus()
        if threads > cpus:  # a note of the command, not a warning pointing into exactblocks
            print(
                f"exactblocks {args.command}: --threads {threads} exceeds the "
                f"{_count(cpus, 'CPU')} usable by this process; using {_count(cpus, 'thread')}",
                file=sys.stderr,
            )
            args.threads = cpus
    if args.command == "models":
        from .models import run_models

        return run_models(args)
    if args.command in ("run", "chat", "serve"):
        from . import run, serve
        from .common import LoadError

        command = {"run": run.run_text, "chat": run.run_chat, "serve": serve.run_serve}
        try:
            return command[args.command](args)
        except LoadError as exc:  # MODEL exists but does not load: 1, not a usage error
            _error(args.command, exc.cause, "MODEL")
            return 1
        except (FileNotFoundError, ImportError, MemoryError, TypeError, ValueError) as exc:
            # a flag's own error names it; a loading error names the model: it is about MODEL
            flag = getattr(exc, "flag", None) or ("MODEL" if args.model in str(exc) else None)
            return _error(args.command, exc, flag)
    if args.command != "demo":
        ap.print_help()
        return 2
    if args.gguf is not None:
        bad = _path_error("demo", "--gguf", args.gguf, want_file=True)
        if bad is not None:
            return bad
    try:
        return run_demo(args.prompt, args.max_new_tokens, args.gguf, args.threads)
    except (FileNotFoundError, ImportError, MemoryError, ValueError) as exc:
        return _error("demo", exc, "--gguf" if args.gguf is not None else None)
