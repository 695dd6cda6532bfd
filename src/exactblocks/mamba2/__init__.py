"""The Mamba-2 block: block, options, weights and state.

Modules: ``config`` (option table, option checks, the typed core config), ``weights`` (weight
table, name and shape checks), ``state`` (Mamba2State and the state checks of calls), ``block``
(Mamba2BlockInference). Only the public classes are re-exported here.
"""

from .block import Mamba2BlockInference
from .state import Mamba2State

__all__ = ["Mamba2BlockInference", "Mamba2State"]
