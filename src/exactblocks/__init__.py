"""exactblocks: bit-exact CPU inference for one Transformer decoder block or one Mamba-2 block.

Public names (SPEC.md 1): :class:`TransformerBlockInference`, :class:`TransformerState`,
:class:`TransformerDecodeSession`, :class:`Mamba2BlockInference`, :class:`Mamba2State`,
:func:`arithmetic_version`, :func:`set_num_threads`, :func:`get_num_threads`, ``__version__``,
and the whole-model layer: :func:`load_model`, :class:`Model`, :class:`ModelState`. The
compiled extension is loaded on first use.

Layout: one folder per block (``transformer/``, ``mamba2/``: ``config``, ``weights``,
``state``, ``block``, and the Transformer's ``session``); ``models/`` (one file per family);
shared private modules at the top (``_block``, ``_state``, ``_weights``, ``_options``,
``_validation``, ``_ext``); ``runtime``, ``loaders``, ``tokenizer``, ``sampling`` and ``cli``
beside them.
"""

__version__ = "0.1.0"

from .mamba2 import Mamba2BlockInference, Mamba2State  # noqa: E402
from .models import Model, ModelState, load_model  # noqa: E402
from .runtime import arithmetic_version, get_num_threads, set_num_threads  # noqa: E402
from .transformer import (  # noqa: E402
    TransformerBlockInference,
    TransformerDecodeSession,
    TransformerState,
)

__all__ = [
    "Mamba2BlockInference",
    "Mamba2State",
    "Model",
    "ModelState",
    "TransformerBlockInference",
    "TransformerDecodeSession",
    "TransformerState",
    "__version__",
    "arithmetic_version",
    "get_num_threads",
    "load_model",
    "set_num_threads",
]
