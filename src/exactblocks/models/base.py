"""The whole model: embedding, the block stack, the output head, states and generation.

What lives here: :class:`Model` (``forward``/``step`` from token ids to float32 logits, and
``generate``), :class:`ModelState` (every layer's state in one caller-owned object),
:class:`GenerateOutput` / :class:`GenerationStream`. What does not: reading files
(``exactblocks.models.loading``), what a family's config means (the family files), and the
sampler (``exactblocks.sampling``) and the streaming detokeniser (``exactblocks.text``).

Exactness: the embedding is a row copy, the blocks keep their promise (SPEC.md 3.1), and the
head (final norm + vocabulary projection) runs in the core with the blocks' own arithmetic
(``_core.OutputHead``), one row at a time. So token-by-token ``step`` == one ``forward`` == any
chunk split, a ragged row == that row alone, 1 thread == N threads and every ISA agree on the
logits bit for bit. Sampling draws from ``numpy.random.Generator(PCG64(seed))`` with
probabilities built from the float32 logits with the library's own ``exp``, so a seeded
``generate`` picks the same tokens on every machine.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import xxhash

from exactblocks._validation import check_choice
from exactblocks.sampling import pick_token
from exactblocks.text import Detokenizer

from .._weights import LazyFingerprint, fingerprint_value, same_fingerprint

__all__ = ["GenerateOutput", "GenerationStream", "Model", "ModelState"]

_PRIVATE = object()


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


def _layer_error(exc: BaseException, where: str, i: int, tail: str) -> BaseException | None:
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
def _memory_named(where: str, what: str, tail: str = ""):
    """``with _memory_named(where, what, tail):`` a MemoryError raised inside (a bare
    ``std::bad_alloc`` of the core, numpy's own) becomes ``MemoryError(f"{where}: cannot
    allocate {what}: ...{tail}")``."""
    try:
        yield
    except MemoryError as exc:
        detail = _memory_detail(exc)
        raise MemoryError(
            f"{where}: cannot allocate {what}{': ' + detail if detail else ''}{tail}"
        ) from None


def _check_int(value, name: str, where: str, *, minimum: int = 0, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int; got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{where}: {name}={value} must be >= {minimum}")
    return value


def _check_real(value, name: str, where: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a real number; got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name}={value} must be finite")
    return value


def _as_ids(ids, where: str, name: str = "ids") -> np.ndarray:
    """Token ids as an int64 array (no float, no bool: a silently truncated id is a bug)."""
    arr = np.asarray(ids)
    if arr.dtype == object or arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # [] or [[]]: an empty list has no dtype
            return arr.astype(np.int64)
        raise TypeError(
            f"{where}: {name} must hold integers (token ids); got dtype {arr.dtype}"
            + (" (bool is not an id)" if arr.dtype == bool else "")
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        at = tuple(int(i) for i in np.unravel_index(int(arr.argmax()), arr.shape))
        raise ValueError(f"{where}: {name}{list(at)}={int(arr[at])} is not a token id")
    return arr.astype(np.int64, copy=False)


# -- states -----------------------------------------------------------------------------------


class ModelState:
    """Every layer's state of one :class:`Model` for a batch of sequences.

    Made only by :meth:`Model.allocate_state`; calling the class raises TypeError. Caller-owned:
    the model keeps nothing between calls, so one model serves any number of states.

    Attributes
    ----------
    layers : tuple
        One state per block, in order (``TransformerState`` or ``Mamba2State``); their buffers
        are the KV caches / conv windows and SSM states themselves.
    batch_size : int
    max_tokens : int or None
        Positions each row may hold (None for a Mamba-2 model: its state has a constant size).
    fingerprint : str
        The allocating model's fingerprint; another model refuses the state.

    Notes
    -----
    The state serves one call at a time through a native lock (RuntimeError when busy). A call
    made on the main thread (the one where signal handlers raise) is atomic over all layers and
    the head (SPEC.md 2.5): it completes, or it raises and every layer's buffers and counters
    are exactly as before, whatever the failure (KeyboardInterrupt or an exception raised by a
    signal handler at any point, a non-finite value arising in a late layer, a MemoryError).
    For that each layer saves what it overwrites into the state's undo log (the call's new K/V
    slots, a copy of each advancing Mamba-2 row's conv window and SSM state), which the lock's
    transaction rolls back or forgets when the call ends. On another thread nothing can be
    raised into a call between bytecodes, so nothing is saved there; if such a call fails
    after the first layer has written (only a non-finite value arising in a later layer or a
    MemoryError can cause that), the rows it advanced are marked inconsistent and refused until
    :meth:`reset` clears them. ``copy.copy`` / ``copy.deepcopy`` and pickling copy every buffer
    under the lock; taken while another thread's call runs, they wait for it (SPEC.md 2.6).
    """

    __slots__ = ("layers", "batch_size", "max_tokens", "_fingerprint", "_lock", "_undo", "_broken")

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "ModelState: states are made by Model.allocate_state(batch_size, max_tokens), not "
            "by calling the class"
        )

    @classmethod
    def _make(cls, token, layers, batch_size, max_tokens, fingerprint, broken=()):
        if token is not _PRIVATE:
            raise TypeError("ModelState: states are made by Model.allocate_state")
        from exactblocks import _ext

        core = _ext.core()
        self = object.__new__(cls)
        s = object.__setattr__
        s(self, "layers", tuple(layers))
        s(self, "batch_size", int(batch_size))
        s(self, "max_tokens", None if max_tokens is None else int(max_tokens))
        if not isinstance(fingerprint, LazyFingerprint):  # the model's object, or a str
            fingerprint = str(fingerprint)
        s(self, "_fingerprint", fingerprint)
        # `with _lock.transaction(msg, _undo):` a model call (RuntimeError when busy; rolls the
        # layers back on any exception); `with _lock.claim(msg):` reset; `with _lock.hold(...)`
        # snapshots. Entered and left natively: no exception can leak the lock.
        s(self, "_lock", core.StateLock())
        s(self, "_undo", core.UndoLog())
        s(self, "_broken", set(broken))  # rows left inconsistent by a failed call (see Notes)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"ModelState: attribute {name!r} cannot be assigned")

    @property
    def fingerprint(self) -> str:
        """str: The allocating model's fingerprint (32 hexadecimal digits)."""
        return fingerprint_value(self._fingerprint)

    @property
    def row_tokens(self) -> np.ndarray:
        """ndarray of shape (batch_size,), int64: positions held per row (a copy)."""
        return np.array(self.layers[0].row_tokens, dtype=np.int64, copy=True)

    def reset(self, rows=None) -> None:
        """Empty rows (all by default) of every layer's state, freeing their batch slots.

        Parameters
        ----------
        rows : None, int or sequence of int, default=None
            Rows to clear; None = all.

        Raises
        ------
        TypeError, ValueError
            As the layers' ``reset`` (a row outside [0, batch_size)); nothing changes then.
        RuntimeError
            The state (or one of its layers) is in use by a call; or some rows are given of a
            state that a call of another thread held when the process forked.

        Notes
        -----
        Every layer's rows are zeroed in one native step: an exception (Ctrl-C) leaves all
        layers reset or none. A reset of every row also makes usable again a state that a call
        of another thread held when the process forked (its contents were undefined in the
        child; SPEC.md 2.6).
        """
        from exactblocks import _ext
        from exactblocks._state import _check_rows

        where = "ModelState.reset"
        idx = np.array(_check_rows(rows, self.batch_size, where), dtype=np.int64)
        busy = f"{where}: the state is in use by another call"
        # a reset of every row also makes a state held by a call at a fork usable (SPEC 2.6)
        all_rows = len(set(idx.tolist())) == self.batch_size
        with self._lock.reset_claim(busy, all_rows):
            layers = []
            for st in self.layers:
                st._check_buffers(where)
                a, b = (getattr(st, name) for name in st._BUFFERS)
                layers.append((st._lock, a, b, st.row_tokens))
            _ext.core().reset_layers(layers, idx, busy)
            self._broken.difference_update(int(r) for r in idx)

    def _copy_layers(self, where: str) -> tuple:
        """Copies of every layer and the inconsistent rows, taken under the state's lock (a
        running call of another thread finishes first; RuntimeError when this thread's own call
        holds it)."""
        import copy

        from exactblocks._state import SNAPSHOT_TIMEOUT

        with self._lock.hold(where, SNAPSHOT_TIMEOUT):
            return tuple(copy.copy(st) for st in self.layers), sorted(self._broken)

    def __reduce__(self):
        layers, broken = self._copy_layers("ModelState (pickle or copy)")
        return (
            _restore_model_state,
            (layers, self.batch_size, self.max_tokens, self.fingerprint, broken),
        )

    def __copy__(self):
        layers, broken = self._copy_layers("ModelState (copy)")
        # the model's own fingerprint object: the copy is recognised by identity, and a
        # fingerprint not yet computed stays so
        return ModelState._make(
            _PRIVATE, layers, self.batch_size, self.max_tokens, self._fingerprint, broken
        )

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __repr__(self) -> str:
        return (
            f"ModelState(batch_size={self.batch_size}, max_tokens={self.max_tokens}, "
            f"layers={len(self.layers)}, row_tokens={self.row_tokens.tolist()})"
        )


def _restore_model_state(layers, batch_size, max_tokens, fingerprint, broken=()):
    return ModelState._make(_PRIVATE, layers, batch_size, max_tokens, fingerprint, broken)


# -- generation results -------------------------------------------------------------------------


@dataclass
class GenerateOutput:
    """What :meth:`Model.generate` produced.

    Attributes
    ----------
    ids : list of int
        The new token ids (a stop token is not included).
    text : str or None
        Their text (``tokenizer.decode(ids)``, cut before a stop string), or None without a
        tokenizer.
    prompt_ids : list of int
        The prompt as token ids.
    finish_reason : str
        ``"length"`` (max_new_tokens reached) or ``"stop"`` (a stop token or string).
    prefill_seconds, decode_seconds : float
        Wall time of the prompt's forward and of the decode steps.
    decode_steps : int
        ``step`` calls made (new tokens after the first).
    """

    ids: list = field(default_factory=list)
    text: str | None = None
    prompt_ids: list = field(default_factory=list)
    finish_reason: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0


class GenerationStream:
    """An iterator over the pieces of a generation, as they are decoded.

    Returned by ``Model.generate(..., stream=True)``. Yields str pieces (whose concatenation
    is the final ``text``) when the model has a tokenizer, else the new token ids (int).
    After exhaustion, :attr:`output` holds the :class:`GenerateOutput`.

    Attributes
    ----------
    output : GenerateOutput or None
        None until the iterator is exhausted.
    """

    def __init__(self, gen: Iterator, holder: list):
        self._gen = gen
        self._holder = holder

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self):
        return next(self._gen)

    @property
    def output(self) -> GenerateOutput | None:
        """GenerateOutput or None: the result, once the iterator is exhausted."""
        return self._holder[0] if self._holder else None

    def close(self) -> None:
        """Stop generating (releases the decode sessions at once)."""
        self._gen.close()


# -- the model ----------------------------------------------------------------------------------


class _HeadRows:
    """The rows of a packed vocabulary matrix, as float32 on demand.

    An embedding without a float32 copy: the output head's matrix for a tied embedding
    (``_core.OutputHead``), or an untied GGUF embedding's own packed blocks
    (``_core.PackedLinear``). ``rows[ids]`` gives ``(*ids.shape, d_model)``, each row rebuilt
    by the core with the kernels' own operations, so it equals the row the matrix was packed
    from, bit for bit.
    """

    __slots__ = ("_head", "vocab_size", "d_model")

    def __init__(self, head, vocab_size: int, d_model: int):
        self._head = head
        self.vocab_size = int(vocab_size)
        self.d_model = int(d_model)

    @property
    def nbytes(self) -> int:
        """int: Bytes of the float32 matrix."""
        return self.vocab_size * self.d_model * 4

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        flat = np.ascontiguousarray(ids.reshape(-1))
        return self._head.rows(flat).reshape(*ids.shape, self.d_model)

    def chunks(self, rows: int = 2048):
        """Yield the float32 matrix a slice of ``rows`` rows at a time, in order."""
        for r0 in range(0, self.vocab_size, rows):
            yield self._head.unpack(r0, min(self.vocab_size, r0 + rows))


class Model:
    """A causal language model: token ids in, float32 logits out, bit-exact on the CPU.

    Made by :func:`exactblocks.load_model`. Embedding (a row copy), the family's blocks
    (``TransformerBlockInference`` or ``Mamba2BlockInference``), the final norm and output head
    (``_core.OutputHead``: the blocks' own norm and GEMM arithmetic). A model is read-only; it
    serves any number of caller-owned :class:`ModelState` objects.

    Attributes
    ----------
    config : mapping
        The HF-style config the model was built from, with HF's defaults filled in (read-only).
    blocks : list
        The block objects, in layer order (a new list each time; the blocks are the model's).
    tokenizer : object or None
        ``encode`` / ``decode`` / ``apply_chat_template`` (HF ``tokenizer.json`` or GGUF
        metadata), or None when the source has none.
    family : str
        The family file's name: ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``,
        ``"gemma2"``, ``"gemma3"``, ``"olmo2"``, ``"smollm3"``, ``"granite"``, ``"phi3"``,
        ``"stablelm"``, ``"starcoder2"``, ``"mamba2"``, ``"nemotron_h"`` or
        ``"granitemoehybrid"``.
    spec : frozen dataclass
        The resolved options every block was built from (``DecoderSpec``, ``Mamba2Spec`` or
        ``HybridSpec``).
    vocab_size, d_model : int
    max_positions : int or None
        Longest sequence (None for Mamba-2: no limit).
    eos_token_ids : tuple of int
        Default stop tokens of ``generate`` (generation_config.json, else the config's).
    fingerprint : str
        32 hex digits over the family, spec, block fingerprints and head weights; states carry it.

    Notes
    -----
    The math follows HF ``<Family>ForCausalLM.forward`` (transformers 5.23):
    ``logits = lm_head(norm(blocks(embed_tokens(ids) * s))) / c`` (softcapped where the family
    does; the scale s and divisor c are 1 unless the family has them); closeness to HF float32
    is tested (rtol = atol = 2e-4 on tiny models), bit equality with PyTorch is not promised.
    """

    def __init__(self, token, *, spec, config, blocks, embed, head, tokenizer, eos_ids,
                 max_positions, head_bytes, source, final_norm_weight):  # fmt: skip
        if token is not _PRIVATE:
            raise TypeError("Model: models are made by exactblocks.load_model(source)")
        self.spec = spec
        self.family = spec.family
        self._config = _frozen_json(config)
        self._blocks = tuple(blocks)
        self._embed = embed
        self._head = head
        # (d_model,) float32, as the file holds it: the head packs its own copy; kept for the
        # final hidden state of exactblocks.ray.Embed without reading the file again
        self._final_norm_weight = final_norm_weight
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_ids)
        self.vocab_size = int(spec.vocab_size)
        self.d_model = int(spec.d_model)
        self.max_positions = max_positions
        self.source = source
        self._is_mamba = spec.family == "mamba2"
        from exactblocks import Mamba2BlockInference

        # per block: a recurrent Mamba-2 state (no capacity, no decode session) or a KV cache
        self._recurrent = tuple(isinstance(b, Mamba2BlockInference) for b in self._blocks)
        # the layers run in one native call (_stack_run); False: each through its block's own
        # call (the reference path the tests compare against)
        self._native_layers = True
        scale = getattr(spec, "embed_scale", None)
        self._embed_scale = None if scale is None else np.float32(scale)
        # Computed on first read (states of this model hold the object and are recognised by
        # identity): hashing the blocks and the 49k-row head rebuilt from its packed form is
        # most of a small model's load time otherwise.
        blocks = self._blocks  # (not self: no reference cycle through the closure)
        self._fingerprint = LazyFingerprint(lambda: _model_fingerprint(spec, blocks, head_bytes))

    config = property(lambda self: self._config, doc="Mapping: the HF-style config (read-only).")
    fingerprint = property(
        lambda self: self._fingerprint.value,
        doc="str: 32 hex digits over the family, spec, block fingerprints and head weights "
        "(computed on first read).",
    )
    blocks = property(lambda self: list(self._blocks), doc="list: the blocks, in layer order.")

    def __repr__(self) -> str:
        return (
            f"Model(family={self.family!r}, layers={len(self._blocks)}, d_model={self.d_model}, "
            f"vocab_size={self.vocab_size}, max_positions={self.max_positions}, "
            f"tokenizer={'yes' if self.tokenizer is not None else 'none'})"
        )

    def weight_storage(self) -> dict:
        """Bytes of packed weights per storage format, blocks and head together.

        Returns
        -------
        dict of str to int
            E.g. ``{"q4_1": ..., "q8_0": ...}`` (README "Weight storage").
        """
        out: dict = {}
        for blk in self._blocks:
            for _, fmt, nbytes in blk.weight_storage():
                out[fmt] = out.get(fmt, 0) + nbytes
        fmt, nbytes = self._head.weight_storage
        out[fmt] = out.get(fmt, 0) + nbytes
        return out

    # -- states ---------------------------------------------------------------------------------
    def allocate_state(self, batch_size: int, max_tokens: int | None = None) -> ModelState:
        """Return a zeroed state of every layer for ``batch_size`` sequences.

        Parameters
        ----------
        batch_size : int
            Rows, >= 1.
        max_tokens : int or None, default=None
            Positions each row may hold, in [1, max_positions]; required for Transformer
            families, ignored (may be None) for Mamba-2, whose state has a constant size.

        Returns
        -------
        ModelState

        Raises
        ------
        TypeError
            A non-int argument.
        ValueError
            batch_size < 1, max_tokens missing (Transformer) or outside [1, max_positions].
        MemoryError
            The buffers cannot be allocated.
        """
        where = "Model.allocate_state"
        b = _check_int(batch_size, "batch_size", where, minimum=1)
        m = _check_int(max_tokens, "max_tokens", where, minimum=1, allow_none=True)
        if not self._is_mamba:
            if m is None:
                raise ValueError(f"{where}: max_tokens is required for a {self.family} model")
            if m > self.max_positions:
                raise ValueError(
                    f"{where}: max_tokens={m} exceeds the model's max_positions="
                    f"{self.max_positions} (pass max_positions= to load_model)"
                )
        recurrent = self._recurrent  # a Mamba-2 block's state has no max_tokens
        try:
            layers = [
                blk.allocate_state(b) if rec else blk.allocate_state(b, m)
                for blk, rec in zip(self._blocks, recurrent)
            ]
            return ModelState._make(_PRIVATE, layers, b, m, self._fingerprint)
        except MemoryError:
            nbytes = sum(
                blk._state_nbytes(b) if rec else blk._state_size(b, m)[3]
                for blk, rec in zip(self._blocks, recurrent)
            )
            size = f"batch_size={b}" + ("" if self._is_mamba else f", max_tokens={m}")
            raise MemoryError(
                f"{where}: cannot allocate a state of {size}: its {len(self._blocks)} layers "
                f"need {nbytes} bytes ({nbytes / 2**30:.3g} GiB)"
            ) from None

    def _check_state(self, state, batch: int, where: str) -> None:
        if not isinstance(state, ModelState):
            raise TypeError(
                f"{where}: state must be a ModelState from Model.allocate_state; got "
                f"{type(state).__name__}"
            )
        if not same_fingerprint(state._fingerprint, self._fingerprint):
            raise ValueError(
                f"{where}: state belongs to another model (fingerprint {state.fingerprint}, "
                f"this model's is {self.fingerprint})"
            )
        if state.batch_size != batch:
            raise ValueError(
                f"{where}: ids has {batch} rows but state.batch_size is {state.batch_size}"
            )
        if state._broken:
            raise ValueError(
                f"{where}: state rows {sorted(state._broken)} are inconsistent after a call "
                "that failed on another thread than the main one; reset() them (or allocate a "
                "new state)"
            )

    # -- calls ----------------------------------------------------------------------------------
    def _check_lengths(self, lengths, batch: int, n_tokens: int, where: str):
        if lengths is None:
            return None
        arr = _as_ids(lengths, where, "lengths")
        if arr.shape != (batch,):
            raise ValueError(
                f"{where}: lengths has shape {arr.shape}; expected ({batch},), one per row"
            )
        for b, n in enumerate(arr.tolist()):
            if not 0 <= n <= n_tokens:
                raise ValueError(f"{where}: lengths[{b}]={n} is outside [0, n_tokens={n_tokens}]")
        return arr

    def _check_vocab(self, ids: np.ndarray, lens, where: str) -> None:
        if lens is None:
            bad = (ids < 0) | (ids >= self.vocab_size)
        else:
            real = np.arange(ids.shape[-1])[None, :] < lens[:, None]
            bad = real & ((ids < 0) | (ids >= self.vocab_size))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{where}: ids{list(idx)}={int(ids[idx])} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    def _check_room(self, state: ModelState, lens, n_tokens: int, where: str) -> None:
        held = state.layers[0].row_tokens
        need = np.full(state.batch_size, n_tokens) if lens is None else lens
        limit = state.max_tokens if state.max_tokens is not None else None
        for b in range(state.batch_size):
            if limit is not None and int(held[b]) + int(need[b]) > limit:
                raise ValueError(
                    f"{where}: state row {b} holds {int(held[b])} positions and this call adds "
                    f"{int(need[b])}; the limit is max_tokens={limit} (allocate the state with "
                    f"max_tokens >= {int(held[b]) + int(need[b])})"
                )

    def _embed_rows(self, ids: np.ndarray, lens) -> np.ndarray:
        if lens is None:
            return self._lookup(ids)  # (B, L, d)
        x = np.zeros((*ids.shape, self.d_model), np.float32)
        real = np.arange(ids.shape[1])[None, :] < lens[:, None]
        x[real] = self._lookup(ids[real])
        return x

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows of ``ids``: exact row copies, times the family's float32 scale (one
        correctly rounded multiply per value, as HF's ``embeds * scale`` in float32)."""
        rows = self._embed[ids]
        if self._embed_scale is not None:
            rows *= self._embed_scale
        return rows

    def _stack_run(self, x: np.ndarray, state: ModelState, lens, i: int, *, undo, workspace):
        """Layers ``i`` .. of ``state`` in one native call (``_core.layer_stack``), up to the
        first it cannot take; returns ``(x, next layer)``.

        Each layer is exactly its block's own call (same kernels and checks, so the same bits
        and state updates), minus the Python around it: about 25 us per layer, a tenth of a
        SmolLM2 decode step. The native call stops before any layer it cannot run as the block
        would (a state it cannot take, a non-finite input or state value, memory), having
        changed nothing of it; the caller then runs that layer through the block's call, which
        raises the block's error (or runs it, when the cause has gone)."""
        items = []
        for j in range(i, len(self._blocks) if self._native_layers else i):
            impl, st, recurrent = self._blocks[j]._impl, state.layers[j], self._recurrent[j]
            if not same_fingerprint(st._fingerprint, impl.fp) or (
                not recurrent and st._session is not None
            ):
                break  # another configuration (set_params), or a decode session: the block's
            if recurrent:
                items.append((impl.core, st._lock, st.conv_window, st.h, st.row_tokens))
            else:
                items.append((impl.core, st._lock, st.k_cache, st.v_cache, st.row_tokens,
                              st.max_tokens, int(st.rope_factors == "long"), st.n_kv_heads,
                              st.capacity, st.head_dim))  # fmt: skip
        if not items:
            return x, i
        from exactblocks import _ext

        B = x.shape[0]
        x3 = x.reshape(B, -1, self.d_model)
        n_tok = x3.shape[1]
        lens_arr = np.full(B, n_tok, np.int64) if lens is None else lens
        try:
            y, done = _ext.core().layer_stack(x3, lens_arr, items, workspace, True, undo)
        except MemoryError:  # its output buffers: the block's own call names the memory
            return x, i
        return (x, i) if done == 0 else (y, i + done)

    def _run_blocks(self, x: np.ndarray, state, lens, *, step: bool, where: str, ws=None):
        """x through every block: without a state, or with a state only this call uses (that of
        ``generate``, with the workspace ``ws`` its calls share), which saves nothing. A layer's
        error is named after the model call ``where`` (:func:`_layer_error`)."""
        i, n = 0, len(self._blocks)
        while i < n:
            try:
                if state is None:
                    x = self._blocks[i].forward(x, lengths=lens)
                    i += 1
                    continue
                x, i = self._stack_run(x, state, lens, i, undo=None, workspace=ws)
                if i < n:
                    x = self._blocks[i]._model_call(x, state.layers[i], lens, step=step,
                                                    session=None, undo=None)  # fmt: skip
                    i += 1
            except BaseException as exc:
                named = _layer_error(exc, where, i, "")
                if named is None:
                    raise
                raise named from None
        return x

    def _run_layers(self, x: np.ndarray, state: ModelState, lens, *, step: bool, where: str):
        """x through every layer of ``state``, inside its transaction (the caller's ``with``).

        On the main thread, where signal handlers raise, every layer saves what it overwrites
        into the state's undo log, which the transaction rolls back on any exception. Another
        thread cannot have an exception raised into it between bytecodes, so its layers save
        nothing (a batched Mamba-2 decode step would copy its whole SSM state, about a fifth of
        its time), and a failure after the first layer has written marks the rows it advanced
        inconsistent instead (reliably: nothing interrupts this handler there).
        """
        main = threading.current_thread() is threading.main_thread()
        undo = state._undo if main else None
        i, n = 0, len(self._blocks)
        while i < n:
            try:
                x, i = self._stack_run(x, state, lens, i, undo=undo, workspace=None)
                if i < n:
                    x = self._blocks[i]._model_call(x, state.layers[i], lens, step=step,
                                                    session=None, undo=undo)  # fmt: skip
                    i += 1
            except BaseException as exc:
                tail = "; the state is unchanged"
                if not main and i > 0:  # layers < i advanced: those rows are inconsistent
                    rows = range(state.batch_size) if lens is None else np.flatnonzero(lens)
                    rows = [int(r) for r in rows]
                    state._broken.update(rows)
                    tail = (
                        f"; state rows {rows} are left inconsistent (the call ran on another "
                        "thread than the main one): reset() them"
                    )
                named = _layer_error(exc, where, i, tail)
                if named is None:
                    raise
                raise named from None
        return x

    def _head_what(self, n: int) -> str:
        """What the output head allocates for ``n`` positions (a MemoryError's message)."""
        return f"the output head's logits of {n} positions ({n * self.vocab_size * 4} bytes)"

    @staticmethod
    def _head_tail() -> str:
        """What a failure of the head (after every layer ran) leaves of a model state: rolled
        back on the main thread; on another thread nothing was saved, every layer advanced."""
        if threading.current_thread() is threading.main_thread():
            return "; the state is unchanged"
        return "; the state has advanced by this call's tokens (the call ran on another thread)"

    def _in_transaction(self, state: ModelState, where: str):
        """``with self._in_transaction(state, where):`` the state for one call: refused at once
        when busy; on any exception leaving the block every layer is rolled back (SPEC.md 2.5).
        The lock and the rollback are native (entered and left without running Python code)."""
        return state._lock.transaction(f"{where}: the state is in use by another call", state._undo)

    def _last_logits(self, hidden: np.ndarray, lens) -> np.ndarray:
        """(B, vocab_size): the head on each row's last real position only (+0.0 for a row
        with no real token). The head is row by row, so these are the bits of ``_logits``."""
        B, L, d = hidden.shape
        if lens is None:
            return self._head.forward(np.ascontiguousarray(hidden[:, L - 1]))
        rows = np.flatnonzero(lens > 0)
        out = np.zeros((B, self.vocab_size), np.float32)
        if rows.size:
            out[rows] = self._head.forward(np.ascontiguousarray(hidden[rows, lens[rows] - 1]))
        return out

    def _logits(self, hidden: np.ndarray, lens) -> np.ndarray:
        B, L, d = hidden.shape
        if lens is None:
            return self._head.forward(hidden.reshape(B * L, d)).reshape(B, L, self.vocab_size)
        real = np.arange(L)[None, :] < lens[:, None]
        out = np.zeros((B, L, self.vocab_size), np.float32)
        out[real] = self._head.forward(np.ascontiguousarray(hidden[real]))
        return out

    def _prepare(self, ids, state, lengths, where):
        ids = _as_ids(ids, where)
        if ids.ndim != 2:
            raise ValueError(
                f"{where}: ids has shape {ids.shape}; expected (batch, n_tokens) token ids"
            )
        B, L = ids.shape
        if B < 1:
            raise ValueError(f"{where}: ids has no rows")
        if L < 1:
            raise ValueError(f"{where}: ids has shape {ids.shape}; expected at least one token")
        lens = self._check_lengths(lengths, B, L, where)
        self._check_vocab(ids, lens, where)
        if state is None:
            if self.max_positions is not None and L > self.max_positions:
                raise ValueError(
                    f"{where}: n_tokens={L} exceeds the model's max_positions={self.max_positions}"
                )
        else:
            self._check_state(state, B, where)
            self._check_room(state, lens, L, where)
        return ids, lens

    def forward(
        self, ids, state: ModelState | None = None, *, lengths=None, logits: str = "all"
    ) -> np.ndarray:
        """Logits of every position (or of each row's last): embedding, blocks, norm and head.

        Parameters
        ----------
        ids : array-like of shape (batch, n_tokens), integer dtype
            Token ids in ``[0, vocab_size)`` at real positions (padding ids are never read).
        state : ModelState or None, default=None
            None: every row starts at position 0, nothing is kept. Otherwise a state of this
            model with ``batch_size == batch``; each row continues from its held positions and
            the state advances by the row's real tokens.
        lengths : None or sequence of int, default=None
            Real tokens per row, in [0, n_tokens]; ``ids[b, lengths[b]:]`` is padding.
        logits : {"all", "last"}, default="all"
            ``"all"``: the logits of every position. ``"last"``: only those of each row's last
            real position (``lengths[b] - 1``, or ``n_tokens - 1`` without lengths), for a
            prefill whose next token is all that is sampled: the output head (final norm and
            the ``(vocab_size, d_model)`` projection) then runs on one position per row
            instead of all of them. The state advances the same way either way.

        Returns
        -------
        ndarray of shape (batch, n_tokens, vocab_size), dtype float32
            With ``logits="all"``. Fresh; padding positions are +0.0. Row b, position t equals,
            bit for bit, the logits of that token computed alone, token by token, or in any
            chunk split.
        ndarray of shape (batch, vocab_size), dtype float32
            With ``logits="last"``: row b equals, bit for bit, row b at position
            ``lengths[b] - 1`` of the ``"all"`` output; a row with ``lengths[b] == 0`` is +0.0.

        Raises
        ------
        TypeError
            ``ids`` or ``lengths`` not integers (floats and bools are refused); ``state`` not a
            ModelState; ``logits`` not a str.
        ValueError
            A shape or ``lengths`` out of range; an id outside the vocabulary (its index and
            value); a state of another model or batch size, without room, or with rows left
            inconsistent by a call that failed on another thread; more than max_positions
            tokens; ``logits`` neither "all" nor "last"; a non-finite value arising inside
            the stack (the layer names it).
        RuntimeError
            The state is in use by another call.
        KeyboardInterrupt
            Or any exception a signal handler raises: a long call polls for them and stops
            within about 100 ms (SPEC.md 2.5).

        Notes
        -----
        With a state, a call on the main thread is atomic over every layer and the head: when
        it raises, for whatever reason, every layer's buffers and counters are as before the
        call (see :class:`ModelState` for calls on other threads).
        """
        where = "Model.forward"
        which = check_choice(logits, "logits", where, ("all", "last"))
        ids, lens = self._prepare(ids, state, lengths, where)
        B, L = ids.shape
        unchanged = "" if state is None else "; the state is unchanged"
        with _memory_named(where, f"the embeddings of {B} x {L} tokens", unchanged):
            x = self._embed_rows(ids, lens)
        head = self._last_logits if which == "last" else self._logits
        n_out = B if which == "last" else B * L
        if state is None:
            x = self._run_blocks(x, None, lens, step=False, where=where)
            with _memory_named(where, self._head_what(n_out)):
                return head(x, lens)
        with self._in_transaction(state, where):  # the head too: a stop there rolls back
            x = self._run_layers(x, state, lens, step=False, where=where)
            with _memory_named(where, self._head_what(n_out), self._head_tail()):
                return head(x, lens)

    __call__ = forward

    def step(self, ids, state: ModelState) -> np.ndarray:
        """Advance every row of ``state`` by one token and return its logits.

        Parameters
        ----------
        ids : array-like of shape (batch,) or (batch, 1), integer dtype
        state : ModelState
            A state of this model with ``batch_size == batch``.

        Returns
        -------
        ndarray of shape (batch, 1, vocab_size), dtype float32
            Bitwise the logits ``forward`` gives for the same token at the same position.

        Raises
        ------
        TypeError, ValueError, RuntimeError
            As :meth:`forward`.
        """
        where = "Model.step"
        arr = _as_ids(ids, where)
        if arr.ndim == 1:
            arr = arr[:, None]
        if arr.ndim != 2 or arr.shape[1] != 1:
            raise ValueError(f"{where}: ids has shape {arr.shape}; expected (batch,) or (batch, 1)")
        if state is None:
            raise TypeError(f"{where}: state is required (use forward() without a state)")
        arr, _ = self._prepare(arr, state, None, where)
        B = arr.shape[0]
        with _memory_named(where, f"the embeddings of {B} tokens", "; the state is unchanged"):
            x = self._lookup(arr[:, 0])  # (B, d)
        with self._in_transaction(state, where):
            x = self._run_layers(x, state, None, step=True, where=where)
            with _memory_named(where, self._head_what(B), self._head_tail()):
                x = self._head.forward(x.reshape(-1, self.d_model))
        return x.reshape(-1, 1, self.vocab_size)

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop=None,
        stream: bool = False,
    ):
        """Continue ``prompt`` token by token: greedy, or sampled with a seeded generator.

        Parameters
        ----------
        prompt : str or sequence of int
            Text (encoded with ``tokenizer.encode``, special tokens added as the tokenizer
            does; apply a chat template first for chat models) or token ids.
        max_new_tokens : int
            Most tokens to generate, >= 1.
        temperature : float, default=0.0
            0 = greedy (argmax, the lowest id on ties); > 0 samples from
            ``softmax(logits / temperature)``.
        top_k : int or None, default=None
            Keep the tokens whose scaled logit is >= the k-th largest (HF ``TopKLogitsWarper``,
            ties kept). Sampling only.
        top_p : float or None, default=None
            In (0, 1]: keep the most probable tokens whose cumulative probability before them
            is < top_p (at least one; HF ``TopPLogitsWarper``). Sampling only.
        seed : int or None, default=None
            Seed of ``numpy.random.Generator(PCG64(seed))``; the same seed gives the same tokens
            on every machine. None = fresh OS entropy.
        stop : None or iterable of int and str, default=None
            Stop token ids and stop strings; None = ``eos_token_ids``. A stop token is not
            part of the output; the text is cut before a stop string.
        stream : bool, default=False
            Return a :class:`GenerationStream` of pieces instead of the output.

        Returns
        -------
        GenerateOutput or GenerationStream

        Raises
        ------
        TypeError
            A wrong argument type (e.g. a str prompt without a tokenizer, a float id).
        ValueError
            An empty prompt, a prompt or stop id outside the vocabulary, an option out of
            range, or prompt + max_new_tokens beyond max_positions.

        Notes
        -----
        Each token is :func:`exactblocks.sampling.pick_token` of the logits (its Notes define
        it): ``z = logits / float32(temperature)``, ``e = exp(z - max z)`` with the library's
        own float32 exp (``_core.elementwise("exp")``, the same bits on every ISA), summed in
        float64 in (logit descending, id ascending) order; one ``Generator.random()`` draw per
        token picks the first token whose cumulative weight exceeds it. The prompt is prefilled
        with one ``forward`` (the output head on its last position only); each new token is
        one ``step`` (every layer in one native call), which equals the prefill bit for bit.
        """
        where = "Model.generate"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(f"{where}: a text prompt needs a tokenizer; this model has none")
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            arr = _as_ids(prompt, where, "prompt")
            if arr.ndim != 1:
                raise ValueError(f"{where}: prompt ids must be 1-D; got shape {arr.shape}")
            prompt_ids = arr.tolist()
        if not prompt_ids:
            raise ValueError(f"{where}: the prompt is empty")
        ids = np.asarray(prompt_ids, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            what = "the encoded prompt" if isinstance(prompt, str) else "prompt"
            raise ValueError(
                f"{where}: {what}[{i}]={int(ids[i])} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        n_new = _check_int(max_new_tokens, "max_new_tokens", where, minimum=1)
        temp = _check_real(temperature, "temperature", where)
        if temp < 0:
            raise ValueError(f"{where}: temperature={temp} must be >= 0")
        k = _check_int(top_k, "top_k", where, minimum=1, allow_none=True)
        p = None if top_p is None else _check_real(top_p, "top_p", where)
        if p is not None and not 0 < p <= 1:
            raise ValueError(f"{where}: top_p={p} must be in (0, 1]")
        seed = _check_int(seed, "seed", where, minimum=0, allow_none=True)
        stop_ids, stop_strs = set(), []
        for s in self.eos_token_ids if stop is None else stop:
            if isinstance(s, str):
                if not s:
                    raise ValueError(f"{where}: a stop string is empty")
                stop_strs.append(s)
            else:
                sid = _check_int(s, "stop entry", where)
                if stop is not None and sid >= self.vocab_size:  # (the model's own eos ids
                    raise ValueError(  # are taken as the config states them)
                        f"{where}: stop id {sid} is outside the vocabulary [0, "
                        f"{self.vocab_size}): it could never be generated"
                    )
                stop_ids.add(sid)
        if stop_strs and self.tokenizer is None:
            raise TypeError(f"{where}: stop strings need a tokenizer; this model has none")
        capacity = len(prompt_ids) + n_new
        if self.max_positions is not None and capacity > self.max_positions:
            raise ValueError(
                f"{where}: the prompt ({len(prompt_ids)} tokens) plus max_new_tokens={n_new} "
                f"exceeds max_positions={self.max_positions}"
            )
        # greedy decoding draws nothing: numpy.random (and the libcrypto its import loads,
        # about 5 MB of memory) is imported only to sample
        rng = np.random.Generator(np.random.PCG64(seed)) if temp > 0 else None
        holder: list = []
        gen = self._generate_iter(
            prompt_ids, n_new, temp, k, p, rng, stop_ids, stop_strs, capacity, holder
        )
        out = GenerationStream(gen, holder)
        if stream:
            return out
        for _ in out:
            pass
        return out.output

    def _generate_iter(self, prompt_ids, n_new, temp, k, p, rng, stop_ids, stop_strs, capacity,
                       holder):  # fmt: skip
        from exactblocks import _ext

        res = GenerateOutput(prompt_ids=list(prompt_ids))
        detok = Detokenizer(self.tokenizer, stop_strs) if self.tokenizer is not None else None
        # A state this generation alone uses (nothing saved for a rollback), and one scratch
        # workspace for all its calls: the layers run one after another (one per layer held
        # ~1.6 MB each after a SmolLM2 prompt: 30 layers, 47 MB of peak memory).
        state = self.allocate_state(1, None if self._is_mamba else capacity)
        ws = _ext.core().Workspace()
        t0 = time.perf_counter()
        ids = np.asarray([prompt_ids], np.int64)
        x = self._run_blocks(self._embed_rows(ids, None), state, None, step=False,
                             where="Model.generate", ws=ws)  # fmt: skip
        logits = self._last_logits(x, None)[0]  # the head on the last position only
        res.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            token = pick_token(logits, temperature=temp, top_k=k, top_p=p, rng=rng)
            if token in stop_ids:
                res.finish_reason = "stop"
                break
            res.ids.append(token)
            if detok is not None:
                piece = detok.push(token)
                if piece:
                    yield piece
                if detok.stopped:
                    res.finish_reason = "stop"
                    break
            else:
                yield token
            if len(res.ids) == n_new:
                break
            x = self._lookup(np.asarray([token]))
            x = self._run_blocks(x, state, None, step=True, where="Model.generate",
                                 ws=ws)  # fmt: skip
            logits = self._head.forward(x.reshape(1, self.d_model))[0]
            res.decode_steps += 1
        res.decode_seconds = time.perf_counter() - t1
        if detok is not None:
            piece = detok.finish()
            res.text = detok.text
            if piece:
                yield piece
        holder.append(res)


def _model_fingerprint(spec, blocks, head_bytes) -> str:
    """XXH3-128 of the family's spec, every block's fingerprint and the head's weights (the
    final norm, and the head and embedding matrices as float32 rows: a packed head's rows are
    rebuilt a slice at a time)."""
    h = xxhash.xxh3_128()
    for part in (b"exactblocks-model-1", repr(spec).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    for blk in blocks:
        h.update(blk.fingerprint.encode())
    for arr in head_bytes:
        h.update(arr.nbytes.to_bytes(8, "little"))
        if isinstance(arr, _HeadRows):  # the packed head's float32 rows, a slice at a time
            for chunk in arr.chunks():
                h.update(memoryview(chunk).cast("B"))
        else:
            h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.hexdigest()


def _eos_from(config: Mapping, generation_config: Mapping | None) -> tuple[int, ...]:
    """Default stop ids: generation_config.json's eos_token_id, else the config's (as HF)."""
    for src in (generation_config or {}, config):
        v = src.get("eos_token_id")
        if v is not None:
            vals = v if isinstance(v, (list, tuple)) else [v]
            return tuple(int(i) for i in vals if isinstance(i, int) and not isinstance(i, bool))
    return ()


def _frozen_json(value: Any) -> Any:
    """A deep copy of a JSON-like config with tuples for lists (for MappingProxyType views)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen_json(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen_json(v) for v in value)
    return value
