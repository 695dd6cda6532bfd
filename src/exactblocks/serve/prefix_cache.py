"""Exact prefix caching: a row's per-layer state saved at token boundaries, restored bit for bit.

What lives here: :class:`PrefixCache` (entries keyed by the token ids up to a boundary, LRU
eviction under a byte budget) and the two functions that move one row of a
:class:`exactblocks.ModelState` in and out of an entry, written on the state's public arrays
(the models API has no row copy). What does not: when to save or look up (the engine).

Why a restore is exact: the blocks' outputs depend only on a row's own state and tokens
(SPEC.md 3.1), and an entry holds that state's bits. A Transformer layer without a window
stores, per entry, only the KV slots of its own tokens ``[start, end)`` and points to its
parent entry (the previous boundary of the same prefix): a chain of entries rebuilds the
cache, as a radix tree of KV blocks does. A layer whose state is not a plain prefix of slots
(a Mamba-2 layer: conv window and SSM state; a sliding-window layer: a ring) stores its whole
row state at every boundary, so only the chain's last entry is read for it. Each entry also
keeps the float32 logits of its last token, so a prompt cached whole needs no forward at all,
and, once a request asking for prompt logprobs passed it, those of its tokens (``scores``).

Eviction never breaks a chain: a hit or an insert touches the entry and then its ancestors,
so an ancestor is always more recent than any descendant and the LRU end is always a leaf.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrefixCache", "PrefixEntry", "clear_row", "restore_row", "snapshot_row"]

#: Alternatives per prompt position in :attr:`PrefixEntry.scores`.
PROMPT_TOP = 20


def _incremental(layer) -> bool:
    """True for a KV cache whose slot p holds position p (no window): saved by pieces."""
    return hasattr(layer, "k_cache") and int(layer.window) == 0


@dataclass(eq=False)
class PrefixEntry:
    """One saved boundary: the state of a row after ``end`` tokens of a prefix.

    Attributes
    ----------
    key : bytes
        The int64 token ids ``[0, end)`` as bytes.
    start, end : int
        This entry's own tokens are ``[start, end)``; ``start`` is the parent's ``end`` (0
        without a parent).
    parent : PrefixEntry or None
    layers : list of tuple of ndarray
        Per layer: ``(k, v)`` slots ``[start, end)`` of an incremental KV cache, ``(k, v)`` of
        the whole ring of a windowed one, or ``(conv_window, h)`` of a Mamba-2 layer.
    logits : ndarray of shape (vocab_size,), float32
        The logits at position ``end - 1``.
    nbytes : int
    evicted : bool
        Set when the cache drops it; a chain through it may no longer be extended.
    scores : list or None
        Prompt logprobs of the tokens ``start + 1 .. end - 1`` (each ``(logprob, top 20)``),
        when a request that asked for them saved or passed this entry; the token at ``end``
        is scored from ``logits``.
    """

    key: bytes
    start: int
    end: int
    parent: PrefixEntry | None
    layers: list
    logits: np.ndarray
    nbytes: int = 0
    evicted: bool = False
    scores: list | None = None
    children: int = field(default=0, repr=False)

    def chain(self) -> list[PrefixEntry]:
        """This entry and its ancestors, root first."""
        out, e = [], self
        while e is not None:
            out.append(e)
            e = e.parent
        return out[::-1]


def snapshot_row(state, row: int, start: int, end: int) -> list:
    """Copy what an entry ``[start, end)`` of ``row`` needs from every layer of ``state``.

    Parameters
    ----------
    state : exactblocks.ModelState
    row : int
    start, end : int
        Token range of the new entry; the row must hold exactly ``end`` tokens.

    Returns
    -------
    list of tuple of ndarray
        Fresh copies, one tuple per layer (see :class:`PrefixEntry`).
    """
    out = []
    for layer in state.layers:
        if _incremental(layer):
            out.append(
                (layer.k_cache[row, :, start:end].copy(), layer.v_cache[row, :, start:end].copy())
            )
        elif hasattr(layer, "k_cache"):
            n = min(end, int(layer.capacity))
            out.append((layer.k_cache[row, :, :n].copy(), layer.v_cache[row, :, :n].copy()))
        else:
            out.append((layer.conv_window[row].copy(), layer.h[row].copy()))
    return out


def restore_row(state, row: int, entry: PrefixEntry) -> None:
    """Write ``entry``'s prefix into ``row`` of ``state``, which then holds ``entry.end`` tokens.

    Parameters
    ----------
    state : exactblocks.ModelState
    row : int
        A free row (its previous content is overwritten where the prefix reads it).
    entry : PrefixEntry
    """
    chain = entry.chain()
    for i, layer in enumerate(state.layers):
        if _incremental(layer):
            for e in chain:
                k, v = e.layers[i]
                layer.k_cache[row, :, e.start : e.end] = k
                layer.v_cache[row, :, e.start : e.end] = v
        elif hasattr(layer, "k_cache"):
            k, v = entry.layers[i]
            layer.k_cache[row, :, : k.shape[1]] = k
            layer.v_cache[row, :, : v.shape[1]] = v
        else:
            conv, h = entry.layers[i]
            layer.conv_window[row] = conv
            layer.h[row] = h
        layer.row_tokens[row] = entry.end


def clear_row(state, row: int) -> None:
    """Free ``row`` for a new sequence in O(1) for KV caches.

    A KV cache row only needs ``row_tokens = 0``: a new sequence writes every slot before it
    reads it (SPEC.md 5 reading rule), so stale slots are never read. A Mamba-2 row's conv
    window and SSM state are read from the first token, so they are zeroed (a fresh state).
    ``ModelState.reset`` would zero whole KV rows (tens of MB per request).
    """
    for layer in state.layers:
        if not hasattr(layer, "k_cache"):
            layer.conv_window[row] = 0.0
            layer.h[row] = 0.0
        layer.row_tokens[row] = 0


class PrefixCache:
    """Saved prefixes keyed by their token ids, with LRU eviction under a byte budget.

    Parameters
    ----------
    max_bytes : int
        Budget of all entries' arrays; 0 disables the cache.

    Attributes
    ----------
    nbytes : int
        Bytes held now.
    hits, misses, evictions : int
        Lookups that found a prefix / found none; entries dropped.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._lengths: dict[int, int] = {}  # boundary length -> entries of that length
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """A snapshot of the entries' keys (int64 token ids as bytes), least recent first."""
        for _ in range(3):  # another thread may insert meanwhile: take the snapshot again
            try:
                return list(self._entries)
            except RuntimeError:
                continue
        return []

    def _touch(self, entry: PrefixEntry) -> None:
        for e in reversed(entry.chain()):  # leaf first, so ancestors end up more recent
            if not e.evicted:
                self._entries.move_to_end(e.key)

    def lookup(self, ids: np.ndarray, scored: bool = False) -> PrefixEntry | None:
        """The entry of the longest saved prefix of ``ids`` (it may be all of ``ids``).

        Parameters
        ----------
        ids : ndarray of int64
            The prompt.
        scored : bool, default=False
            Only a prefix whose every entry holds ``scores`` (for prompt logprobs).

        Returns
        -------
        PrefixEntry or None
        """
        if self.max_bytes <= 0:
            return None
        for n in sorted(self._lengths, reverse=True):
            if n > len(ids):
                continue
            entry = self._entries.get(ids[:n].tobytes())
            if entry is not None and scored and any(e.scores is None for e in entry.chain()):
                entry = None
            if entry is not None:
                self._touch(entry)
                self.hits += 1
                return entry
        self.misses += 1
        return None

    def get(self, ids: np.ndarray) -> PrefixEntry | None:
        """The entry saved for exactly ``ids``, or None (no statistics)."""
        entry = self._entries.get(ids.tobytes())
        if entry is not None:
            self._touch(entry)
        return entry

    def insert(self, ids: np.ndarray, parent: PrefixEntry | None, layers: list, logits):
        """Save a boundary; return its entry, or None when it cannot be kept.

        Parameters
        ----------
        ids : ndarray of int64
            The prefix ``[0, end)``.
        parent : PrefixEntry or None
            The entry of the previous boundary of this prefix (its ``end`` is this entry's
            ``start``); None starts at 0.
        layers : list
            From :func:`snapshot_row`.
        logits : ndarray of shape (vocab_size,), float32
            The logits at ``end - 1`` (copied).

        Returns
        -------
        PrefixEntry or None
            None when the cache is disabled, the parent was evicted meanwhile, or the entry
            alone exceeds the budget.
        """
        if self.max_bytes <= 0 or (parent is not None and parent.evicted):
            return None
        key = ids.tobytes()
        old = self._entries.get(key)
        if old is not None:
            self._touch(old)
            return old
        logits = np.array(logits, dtype=np.float32, copy=True)
        nbytes = logits.nbytes + sum(a.nbytes for t in layers for a in t)
        if nbytes > self.max_bytes:
            return None
        start = 0 if parent is None else parent.end
        entry = PrefixEntry(key, start, len(ids), parent, layers, logits, nbytes)
        self._entries[key] = entry
        self._lengths[entry.end] = self._lengths.get(entry.end, 0) + 1
        self.nbytes += nbytes
        if parent is not None:
            parent.children += 1
        self._touch(entry)
        while self.nbytes > self.max_bytes:
            self._evict_one()
        return None if entry.evicted else entry

    def add_scores(self, entry: PrefixEntry, scores: list) -> None:
        """Attach prompt logprobs to ``entry`` (see :attr:`PrefixEntry.scores`), counting
        about their size against the budget (evicted by the next inserts if over)."""
        if entry.evicted or entry.scores is not None:
            return
        entry.scores = list(scores)
        extra = 64 + 48 * PROMPT_TOP * len(entry.scores)  # tuples of Python floats, roughly
        entry.nbytes += extra
        self.nbytes += extra

    def _evict_one(self) -> None:
        key, entry = self._entries.popitem(last=False)
        entry.evicted = True
        self.nbytes -= entry.nbytes
        self.evictions += 1
        n = self._lengths[entry.end] - 1
        if n:
            self._lengths[entry.end] = n
        else:
            del self._lengths[entry.end]
        if entry.parent is not None:
            entry.parent.children -= 1

    def clear(self) -> None:
        """Drop every entry."""
        while self._entries:
            self._evict_one()
