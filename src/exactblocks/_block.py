"""Members shared by both block classes (SPEC.md 2.8): extension queries and ``backward``."""

from __future__ import annotations

from . import _ext

__all__ = ["BlockCommon"]


class BlockCommon:
    """Mixin of TransformerBlockInference and Mamba2BlockInference (no state of its own)."""

    __slots__ = ()

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
        raise NotImplementedError(f"{type(self).__name__}.backward: exactblocks is forward only "
                                  "(inference); there are no gradients")
