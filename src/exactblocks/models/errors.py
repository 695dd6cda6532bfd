"""How a Model call names the failures of its layers and its allocations.

What lives here: :class:`LayerError` (the structured facts of a block's error inside a model
call: where, layer, kind, detail), :func:`layer_error` (the exception a Model call raises for
an exception of its layer) and :func:`memory_named` (a MemoryError naming what could not be
allocated). What does not: the checks of the arguments (``exactblocks.models.model``).
"""

from __future__ import annotations

import contextlib
import re

__all__ = ["layer_error", "memory_named"]

# A block's own error message: "<Block>.<method>: <detail>" (SPEC.md 2.7).
_BLOCK_PREFIX = re.compile(r"^(?:TransformerBlockInference|Mamba2BlockInference|"
                           r"TransformerDecodeSession)\.\w+: ")  # fmt: skip
# The blocks' input check of x (SPEC.md 2.4): inside a model, x is the previous layer's output.
_X_NOT_FINITE = re.compile(r"^x(\[[^\]]*\])? must be finite; got (.*)$")


def _strip_block(msg: str) -> str:
    """``msg`` without a block's ``Class.method: `` prefix."""
    return _BLOCK_PREFIX.sub("", msg, count=1)


def _memory_detail(exc: MemoryError) -> str:
    """What a MemoryError says, without a block's prefix, its tail about the state (the model
    call states its own) or a bare ``std::bad_alloc``."""
    msg = _strip_block(str(exc))
    msg = msg.removesuffix("; the state is unchanged")
    return "" if msg in ("", "std::bad_alloc", "bad allocation") else msg


def layer_error(exc: BaseException, where: str, i: int, tail: str) -> BaseException | None:
    """The exception a Model call raises for ``exc`` raised by its layer ``i`` (SPEC.md 2.7: a
    Model call's errors name the model call, ``where``, never an inner block), or None to let
    ``exc`` through (an interrupt, an exception of another kind). ``tail`` says what became of
    the state (``"; the state is unchanged"``, or empty without a state)."""
    if isinstance(exc, MemoryError):
        detail = _memory_detail(exc) or "out of memory"
        return MemoryError(f"{where}: layer {i}: {detail}{tail}")
    if not isinstance(exc, (ValueError, RuntimeError, TypeError)):
        return None
    msg = str(exc)
    if not _BLOCK_PREFIX.match(msg):
        return None
    detail = _strip_block(msg)
    m = _X_NOT_FINITE.match(detail)
    if m is not None and isinstance(exc, ValueError):
        index = m.group(1) or ""
        source = f"layer {i - 1}" if i > 0 else "the embedding"
        return ValueError(
            f"{where}: the activations overflowed in {source} (x{index} = {m.group(2)} entering "
            f"layer {i}){tail}"
        )
    return type(exc)(f"{where}: layer {i}: {detail}{tail}")


@contextlib.contextmanager
def memory_named(where: str, what: str, tail: str = ""):
    """``with memory_named(where, what, tail):`` a MemoryError raised inside (a bare
    ``std::bad_alloc`` of the core, numpy's own) becomes ``MemoryError(f"{where}: cannot
    allocate {what}: ...{tail}")``."""
    try:
        yield
    except MemoryError as exc:
        detail = _memory_detail(exc)
        raise MemoryError(
            f"{where}: cannot allocate {what}{': ' + detail if detail else ''}{tail}"
        ) from None
