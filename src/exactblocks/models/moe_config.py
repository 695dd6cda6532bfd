"""The mixture-of-experts config fields the MoE families read alike (HF transformers 5.23).

What lives here: :func:`moe_fields`, the :class:`~exactblocks.models._decoder.DecoderSpec` MoE
fields from a config (expert count under either HF spelling, experts per token, their width,
renormalisation, which layers are sparse), and the refusal of MoE options the block cannot
follow. What does not: the experts' tensors (``_decoder.py``), the arithmetic (SPEC.md 4.8).
"""

from __future__ import annotations

from exactblocks.transformer.moe import MOE_UNSUPPORTED

from ._config import ConfigReader

__all__ = ["moe_fields"]


def _refuse_unsupported(c: ConfigReader) -> None:
    for key, follows in MOE_UNSUPPORTED.items():
        v = c.resolved.get(key)
        if v is not None and (isinstance(v, bool) or v not in follows):
            raise ValueError(
                f"load_model: config field {key!r}={v!r} is not supported by the {c.family} "
                f"family: the MoE block routes every token to its top-k experts (no capacity "
                f"limit, no grouped routing, no router noise); expected {follows[0]!r} or absent"
            )


def _integer(c: ConfigReader, key: str, minimum: int = 1) -> int:
    v = c.integer(key, minimum=minimum)  # never None without allow_none
    assert v is not None
    return v


def moe_fields(
    c: ConfigReader, n_layers: int, *, norm_topk_key: str | None, shared_key: str | None = None
) -> dict:
    """The MoE fields of a DecoderSpec.

    Parameters
    ----------
    c : ConfigReader
        The family's reader; ``num_local_experts`` (or its HF alias ``num_experts``),
        ``num_experts_per_tok``, ``moe_intermediate_size`` (else ``intermediate_size``: Mixtral,
        OLMoE), and, when the defaults have them, ``mlp_only_layers`` and
        ``decoder_sparse_step`` (Qwen2/3-MoE: layer i is sparse iff i is not in
        mlp_only_layers and (i + 1) % decoder_sparse_step == 0).
    n_layers : int
    norm_topk_key : str or None
        The renormalisation flag's field; None = always renormalised (Mixtral).
    shared_key : str or None
        The shared expert's width field (Qwen2-MoE ``shared_expert_intermediate_size``; 0 =
        none); None = the family has no shared expert.

    Returns
    -------
    dict
        ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``moe_intermediate``,
        ``moe_layers``, ``shared_intermediate``.

    Raises
    ------
    ValueError
        A field of the wrong type or range, num_experts_per_tok > the expert count, a layer
        index out of range in mlp_only_layers, or an MoE option of
        :data:`~exactblocks.transformer.moe.MOE_UNSUPPORTED` set.
    """
    _refuse_unsupported(c)
    given = [k for k in ("num_experts", "num_local_experts") if c.raw.get(k) is not None]
    key = given[0] if given else next(k for k in ("num_experts", "num_local_experts")
                                      if k in c.resolved)  # fmt: skip
    if len(given) == 2 and c.raw["num_local_experts"] != c.raw["num_experts"]:
        raise ValueError(
            f"load_model: config fields num_experts={c.raw['num_experts']!r} and "
            f"num_local_experts={c.raw['num_local_experts']!r} disagree (HF aliases of one field)"
        )
    n_e = _integer(c, key)
    k = _integer(c, "num_experts_per_tok")
    if k > n_e:
        raise ValueError(
            f"load_model: config field num_experts_per_tok={k} exceeds the {n_e} experts ({key})"
        )
    wide = "moe_intermediate_size" if "moe_intermediate_size" in c.resolved else "intermediate_size"
    layers = tuple(range(n_layers))
    if "decoder_sparse_step" in c.resolved:
        step = _integer(c, "decoder_sparse_step")
        dense = c.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in dense
        ):
            raise ValueError(
                f"load_model: config field 'mlp_only_layers'={dense!r} must list layer indices "
                f"in [0, {n_layers})"
            )
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        c.resolved["mlp_only_layers"] = list(dense)
    return {
        "num_experts": n_e,
        "num_experts_per_tok": k,
        "norm_topk_prob": True if norm_topk_key is None else c.flag(norm_topk_key),
        "moe_intermediate": _integer(c, wide),
        "moe_layers": layers,
        "shared_intermediate": 0 if shared_key is None else _integer(c, shared_key, minimum=0),
    }
