"""Compatibility only: states pickled by exactblocks 0.1.0 name this module.

Pickles of a ``Mamba2State`` written before the package was split into ``exactblocks.mamba2``
refer to ``exactblocks.mamba2_state._restore_mamba2_state``; this module keeps that name
importable so those pickles still load. New code imports ``exactblocks.Mamba2State``.
"""

from .mamba2.state import _restore_mamba2_state

__all__: list[str] = []
_ = _restore_mamba2_state
