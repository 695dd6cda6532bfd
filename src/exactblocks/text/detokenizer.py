"""The text of a growing list of new token ids, for streaming: the detokenizer.

What lives here: :class:`Detokenizer` (the text of the ids generated so far, released piece by
piece once it is final, cut before stop strings). :meth:`exactblocks.Model.generate`, the
serving engine (``exactblocks.serve``) and ``exactblocks.ray.Generate`` all use it, so the same
tokens give the same text everywhere. What does not: the tokenizers it decodes with
(:mod:`exactblocks.text`).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Detokenizer"]


class Detokenizer:
    """The text of a growing list of new token ids, released only once it is final.

    Parameters
    ----------
    tokenizer : object
        Anything with ``decode(list of int) -> str`` (``Model.tokenizer``).
    stop_strings : sequence of str, default=()
        The text ends before the first occurrence of any of them.

    Attributes
    ----------
    ids : list of int
        The ids pushed so far.
    text : str
        The final text so far (cut before a stop string once one appeared).
    stopped : bool
        True once a stop string appeared; push no more ids then.
    decoded_len : int
        Characters of the last whole decode of :attr:`ids` that ended on a complete
        character (before any stop-string cut).
    released : int
        Characters of :attr:`text` returned so far by :meth:`push` and :meth:`finish`.

    Raises
    ------
    TypeError
        A stop string that is not a str.
    ValueError
        An empty stop string.

    Notes
    -----
    The whole id list is decoded at each token, which is exact for every tokenizer whatever
    its decoder's context rules (a leading-space strip, byte fallback). Text ending in U+FFFD
    (an incomplete UTF-8 character) waits for the next token; the last
    ``len(longest stop string) - 1`` characters wait until they cannot start a stop string.
    So the pieces returned by :meth:`push` and :meth:`finish`, joined, equal :attr:`text`.

    Examples
    --------
    >>> class Letters:
    ...     def decode(self, ids):
    ...         return "".join(chr(ord("a") + i) for i in ids)
    >>> d = Detokenizer(Letters(), ["cd"])
    >>> [d.push(t) for t in (0, 1, 2)]  # each letter waits a token: it could start "cd"
    ['', 'a', 'b']
    >>> d.push(3), d.stopped, d.text
    ('', True, 'ab')
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        stops = list(stop_strings)
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"Detokenizer: a stop string must be a str; got {type(s).__name__}")
            if not s:
                raise ValueError("Detokenizer: a stop string is empty")
        self._tok = tokenizer
        self._stop = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.decoded_len = 0
        self._sent = 0

    @property
    def released(self) -> int:
        """int: Characters of :attr:`text` returned so far."""
        return self._sent

    def _cut(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)

    def push(self, token: int) -> str:
        """Append ``token``; return the text it releases (may be empty).

        Parameters
        ----------
        token : int
            The next new id.

        Returns
        -------
        str
            New final text: empty while a character is incomplete or the tail could still
            start a stop string; when a stop string appears, everything before it not yet
            returned, and :attr:`stopped` becomes True.
        """
        self.ids.append(token)
        text = self._tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        self.decoded_len = len(text)
        cut = self._cut(text)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        self.text = text
        end = len(text) if self.stopped else max(self._sent, len(text) - self._hold)
        piece = text[self._sent : end]
        self._sent = end
        return piece

    def finish(self) -> str:
        """End the text; return what was held back (an incomplete tail decodes as it is).

        Returns
        -------
        str
            The rest of :attr:`text` not yet returned (cut before a stop string).
        """
        if not self.stopped:
            self.text = self._tok.decode(self.ids)
            cut = self._cut(self.text)
            if cut >= 0:
                self.text = self.text[:cut]
        piece = self.text[self._sent :] if len(self.text) > self._sent else ""
        self._sent = max(self._sent, len(self.text))
        return piece
