"""Mamba2BlockInference against Hugging Face ``Mamba2Block`` and float64 references (SPEC 7).

The oracle is transformers 5.23 ``transformers.models.mamba2.modeling_mamba2.Mamba2Block``
(block RMSNorm, ``Mamba2Mixer``, residual) in float32 on the CPU. Its kernels are chosen when
``modeling_mamba2`` is imported: ``use_kernel_func_from_hub_with_fallback`` (transformers
``integrations/hub_kernels.py``) wraps ``causal_conv1d_fn``, ``causal_conv1d_update``,
``mamba2_chunk_scan``, ``mamba2_selective_state_update`` and
``mamba2_split_conv1d_scan_combined`` and replaces them by ``causal_conv1d`` / ``mamba_ssm``
functions only when those packages import, or by hub kernels only when ``kernels`` is
installed. `test_oracle_environment` asserts that none is, and that every wrapper still holds
its torch function; the layer runs in eval mode, so the fused training shortcut is never taken.
HF therefore computes a multi-token call with the chunked SSD scan (``mamba2_chunk_scan``, the
config's ``chunk_size``; L = 24 spans several chunks in most cases) and a cached one-token call
with ``mamba2_selective_state_update``.

Each case gives every parameter seeded values so that each one matters: in/out projections
N(0, 1/in), conv taps N(0, 1/K), biases 0.1 N, both norm weights 1 + 0.1 N, ``A = -exp(A_log)``
uniform in [-16, -0.5] (log-uniform magnitude), ``dt_bias`` the inverse softplus of a
log-uniform dt in [1e-3, 0.5], ``D`` = 1 + 0.5 N. The weights reach exactblocks as
``{k: v.numpy() for k, v in block.state_dict().items()}`` (HF keys, SPEC 7.2); short names are
checked to give the same bits. Finite ``time_step_limit`` values are chosen so that the clamp
bites at each finite end on some tokens (asserted, so the clamp cannot be skipped unnoticed).

Coverage (the issue's grid, not its product; `CASES`): d_state {16, 64, 128}, head_dim {16, 32,
64}, n_groups {1, 2, 4} (and 3), conv kernel {2, 3, 4} (and 1), expand {1, 2}, use_bias and
use_conv_bias on and off in all four combinations, default and finite dt_limit (lo = 0 and
lo > 0, hi finite and infinite), HF chunk_size 256/8/7/6/5/4, eps 1e-5 and 1e-6, and odd sizes
(d_model 40 and 72, d_state 20 and 24, 5 heads) for vector tails.

Comparisons (tolerance rtol = atol = 2e-4 against HF, SPEC 7.5):
- exactblocks ``forward`` (B = 2) vs HF's forward; the float64 recurrent reference
  (``tests/reference/mamba2_ref.py``) vs HF, and exactblocks vs that reference;
- the two float64 references (recurrent form and chunked SSD form of arXiv:2405.21060) agree
  to 1e-10, with and without an initial state, at several chunk sizes;
- exactblocks' decode (a ``step`` loop) vs HF's full forward, not HF's cached decode (SPEC
  7.5: that path ignores ``time_step_limit``; `test_hf_cached_decode` pins both halves of this
  statement); the state after the loop vs HF's cache after a prefill and vs the reference;
- chunked ``forward`` calls carrying a state vs HF prefill continued through its cache;
- a random initial state (``h`` and ``conv_window`` written by the caller) vs the float64
  reference and vs HF with the same values written into its cache;
- a ragged batch (``lengths``, NaN in the padding, continued with a state) vs HF per row alone.

Every comparison prints ``[oracle] <case> <what>: max_abs=... max_rel=...`` (pytest -s or -rP);
``python tests/oracle/test_mamba2_hf.py`` prints the per-case table of the largest errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

TORCH_THREADS = 2  # the conftest's autouse fixture sets this for every test
RTOL = ATOL = 2e-4  # SPEC 7.5
REF_AGREE = 1e-10  # recurrent vs chunked float64 reference (both float64; ~1e-14 observed)
SEQ_LEN = 24


def require(module: str, why: str):
    """Import `module`; skip this file locally if it is missing, fail under CI (``CI`` set)."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - local convenience only
        pytest.skip(f"{why}: {exc}", allow_module_level=True)


