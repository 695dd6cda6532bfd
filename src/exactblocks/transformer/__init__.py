"""The Transformer decoder block: block, options, weights, state and decode session.

Modules: ``config`` (option table, option checks, the typed core config), ``weights`` (weight
table, name and shape checks), ``state`` (TransformerState and the state checks of calls),
``session`` (TransformerDecodeSession), ``block`` (TransformerBlockInference). Only the public
classes are re-exported here.
"""

from .block import TransformerBlockInference
from .session import TransformerDecodeSession
from .state import TransformerState

__all__ = ["TransformerBlockInference", "TransformerDecodeSession", "TransformerState"]
