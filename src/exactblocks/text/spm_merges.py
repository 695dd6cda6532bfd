"""The merges of a SentencePiece-style vocabulary, derived as transformers derives them.

What lives here: :func:`spm_merges` (vectorised with NumPy: hashed prefixes, every hit checked
on the strings) and :func:`spm_merges_ref`, its plain-Python twin, which
tests/unit/test_spm_merges.py holds it to. What does not: the tokenizer they feed
(:mod:`exactblocks.text.gguf_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["spm_merges", "spm_merges_ref"]

# Polynomial string hash of spm_merges: h(s) = sum_j (ord(s[j]) + 1) * BASE**j mod 2**64 (the
# FNV-1 64-bit prime as BASE; any odd BASE works, only the speed depends on it: every hit is
# checked on the strings themselves). MIX spreads a hash over the table (Fibonacci hashing:
# Knuth, TAOCP vol. 3, 6.4).
_HASH_BASE = 0x100000001B3
_HASH_MIX = 0x9E3779B97F4A7C15
_HASH_CHUNK = 1 << 13  # tokens split per pass (bounds the temporary arrays to about 1 MB)


def _prefix_hashes(strs: Sequence[str], base: int):
    """For each string, its length and the hash of every prefix (one flat uint64 array).

    Returns ``(lengths int64 (n,), starts int64 (n + 1,), prefix uint64 (sum(lengths),))``:
    ``prefix[starts[i] + j]`` is h(strs[i][: j + 1]) (code points, as Python slices count).
    """
    n = len(strs)
    lengths = np.fromiter(map(len, strs), dtype=np.int64, count=n)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    chars = np.frombuffer("".join(strs).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    width = int(lengths.max(initial=0))
    powers = np.ones(max(width, 1), dtype=np.uint64)
    for j in range(1, width):
        powers[j] = int(powers[j - 1]) * base % 2**64
    owner = np.repeat(np.arange(n), lengths)
    within = np.arange(len(chars)) - starts[owner]
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64
        running = np.cumsum((chars.astype(np.uint64) + np.uint64(1)) * powers[within])
        before = np.concatenate((np.zeros(1, np.uint64), running))[starts[:-1]]
        prefix = running - before[owner]
    return lengths, starts, prefix


def _token_hashes(strs: Sequence[str], base: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths int64, hashes uint64)`` of whole strings, in chunks of :data:`_HASH_CHUNK`."""
    lengths, hashes = [], []
    for c in range(0, len(strs), _HASH_CHUNK):
        n_c, starts, prefix = _prefix_hashes(strs[c : c + _HASH_CHUNK], base)
        h = np.zeros(len(n_c), dtype=np.uint64)
        some = n_c > 0
        h[some] = prefix[starts[1:][some] - 1]
        lengths.append(n_c)
        hashes.append(h)
    if not lengths:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    return np.concatenate(lengths), np.concatenate(hashes)


class _HashIndex:
    """Exact-match table uint64 hash -> position (open addressing, linear probing, NumPy).

    ``None`` from :meth:`build` when two keys share a hash (the caller then takes the slow path).
    """

    def __init__(self, table, keys, bits):
        self.table, self.keys, self.bits = table, keys, bits

    @staticmethod
    def _home(hashes, bits):
        with np.errstate(over="ignore"):
            return ((hashes * np.uint64(_HASH_MIX)) >> np.uint64(64 - bits)).astype(np.int64)

    @classmethod
    def build(cls, keys: np.ndarray) -> _HashIndex | None:
        ordered = np.sort(keys)
        if (ordered[1:] == ordered[:-1]).any():
            return None
        del ordered
        bits = max((4 * len(keys) - 1).bit_length(), 4)  # load factor <= 1/4
        size = 1 << bits
        table = np.full(size, -1, dtype=np.int32)
        home = cls._home(keys, bits)
        pending = np.arange(len(keys))
        step = 0
        while pending.size:  # each pass places one key in every free slot it reaches
            slots = (home[pending] + step) & (size - 1)
            free = table[slots] < 0
            slots, cand = slots[free], pending[free]
            slots, first = np.unique(slots, return_index=True)
            table[slots] = cand[first]
            placed = np.zeros(len(keys), dtype=bool)
            placed[cand[first]] = True
            pending = pending[~placed[pending]]
            step += 1
        return cls(table, keys, bits)

    def find(self, queries: np.ndarray) -> np.ndarray:
        """Position of each query's hash among the keys, -1 where absent (int64)."""
        size = 1 << self.bits
        out = np.full(len(queries), -1, dtype=np.int64)
        active = np.arange(len(queries))
        home = self._home(queries, self.bits)
        step = 0
        while active.size:
            idx = self.table[(home[active] + step) & (size - 1)]
            match = idx >= 0
            done = ~match
            match[match] = self.keys[idx[match]] == queries[active[match]]
            out[active[match]] = idx[match]
            active = active[~(done | match)]
            step += 1
        return out


