"""The command line: ``python -m benchmarks [--quick] [--workloads ...] ...``.

Here: the options, their parsing and the exit status (:func:`main`). Run it from a clone's
root: the benchmark lives outside the installed package. Not here: the run itself
(:func:`benchmarks.driver.run_bench`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .driver import run_bench
from .workloads import WORKLOAD_NAMES

__all__ = ["main", "positive_int"]

PROG = "python -m benchmarks"


def positive_int(text: str) -> int:
    """argparse type of the integer options: a decimal integer >= 1.

    Parameters
    ----------
    text : str
        The option's value as typed.

    Returns
    -------
    int

    Raises
    ------
    argparse.ArgumentTypeError
        ``expected a positive integer, got '<text>'`` (argparse prints it after the option
        name).

    Examples
    --------
    >>> positive_int("12")
    12
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a positive integer, got '0'
    """
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value < 1:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {shown!r}")
    return value


def _workload_list(text: str) -> list[str]:
    """argparse type of ``--workloads``: comma-separated names of WORKLOAD_NAMES."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in WORKLOAD_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {bad or text!r}; choose from {', '.join(WORKLOAD_NAMES)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``.

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
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="exactblocks vs NumPy matmul, PyTorch (HF layers and generate), mojolearn "
        "and llama.cpp (whole models), same threads; checks outputs before timing; prints a "
        "markdown table and writes bench.json and bench.png.",
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
        type=positive_int,
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
        type=positive_int,
        default=None,
        help="threads for exactblocks, torch and NumPy (default: exactblocks' "
        "default, the CPUs available)",
    )
    ap.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench program, the whole models' llama.cpp peer (default: "
        "$LLAMA_BENCH, else llama-bench on PATH, else skipped)",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args(argv)
    command = PROG + ("" if not argv else " " + " ".join(argv))
    try:
        data = run_bench(
            args.workloads,
            quick=args.quick,
            repeats=args.repeats,
            threads=args.threads,
            out_dir=args.out_dir,
            verbose=not args.quiet,
            command=command,
            llama_bench=args.llama_bench,
        )
    except ImportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0 if data["ok"] else 1
