"""Members shared by both block classes (SPEC.md 2.8): construction, read-only attributes,
``get_params``/``set_params``, ``repr``, pickling, extension queries, ``backward`` and the checks
that open every call.

A subclass sets ``_build`` (a staticmethod ``(raw_options, where, weights=None, canonical=None)
-> Impl`` that validates everything and returns the implementation object stored as
``self._impl``) and ``_REPR_SIZES`` (the sizes its ``repr`` shows first), then calls
:func:`exactblocks._options.install` with its option table, which adds ``__init__``, the option
properties, ``_options`` and ``_defaults``. What does not live here: any option, weight or state
of a particular block (``transformer/``, ``mamba2/``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import _ext
from ._options import options_repr, public_values
from ._validation import check_finite, check_lengths, check_tokens, format_shape
from ._weights import (
    LazyFingerprint,
    QuantizedMatrix,
    ResidentWeights,
    fingerprint,
    same_fingerprint,
)

__all__ = ["BlockCommon", "Impl", "make_impl"]


class Impl:
    """Everything one configuration needs; swapped as a whole by ``set_params``.

    ``raw``: the options as given (mappings copied); ``opts``: the options in force; ``sizes``:
    what the weights gave; ``weights``: the canonical weights (short names) as a
    :class:`~exactblocks._weights.ResidentWeights` (small tensors as read-only float32, projection
    matrices rebuilt from the core's packed form on access: no float32 copy is kept);
    ``core``: the compiled block; ``fp``: its :class:`~exactblocks._weights.LazyFingerprint`
    (``fingerprint`` is its string, computed on first read).
    """

    __slots__ = ("raw", "opts", "sizes", "weights", "fp", "core")

    @property
    def fingerprint(self) -> str:
        """str: The configuration's fingerprint (computed on first read)."""
        return self.fp.value


def make_impl(
    class_name: str, table, raw, opts, sizes, weights, core_mod, cfg, core_type, layout
) -> Impl:
    """The last step of a block's ``_build``: core (``core_type(cfg, weights, blocks)``) and
    fingerprint (class, arithmetic, options in force, weight bytes) of a checked configuration.

    ``weights`` maps short names to checked float32 arrays or
    :class:`~exactblocks._weights.QuantizedMatrix` (projection matrices); ``layout`` maps each
    projection matrix's name to ``(packed matrix, first row, end row)`` in the core. The block
    keeps the small tensors and the core; the fingerprint (computed on first read) hashes the
    float32 bytes of every weight, the packed ones rebuilt from the core one tensor at a time.
    """
    impl = Impl()
    impl.raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    impl.opts = opts
    impl.sizes = sizes
    f32, blocks = {}, {}
    for n in weights:
        a = weights[n]
        if isinstance(a, QuantizedMatrix):
            blocks[n] = a.core_arg()
        else:
            f32[n] = a
    impl.core = core_type(cfg, f32, blocks)
    packed = {n: (m, r0, r1, tuple(weights[n].shape)) for n, (m, r0, r1) in layout.items()
              if n in weights}  # fmt: skip
    resident = ResidentWeights({n: a for n, a in f32.items() if n not in packed}, packed, impl.core)
    impl.weights = resident
    # The fingerprint hashes the float32 bytes of every weight: computed when first read (a
    # state of this block is recognised by identity, see _check_fingerprint), from what the
    # block keeps: the small tensors and the packed matrices rebuilt one at a time with the
    # kernels' own operations, which are the weights given, bit for bit (tests/unit/
    # test_compact.py). GGUF blocks would otherwise be dequantised only to be hashed.
    if set(resident) != set(weights):  # every weight must be kept to be hashed later
        raise RuntimeError(
            f"{class_name}: internal error: weights {sorted(set(weights) - set(resident))} "
            "are neither kept nor packed"
        )
    options = options_repr(table, opts)
    arithmetic = str(core_mod.arithmetic_version())
    impl.fp = LazyFingerprint(lambda: fingerprint(class_name, arithmetic, options, resident))
    return impl


class BlockCommon:
    """Mixin of TransformerBlockInference and Mamba2BlockInference (no state of its own)."""

    __slots__ = ()
    _options: tuple = ()
    _defaults: dict = {}
    _REPR_SIZES: tuple = ()

    @staticmethod
    def _build(raw: dict, where: str, weights=None, canonical=None):  # pragma: no cover
        raise NotImplementedError

    def _init(self, weights, raw: dict, where: str) -> None:
        """The body of the generated ``__init__``: build and store the first configuration."""
        object.__setattr__(self, "_impl", self._build(raw, where, weights=weights))

    def _public_options(self) -> dict:
        """``get_params()``: every option in force, mutable values copied."""
        return public_values(self._options, self._impl.opts)

    def __repr__(self) -> str:
        impl = self._impl
        inner = ", ".join(
            [f"{k}={impl.sizes[k]!r}" for k in self._REPR_SIZES]
            + [f"{k}={impl.opts[k]!r}" for k in self._defaults]
        )
        return f"{type(self).__name__}({inner})"

    # -- checks that open every call (SPEC.md 2.5: all before anything is computed) -----------
    @staticmethod
    def _check_call_inputs(
        x,
        state,
        lengths,
        where: str,
        *,
        step: bool,
        d_model: int,
        state_cls: type,
        type_error,
        alloc_call: str,
    ):
        """Check ``x``, the state's type and ``lengths``; return ``(x as float32 (B, L, d),
        lengths as int64 (B,))``. ``type_error(where, state)`` builds the wrong-type error;
        ``alloc_call`` names the allocation call in the missing-state message."""
        xa = check_tokens(x, d_model, where, step=step)
        bsz, n_tok, _ = xa.shape
        if state is None and step:
            raise TypeError(
                f"{where}: state is required (got None); allocate one with {alloc_call}"
            )
        if state is not None and not isinstance(state, state_cls):
            raise type_error(where, state)
        lens = check_lengths(lengths, bsz, n_tok, where)
        if lengths is None:  # every row full: one pass, the same first element and message
            check_finite(xa, "x", where)
            return xa, lens
        for b in range(bsz):
            n = int(lens[b])
            if n:
                check_finite(xa[b, :n], "x", where, index_base=(b,))
        return xa, lens

    @staticmethod
    def _check_fingerprint(impl, state, where: str) -> None:
        """The state was allocated by a block of this configuration (the same fingerprint
        object: nothing is computed; else the same digest)."""
        if not same_fingerprint(state._fingerprint, impl.fp):
            raise ValueError(
                f"{where}: state belongs to another block or configuration (state "
                f"fingerprint {state.fingerprint}, block fingerprint "
                f"{impl.fingerprint})"
            )

    @classmethod
    def _check_state_fits(cls, impl, state, xa: np.ndarray, where: str) -> None:
        """The state was allocated by a block of this configuration, for x's batch size."""
        cls._check_fingerprint(impl, state, where)
        if state.batch_size != xa.shape[0]:
            raise ValueError(
                f"{where}: state.batch_size={state.batch_size} does not match the "
                f"batch of x, {xa.shape[0]} (x shape {format_shape(xa.shape)})"
            )

    @staticmethod
    def _claim_state(state, where: str):
        """``with self._claim_state(state, where):`` the state for this call; RuntimeError at
        once when another call holds it. The claim is native (its ``__enter__`` and
        ``__exit__`` run no Python code), so no exception raised by a signal handler can fall
        between taking the lock and the protected region: it cannot leak."""
        return state._lock.claim(
            f"{where}: state is in use by another call (a state serves one call at a time)"
        )

    @staticmethod
    def _memory_error(where: str, exc: MemoryError, state) -> MemoryError:
        """A MemoryError of the native call (output or scratch), named after the call (the
        native side has released the scratch it had grown; no state byte was written)."""
        tail = "" if state is None else "; the state is unchanged"
        return MemoryError(f"{where}: {exc or 'out of memory'}{tail}")

    # -- read-only attributes ---------------------------------------------------------------
    def __setattr__(self, name, value):
        raise AttributeError(
            f"{type(self).__name__}: attribute {name!r} is read-only; build a "
            f"new block or use set_params({name}=...) for an option"
        )

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__}: attribute {name!r} cannot be deleted")

    # -- sklearn-style parameters -------------------------------------------------------------
    def set_params(self, **params):
        """Change keyword options, re-running every constructor check against the weights.

        Parameters
        ----------
        **params
            Keyword options of the constructor. Options not given keep the value they were
            given (an option left to None, such as ``head_dim``, is derived again).

        Returns
        -------
        self
            The same block, now with the new configuration.

        Raises
        ------
        ValueError
            A key is ``weights`` or not a keyword option; or any constructor check fails.
        TypeError
            An option of the wrong type.

        Notes
        -----
        Atomic: a new configuration (with its own compiled core) is built first and swapped in
        as a whole, so on any error nothing changes, and concurrent calls see wholly the old or
        wholly the new configuration. If the options change, the fingerprint changes and states
        of the old configuration are refused.
        """
        where = f"{type(self).__name__}.set_params"
        for k in params:
            if k == "weights":
                raise ValueError(
                    f"{where}: 'weights' cannot be set; build a new block for new weights"
                )
            if k not in self._defaults:
                raise ValueError(
                    f"{where}: {k!r} is not a keyword option; accepted: {list(self._defaults)}"
                )
        impl = self._impl
        raw = dict(impl.raw)
        raw.update(params)
        object.__setattr__(self, "_impl", self._build(raw, where, canonical=impl.weights))
        return self

    # -- pickling and copying -----------------------------------------------------------------
    def __getstate__(self) -> dict:
        impl = self._impl
        return {"format": 1, "options": dict(impl.raw), "weights": dict(impl.weights)}

    def __setstate__(self, st: dict) -> None:
        where = f"{type(self).__name__}.__setstate__"
        weights = {}
        for n, a in st["weights"].items():
            a = np.array(a, dtype=np.float32, order="C", copy=True)
            check_finite(a, f"weights[{n!r}]", where, flat=True)
            a.flags.writeable = False
            weights[n] = a
        raw = dict(self._defaults)
        raw.update(st["options"])  # every constructor check runs again on unpickling
        object.__setattr__(self, "_impl", self._build(raw, where, canonical=weights))

    def _float32_storage_copy(self):
        """Return a copy of this block whose core stores float32 panels only (for tests).

        The copy has the same options, weights and fingerprint; its outputs must equal this
        block's bit for bit whatever storage each picked (tests compare the two).
        """
        impl = self._impl
        cfg = impl.core.cfg
        cfg.compact_weights = False
        clone = object.__new__(type(self))
        new = type(impl)()
        for name in type(impl).__slots__:
            object.__setattr__(new, name, getattr(impl, name))
        new.core = type(impl.core)(cfg, dict(impl.weights))
        new.weights = ResidentWeights(dict(impl.weights._small), impl.weights._layout, new.core)
        object.__setattr__(clone, "_impl", new)
        return clone

    def weight_storage(self) -> list:
        """How each packed projection matrix is stored in the compiled core.

        A matrix whose every weight is exactly a GGUF block-quantised value (the float32 values
        ``gguf`` dequantises Q4_1, Q5_1, Q8_0, Q4_0, Q5_0 or Q6_K tensors to) is stored as 4-, 5-
        or 8-bit codes with float32 scales (and offsets) per 32 inputs (per 16 for Q6_K), which
        the kernels turn back into the same float32 weight before each use; one whose weights
        all have zero low 16 bits (a bfloat16 checkpoint widened to float32) is stored as
        bfloat16. Matrices given as GGUF blocks (``exactblocks.load_model`` on a GGUF file) are
        packed from the blocks directly, Q4_K and Q5_K included. The arithmetic, and every
        output bit, is the same as with float32 storage; a decode step reads 5.3x (Q4_1), 3.6x
        (Q8_0), 3.2x (Q5_1, Q6_K) or 2x (bfloat16) fewer bytes. The fused q|k|v and gate|up
        matrices are stored as one matrix each when all their parts fit one format; parts given
        as GGUF blocks of types that share none (a Q4_K q|k with a Q6_K v, as Q4_K_M files
        have) are stored each run of one format on its own, listed once per part. Any
        other matrix, or one whose input size is not a multiple of 32, is stored as float32
        panels. The packer checks every weight against what the kernels rebuild, so what it
        picks never changes an output bit.

        Returns
        -------
        list of (str, str, int)
            One ``(matrix, format, nbytes)`` per packed matrix, in call order: matrix names
            ``'qkv_proj'``, ``'o_proj'``, ``'gate_up_proj'`` (``'up_proj'`` for ungated MLPs)
            and ``'down_proj'`` for a Transformer block, ``'in_proj'`` and ``'out_proj'`` for
            Mamba-2; format ``'q4_1'`` (w = d*q + m, q in 0..15), ``'q5_1'`` (the same, q in
            0..31), ``'q8_0'`` (w = d*q, q int8), ``'q6_k'`` (w = d*q, q int8, d per 16
            inputs), ``'bf16'`` or ``'float32'``; nbytes the bytes held, including scales and
            biases.

        Examples
        --------
        Weights as ``gguf`` dequantises a Q8_0 tensor (needs the ``gguf`` package):

        >>> import numpy as np, gguf, exactblocks as eb
        >>> from gguf.quants import quantize, dequantize
        >>> rng = np.random.default_rng(0)
        >>> w = {"block_norm.weight": np.ones(64, np.float32),
        ...      "in_proj.weight": rng.standard_normal((2 * 128 + 2 * 16 + 4, 64),
        ...                                            dtype=np.float32),
        ...      "conv1d.weight": rng.standard_normal((128 + 32, 1, 4), dtype=np.float32),
        ...      "dt_bias": np.zeros(4, np.float32), "A_log": np.zeros(4, np.float32),
        ...      "D": np.ones(4, np.float32), "norm.weight": np.ones(128, np.float32),
        ...      "out_proj.weight": rng.standard_normal((64, 128), dtype=np.float32)}
        >>> q8 = gguf.GGMLQuantizationType.Q8_0
        >>> w["out_proj.weight"] = dequantize(quantize(w["out_proj.weight"], q8), q8)
        >>> eb.Mamba2BlockInference(w).weight_storage()
        [('in_proj', 'float32', 86016), ('out_proj', 'q8_0', 13824)]
        """
        return [(str(n), str(f), int(b)) for n, f, b in self._impl.core.weight_storage]

    def numeric_mode_used(self) -> str:
        """Return the numeric mode of the compiled extension.

        Returns
        -------
        str
            ``'identical'`` (read from ``exactblocks._core``, not a Python constant).
        """
        return str(_ext.core().numeric_mode())

    def vendor_used(self) -> str:
        """Return the compute vendor of the compiled extension.

        Returns
        -------
        str
            ``'cpu'`` (read from ``exactblocks._core``).
        """
        return str(_ext.core().vendor())

    def backward(self, *args, **kwargs):
        """Not available: exactblocks is forward only.

        Parameters
        ----------
        *args, **kwargs
            Ignored.

        Raises
        ------
        NotImplementedError
            Always.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.backward: exactblocks is forward only "
            "(inference); there are no gradients"
        )
