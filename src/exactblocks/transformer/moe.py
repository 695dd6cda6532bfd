"""The mixture-of-experts options of the Transformer block and their checks (SPEC.md 4.8).

What lives here: :data:`MOE_OPTIONS` (appended to the block's option table in ``config.py``),
:func:`check_moe_combinations` (the checks between them and the other options) and
:data:`MOE_UNSUPPORTED`, the HF MoE config fields whose behaviour the block cannot follow (a
family refuses them by name). What does not: the MoE tensors (``weights.py``), the arithmetic
(``csrc/ops/moe.hpp``).
"""

from __future__ import annotations

from functools import partial

from .._options import Option
from .._validation import check_flag, check_int

__all__ = ["MOE_OPTIONS", "MOE_UNSUPPORTED", "check_moe_combinations", "is_moe"]

_MAX_EXPERTS = 1 << 16

MOE_OPTIONS: tuple[Option, ...] = (
    Option(
        "num_experts",
        0,
        partial(check_int, min_value=0, max_value=_MAX_EXPERTS),
        "int: Routed experts of the MoE MLP (0 = the dense MLP).",
        field="num_experts",
    ),
    Option(
        "num_experts_per_tok",
        None,
        partial(check_int, min_value=1, max_value=_MAX_EXPERTS, allow_none=True),
        "int or None: Experts chosen per token (top-k; None without experts).",
        field="num_experts_per_tok",
        to_core=lambda v, core: 0 if v is None else v,
    ),
    Option(
        "norm_topk_prob",
        False,
        check_flag,
        "bool: Renormalise the chosen experts' weights to sum to 1.",
        field="norm_topk_prob",
        stage=1,
    ),
    Option(
        "shared_expert",
        False,
        check_flag,
        "bool: A shared expert with a sigmoid gate on every token (Qwen2-MoE).",
        stage=1,  # its width comes from the weights (core_config)
    ),
)

#: HF MoE config fields and the values the block follows; any other value is refused.
MOE_UNSUPPORTED = {
    "capacity_factor": (None,),  # token dropping (Switch-style capacity): not followed
    "moe_capacity_factor": (None,),
    "expert_capacity": (None,),
    "router_jitter_noise": (None, 0, 0.0),  # training-time noise
    "n_group": (None, 1),  # DeepSeek-V3 grouped routing
    "topk_group": (None, 1),
}


def is_moe(o) -> bool:
    """Whether the options build an MoE MLP half (option dicts without the MoE keys, such as
    a family's table lookups, are dense)."""
    return o.get("num_experts", 0) > 0 and o["block_parts"] != "attention"


def check_moe_combinations(o: dict, where: str, gated: tuple) -> None:
    """The MoE options between themselves and with the MLP options (SPEC.md 4.8)."""
    n, k = o["num_experts"], o["num_experts_per_tok"]
    if n == 0:
        for name, default in (("num_experts_per_tok", None), ("norm_topk_prob", False),
                              ("shared_expert", False)):  # fmt: skip
            if o[name] != default:
                raise ValueError(
                    f"{where}: {name}={o[name]!r} is an MoE option, but num_experts=0 builds "
                    f"the dense MLP; pass num_experts >= 1 or leave {name} at {default!r}"
                )
        return
    if o["block_parts"] == "attention":
        raise ValueError(
            f"{where}: num_experts={n} sets up an MoE MLP, but block_parts='attention' has no "
            "MLP half; leave num_experts at 0"
        )
    if k is None or k > n:
        raise ValueError(
            f"{where}: num_experts_per_tok={k!r} must be an int in [1, num_experts={n}] (the "
            "experts chosen per token, HF num_experts_per_tok)"
        )
    if o["mlp"] not in gated or o["mlp_bias"]:
        raise ValueError(
            f"{where}: MoE experts are gated MLPs without biases (mlp in {list(gated)}, "
            f"mlp_bias=False); got mlp={o['mlp']!r}, mlp_bias={o['mlp_bias']!r}"
        )
    if o["norm_placement"] == "parallel":
        raise ValueError(
            f"{where}: num_experts={n} with norm_placement='parallel' is not supported (no "
            "family has it); use 'pre', 'sandwich' or 'post'"
        )
