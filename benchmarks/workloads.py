"""What is benchmarked: layer sizes, sequence shapes, the four cases and the random weights.

Here: :class:`LayerSpec` (one layer's sizes), :class:`Shapes` (the four cases' sequence
shapes, full or ``--quick``), the workload tables, the case labels and token counts, and the
weight generators (short names, float32, optionally bfloat16-valued). Not here: how a library
is called (the peer modules), checks and timing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CASES",
    "FULL_LAYERS",
    "FULL_SHAPES",
    "QUICK_LAYERS",
    "QUICK_SHAPES",
    "WORKLOAD_NAMES",
    "LayerSpec",
    "Shapes",
    "bf16_round",
    "case_label",
    "case_tokens",
    "mamba2_weights",
    "transformer_weights",
]

CASES = ("prefill_b1", "prefill_ragged", "decode_b1", "decode_b8")
WORKLOAD_NAMES = (
    "smollm2-layer",
    "smollm2-layer-bf16",
    "llama1b-layer",
    "llama1b-layer-bf16",
    "mamba2-layer",
    "smollm2-model",
    "gemma3-model",
)


@dataclass(frozen=True)
class LayerSpec:
    """Sizes of one benchmarked layer (a Llama decoder layer or a Mamba-2 block).

    Parameters
    ----------
    name : str
        Workload name used by ``--workloads`` (e.g. ``"llama1b-layer"``).
    label : str
        Human-readable name for the report.
    kind : {"transformer", "mamba2"}
        Block type: HF ``LlamaDecoderLayer`` or HF ``Mamba2Block``.
    d_model : int
        Residual width.
    n_heads, n_kv_heads, head_dim, intermediate : int
        Transformer sizes (for "mamba2": ``n_heads`` and ``head_dim`` are the SSM heads).
    rope_theta : float
        RoPE base (transformer).
    rope_scaling : dict or None
        HF ``rope_parameters``-style scaling (``rope_type`` "llama3"), or None.
    norm_eps : float
        RMSNorm epsilon.
    d_state, expand, n_groups, conv_kernel : int
        Mamba-2 sizes (HF ``Mamba2Config`` state_size, expand, n_groups, conv_kernel).
    bf16_weights : bool
        Round every weight to a bfloat16 value (widened back to float32), as the released
        SmolLM2-135M and Llama-3.2-1B checkpoints hold them. Every peer gets the same float32
        values; exactblocks stores such matrices as bfloat16 (same bits, half the bytes).
    """

    name: str
    label: str
    kind: str
    d_model: int
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 64
    intermediate: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    d_state: int = 128
    expand: int = 2
    n_groups: int = 1
    conv_kernel: int = 4
    bf16_weights: bool = False

    @property
    def d_inner(self) -> int:
        """Mamba-2 inner width ``expand * d_model``."""
        return self.expand * self.d_model

    def gemm_shapes(self) -> list[tuple[str, int, int]]:
        """The block's matrix products as ``(name, out_features, in_features)``.

        Returns
        -------
        list of (str, int, int)
            Transformer: q, k, v, o, gate, up, down. Mamba-2: in_proj, out_proj.
        """
        d = self.d_model
        if self.kind == "transformer":
            q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            it = self.intermediate
            return [
                ("q", q, d),
                ("k", kv, d),
                ("v", kv, d),
                ("o", d, q),
                ("gate", it, d),
                ("up", it, d),
                ("down", d, it),
            ]
        n_in = 2 * self.d_inner + 2 * self.n_groups * self.d_state + self.n_heads
        return [("in_proj", n_in, d), ("out_proj", d, self.d_inner)]

    def gemm_params(self) -> int:
        """Number of matrix weights (sum of out * in over :meth:`gemm_shapes`)."""
        return sum(n * k for _, n, k in self.gemm_shapes())

    def weight_bytes(self) -> int:
        """Bytes per matrix weight that exactblocks streams: 2 for bfloat16 values, else 4."""
        return 2 if self.bf16_weights else 4

    def variant(self, name: str, label: str) -> LayerSpec:
        """The same sizes with bfloat16-valued weights, under another name and label."""
        return dataclasses.replace(self, name=name, label=label, bf16_weights=True)


@dataclass(frozen=True)
class Shapes:
    """Sequence shapes of the four cases (full run or ``--quick``)."""

    prefill_len: int = 512
    ragged_lengths: tuple = (128, 96, 64, 32)
    context: int = 512
    decode_batch: int = 8
    decode_warm_steps: int = 4  # untimed steps at the start of each decode repeat
    decode_steps: int = 12  # then this many timed steps, one by one
    model_new_tokens: int = 16
    default_repeats: int = 5
    bandwidth_mib: int = 256


_LLAMA3_1B_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

FULL_LAYERS = {
    "smollm2-layer": LayerSpec(
        "smollm2-layer",
        "SmolLM2-135M layer",
        "transformer",
        576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        intermediate=1536,
        rope_theta=100000.0,
    ),
    "llama1b-layer": LayerSpec(
        "llama1b-layer",
        "Llama-3.2-1B layer",
        "transformer",
        2048,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        intermediate=8192,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_1B_ROPE,
    ),
    "mamba2-layer": LayerSpec(
        "mamba2-layer",
        "mamba2-130m layer",
        "mamba2",
        768,
        n_heads=24,
        head_dim=64,
        d_state=128,
        expand=2,
    ),
}
# --quick: the same code paths on tiny sizes (mamba2 keeps d_state 128 / head_dim 64, the only
# sizes mojolearn's Mamba2 accepts; d_model 64 gives 2 heads).
QUICK_LAYERS = {
    "smollm2-layer": LayerSpec(
        "smollm2-layer",
        "SmolLM2-135M layer (quick: tiny)",
        "transformer",
        64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate=128,
        rope_theta=100000.0,
    ),
    "llama1b-layer": LayerSpec(
        "llama1b-layer",
        "Llama-3.2-1B layer (quick: tiny)",
        "transformer",
        128,
        n_heads=8,
        n_kv_heads=2,
        head_dim=16,
        intermediate=256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_1B_ROPE,
    ),
    "mamba2-layer": LayerSpec(
        "mamba2-layer",
        "mamba2-130m layer (quick: tiny)",
        "mamba2",
        64,
        n_heads=2,
        head_dim=64,
        d_state=128,
        expand=2,
    ),
}
# bfloat16-valued weights, as the released checkpoints: the same layers, the same peers
for _layers in (FULL_LAYERS, QUICK_LAYERS):
    for _base in ("smollm2-layer", "llama1b-layer"):
        _layers[f"{_base}-bf16"] = _layers[_base].variant(
            f"{_base}-bf16", _layers[_base].label.replace(" layer", " layer, bf16 weights", 1)
        )
FULL_SHAPES = Shapes()
QUICK_SHAPES = Shapes(
    prefill_len=32,
    ragged_lengths=(16, 12, 8, 4),
    context=32,
    decode_batch=8,
    decode_warm_steps=1,
    decode_steps=2,
    model_new_tokens=4,
    default_repeats=2,
    bandwidth_mib=16,
)


def case_label(case: str, sh: Shapes) -> str:
    """Report label of one case at the given shapes.

    Parameters
    ----------
    case : str
        One of :data:`CASES`.
    sh : Shapes
        The run's sequence shapes.

    Returns
    -------
    str

    Examples
    --------
    >>> case_label("prefill_ragged", FULL_SHAPES)
    'prefill B=4 L=128 ragged'
    >>> case_label("decode_b8", QUICK_SHAPES)
    'decode B=8 ctx 32'
    """
    r = sh.ragged_lengths
    return {
        "prefill_b1": f"prefill B=1 L={sh.prefill_len}",
        "prefill_ragged": f"prefill B={len(r)} L={max(r)} ragged",
        "decode_b1": f"decode B=1 ctx {sh.context}",
        "decode_b8": f"decode B={sh.decode_batch} ctx {sh.context}",
    }[case]


def case_tokens(case: str, sh: Shapes) -> int:
    """Real tokens one call of a case processes (padding not counted).

    Parameters
    ----------
    case : str
        One of :data:`CASES`.
    sh : Shapes
        The run's sequence shapes.

    Returns
    -------
    int

    Examples
    --------
    >>> [case_tokens(c, FULL_SHAPES) for c in CASES]
    [512, 320, 1, 8]
    """
    return {
        "prefill_b1": sh.prefill_len,
        "prefill_ragged": int(sum(sh.ragged_lengths)),
        "decode_b1": 1,
        "decode_b8": sh.decode_batch,
    }[case]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bfloat16 value (ties to even), as float32 (low 16 bits zero).

    Parameters
    ----------
    x : ndarray of float32 (finite)

    Returns
    -------
    ndarray of float32, the shape of x

    Examples
    --------
    >>> bf16_round(np.array([1.0, 1.00390625, 1.01171875, 3.14159], np.float32)).tolist()
    [1.0, 1.0, 1.015625, 3.140625]
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).reshape(np.shape(x))


def transformer_weights(spec: LayerSpec, rng: np.random.Generator) -> dict:
    """Random short-name weights of a Llama decoder layer (SPEC.md 4.2).

    Parameters
    ----------
    spec : LayerSpec
        A ``"transformer"`` layer.
    rng : numpy.random.Generator
        Source of the values (the draws' order is part of the benchmark: same seed, same
        weights).

    Returns
    -------
    dict of str to ndarray of float32
        ``q_proj.weight`` ... ``down_proj.weight`` drawn N(0, 1/in), the two norms
        ``1 + 0.1 N(0, 1)``; every value rounded to bfloat16 when ``spec.bf16_weights``.
    """
    w = {
        f"{n}_proj.weight": (
            rng.standard_normal((o, i), dtype=np.float32) * np.float32(1.0 / math.sqrt(i))
        )
        for n, o, i in spec.gemm_shapes()
    }
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        w[n] = (1.0 + 0.1 * rng.standard_normal(spec.d_model)).astype(np.float32)
    if spec.bf16_weights:
        w = {n: bf16_round(a) for n, a in w.items()}
    return w


def mamba2_weights(spec: LayerSpec, rng: np.random.Generator) -> dict:
    """Random short-name weights of a Mamba-2 block (mojolearn's names).

    Parameters
    ----------
    spec : LayerSpec
        A ``"mamba2"`` layer.
    rng : numpy.random.Generator
        Source of the values.

    Returns
    -------
    dict of str to ndarray of float32
        ``block_norm.weight``, ``in_proj.weight``, ``conv1d.weight``, ``conv1d.bias``,
        ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj.weight``, initialised like
        HF's ``Mamba2Block`` (as in the oracle tests).
    """
    d, di, h = spec.d_model, spec.d_inner, spec.n_heads
    conv_dim = di + 2 * spec.n_groups * spec.d_state
    n_in = 2 * di + 2 * spec.n_groups * spec.d_state + h

    def mat(o, i):
        return rng.standard_normal((o, i), dtype=np.float32) * np.float32(1.0 / math.sqrt(i))

    dt = np.exp(math.log(1e-3) + rng.random(h) * (math.log(0.1) - math.log(1e-3)))
    return {
        "block_norm.weight": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "in_proj.weight": mat(n_in, d),
        "conv1d.weight": (
            rng.standard_normal((conv_dim, 1, spec.conv_kernel)) / math.sqrt(spec.conv_kernel)
        ).astype(np.float32),
        "conv1d.bias": (0.1 * rng.standard_normal(conv_dim)).astype(np.float32),
        "dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),  # inverse softplus
        "A_log": np.log(rng.uniform(1.0, 16.0, h)).astype(np.float32),
        "D": np.ones(h, np.float32),
        "norm.weight": (1.0 + 0.1 * rng.standard_normal(di)).astype(np.float32),
        "out_proj.weight": mat(d, di),
    }
