"""What the ``exactblocks`` commands share: argparse types, loading a model with notes on stderr.

What lives here: the argument types (:func:`positive_int`, :func:`non_negative_float`) whose
messages argparse prints after the flag's name, and :func:`load` (``run``, ``chat`` and
``serve``). What does not: the commands themselves (``demo``, ``run``, ``models``, ``serve``).
"""

from __future__ import annotations

import argparse
import math
import time

__all__ = [
    "FlagError",
    "LoadError",
    "load",
    "non_negative_float",
    "non_negative_int",
    "positive_int",
    "probability",
]


class LoadError(Exception):
    """MODEL exists but could not be loaded (malformed, unsupported, a part missing, out of
    memory, a reader not installed): the command exits 1, not 2 (a usage error).

    Parameters
    ----------
    exc : BaseException
        What ``load_model`` raised; ``str(err)`` is its message.
    """

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.cause = exc


class FlagError(ValueError):
    """A flag's value that cannot work, found once the model is known; ``flag`` names it.

    The command's error line then reads ``exactblocks COMMAND: error: FLAG: message``.

    Parameters
    ----------
    flag : str
        The flag (``"--port"``) or argument (``"MODEL"``) at fault.
    message : str
        What is wrong, with the value that came.
    """

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


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
        name), never a message naming this function.
    """
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {_shown(text)!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a count that may be 0 (``--max-queue``): a decimal integer >= 0.

    Parameters
    ----------
    text : str

    Returns
    -------
    int

    Raises
    ------
    argparse.ArgumentTypeError
        ``expected an integer >= 0, got '<text>'``.
    """
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {_shown(text)!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type of ``--temperature``: a finite number >= 0.

    Parameters
    ----------
    text : str

    Returns
    -------
    float

    Raises
    ------
    argparse.ArgumentTypeError
        ``expected a finite number >= 0, got '<text>'``.
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {_shown(text)!r}")
    return value


def probability(text: str) -> float:
    """argparse type of ``--top-p``: a number in (0, 1].

    Parameters
    ----------
    text : str

    Returns
    -------
    float

    Raises
    ------
    argparse.ArgumentTypeError
        ``expected a number in (0, 1], got '<text>'``.
    """
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {_shown(text)!r}")
    return value


def load(path: str, threads: int | None, err):
    """Load ``path`` with :func:`exactblocks.load_model`, noting the start and the result on err.

    Parameters
    ----------
    path : str
        Anything ``load_model`` accepts (already resolved from a bundled model's name).
    threads : int or None
        ``exactblocks.set_num_threads`` before loading (None: leave it).
    err : text stream
        Gets ``loading PATH ...`` and ``loaded <family> model (...) in S s``.

    Returns
    -------
    exactblocks.Model

    Raises
    ------
    LoadError
        ``load_model`` refused or failed (the command then exits 1).
    """
    import exactblocks

    if threads is not None:
        exactblocks.set_num_threads(threads)
    t0 = time.perf_counter()
    err.write(f"loading {path} ...\n")
    err.flush()
    try:
        model = exactblocks.load_model(path)
    except (FileNotFoundError, ImportError, MemoryError, TypeError, ValueError) as exc:
        raise LoadError(exc) from exc
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