torch = require("torch", "oracle tests need torch==2.13.0 (pip install '.[test]')")
transformers = require("transformers", "oracle tests need transformers==5.23.0")

if __name__ == "__main__":  # direct run: make `reference` importable like the conftest does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference.mamba2_ref import (  # noqa: E402
    HF_TO_SHORT,
    mamba2_ref,
    mamba2_ssd_ref,
    prepare,
)
from transformers import Mamba2Config  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Block  # noqa: E402

INF = math.inf
# The five functions Mamba2Mixer may take from a kernel package; each must be the torch one.
_WRAPPED = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_chunk_scan",
    "mamba2_selective_state_update",
    "mamba2_split_conv1d_scan_combined",
)


@dataclass(frozen=True)
class Spec:
    """One tested configuration (HF ``Mamba2Config`` fields; exactblocks options follow)."""

    name: str
    d_model: int
    expand: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    use_bias: bool
    use_conv_bias: bool
    dt_limit: tuple = (0.0, INF)
    chunk_size: int = 256
    eps: float = 1e-5
    seed: int = 0

    @property
    def n_heads(self) -> int:
        return self.d_model * self.expand // self.head_dim


CASES = [
    #    name             d  e  hd  ds  g  K  bias   cbias  dt_limit       chunk  eps
    Spec("s16_hd16_g1_k4", 64, 2, 16, 16, 1, 4, False, True, (0.0, INF), 256, 1e-5, 1),
    Spec("s64_hd32_g2_k3_bias_lim", 64, 2, 32, 64, 2, 3, True, True, (0.02, 0.3), 8, 1e-5, 2),
    Spec("s128_hd16_g4_k2_e1_nobias", 64, 1, 16, 128, 4, 2, False, False, (0.0, INF), 5, 1e-6, 3),
    Spec(
        "s16_hd64_g4_k4_bias_noconvb_lim",
        128,
        2,
        64,
        16,
        4,
        4,
        True,
        False,
        (0.05, 0.5),
        256,
        1e-5,
        4,
    ),
    Spec("s64_hd64_g1_k2_e1_bias_lo", 64, 1, 64, 64, 1, 2, True, True, (0.001, INF), 7, 1e-5, 5),
    Spec("s128_hd32_g1_k3_hi", 64, 2, 32, 128, 1, 3, False, True, (0.0, 0.25), 256, 1e-6, 6),
    Spec("s16_hd64_g2_k2_nobias", 64, 2, 64, 16, 2, 2, False, False, (0.0, INF), 4, 1e-5, 7),
    Spec("s64_hd16_g4_k4_bias_lim", 96, 2, 16, 64, 4, 4, True, True, (0.05, 1.0), 256, 1e-5, 8),
    Spec(
        "s16_hd32_g2_k3_e1_bias_noconvb", 64, 1, 32, 16, 2, 3, True, False, (0.0, INF), 256, 1e-5, 9
    ),
    Spec("s128_hd64_g2_k4_e1_lim", 128, 1, 64, 128, 2, 4, False, True, (0.01, 0.2), 6, 1e-5, 10),
    Spec("s64_hd16_g4_k3", 64, 2, 16, 64, 4, 3, False, True, (0.0, INF), 256, 1e-5, 11),
    Spec("s128_hd64_g1_k4_bias", 64, 2, 64, 128, 1, 4, True, True, (0.0, INF), 256, 1e-5, 12),
    Spec("odd_d40_s20_h5_k1_bias_lim", 40, 2, 16, 20, 1, 1, True, True, (0.02, 0.4), 256, 1e-5, 13),
    Spec("odd_d72_s24_h3_g3_k3_e1", 72, 1, 24, 24, 3, 3, False, True, (0.0, INF), 8, 1e-6, 14),
]
CASE_NAMES = [c.name for c in CASES]
_SPECS = {c.name: c for c in CASES}


