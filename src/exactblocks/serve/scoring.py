"""The engine's prompt-logprobs (scoring) step: the logits of every prompt position, scored.

What lives here: :func:`forward_scored` (a step with prompt chunks whose logprobs are asked
for), :func:`score_prompt` (a chunk's logits to the logprobs of the prompt tokens they
predict), :func:`restore_scores` (the scores of a prefix restored from the prefix cache) and
:func:`prompt_view` (the request's own number of alternatives). What does not: which rows run
in a step and the byte budget of their logits (``exactblocks.serve.engine``). NumPy only.
"""

from __future__ import annotations

import numpy as np

from exactblocks.sampling import logprobs

# PROMPT_TOP: alternatives kept per prompt position (the most a request asks for), what the
# prefix cache stores, so any request's top k is their first k
from .prefix_cache import PROMPT_TOP
from .request import _Seq

__all__ = ["forward_scored", "prompt_view", "restore_scores", "score_prompt"]


def prompt_view(seq: _Seq) -> list:
    """The prompt's (logprob, top) with the request's own number of alternatives (the
    engine keeps the top 20: the first k of them are the top k, same bits)."""
    k = seq.prompt_top
    return [(lp, None if top is None or k == 0 else top[:k]) for lp, top in seq.prompt_lps]


def restore_scores(seq: _Seq, entry) -> None:
    """The logprobs of the prompt tokens a restored prefix predicts: each entry's stored
    ones, and the token after each entry from the entry's last logits."""
    for e in entry.chain():
        seq.prompt_lps += e.scores
        if e.end < len(seq.ids):
            lp, top = logprobs(e.logits, int(seq.ids[e.end]), PROMPT_TOP)
            seq.prompt_lps.append((float(lp), [(i, float(v)) for i, v in top]))


def forward_scored(model, state, ids: np.ndarray, lens: np.ndarray, scored: list, budget: int):
    """A step with prompt chunks whose logprobs are asked for: the other rows run with
    ``logits="last"``, the scored rows then with ``logits="all"`` (a row of length 0 is
    untouched by a call, so each row still advances once). The scored rows carry at most
    ``budget`` bytes of logits in all (the engine's ``SCORED_LOGITS_BYTES``; a row cut short
    continues next step).

    Returns (the lengths run, the all-position logits, each row's last logits)."""
    B, vocab = len(lens), model.vocab_size
    room = max(1, budget // (4 * vocab))
    mine = np.zeros_like(lens)
    for r in scored:
        mine[r] = min(int(lens[r]), room)
        room -= int(mine[r])
    others = lens.copy()
    others[scored] = 0
    last = np.zeros((B, vocab), np.float32)
    if others.any():
        last = model.forward(ids, state, lengths=others, logits="last")
    width = int(mine.max())
    every = model.forward(ids[:, :width], state, lengths=mine, logits="all")
    rows = np.flatnonzero(mine)
    last[rows] = every[rows, mine[rows] - 1]
    return others + mine, every, last


def score_prompt(seq: _Seq, chunk_logits: np.ndarray) -> None:
    """Append the logprobs of the prompt tokens the chunk's positions predict."""
    ids = seq.ids
    for t in range(len(chunk_logits)):
        nxt = seq.pos + t + 1
        if nxt >= len(ids):
            break  # the last position predicts the first new token
        lp, top = logprobs(chunk_logits[t], int(ids[nxt]), PROMPT_TOP)
        seq.prompt_lps.append((float(lp), [(i, float(v)) for i, v in top]))
