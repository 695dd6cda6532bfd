"""The mixture-of-experts config fields the MoE families read alike (HF transformers 5.23).

What lives here: :func:`moe_fields`, the :class:`~exactblocks.models._decoder.DecoderSpec` MoE
fields from a config (expert count under either HF spelling, experts per token, their width,
renormalisation, which layers are sparse), the refusal of MoE options the block cannot
follow, and :func:`moe_sized_by`, the fields a wrong-shaped MoE tensor's message names. What
does not: the experts' tensors (``_decoder.py``), the arithmetic (SPEC.md 4.8).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from exactblocks.transformer.moe import MOE_UNSUPPORTED

from ._config import ConfigReader

__all__ = ["moe_fields", "moe_keys", "moe_sized_by"]


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


_COUNT_KEYS = ("num_experts", "num_local_experts")  # HF aliases of one field


# the families whose experts are intermediate_size wide (HF's config has no
# moe_intermediate_size: a stray one in config.json is ignored there, so here too)
_WIDTH_IS_INTERMEDIATE = ("mixtral", "olmoe")


def moe_keys(raw: Mapping, resolved: Mapping, family: str) -> tuple[str, str]:
    """The config fields that hold the expert count and each expert's width.

    Parameters
    ----------
    raw : Mapping
        The config as given (config.json).
    resolved : Mapping
        The config over the family's defaults (``ConfigReader.resolved``).
    family : str
        The family (``"qwen3_moe"``, ``"qwen2_moe"``, ``"olmoe"``, ``"mixtral"``).

    Returns
    -------
    tuple of (str, str)
        The expert count's field as the config spells it (``num_experts`` or
        ``num_local_experts``; the defaults' spelling when the config gives neither) and the
        width's: ``intermediate_size`` for Mixtral and OLMoE (HF ``MixtralConfig``,
        ``OlmoeConfig``), ``moe_intermediate_size`` otherwise.
    """
    given = [k for k in _COUNT_KEYS if raw.get(k) is not None]
    count = given[0] if given else next((k for k in _COUNT_KEYS if k in resolved), _COUNT_KEYS[0])
    wide = "intermediate_size" if family in _WIDTH_IS_INTERMEDIATE else "moe_intermediate_size"
    return count, wide


_EXPERT = re.compile(r"experts\.\d+\.(\w+)\.weight$")  # one expert's matrix, in files


def moe_sized_by(name: str, spec, raw: Mapping, resolved: Mapping) -> list[str] | None:
    """What sizes MoE tensor ``name``: ``["rows: <field>=<value>", "columns: ..."]`` (a stack
    of experts, as a transformers object holds it, leads with ``"experts: ..."``), or None
    when ``name`` is not an MoE layer's router, expert or shared-expert tensor.

    Parameters
    ----------
    name : str
        The tensor's full HF name (``model.layers.N.mlp.experts.E.gate_proj.weight``).
    spec : DecoderSpec
        An MoE family's spec (``num_experts`` > 0).
    raw, resolved : Mapping
        As for :func:`moe_keys`.

    Returns
    -------
    list of str or None
        Router: (expert count, ``hidden_size``); expert gate/up (Mixtral ``w1``/``w3``): (expert
        width, ``hidden_size``), down (``w2``): transposed; Qwen2-MoE's shared expert:
        ``shared_expert_intermediate_size`` in place of the width, its gate (1,
        ``hidden_size``).
    """
    count, wide = moe_keys(raw, resolved, spec.family)
    d, it, sit = f"hidden_size={spec.d_model}", f"{wide}={spec.moe_intermediate}", None
    prefix, gate, up, down = spec.moe_files
    if name.endswith(("mlp.gate.weight", "." + prefix + "gate.weight")):
        return [f"rows: {count}={spec.num_experts}", f"columns: {d}"]
    if name.endswith("experts.gate_up_proj"):  # (E, 2 * width, hidden)
        two = f"2 * {wide} = 2 * {spec.moe_intermediate}"
        return [f"experts: {count}={spec.num_experts}", f"rows: {two}", f"columns: {d}"]
    if name.endswith("experts.down_proj"):  # (E, hidden, width)
        return [f"experts: {count}={spec.num_experts}", f"rows: {d}", f"columns: {it}"]
    if ".shared_expert_gate." in name:
        return [f"columns: {d}"]
    m = _EXPERT.search(name)
    if m and m.group(1) in (gate, up, down):
        leaf = m.group(1)
    elif ".shared_expert." in name:
        leaf = next((x for x in ("gate_proj", "up_proj", "down_proj") if f".{x}." in name), None)
        sit = f"shared_expert_intermediate_size={spec.shared_intermediate}"
    else:
        return None
    width = it if sit is None else sit
    if leaf in (gate, up):
        return [f"rows: {width}", f"columns: {d}"]
    return [f"rows: {d}", f"columns: {width}"] if leaf == down else None


def moe_fields(
    c: ConfigReader, n_layers: int, *, norm_topk_key: str | None, shared_key: str | None = None
) -> dict:
    """The MoE fields of a DecoderSpec.

    Parameters
    ----------
    c : ConfigReader
        The family's reader; ``num_local_experts`` (or its HF alias ``num_experts``),
        ``num_experts_per_tok``, ``moe_intermediate_size`` (``intermediate_size`` in Mixtral
        and OLMoE: :func:`moe_keys`), and, when the defaults have them, ``mlp_only_layers`` and
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
    key, wide = moe_keys(c.raw, c.resolved, c.family)
    if (
        all(c.raw.get(k) is not None for k in _COUNT_KEYS)
        and c.raw["num_local_experts"] != c.raw["num_experts"]
    ):
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