@dataclass
class Case:
    """A built HF block with the exactblocks options and weights describing it."""

    spec: Spec
    block: object  # Mamba2Block, float32, eval mode
    config: object  # Mamba2Config
    weights: dict  # HF keys -> float32 ndarray (what the user passes)
    options: dict  # Mamba2BlockInference keyword options
    params: object = None  # reference.mamba2_ref.Mamba2Params
    errors: dict = field(default_factory=dict)  # what -> (max_abs, max_rel), for the table


# --------------------------------------------------------------------------- building


def _perturb(block, seed: int) -> None:
    """Seeded values for every parameter of `block` (module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def rand(shape):
        return torch.rand(shape, generator=gen, dtype=torch.float32)

    with torch.no_grad():
        for name, p in sorted(block.named_parameters()):
            if name == "mixer.A_log":
                p.copy_(math.log(0.5) + rand(p.shape) * (math.log(16.0) - math.log(0.5)))
            elif name == "mixer.dt_bias":
                dt = torch.exp(math.log(1e-3) + rand(p.shape) * (math.log(0.5) - math.log(1e-3)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus (HF's init rule)
            elif name == "mixer.D":
                p.copy_(1.0 + 0.5 * randn(p.shape))
            elif name == "mixer.conv1d.weight":
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * randn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.1 * randn(p.shape))
            elif p.ndim == 2:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[1]))
            else:  # pragma: no cover - the list above is every Mamba2Block parameter
                raise AssertionError(f"unexpected parameter {name}")


def build(spec: Spec) -> Case:
    """HF block, weights and options of `spec`."""
    cfg = Mamba2Config(
        hidden_size=spec.d_model,
        expand=spec.expand,
        head_dim=spec.head_dim,
        num_heads=spec.n_heads,
        state_size=spec.d_state,
        n_groups=spec.n_groups,
        conv_kernel=spec.conv_kernel,
        use_bias=spec.use_bias,
        use_conv_bias=spec.use_conv_bias,
        time_step_limit=spec.dt_limit,
        chunk_size=spec.chunk_size,
        layer_norm_epsilon=spec.eps,
        num_hidden_layers=1,
        hidden_act="silu",
    )
    block = Mamba2Block(cfg, 0)
    _perturb(block, 1000 + spec.seed)
    block.eval()
    weights = {k: v.detach().numpy().copy() for k, v in block.state_dict().items()}
    options = dict(dt_limit=spec.dt_limit, n_groups=spec.n_groups, norm_eps=spec.eps)
    case = Case(spec, block, cfg, weights, options)
    case.params = prepare(weights, **options)
    return case


_CACHE: dict = {}


def get_case(name: str) -> Case:
    """Build (once per session) the case `name`."""
    if name not in _CACHE:
        _CACHE[name] = build(_SPECS[name])
    return _CACHE[name]


def make_x(case: Case, batch: int, seed: int, seq_len: int = SEQ_LEN) -> np.ndarray:
    rng = np.random.default_rng(10_000 * case.spec.seed + seed)
    return rng.standard_normal((batch, seq_len, case.spec.d_model)).astype(np.float32)


def random_state(case: Case, batch: int, seed: int):
    """Random (h, conv_window) float32 of the sizes of SPEC 8, N(0, 1) entries."""
    rng = np.random.default_rng(20_000 * case.spec.seed + seed)
    p = case.params
    h = rng.standard_normal((batch, p.n_heads, p.head_dim, p.d_state)).astype(np.float32)
    cw = rng.standard_normal((batch, p.conv_dim, p.K)).astype(np.float32)
    return h, cw


# --------------------------------------------------------------------------- running HF


def _check_hf(case: Case) -> None:
    dtypes = {p.dtype for p in case.block.parameters()}
    assert dtypes == {torch.float32}, f"{case.spec.name}: HF dtypes {dtypes}"
    assert not case.block.training
    assert torch.get_num_threads() == TORCH_THREADS


def hf_forward(case: Case, x: np.ndarray, cache=None) -> np.ndarray:
    """HF ``Mamba2Block`` on x (B, L, d) float32, optionally through a ``DynamicCache``."""
    _check_hf(case)
    with torch.no_grad():
        out = case.block(torch.from_numpy(np.ascontiguousarray(x)), cache_params=cache)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.float32
    return out.numpy().copy()


def hf_cache(case: Case):
    return DynamicCache(config=case.config)


def hf_cache_states(cache):
    """(h, conv_window) of layer 0 of a HF cache as float32 arrays (SPEC 8 layouts)."""
    layer = cache.layers[0]
    return layer.recurrent_states[0].numpy().copy(), layer.conv_states[0].numpy().copy()


def hf_cache_with_state(case: Case, h: np.ndarray, cw: np.ndarray):
    """A HF cache holding state (h, cw): a 2-token prefill initialises it, then it is overwritten.

    The next multi-token call continues from it (``update_conv_state`` prepends the window,
    ``mamba2_chunk_scan`` takes ``initial_states``), exactly as after a real prefill.
    """
    cache = hf_cache(case)
    hf_forward(case, np.zeros((h.shape[0], 2, case.spec.d_model), np.float32), cache)
    layer = cache.layers[0]
    assert tuple(layer.recurrent_states[0].shape) == h.shape
    assert tuple(layer.conv_states[0].shape) == cw.shape
    layer.recurrent_states[0].copy_(torch.from_numpy(h))
    layer.conv_states[0].copy_(torch.from_numpy(cw))
    return cache


# --------------------------------------------------------------------------- comparing


def errors(got, want) -> tuple[float, float]:
    """(max |got - want|, max |got - want| / |want| over elements with |want| >= 1e-2)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    err = np.abs(got - want)
    big = np.abs(want) >= 1e-2
    rel = float((err[big] / np.abs(want[big])).max()) if big.any() else 0.0
    return float(err.max()), rel