def spm_merges(
    vocab: Mapping[str, int], priority: Mapping[str, float] | None, *, base: int = _HASH_BASE
) -> list:
    """The merges transformers' ``generate_merges(vocab, priority)`` derives from a vocabulary.

    Every split ``(token[:k], token[k:])`` of a token of ``priority`` whose two parts are in
    ``vocab``, ordered by the token's priority descending, then ``len(left)`` descending, then
    ``len(right)`` descending, ties in ``priority``'s order (a stable sort). ``priority=None``
    means the vocabulary's own order is the priority order (Gemma: minus the token id, no
    repeated token); then, as when the priorities descend strictly, the splits come out sorted
    and no sort runs. Equal to :func:`spm_merges_ref` (tests/unit/test_spm_merges.py).

    Vectorised with NumPy: every prefix of every token is hashed at once (a polynomial hash
    modulo 2**64, ``base``), each split's two parts are looked up by hash in a table of the
    vocabulary, and each hit is then checked on the strings (``token.startswith(left)`` and
    ``token.endswith(right)`` with ``len(left) + len(right) == len(token)``), so a hash
    collision can drop nothing and add nothing; two vocabulary strings of one hash send the
    whole derivation to :func:`spm_merges_ref`. The pairs returned are the vocabulary's own
    string objects (no new strings: about 100 MB less at the peak for Gemma 3's 514906 merges).
    Tokens are split :data:`_HASH_CHUNK` at a time, so the temporary arrays stay small.

    Parameters
    ----------
    vocab : mapping of str to int
        The vocabulary (as spelled for the BPE model).
    priority : mapping of str to float or None
        Each token's merge priority, highest first; None = the vocabulary's own order.
    base : int, default=0x100000001B3
        The odd multiplier of the string hash (only the speed depends on it).

    Returns
    -------
    list of tuple of (str, str)
        The merges, highest priority first.
    """
    keys = list(vocab)
    split_keys = keys if priority is None else list(priority)
    lengths, hashes = _token_hashes(keys, base)
    index = _HashIndex.build(hashes)
    if index is None:
        return spm_merges_ref(vocab, priority)
    inv = pow(base, -1, 2**64)
    width = int(lengths.max(initial=0)) + 1
    inv_powers = np.ones(width, dtype=np.uint64)
    for j in range(1, width):
        inv_powers[j] = int(inv_powers[j - 1]) * inv % 2**64
    parts = []  # per chunk: (token, k, left, right) as positions in split_keys / keys
    for c in range(0, len(split_keys), _HASH_CHUNK):
        n_c, starts, prefix = _prefix_hashes(split_keys[c : c + _HASH_CHUNK], base)
        # the splits of token i after k = L_i - 1, ..., 1 code points (k descending)
        splits = np.maximum(n_c - 1, 0)
        tok = np.repeat(np.arange(len(n_c)), splits)
        first = np.zeros(len(n_c) + 1, dtype=np.int64)
        np.cumsum(splits, out=first[1:])
        k = n_c[tok] - 1 - (np.arange(len(tok)) - first[tok])
        whole = np.zeros(len(n_c), dtype=np.uint64)
        some = n_c > 0
        whole[some] = prefix[starts[1:][some] - 1]
        with np.errstate(over="ignore"):
            left_h = prefix[starts[tok] + k - 1]
            right_h = (whole[tok] - left_h) * inv_powers[k]  # h(token[k:])
        left = index.find(left_h)
        hit = np.flatnonzero(left >= 0)
        hit = hit[lengths[left[hit]] == k[hit]]
        right = index.find(right_h[hit])
        ok = right >= 0
        hit, right = hit[ok], right[ok]
        ok = lengths[right] == n_c[tok[hit]] - k[hit]
        hit, right = hit[ok], right[ok]
        parts.append((tok[hit] + c, k[hit], left[hit], right))
    tok, k, left, right = (
        (np.concatenate(a) for a in zip(*parts)) if parts else [np.zeros(0, int)] * 4
    )
    if priority is not None:
        p = np.fromiter(priority.values(), dtype=np.float64, count=len(split_keys))
        if not (p[:-1] > p[1:]).all():  # generate_merges' stable sort
            split_len = np.fromiter(map(len, split_keys), dtype=np.int64, count=len(split_keys))
            order = np.lexsort((k - split_len[tok], -k, -p[tok]))
            tok, left, right = tok[order], left[order], right[order]
    # the strings through object arrays: no Python int per pair (3 x 16 MB for Gemma 3)
    keys_arr = np.empty(len(keys), dtype=object)
    keys_arr[:] = keys
    split_arr = keys_arr if split_keys is keys else np.empty(len(split_keys), dtype=object)
    if split_arr is not keys_arr:
        split_arr[:] = split_keys
    lefts, rights = keys_arr[left].tolist(), keys_arr[right].tolist()
    tokens = split_arr[tok].tolist()
    del keys_arr, split_arr
    exact = np.fromiter(map(str.startswith, tokens, lefts), dtype=bool, count=len(tokens))
    exact &= np.fromiter(map(str.endswith, tokens, rights), dtype=bool, count=len(tokens))
    del tokens
    if not exact.all():  # a hash collision: keep only the true splits
        keep = np.flatnonzero(exact).tolist()
        lefts, rights = [lefts[i] for i in keep], [rights[i] for i in keep]
    return list(zip(lefts, rights))


