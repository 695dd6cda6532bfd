"""The mojolearn peer: mojolearn-core's CPU binding of the same two blocks.

Here: :func:`import_mojolearn` (with the workaround for the wheel's RUNPATH) and
:class:`MojolearnPeer`, with the peer surface described in :mod:`benchmarks.peers`. Not here:
checks and timing; mojolearn runs on its own threads (not settable).
"""

from __future__ import annotations

import copy
import ctypes
import importlib
import importlib.util
import os
import sys

import numpy as np

from .workloads import LayerSpec

__all__ = ["MojolearnPeer", "import_mojolearn"]

_MOJOLEARN: dict = {}


def import_mojolearn():
    """Import mojolearn once per process.

    Returns
    -------
    (module or None, str)
        ``(mojolearn, "")``, ``(mojolearn, how it was made to load)`` or ``(None, why not)``.

    Notes
    -----
    The mojolearn-core 0.8.62 wheel's host bindings carry a RUNPATH of the machine they were
    built on, so their runtime libraries (``mojolearn/.libs``) are not found; they are preloaded
    here with ``RTLD_GLOBAL`` when the plain import fails for that reason.
    """
    if "result" in _MOJOLEARN:
        return _MOJOLEARN["result"]
    spec = importlib.util.find_spec("mojolearn")
    if spec is None:
        res = (None, "mojolearn-core not installed")
    else:
        try:
            res = (importlib.import_module("mojolearn"), "")
        except ImportError as exc:
            if "cannot open shared object" not in str(exc):
                res = (None, f"mojolearn-core not usable: {exc}")
            else:
                for k in [k for k in sys.modules if k == "mojolearn" or k.startswith("mojolearn.")]:
                    del sys.modules[k]
                libdir = os.path.join(list(spec.submodule_search_locations)[0], ".libs")
                pending = (
                    sorted(f for f in os.listdir(libdir) if f.endswith(".so"))
                    if os.path.isdir(libdir)
                    else []
                )
                for _ in range(len(pending) + 1):  # load in dependency order, whatever it is
                    left = []
                    for f in pending:
                        try:
                            ctypes.CDLL(os.path.join(libdir, f), mode=ctypes.RTLD_GLOBAL)
                        except OSError:
                            left.append(f)
                    if not left or left == pending:
                        break
                    pending = left
                try:
                    res = (
                        importlib.import_module("mojolearn"),
                        "runtime libraries in mojolearn/.libs preloaded (the wheel's RUNPATH "
                        "points at its build machine)",
                    )
                except ImportError as exc2:
                    res = (None, f"mojolearn-core not usable: {exc2}")
    _MOJOLEARN["result"] = res
    return res


class MojolearnPeer:
    """mojolearn CPU binding (``TransformerBlockInference`` / ``Mamba2BlockInference``).

    Parameters
    ----------
    ml : module
        mojolearn, from :func:`import_mojolearn`.
    spec : LayerSpec
        The layer (Mamba-2: mojolearn accepts d_state 128 and head_dim 64 only).
    weights : dict of str to ndarray
        Short-name float32 weights.
    max_positions : int
        Positions a transformer state holds.
    """

    name = "mojolearn"

    def __init__(self, ml, spec: LayerSpec, weights: dict, max_positions: int):
        self.spec = spec
        self.max_tokens = max_positions
        if spec.kind == "transformer":
            self.blk = ml.TransformerBlockInference(
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
            self.blk = ml.Mamba2BlockInference(weights)

    def make_prefill(self, x, lengths):
        blk = self.blk
        if lengths is None:
            return lambda: np.asarray(blk.forward(x))
        lens = [int(n) for n in lengths]
        return lambda: np.asarray(blk.forward(x, lengths=lens))

    def allocate(self, batch: int):
        if self.spec.kind == "transformer":
            return self.blk.allocate_state(batch, self.max_tokens)
        return self.blk.allocate_state(batch)

    def prefix_state(self, x_ctx):
        st = self.allocate(1)
        return st, np.asarray(self.blk.forward(x_ctx, st))

    def tile(self, st1, batch: int):
        st = self.allocate(batch)
        if self.spec.kind == "transformer":
            # flat buffers, packed [B, KV, cached_tokens, HD] at stride cached_tokens
            n = st1.n_kv_heads * st1.cached_tokens * st1.head_dim
            for name in ("k_cache", "v_cache"):
                src = np.asarray(getattr(st1, name)).reshape(-1)[:n]
                np.asarray(getattr(st, name)).reshape(-1)[: batch * n] = np.tile(src, batch)
            st.cached_tokens = st1.cached_tokens
        else:
            for name in ("conv_window", "h", "buffer_xbc", "buffer_dtraw"):
                np.asarray(getattr(st, name))[:] = np.asarray(getattr(st1, name))
            st.buffered_tokens = st1.buffered_tokens
        return st

    def clone(self, st):
        return copy.deepcopy(st)

    def make_step(self, st, x_tok):
        blk = self.blk
        b, d = x_tok.shape
        return lambda: np.asarray(blk.step(x_tok, st)).reshape(b, d)