def compare(case: Case, what: str, got, want, *, rtol=RTOL, atol=ATOL) -> None:
    """Record and print the errors, then assert ``|got - want| <= atol + rtol |want|``."""
    mx, rel = errors(got, want)
    old = case.errors.get(what, (0.0, 0.0))
    case.errors[what] = (max(old[0], mx), max(old[1], rel))
    print(f"[oracle] {case.spec.name} {what}: max_abs={mx:.3e} max_rel={rel:.3e}")
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=rtol,
        atol=atol,
        err_msg=f"{case.spec.name}: {what}",
    )


def ref_rows(case: Case, x: np.ndarray, h0=None, cw0=None, lengths=None) -> list:
    """`mamba2_ref` on each row (its real tokens when `lengths` is given)."""
    out = []
    for b in range(x.shape[0]):
        n = x.shape[1] if lengths is None else lengths[b]
        out.append(
            mamba2_ref(
                x[b, :n],
                case.params,
                None if h0 is None else h0[b],
                None if cw0 is None else cw0[b],
            )
        )
    return out


def stack(results, attr):
    return np.stack([getattr(r, attr) for r in results])


# --------------------------------------------------------------------------- tests


def test_oracle_environment():
    """Pinned stack, 2 threads, and HF's torch fallback kernels (module docstring)."""
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    assert transformers.__version__ == "5.23.0", transformers.__version__
    assert torch.get_num_threads() == TORCH_THREADS
    for pkg in ("mamba_ssm", "causal_conv1d", "kernels"):
        assert importlib.util.find_spec(pkg) is None, f"{pkg} is installed: HF would not use torch"
    for fname in _WRAPPED:
        fn = getattr(modeling_mamba2, fname)
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        assert cells["is_new_implementation"] is False, fname
        assert cells["implementation"] is cells["torch_function"], fname


