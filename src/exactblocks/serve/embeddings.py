"""The ``/v1/embeddings`` route and :func:`pooled_embeddings` (re-exported by
``exactblocks.serve.api``).

What lives here: :func:`add_routes` (inputs to token ids, checked; the pooled final hidden
states as floats or base64) and :func:`pooled_embeddings` (``Model.hidden_states``, pooled;
batch-invariant). What does not: the body checks and the tokenizer threads
(``exactblocks.serve.handling``), the app (``exactblocks.serve.api``).
"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import numpy as np
from fastapi import FastAPI, Request

from .handling import _encode
from .protocol import APIError, EmbeddingRequest, check_token_ids

__all__ = ["add_routes", "pooled_embeddings"]

#: Most inputs of one ``/v1/embeddings`` request.
MAX_EMBEDDING_INPUTS = 256
#: Inputs run together in one ``Model.hidden_states`` call (the bits do not depend on it).
EMBEDDING_BATCH = 8


def add_routes(app: FastAPI, h: SimpleNamespace, model_name: str) -> None:
    """Add ``/v1/embeddings`` to ``app``, with the helpers ``h`` of
    :func:`exactblocks.serve.handling.shared`."""
    engine, model, tok = h.engine, h.model, h.tok
    parse, off_loop, refuse_if_too_long = h.parse, h.off_loop, h.refuse_if_too_long

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse(request, EmbeddingRequest)
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise APIError(400, "the input is empty", param="input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(
                400,
                f"{len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
                param="input",
            )
        cap = engine.max_tokens_per_sequence
        id_lists = []
        for i, item in enumerate(inputs):
            where = "input" if len(inputs) == 1 else f"input.{i}"
            if isinstance(item, str):
                if tok is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", param=where)
                await refuse_if_too_long(len(item.encode("utf-8")), where)
                ids = await off_loop(_encode, tok, item)
            else:
                ids = list(item)
            if not ids:
                raise APIError(400, f"the {where.replace('.', ' ')} is empty", param=where)
            if len(ids) > cap:
                raise APIError(
                    400,
                    f"the {where.replace('.', ' ')} has {len(ids)} tokens; this server embeds "
                    f"at most {cap}",
                    param=where,
                    code="context_length_exceeded",
                )
            check_token_ids(ids, model.vocab_size, where)
            id_lists.append(ids)
        try:
            vectors = await asyncio.to_thread(pooled_embeddings, model, id_lists, body.pooling)
        except Exception as exc:  # non-finite activations, memory
            raise APIError(500, f"{type(exc).__name__}: {exc}", type="server_error") from None
        data = []
        for i, vec in enumerate(vectors):
            if body.encoding_format == "base64":
                emb = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
            else:
                emb = vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n_tokens = sum(len(ids) for ids in id_lists)
        return {
            "object": "list",
            "data": data,
            "model": model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }


def pooled_embeddings(model, id_lists: list, pooling: str = "last") -> list:
    """One embedding per token-id list: the final hidden states (after the final norm), pooled.

    Parameters
    ----------
    model : exactblocks.Model
    id_lists : list of list of int
        Non-empty, within the model's positions.
    pooling : {"last", "mean"}, default="last"
        ``"last"``: the state of the last token. ``"mean"``: the mean over the tokens, summed
        position by position in float64 and rounded once to float32.

    Returns
    -------
    list of ndarray of shape (d_model,), float32
        Each the bits of its list run alone (``Model.hidden_states`` is batch-invariant and
        the pooling reads only the list's own positions).
    """
    if pooling not in ("last", "mean"):
        raise ValueError(f"pooling={pooling!r}; expected 'last' or 'mean'")
    out = []
    for start in range(0, len(id_lists), EMBEDDING_BATCH):
        group = id_lists[start : start + EMBEDDING_BATCH]
        lens = np.array([len(ids) for ids in group], np.int64)
        ids = np.zeros((len(group), int(lens.max())), np.int64)
        for r, row in enumerate(group):
            ids[r, : len(row)] = row
        hidden = model.hidden_states(ids, lengths=lens)
        for r, n in enumerate(lens.tolist()):
            if pooling == "last":
                out.append(hidden[r, n - 1].copy())
            else:
                acc = np.zeros(hidden.shape[2], np.float64)
                for t in range(n):  # one fixed order: position by position
                    acc += hidden[r, t]
                out.append((acc / n).astype(np.float32))
    return out
