"""In-memory torch tensors (a transformers model's ``state_dict()``) -> float32 NumPy arrays.

What lives here: :class:`TorchSource`, a read-only mapping over a state dict that hands out
float32 arrays without copying float32 tensors (``Tensor.numpy()`` shares the memory) and
widening bfloat16/float16 exactly (``Tensor.float()``). What does not: which tensors a model
needs (``exactblocks.models``). torch is never imported here: the tensors come from the caller.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["ArraySource", "TorchSource", "is_torch_module"]


def is_torch_module(obj) -> bool:
    """Whether ``obj`` looks like a transformers model: a ``torch.nn.Module`` with a ``.config``.

    Parameters
    ----------
    obj : object

    Returns
    -------
    bool
    """
    mro = [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]
    return "torch.nn.modules.module.Module" in mro and hasattr(obj, "config")


def _is_tensor(v) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == "torch.Tensor" for c in type(v).__mro__)


class TorchSource(Mapping):
    """float32 views of a state dict's tensors (name -> ndarray), made on demand.

    Parameters
    ----------
    state_dict : Mapping of str to torch.Tensor or ndarray
        E.g. ``model.state_dict()``. Tensors on a device other than the CPU are refused.

    Notes
    -----
    float32 tensors are shared (``t.detach().numpy()``: zero-copy, the exactblocks blocks copy
    what they keep); bfloat16 and float16 tensors are widened with ``t.float()``, exact. NumPy
    float32 arrays pass through; every other dtype raises ValueError naming the tensor.
    """

    def __init__(self, state_dict):
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_model: a state dict must be a Mapping of str to tensors; got "
                f"{type(state_dict).__name__}"
            )
        self._sd = dict(state_dict)

    def __getitem__(self, name: str) -> np.ndarray:
        v = self._sd[name]
        if _is_tensor(v):
            if v.device.type != "cpu":
                raise ValueError(
                    f"load_model: tensor {name!r} is on device {v.device}; move the model to the "
                    "CPU first (model.to('cpu'))"
                )
            kind = str(v.dtype).replace("torch.", "")
            if kind == "float32":
                return v.detach().contiguous().numpy()
            if kind in ("bfloat16", "float16"):
                return v.detach().float().contiguous().numpy()
            raise ValueError(
                f"load_model: tensor {name!r} has dtype torch.{kind}; model weights must be "
                "float32, bfloat16 or float16"
            )
        arr = np.asarray(v)
        if arr.dtype == np.float32:
            return arr
        if arr.dtype == np.float16:
            return arr.astype(np.float32)
        raise ValueError(
            f"load_model: tensor {name!r} has dtype {arr.dtype}; model weights must be float32, "
            "bfloat16 or float16"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._sd)

    def __len__(self) -> int:
        return len(self._sd)

    def shape(self, name: str) -> tuple:
        """Shape of tensor ``name`` (tuple of int), without converting it."""
        return tuple(int(s) for s in self._sd[name].shape)

    def where(self, name: str) -> str:
        """Where tensor ``name`` comes from (for messages)."""
        return "the state dict"

    def same_storage(self, a: str, b: str) -> bool:
        """Whether tensors ``a`` and ``b`` share memory (tied weights of a live model)."""
        x, y = self._sd[a], self._sd[b]
        if _is_tensor(x) and _is_tensor(y):
            return x.data_ptr() == y.data_ptr() and x.shape == y.shape
        return x is y


class ArraySource(Mapping):
    """float32 NumPy arrays under their names (the GGUF loader's dequantised tensors).

    Parameters
    ----------
    arrays : Mapping of str to ndarray (float32) or QuantizedMatrix
        float32 arrays, or GGUF blocks for matrices the core packs directly.
    origin : str
        Where they come from, for messages (e.g. the GGUF path).
    release : callable or None, default=None
        Called by the model builder after each layer is packed (a memory-mapped file drops the
        pages already copied from its resident set; see :meth:`release`).
    names : Mapping of str to str or None, default=None
        Array name -> the name the file gives the tensor (a GGUF's ``blk.0.attn_q.weight`` for
        ``model.layers.0.self_attn.q_proj.weight``), for messages (:meth:`name_in_file`).
    """

    def __init__(self, arrays, origin: str, release=None, names=None):
        self._a = dict(arrays)
        self._names = dict(names or {})
        self._shapes: dict = {}  # of forgotten arrays
        self.origin = origin
        self._release = release

    def release(self) -> None:
        """Let the source drop what the built layers no longer need (a no-op by default)."""
        if self._release is not None:
            self._release()

    def forget(self, names) -> None:
        """Drop the arrays of ``names`` (the model builder calls it once a layer is built, so
        arrays the source owns, such as GGUF's un-permuted q/k blocks, are freed as it goes;
        the names stay listed, with their shapes, but cannot be read again).

        Parameters
        ----------
        names : iterable of str
        """
        for name in names:
            if name in self._a:
                self._shapes[name] = self.shape(name)
                self._a[name] = None

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._a[name]
        if value is None:
            raise KeyError(f"ArraySource: {name!r} was forgotten after its layer was built")
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._a)

    def __len__(self) -> int:
        return len(self._a)

    def __contains__(self, name) -> bool:
        return name in self._a

    def shape(self, name: str) -> tuple:
        """Shape of array ``name`` (tuple of int)."""
        if name in self._shapes:
            return self._shapes[name]
        return tuple(int(s) for s in self._a[name].shape)

    def where(self, name: str) -> str:
        """Where array ``name`` comes from (for messages)."""
        return self.origin

    def name_in_file(self, name: str) -> str:
        """The name the file gives tensor ``name`` (``name`` itself when the file names it so),
        for messages."""
        return self._names.get(name, name)

    def same_storage(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are the same array (a tied head)."""
        x = self._a[a]
        return x is not None and x is self._a[b]
