"""Type-check the package with mypy against a baseline count that may only shrink.

Runs ``mypy`` (configured in pyproject.toml's ``[tool.mypy]``) on ``src/exactblocks``, prints
the error count, and exits 1 when it is above the count in ``tools/mypy-baseline.txt``. When
the count is below the baseline it says so: lower the file with ``--update`` in the same
commit as the fix, so that the errors fixed cannot come back.

Usage, from a clone's root::

    python tools/typecheck.py            # check against the baseline
    python tools/typecheck.py --update   # write a lower count (never a higher one)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tools" / "mypy-baseline.txt"


def count_errors(output: str) -> int:
    """Count mypy's ``error:`` lines in its output.

    Parameters
    ----------
    output : str
        mypy's standard output.

    Returns
    -------
    int
        The number of lines reporting an error (notes are not counted).
    """
    return sum(1 for line in output.splitlines() if re.search(r":\d+: error: ", line))


def run_mypy() -> tuple[int, str]:
    """Run mypy on the package from the clone's root.

    Returns
    -------
    tuple of (int, str)
        The error count and mypy's output.

    Raises
    ------
    RuntimeError
        When mypy did not run (not installed, or a crash: exit status 2 and no error lines).
    """
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-pretty", "--no-error-summary"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    n = count_errors(res.stdout)
    if res.returncode not in (0, 1) or (res.returncode == 1 and n == 0):
        raise RuntimeError(
            f"mypy did not run (exit status {res.returncode}); install it with "
            f"`pip install mypy==2.4.1`:\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
    return n, res.stdout


def read_baseline(path: Path = BASELINE) -> int:
    """Read the checked-in baseline count.

    Parameters
    ----------
    path : pathlib.Path, default=tools/mypy-baseline.txt
        A file holding one non-negative integer.

    Returns
    -------
    int
        The baseline count.

    Raises
    ------
    ValueError
        When the file does not hold one non-negative integer.
    """
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected one non-negative integer, got {text[:40]!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 when the count is at or below the baseline, 1 when it is above.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="write a lower count")
    parser.add_argument("--show", action="store_true", help="print mypy's errors too")
    args = parser.parse_args(argv)
    baseline = read_baseline()
    n, output = run_mypy()
    if args.show or n > baseline:
        print(output, end="")
    print(f"mypy: {n} errors in src/exactblocks (baseline {baseline})")
    if n > baseline:
        print(
            f"mypy: {n - baseline} more than the baseline: fix the new errors "
            "(the baseline may only shrink)",
            file=sys.stderr,
        )
        return 1
    if n < baseline:
        if args.update:
            BASELINE.write_text(f"{n}\n")
            print(f"mypy: baseline lowered to {n}")
        else:
            print(f"mypy: {baseline - n} below the baseline: lower it with --update")
    return 0


if __name__ == "__main__":
    sys.exit(main())