def test_grid_covers_issue_values():
    """Each value of each axis of the issue's grid appears in CASES."""
    want = {
        "d_state": {16, 64, 128},
        "head_dim": {16, 32, 64},
        "n_groups": {1, 2, 4},
        "conv_kernel": {2, 3, 4},
        "expand": {1, 2},
    }
    for axis, values in want.items():
        assert values <= {getattr(c, axis) for c in CASES}, axis
    assert {(c.use_bias, c.use_conv_bias) for c in CASES} == {
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    }
    limits = {c.dt_limit for c in CASES}
    assert (0.0, INF) in limits
    assert any(lo > 0 for lo, _ in limits) and any(hi < INF for _, hi in limits)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_reference_forms_agree(name):
    """Recurrent (SPEC 7.3) == chunked SSD form in float64: y, final h, final conv window."""
    case = get_case(name)
    x = make_x(case, 1, seed=1)[0]
    h0, cw0 = random_state(case, 1, seed=1)
    for init in (False, True):
        kw = dict(h0=h0[0], conv0=cw0[0]) if init else {}
        rec = mamba2_ref(x, case.params, **kw)
        for chunk in (1, 5, 8, SEQ_LEN):
            ssd = mamba2_ssd_ref(x, case.params, chunk_size=chunk, **kw)
            for attr in ("y", "h", "conv_window"):
                a, b = getattr(rec, attr), getattr(ssd, attr)
                scale = max(1.0, float(np.abs(a).max()))
                err = float(np.abs(a - b).max())
                assert err <= REF_AGREE * scale, (name, init, chunk, attr, err)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_matches_hf(eb, name):
    """exactblocks forward (B=2, HF keys) vs HF; reference vs HF; exactblocks vs reference."""
    case = get_case(name)
    blk = eb.Mamba2BlockInference(case.weights, **case.options)
    x = make_x(case, 2, seed=2)
    y = blk.forward(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    y_hf = hf_forward(case, x)
    refs = ref_rows(case, x)
    y_ref = stack(refs, "y")
    compare(case, "forward ours-vs-hf", y, y_hf)
    compare(case, "forward ref64-vs-hf", y_hf, y_ref)
    compare(case, "forward ours-vs-ref64", y, y_ref)
    # A finite dt_limit must bite on some tokens, or the test could not see a missing clamp.
    dt = stack(refs, "dt")
    lo, hi = case.spec.dt_limit
    if lo > 0:
        assert (dt == lo).any(), f"{name}: lower dt clamp never active"
    if hi < INF:
        assert (dt == hi).any(), f"{name}: upper dt clamp never active"
    # Short names (SPEC 7.2) give the same bits as HF keys.
    short = {HF_TO_SHORT[k]: v for k, v in case.weights.items()}
    y_short = eb.Mamba2BlockInference(short, **case.options).forward(x)
    assert np.array_equal(y_short.view(np.uint32), y.view(np.uint32)), name


@pytest.mark.parametrize("name", CASE_NAMES)
def test_step_decode_matches_hf_forward(eb, name):
    """A step loop from a fresh state vs HF's full forward; the state vs HF's cache and ref."""
    case = get_case(name)
    blk = eb.Mamba2BlockInference(case.weights, **case.options)
    x = make_x(case, 2, seed=3)
    st = blk.allocate_state(2)
    y = np.concatenate([blk.step(x[:, t], st) for t in range(x.shape[1])], axis=1)
    cache = hf_cache(case)
    y_hf = hf_forward(case, x, cache)  # one multi-token call: HF's prefill path, which clamps
    compare(case, "step ours-vs-hf_forward", y, y_hf)
    h_hf, cw_hf = hf_cache_states(cache)
    refs = ref_rows(case, x)
    compare(case, "state.h ours-vs-hf", st.h, h_hf)
    compare(case, "state.h ours-vs-ref64", st.h, stack(refs, "h"))
    compare(case, "state.conv_window ours-vs-hf", st.conv_window, cw_hf)
    compare(case, "state.conv_window ours-vs-ref64", st.conv_window, stack(refs, "conv_window"))
    assert np.array_equal(st.row_tokens, [x.shape[1]] * 2)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_chunked_forward_with_state_matches_hf(eb, name):
    """forward in pieces 9 + 15 carrying a state vs HF prefill continued through its cache."""
    case = get_case(name)
    blk = eb.Mamba2BlockInference(case.weights, **case.options)
    x = make_x(case, 2, seed=4)
    st = blk.allocate_state(2)
    y = np.concatenate([blk.forward(x[:, :9], st), blk.forward(x[:, 9:], st)], axis=1)
    cache = hf_cache(case)
    y_hf = np.concatenate(
        [hf_forward(case, x[:, :9], cache), hf_forward(case, x[:, 9:], cache)], axis=1
    )
    compare(case, "chunks ours-vs-hf_chunks", y, y_hf)
    compare(case, "chunks ours-vs-hf_forward", y, hf_forward(case, x))
    h_hf, cw_hf = hf_cache_states(cache)
    compare(case, "state.h ours-vs-hf", st.h, h_hf)
    compare(case, "state.conv_window ours-vs-hf", st.conv_window, cw_hf)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_initial_state_matches_reference_and_hf(eb, name):
    """h and conv_window written by the caller (HF initial_states) vs ref64 and HF's cache."""
    case = get_case(name)
    blk = eb.Mamba2BlockInference(case.weights, **case.options)
    x = make_x(case, 2, seed=5)
    h0, cw0 = random_state(case, 2, seed=5)
    st = blk.allocate_state(2)
    st.h[...] = h0
    st.conv_window[...] = cw0
    y = blk.forward(x, st)
    refs = ref_rows(case, x, h0, cw0)
    compare(case, "init-state ours-vs-ref64", y, stack(refs, "y"))
    compare(case, "init-state state.h ours-vs-ref64", st.h, stack(refs, "h"))
    compare(
        case,
        "init-state state.conv_window ours-vs-ref64",
        st.conv_window,
        stack(refs, "conv_window"),
    )
    cache = hf_cache_with_state(case, h0, cw0)
    y_hf = hf_forward(case, x, cache)
    compare(case, "init-state ours-vs-hf", y, y_hf)
    compare(case, "init-state ref64-vs-hf", y_hf, stack(refs, "y"))
    # The initial state matters: without it the outputs differ far beyond the tolerance.
    assert np.abs(y - blk.forward(x)).max() > 100 * ATOL
    # Steps from the same written state give the same bits as the one forward (SPEC 3.1).
    st2 = blk.allocate_state(2)
    st2.h[...] = h0
    st2.conv_window[...] = cw0
    ys = np.concatenate([blk.step(x[:, t], st2) for t in range(x.shape[1])], axis=1)
    assert np.array_equal(ys.view(np.uint32), y.view(np.uint32)), name


@pytest.mark.parametrize("name", CASE_NAMES[::2])
def test_ragged_batch_matches_hf_rows_alone(eb, name):
    """Two ragged calls with a state (NaN padding, an idle row) vs HF on each row's tokens."""
    case = get_case(name)
    blk = eb.Mamba2BlockInference(case.weights, **case.options)
    first, second = [SEQ_LEN, 0, 7, 13], [5, 11, 0, 9]
    x1 = make_x(case, 4, seed=6)
    x2 = make_x(case, 4, seed=7, seq_len=11)
    for xx, lens in ((x1, first), (x2, second)):
        for b, n in enumerate(lens):
            xx[b, n:] = np.nan  # padding is never read (SPEC 9)
    st = blk.allocate_state(4)
    y1 = blk.forward(x1, st, lengths=first)
    assert not st.h[1].any() and not st.conv_window[1].any(), "idle row 1 was written"
    h_idle, cw_idle = st.h[2].copy(), st.conv_window[2].copy()
    y2 = blk.forward(x2, st, lengths=second)
    assert np.array_equal(st.h[2], h_idle) and np.array_equal(st.conv_window[2], cw_idle)
    for y, lens in ((y1, first), (y2, second)):
        for b, n in enumerate(lens):
            assert not np.any(y[b, n:].view(np.uint32)), f"{name}: padding of row {b} not +0.0"
    for b in range(4):
        n1, n2 = first[b], second[b]
        xb = np.concatenate([x1[b, :n1], x2[b, :n2]])[None]
        got = np.concatenate([y1[b, :n1], y2[b, :n2]])[None]
        want = hf_forward(case, xb)  # the row alone, all its real tokens in one HF call
        compare(case, "ragged ours-vs-hf_row", got, want)
        ref = mamba2_ref(xb[0], case.params)
        compare(case, "ragged state.h ours-vs-ref64", st.h[b], ref.h)
        compare(case, "ragged state.conv_window ours-vs-ref64", st.conv_window[b], ref.conv_window)
    assert np.array_equal(st.row_tokens, np.add(first, second))


@pytest.mark.parametrize(
    "name", [n for n in CASE_NAMES if _SPECS[n].dt_limit != (0.0, INF)][:2] + ["s16_hd16_g1_k4"]
)
def test_hf_cached_decode(eb, name):
    """SPEC 7.5, both halves: HF's cached one-token decode matches its forward (and our step)
    with the default dt_limit, and departs from it when a finite dt_limit bites."""
    case = get_case(name)
    blk = eb.Mamba2BlockInference(case.weights, **case.options)
    x = make_x(case, 2, seed=8)
    st = blk.allocate_state(2)
    ours = np.concatenate([blk.step(x[:, t], st) for t in range(x.shape[1])], axis=1)
    cache = hf_cache(case)
    prefill = 4
    ys = [hf_forward(case, x[:, :prefill], cache)]
    ys += [hf_forward(case, x[:, t : t + 1], cache) for t in range(prefill, x.shape[1])]
    hf_decode = np.concatenate(ys, axis=1)
    hf_full = hf_forward(case, x)
    compare(case, "step ours-vs-hf_forward", ours, hf_full)
    gap = float(np.abs(hf_decode - hf_full).max())
    print(f"[oracle] {name} hf_decode-vs-hf_forward: max_abs={gap:.3e}")
    if case.spec.dt_limit == (0.0, INF):
        compare(case, "step ours-vs-hf_decode", ours, hf_decode)
    else:
        assert gap > 100 * ATOL, f"{name}: HF decode now clamps dt? gap {gap:.3e} (SPEC 7.5)"


# --------------------------------------------------------------------------- table


def error_table(cases) -> str:
    """Markdown table of the largest errors recorded per case (filled by the tests)."""
    whats = sorted({w for c in cases for w in c.errors})
    lines = ["| case | comparison | max_abs | max_rel |", "|---|---|---|---|"]
    for c in cases:
        for w in whats:
            if w in c.errors:
                mx, rel = c.errors[w]
                lines.append(f"| {c.spec.name} | {w} | {mx:.2e} | {rel:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - prints the per-case error table
    import exactblocks as _eb

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    torch.set_num_threads(TORCH_THREADS)
    for nm in CASE_NAMES:
        test_forward_matches_hf(_eb, nm)
        test_step_decode_matches_hf_forward(_eb, nm)
        test_chunked_forward_with_state_matches_hf(_eb, nm)
        test_initial_state_matches_reference_and_hf(_eb, nm)
        test_ragged_batch_matches_hf_rows_alone(_eb, nm)
    print(error_table([get_case(n) for n in CASE_NAMES]))
