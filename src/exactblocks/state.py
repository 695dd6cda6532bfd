"""Compatibility only: states pickled by exactblocks 0.1.0 name this module.

Pickles of a ``TransformerState`` written before the package was split into
``exactblocks.transformer`` refer to ``exactblocks.state._restore_transformer_state``; this
module keeps that name importable so those pickles still load. New code imports
``exactblocks.TransformerState``.
"""

from .transformer.state import _restore_transformer_state

__all__: list[str] = []
_ = _restore_transformer_state