def spm_merges_ref(vocab: Mapping[str, int], priority: Mapping[str, float] | None) -> list:
    """The merges transformers' ``generate_merges(vocab, priority)`` derives from a vocabulary
    (the plain-Python twin of :func:`spm_merges`, kept as its reference in the tests).

    Every split ``(token[:k], token[k:])`` of a token of ``priority`` whose two parts are in
    ``vocab``, ordered by the token's priority descending, then ``len(left)`` descending, then
    ``len(right)`` descending, ties in ``priority``'s order (a stable sort). ``priority=None``
    means the vocabulary's own order is the priority order (Gemma: minus the token id, no
    repeated token); then, as when the priorities descend strictly, the splits come out sorted
    and no sort runs.

    Parameters
    ----------
    vocab : mapping of str to int
        The vocabulary (as spelled for the BPE model).
    priority : mapping of str to float or None
        Each token's merge priority, highest first; None = the vocabulary's own order.

    Returns
    -------
    list of tuple of (str, str)
        The merges, highest priority first.
    """
    values = list(priority.values()) if priority is not None else []
    if priority is None or all(a > b for a, b in zip(values, values[1:])):
        return [
            (left, right)
            for tok in (vocab if priority is None else priority)
            for k in range(len(tok) - 1, 0, -1)
            if (left := tok[:k]) in vocab and (right := tok[k:]) in vocab
        ]
    found = [
        (left, right, p)
        for tok, p in priority.items()
        for k in range(len(tok) - 1, 0, -1)
        if (left := tok[:k]) in vocab and (right := tok[k:]) in vocab
    ]
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [(left, right) for left, right, _ in found]
