"""The whole model: embedding, the block stack and the output head, token ids to logits.

What lives here: :class:`Model` (``forward``/``step`` from token ids to float32 logits,
``hidden_states`` and ``logits`` for apps that need a layer's output or the head on chosen
rows, and ``generate``). What does not: the caller-owned state
(``exactblocks.models.state``), sampling and stop rules (``exactblocks.models.generate``),
how layer failures are named (``exactblocks.models.errors``), reading files
(``exactblocks.models.loading``) and what a family's config means (the family files).

Exactness: the embedding is a row copy, the blocks keep their promise (SPEC.md 3.1), and the
head (final norm + vocabulary projection) runs in the core with the blocks' own arithmetic
(``_core.OutputHead``), one row at a time. So token-by-token ``step`` == one ``forward`` == any
chunk split, a ragged row == that row alone, 1 thread == N threads and every ISA agree on the
logits bit for bit. Sampling draws from ``numpy.random.Generator(PCG64(seed))`` with
probabilities built from the float32 logits with the library's own ``exp``, so a seeded
``generate`` picks the same tokens on every machine.
"""

from __future__ import annotations

import threading

import numpy as np

from exactblocks._validation import check_choice

from .._weights import LazyFingerprint, same_fingerprint
from ._args import _as_ids, _check_int, _frozen_json, _prompt_ids
from .errors import layer_error, memory_named
from .generate import Generation, GenerationStream, SamplingParams, decode_one, split_stop
from .head import _model_fingerprint
from .state import _PRIVATE, ModelState

