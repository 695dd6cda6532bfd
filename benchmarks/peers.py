"""The timed libraries ("peers"): their names, the exactblocks adapter, and building them all.

Every peer adapter offers the same small surface; ``make_*`` does the untimed preparation and
returns the function that is timed::

    make_prefill(x, lengths) -> fn()      fn returns (B, L, d) float32
    prefix_state(x_ctx) -> (state, y)     state after a (1, C, d) prefill (untimed)
    tile(state, B) -> state               B identical rows (untimed)
    clone(state) -> state                 independent copy (untimed)
    make_step(state, x_tok) -> fn()       x_tok (B, d); fn returns (B, d), advances state

Here: :data:`PEERS` and their labels, :class:`ExactblocksPeer` (through exactblocks' public
API only) and :func:`build_peers`. The PyTorch adapters live in :mod:`benchmarks.torch_peers`,
mojolearn's in :mod:`benchmarks.mojolearn_peer`, NumPy's ceiling in
:mod:`benchmarks.numpy_peer`. Not here: checks and timing.
"""

from __future__ import annotations

import copy

from .checks import Recorder
from .mojolearn_peer import MojolearnPeer
from .torch_peers import TorchLlamaPeer, TorchMamba2Peer
from .workloads import LayerSpec

__all__ = ["PEERS", "PEER_LABELS", "ExactblocksPeer", "build_peers"]

PEERS = ("exactblocks", "torch_eager", "torch_sdpa", "mojolearn")
PEER_LABELS = {
    "exactblocks": "exactblocks",
    "torch_eager": "torch eager",
    "torch_sdpa": "torch sdpa",
    "mojolearn": "mojolearn",
}


class ExactblocksPeer:
    """exactblocks block (transformer or Mamba-2), the reference every other peer is checked
    against.

    Parameters
    ----------
    spec : LayerSpec
        The layer's sizes.
    weights : dict of str to ndarray
        Short-name float32 weights (:mod:`benchmarks.workloads`).
    max_positions : int
        Positions a transformer state holds (ignored for Mamba-2).

    Attributes
    ----------
    blk : exactblocks.TransformerBlockInference or exactblocks.Mamba2BlockInference
    """

    name = "exactblocks"

    def __init__(self, spec: LayerSpec, weights: dict, max_positions: int):
        import exactblocks as eb

        self.spec = spec
        self.max_tokens = max_positions
        if spec.kind == "transformer":
            self.blk = eb.TransformerBlockInference(
                weights,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim,
                rope_theta=spec.rope_theta,
                rope_scaling=copy.deepcopy(spec.rope_scaling),
                norm_eps=spec.norm_eps,
                max_positions=max_positions,
            )
        else:
            self.blk = eb.Mamba2BlockInference(
                weights, n_groups=spec.n_groups, norm_eps=spec.norm_eps
            )

    def make_prefill(self, x, lengths):
        """``fn()``: one ``forward(x, lengths=lengths)`` without state."""
        blk = self.blk
        return lambda: blk.forward(x, lengths=lengths)

    def allocate(self, batch: int):
        """A fresh state of ``batch`` rows."""
        if self.spec.kind == "transformer":
            return self.blk.allocate_state(batch, self.max_tokens)
        return self.blk.allocate_state(batch)

    def prefix_state(self, x_ctx):
        """``(state, y)`` after a ``(1, C, d)`` prefill of ``x_ctx``."""
        st = self.allocate(1)
        return st, self.blk.forward(x_ctx, st)

    def tile(self, st1, batch: int):
        """A state of ``batch`` rows, each a copy of the one row of ``st1``."""
        st = self.allocate(batch)
        if self.spec.kind == "transformer":
            st.k_cache[:] = st1.k_cache
            st.v_cache[:] = st1.v_cache
        else:
            st.h[:] = st1.h
            st.conv_window[:] = st1.conv_window
        st.row_tokens[:] = st1.row_tokens[0]
        return st

    def clone(self, st):
        """An independent copy of ``st``."""
        return copy.deepcopy(st)

    def make_step(self, st, x_tok):
        """``fn()``: one ``step`` of the ``(B, d)`` tokens ``x_tok``; returns ``(B, d)``."""
        blk = self.blk
        return lambda: blk.step(x_tok, st)[:, 0]


def build_peers(
    spec: LayerSpec, weights: dict, max_positions: int, avail: dict, rec: Recorder
) -> dict:
    """Every peer that can be built for one layer, exactblocks first.

    Parameters
    ----------
    spec : LayerSpec
        The layer.
    weights : dict of str to ndarray
        Its short-name float32 weights; every peer gets the same values.
    max_positions : int
        Positions the transformer states hold.
    avail : dict
        ``{"torch_error": None or why torch is missing, "mojolearn": module or None}``.
    rec : Recorder
        Gets a note for each peer that could not be built (not fatal).

    Returns
    -------
    dict of str to peer adapter
        Keys among :data:`PEERS`. mojolearn is left out for bf16-valued weights: its time
        does not depend on the values.
    """
    peers = {"exactblocks": ExactblocksPeer(spec, weights, max_positions)}
    if avail["torch_error"] is None:
        if spec.kind == "transformer":
            shared = None
            try:
                shared = TorchLlamaPeer.build(spec, weights, max_positions)
            except Exception as exc:  # noqa: BLE001 - a broken peer is reported, not fatal
                rec.note(f"{spec.name}: HF LlamaDecoderLayer could not be built: {exc!r}")
            if shared is not None:
                peers["torch_eager"] = TorchLlamaPeer(shared, "eager")
                peers["torch_sdpa"] = TorchLlamaPeer(shared, "sdpa")
        else:
            try:
                peers["torch_eager"] = TorchMamba2Peer(spec, weights)
            except Exception as exc:  # noqa: BLE001
                rec.note(f"{spec.name}: HF Mamba2Block could not be built: {exc!r}")
    if avail["mojolearn"] is not None and not spec.bf16_weights:  # its time does not
        try:  # depend on the values
            peers["mojolearn"] = MojolearnPeer(avail["mojolearn"], spec, weights, max_positions)
        except Exception as exc:  # noqa: BLE001
            rec.note(f"{spec.name}: mojolearn block could not be built: {exc!r}")
    return peers
