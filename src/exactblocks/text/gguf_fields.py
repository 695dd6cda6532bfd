"""The ``tokenizer.*`` metadata fields of a GGUF file, each checked for its kind as it is read.

What lives here: :class:`TokenizerFields`, which :meth:`GGUFTokenizer.from_gguf
<exactblocks.text.GGUFTokenizer.from_gguf>` reads every tokenizer field through, so that a
malformed one (a count stored as a string, an id out of range, an array of the wrong length or
kind) is a ValueError naming the file, the field, what it holds and what was expected, before
anything is built. What does not: reading the file (``exactblocks.loaders.gguf``).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

__all__ = ["TokenizerFields"]

_INTS = (int, np.integer)


def _show(value) -> str:
    """A field's value for an error message: short, with its type."""
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(value).__name__
    return f"{text} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"


class TokenizerFields:
    """The metadata fields of one GGUF, each checked for its kind as it is read.

    Every accessor returns None for an absent field (or its ``default``) and raises a
    ValueError naming the file, the field, what it holds and what was expected.

    Parameters
    ----------
    reader : exactblocks.loaders.gguf.GGUFFile or gguf.GGUFReader
        The open file.
    where : str
        ``"Class.method"`` for the messages.

    Attributes
    ----------
    where : str
        ``where`` and the file's path, the prefix of every message.
    """

    def __init__(self, reader, where: str):
        from exactblocks.loaders.gguf import gguf_field

        path = getattr(reader, "path", None) or getattr(
            getattr(reader, "data", None), "filename", None
        )
        self._reader, self._field = reader, gguf_field
        self.where = f"{where}: {os.fspath(path)!r}" if path else where

    def _get(self, key: str, default=None):
        try:
            value = self._field(self._reader, key, default)
        except UnicodeDecodeError as exc:  # (gguf.GGUFReader decodes strictly)
            self._not_utf8(key, exc.start)
        except ValueError as exc:  # a nested array
            raise ValueError(f"{self.where}: {exc}") from None
        bad = getattr(self._reader, "invalid_utf8", {}).get(key)  # (GGUFFile: recorded)
        if bad is not None:
            self._not_utf8(key, bad)
        return value

    def _not_utf8(self, key: str, offset: int):
        raise ValueError(
            f"{self.where}: {key} is not valid UTF-8 (an invalid byte at offset {offset} of "
            "the string); expected UTF-8 text"
        )

    def _fail(self, key: str, value, expected: str):
        raise ValueError(f"{self.where}: {key} is {_show(value)}; expected {expected}")

    def string(self, key: str) -> str | None:
        """A string field, or None when absent.

        Parameters
        ----------
        key : str
            The field, e.g. ``"tokenizer.ggml.eos_token_id"``.

        Returns
        -------
        str or None

        Raises
        ------
        ValueError
            The field holds another kind of value, or bytes that are not UTF-8 (the message
            names file and field).
        """
        value = self._get(key)
        if value is not None and not isinstance(value, str):
            self._fail(key, value, "a string")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """A bool field, ``default`` when absent.

        Parameters
        ----------
        key : str
            The field, e.g. ``"tokenizer.ggml.eos_token_id"``.
        default : bool

        Returns
        -------
        bool

        Raises
        ------
        ValueError
            The field holds another kind of value (the message names file and field).
        """
        value = self._get(key, default)
        if not isinstance(value, bool):
            self._fail(key, value, "a bool")
        return value

    def token_id(self, key: str, n: int) -> int | None:
        """A token id field in ``[0, n)``, or None when absent.

        Parameters
        ----------
        key : str
            The field, e.g. ``"tokenizer.ggml.eos_token_id"``.
        n : int
            The vocabulary size.

        Returns
        -------
        int or None

        Raises
        ------
        ValueError
            The field holds another kind of value (the message names file and field).
        """
        value = self._get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, _INTS) or not 0 <= value < n
        ):
            self._fail(key, value, f"an integer token id in [0, {n})")
        return value

    def special_ids(self, n: int) -> dict:
        """``bos/eos/unk/pad_token_id`` keyword arguments from their GGUF fields.

        Parameters
        ----------
        n : int
            The vocabulary size.

        Returns
        -------
        dict of str to int or None
        """
        return {
            f"{name}_token_id": self.token_id(f"tokenizer.ggml.{key}_token_id", n)
            for name, key in (
                ("bos", "bos"),
                ("eos", "eos"),
                ("unk", "unknown"),
                ("pad", "padding"),
            )
        }

    def _array(self, key: str, value, kinds: frozenset, what: str, n: int | None):
        if not isinstance(value, list):
            self._fail(key, value, f"an array of {what}")
        if not set(map(type, value)) <= kinds:  # (one C pass over 10^5 entries)
            bad = next(i for i, v in enumerate(value) if type(v) not in kinds)
            raise ValueError(
                f"{self.where}: {key}[{bad}] is {_show(value[bad])}; expected an array of {what}"
            )
        if n is not None and len(value) != n:
            raise ValueError(
                f"{self.where}: {key} has {len(value)} entries; expected one per token ({n})"
            )
        return value

    def strings(self, key: str, *, required: bool = False) -> list | None:
        """An array of strings, or None when absent.

        Parameters
        ----------
        key : str
            The field, e.g. ``"tokenizer.ggml.eos_token_id"``.
        required : bool, default=False
            Absent or empty is an error.

        Returns
        -------
        list of str or None

        Raises
        ------
        ValueError
            The field holds another kind of value (the message names file and field).
        """
        value = self._get(key)
        if value is None:
            if required:
                raise ValueError(f"{self.where}: the file has no {key}")
            return None
        value = self._array(key, value, frozenset({str}), "strings", None)
        if required and not value:
            raise ValueError(f"{self.where}: {key} is empty; expected at least one token")
        return value

    def ints(self, key: str, n: int) -> list | None:
        """An array of ``n`` integers (one per token), or None when absent.

        Parameters
        ----------
        key : str
            The field, e.g. ``"tokenizer.ggml.eos_token_id"``.
        n : int

        Returns
        -------
        list of int or None

        Raises
        ------
        ValueError
            The field holds another kind of value (the message names file and field).
        """
        value = self._get(key)
        return None if value is None else self._array(key, value, frozenset({int}), "integers", n)

    def floats(self, key: str, n: int) -> list | None:
        """An array of ``n`` numbers (one per token), or None when absent.

        Parameters
        ----------
        key : str
            The field, e.g. ``"tokenizer.ggml.scores"``.
        n : int

        Returns
        -------
        list of float or None

        Raises
        ------
        ValueError
            The field holds another kind of value (the message names file and field).
        """
        value = self._get(key)
        return (
            None
            if value is None
            else self._array(key, value, frozenset({int, float}), "numbers", n)
        )

    @contextlib.contextmanager
    def naming_fields(self):
        """Prefix a constructor's ValueError with the file and its fields' GGUF names.

        Yields
        ------
        None
        """
        try:
            yield
        except ValueError as exc:
            detail = str(exc).split(": ", 1)[-1]  # after "GGUFTokenizer.<method>: "
            if detail.startswith(("merges[", "scores[")):
                detail = "tokenizer.ggml." + detail
            raise ValueError(f"{self.where}: {detail}") from None