__all__ = ["Model"]


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
        from exactblocks.mamba2 import Mamba2BlockInference

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
            E.g. ``{"q4_1": ..., "q8_0": ...}`` (docs/weights-and-loading.md, "Weight storage").
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

    def _stack_run(self, x: np.ndarray, state: ModelState, lens, i: int, *, undo, workspace,
                   end=None):  # fmt: skip
        """Layers ``i`` .. of ``state`` in one native call (``_core.layer_stack``), up to the
        first it cannot take; returns ``(x, next layer)``.

        Each layer is exactly its block's own call (same kernels and checks, so the same bits
        and state updates), minus the Python around it: about 25 us per layer, a tenth of a
        SmolLM2 decode step. The native call stops before any layer it cannot run as the block
        would (a state it cannot take, a non-finite input or state value, memory), having
        changed nothing of it; the caller then runs that layer through the block's call, which
        raises the block's error (or runs it, when the cause has gone)."""
        items = []
        end = len(self._blocks) if end is None else end
        for j in range(i, end if self._native_layers else i):
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

    def _run_blocks(self, x: np.ndarray, state, lens, *, step: bool, where: str, ws=None,
                    upto=None):  # fmt: skip
        """x through every block: without a state, or with a state only this call uses (that of
        ``generate``, with the workspace ``ws`` its calls share), which saves nothing. A layer's
        error is named after the model call ``where`` (``errors.layer_error``). ``upto``: run
        layers [0, upto) only (None = all)."""
        i, n = 0, len(self._blocks) if upto is None else upto
        while i < n:
            try:
                if state is None:
                    x = self._blocks[i].forward(x, lengths=lens)
                    i += 1
                    continue
                x, i = self._stack_run(x, state, lens, i, undo=None, workspace=ws, end=n)
                if i < n:
                    x = self._blocks[i]._model_call(x, state.layers[i], lens, step=step,
                                                    session=None, undo=None)  # fmt: skip
                    i += 1
            except BaseException as exc:
                named = layer_error(exc, where, i, "")
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
                named = layer_error(exc, where, i, tail)
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
        with memory_named(where, f"the embeddings of {B} x {L} tokens", unchanged):
            x = self._embed_rows(ids, lens)
        head = self._last_logits if which == "last" else self._logits
        n_out = B if which == "last" else B * L
        if state is None:
            x = self._run_blocks(x, None, lens, step=False, where=where)
            with memory_named(where, self._head_what(n_out)):
                return head(x, lens)
        with self._in_transaction(state, where):  # the head too: a stop there rolls back
            x = self._run_layers(x, state, lens, step=False, where=where)
            with memory_named(where, self._head_what(n_out), self._head_tail()):
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
        with memory_named(where, f"the embeddings of {B} tokens", "; the state is unchanged"):
            x = self._lookup(arr[:, 0])  # (B, d)
        with self._in_transaction(state, where):
            x = self._run_layers(x, state, None, step=True, where=where)
            with memory_named(where, self._head_what(B), self._head_tail()):
                x = self._head.forward(x.reshape(-1, self.d_model))
        return x.reshape(-1, 1, self.vocab_size)

    # -- for apps: a layer's output, the head on chosen rows ------------------------------------
    def hidden_states(self, ids, *, lengths=None, layer: int | None = None) -> np.ndarray:
        """The hidden states of every position: a block's output, or the final normed one.

        Parameters
        ----------
        ids : array-like of shape (batch, n_tokens), integer dtype
        lengths : array-like of shape (batch,) or None, default=None
            Valid tokens per ragged row (as :meth:`forward`).
        layer : int or None, default=None
            None: after the model's final norm (what the output head reads). An int: the
            output of block ``layer`` (0-based; negative counts from the end, -1 = the last
            block, before the final norm).

        Returns
        -------
        ndarray of shape (batch, n_tokens, d_model), float32
            Row b, position t equals, bit for bit, the same row run alone; padding positions
            hold unspecified values.

        Raises
        ------
        TypeError, ValueError
            As :meth:`forward`; ``layer`` not an int or outside the blocks. The layers run as
            in :meth:`forward` (one native call), the final norm is the core's ``norm``.
        """
        where = "Model.hidden_states"
        n = len(self._blocks)
        if layer is not None:
            layer = _check_int(layer, "layer", where, minimum=-n)
            if layer >= n:
                raise ValueError(f"{where}: layer={layer}; the model has {n} blocks")
            layer %= n
        ids, lens = self._prepare(ids, None, lengths, where)
        x = self._run_private(ids, lens, where, upto=None if layer is None else layer + 1)
        if layer is not None:
            return x
        from exactblocks import _ext

        core = _ext.core()
        fn = self.spec.final_norm()
        kind = getattr(core.NormKind, fn["norm"]).value
        B, L, _ = x.shape
        real = np.ones((B, L), bool) if lens is None else np.arange(L)[None, :] < lens[:, None]
        if real.any():
            x[real] = core.norm(kind, np.ascontiguousarray(x[real]), self._final_norm_weight,
                                None, float(fn["norm_eps"]))  # fmt: skip
        return x

    def logits(self, hidden) -> np.ndarray:
        """The output head (final norm and vocabulary projection) on chosen hidden rows.

        Parameters
        ----------
        hidden : array-like of shape (n, d_model), float32
            Outputs of the last block (``hidden_states(ids, layer=-1)[rows, positions]``).

        Returns
        -------
        ndarray of shape (n, vocab_size), float32
            Bit for bit the logits :meth:`forward` gives at those positions.

        Raises
        ------
        TypeError
            ``hidden`` not float32.
        ValueError
            ``hidden`` not of shape (n, d_model).
        """
        h = np.asarray(hidden)
        if h.dtype != np.float32:
            raise TypeError(f"Model.logits: hidden has dtype {h.dtype}; expected float32")
        if h.ndim != 2 or h.shape[1] != self.d_model:
            raise ValueError(
                f"Model.logits: hidden has shape {h.shape}; expected (n, {self.d_model})"
            )
        if h.shape[0] == 0:
            return np.zeros((0, self.vocab_size), np.float32)
        with memory_named("Model.logits", self._head_what(h.shape[0])):
            return self._head.forward(np.ascontiguousarray(h))

    def _run_private(self, ids, lens, where, upto=None, state=None, ws=None):
        """Embed ``ids`` and run layers ``[0, upto)`` on a state this call alone uses (nothing
        saved for a rollback) with one scratch workspace: the one-native-call layer path."""
        from exactblocks import _ext

        B, L = ids.shape
        if state is None:
            state = self.allocate_state(B, None if self._is_mamba else L)
        if ws is None:
            ws = _ext.core().Workspace()
        with memory_named(where, f"the embeddings of {B} x {L} tokens"):
            x = self._embed_rows(ids, lens)
        return self._run_blocks(x, state, lens, step=False, where=where, ws=ws, upto=upto)

    def __reduce__(self):
        raise TypeError(
            "Model: a loaded model cannot be pickled (its weights live in the native core); "
            "ship its path, or exactblocks.ray.pack_model(path), and load_model it where it is "
            "needed"
        )

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
        ignore_eos: bool = False,
        logprobs: bool = False,
        grammar=None,
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
        stop : None, str, int or sequence (list or tuple) of int and str, default=None
            Stop token ids and stop strings, in addition to the model's ``eos_token_ids``; a
            str is one stop string. A stop token is not part of the output; the text is cut
            before a stop string.
        ignore_eos : bool, default=False
            True: the model's ``eos_token_ids`` do not stop the generation.
        logprobs : bool, default=False
            Fill ``GenerateOutput.logprobs`` (:func:`exactblocks.sampling.logprobs`).
        grammar : Grammar or None, default=None
            Constrained decoding (:class:`exactblocks.models.Grammar`, e.g.
            ``Grammar.json_schema(schema)``): tokens are picked among those it allows; the
            generation stops once it is complete (docs/generation.md).
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
        The stop rules and sampling arguments are those of the server and
        ``exactblocks.ray`` (``exactblocks.models.generate``, docs/generation.md).
        """
        where = "Model.generate"
        prompt_ids = _prompt_ids(prompt, self.tokenizer, self.vocab_size, where)
        stop_ids, stop_strs = split_stop(stop, where)
        params = SamplingParams.checked(
            where,
            {"max_tokens": "max_new_tokens"},
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop_strs,
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            grammar=grammar,
        )
        gen = self.generation(prompt_ids, params, where=where)
        capacity = len(prompt_ids) + params.max_tokens
        if self.max_positions is not None and capacity > self.max_positions:
            raise ValueError(
                f"{where}: the prompt ({len(prompt_ids)} tokens) plus max_new_tokens="
                f"{params.max_tokens} exceeds max_positions={self.max_positions}"
            )
        holder: list = []
        out = GenerationStream(decode_one(self, gen, capacity, holder), holder)
        if stream:
            return out
        for _ in out:
            pass
        return out.output

    def generation(self, prompt_ids, params: SamplingParams, *, where: str = "Model.generation",
                   resume=()):  # fmt: skip
        """A :class:`~exactblocks.models.generate.Generation` of ``prompt_ids`` on this model.

        Parameters
        ----------
        prompt_ids : sequence of int
        params : SamplingParams
        where : str, default="Model.generation"
            The call named in errors.
        resume : sequence of int, default=()
            Tokens the request already generated, replayed (as ``Generation``'s ``resume``).

        Returns
        -------
        Generation
            Its stop tokens are this model's ``eos_token_ids`` (unless ``params.ignore_eos``)
            and ``params.stop_token_ids``; its text is decoded with this model's tokenizer.

        Raises
        ------
        TypeError, ValueError
            As :class:`~exactblocks.models.generate.Generation`.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"{where}: params must be a SamplingParams; got {type(params).__name__}"
            )
        return Generation(params, prompt_ids, tokenizer=self.tokenizer,
                          eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size,
                          where=where, resume=resume)  # fmt: skip
