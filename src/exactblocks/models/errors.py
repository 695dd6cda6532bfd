"""How a Model call names the failures of its layers and its allocations.

What lives here: :func:`layer_error` (the exception a Model call raises for an exception of
one of its layers, carrying structured fields) and :func:`memory_named` (a MemoryError naming
what could not be allocated). What does not: the checks of the arguments
(``exactblocks.models.model``).

Every exception a Model call raises for a layer carries, besides its message, the fields
``where`` (the model call, ``"Model.forward"``), ``layer`` (the layer's index), ``kind``
(``"overflow"``, ``"memory"``, ``"invalid"``, ``"type"`` or ``"runtime"``) and ``detail`` (what
the block said, without its own name). The block's facts are read from its exception's fields
(:class:`exactblocks._validation.NonFiniteError`) and its known name, never parsed out of the
message.
"""

from __future__ import annotations

import contextlib

from exactblocks._validation import NonFiniteError

__all__ = ["layer_error", "memory_named"]

# What the blocks call themselves in their messages ("<Block>.<method>: <detail>", SPEC.md 2.7).
_BLOCK_CALLS = tuple(
    f"{cls}.{method}: "
    for cls in ("TransformerBlockInference", "Mamba2BlockInference", "TransformerDecodeSession")
    for method in ("forward", "step")
)
_STATE_TAIL = "; the state is unchanged"
_KINDS = ((MemoryError, "memory"), (ValueError, "invalid"), (TypeError, "type"),
          (RuntimeError, "runtime"))  # fmt: skip


def _block_detail(msg: str) -> str | None:
    """``msg`` without the block's ``Class.method: `` name, or None when no block named it."""
    for prefix in _BLOCK_CALLS:
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return None


def _memory_detail(exc: MemoryError) -> str:
    """What a MemoryError says, without a block's name, its tail about the state (the model
    call states its own) or a bare ``std::bad_alloc``."""
    msg = str(exc)
    msg = _block_detail(msg) or msg
    msg = msg.removesuffix(_STATE_TAIL)
    return "" if msg in ("", "std::bad_alloc", "bad allocation") else msg


def _named(cls, message: str, *, where: str, layer: int, kind: str, detail: str):
    err = cls(message)
    err.where, err.layer, err.kind, err.detail = where, layer, kind, detail
    return err


def layer_error(exc: BaseException, where: str, i: int, tail: str) -> BaseException | None:
    """The exception a Model call raises for ``exc`` raised by its layer ``i``.

    Parameters
    ----------
    exc : BaseException
        What the layer's block raised.
    where : str
        The model call (SPEC.md 2.7: its errors name it, never an inner block).
    i : int
        The layer.
    tail : str
        What became of the state (``"; the state is unchanged"``, or empty without one).

    Returns
    -------
    BaseException or None
        An exception of ``exc``'s type whose message names ``where`` and the layer, with the
        fields ``where``, ``layer``, ``kind`` and ``detail``; None to let ``exc`` through (an
        interrupt, or an exception no block raised).
    """
    if isinstance(exc, MemoryError):
        detail = _memory_detail(exc) or "out of memory"
        return _named(MemoryError, f"{where}: layer {i}: {detail}{tail}", where=where, layer=i,
                      kind="memory", detail=detail)  # fmt: skip
    if not isinstance(exc, (ValueError, RuntimeError, TypeError)):
        return None
    detail = _block_detail(str(exc))
    if detail is None:
        return None
    if isinstance(exc, NonFiniteError) and exc.name == "x":
        # the blocks' input check of x (SPEC.md 2.4): inside a model, x is the previous
        # layer's output, so the activations overflowed there
        index = "" if exc.index is None else f"[{', '.join(str(j) for j in exc.index)}]"
        source = f"layer {i - 1}" if i > 0 else "the embedding"
        return _named(
            ValueError,
            f"{where}: the activations overflowed in {source} (x{index} = {exc.value!r} "
            f"entering layer {i}){tail}",
            where=where,
            layer=i,
            kind="overflow",
            detail=detail,
        )
    base, kind = next((cls, k) for cls, k in _KINDS if isinstance(exc, cls))
    # the block's own subclass when it takes a message alone (NonFiniteError does not)
    cls = base if isinstance(exc, NonFiniteError) else type(exc)
    return _named(cls, f"{where}: layer {i}: {detail}{tail}", where=where, layer=i,
                  kind=kind, detail=detail)  # fmt: skip


@contextlib.contextmanager
def memory_named(where: str, what: str, tail: str = ""):
    """``with memory_named(where, what, tail):`` a MemoryError raised inside (a bare
    ``std::bad_alloc`` of the core, numpy's own) becomes ``MemoryError(f"{where}: cannot
    allocate {what}: ...{tail}")``.

    Parameters
    ----------
    where : str
        The model call.
    what : str
        What the block allocates.
    tail : str, default=""
        What became of the state.
    """
    try:
        yield
    except MemoryError as exc:
        detail = _memory_detail(exc)
        raise MemoryError(
            f"{where}: cannot allocate {what}{': ' + detail if detail else ''}{tail}"
        ) from None
