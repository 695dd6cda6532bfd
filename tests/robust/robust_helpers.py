"""Helpers of the robustness tests: small blocks, byte snapshots of states, exception
injection after every call event of a block call, and subprocess runs with a timeout.

A unique module name (tests import helpers by name, and several folders have a conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
from helpers import make_mamba2_weights, make_transformer_weights

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_transformer(window: int = 0, **kw):
    """A TransformerBlockInference of the API sizes (d 32, 4 heads of 8, 2 KV heads)."""
    import exactblocks as eb

    w = make_transformer_weights(np.random.default_rng(7), 32, 4, 2, 8, 64)
    return eb.TransformerBlockInference(w, n_heads=4, window=window, **kw)


def small_mamba2():
    """A Mamba2BlockInference of d_model 24, d_inner 48, 6 heads, d_state 5, 2 groups."""
    import exactblocks as eb

    return eb.Mamba2BlockInference(make_mamba2_weights(3), n_groups=2)


def save_hybrid_model(folder: str, *, hidden: int, heads: int, head_dim: int, state: int,
                      max_positions: int, pattern: str = "M*-M*-") -> str:  # fmt: skip
    """Save a random Nemotron-H model (Mamba-2, attention and MLP layers: ``pattern``, HF's
    ``hybrid_override_pattern``) as transformers saves it, into ``folder``; return ``folder``.
    Needs torch and transformers (a skip locally without them, an error under CI)."""
    import pytest

    if os.environ.get("CI"):  # CI has them: fail rather than skip there
        import torch
        import transformers
    else:  # pragma: no cover - local convenience only
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(
        vocab_size=320,
        hidden_size=hidden,
        hybrid_override_pattern=pattern,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=head_dim,
        intermediate_size=2 * hidden,
        ssm_state_size=state,
        mamba_num_heads=2 * hidden // head_dim,
        mamba_head_dim=head_dim,
        n_groups=2,
        max_position_embeddings=max_positions,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(folder)
    return folder


def model_state_bytes(state) -> dict:
    """:func:`state_bytes` of every layer of a ModelState, keyed ``layers[i].<buffer>``."""
    return {
        f"layers[{i}].{name}": raw
        for i, layer in enumerate(state.layers)
        for name, raw in state_bytes(layer).items()
    }


def state_bytes(st) -> dict:
    """Every buffer and counter of a state, as bytes (byte equality is the test)."""
    return {
        name: bytes(np.ascontiguousarray(getattr(st, name)).tobytes())
        for name in (*type(st)._BUFFERS, "row_tokens")
    }


def differing(a: dict, b: dict) -> list:
    """Names of the buffers two :func:`state_bytes` snapshots disagree on (a short message; a
    plain ``==`` of the dicts makes pytest diff megabytes of bytes)."""
    return sorted(k for k in a if a[k] != b.get(k))


def load_bytes(st, snap: dict) -> None:
    """Write a :func:`state_bytes` snapshot back into the state's own arrays."""
    for name, raw in snap.items():
        arr = getattr(st, name)
        arr[...] = np.frombuffer(raw, dtype=arr.dtype).reshape(arr.shape)


class Injected(BaseException):
    """What the injector raises: a BaseException, like KeyboardInterrupt."""


def _profiled(run, prof) -> None:
    """``run()`` with ``prof`` as the profile function; ``prof`` sees only run's own events."""
    active = [False]

    def gated(frame, event, arg):
        if active[0]:
            prof(frame, event, arg)

    sys.setprofile(gated)
    try:
        active[0] = True
        try:
            run()
        finally:
            active[0] = False
    finally:
        sys.setprofile(None)


def profile_events(run) -> int:
    """How many profiler events (call, return, c_call, c_return) ``run()`` makes."""
    n = [0]

    def count(frame, event, arg):
        n[0] += 1

    _profiled(run, count)
    return n[0]


def run_injected(run, k: int) -> bool:
    """Run ``run()`` raising :class:`Injected` from the profiler at its k-th event (0-based).

    An exception raised by a profile function propagates into the profiled code at that point,
    as an exception raised by a signal handler does when the interpreter checks for pending
    signals (at calls and returns, and after a native call returns). Returns True when ``run``
    completed (k is past its last event), False when Injected propagated.
    """
    seen = [0]

    def prof(frame, event, arg):
        seen[0] += 1
        if seen[0] == k + 1:
            raise Injected(f"injected at event {k} ({event})")

    try:
        _profiled(run, prof)
        return True
    except Injected:
        return False


def run_python(code: str, timeout: float = 120, env: dict | None = None, **kw):
    """Run ``code`` (dedented) in a fresh interpreter with this test run's import path.

    Returns the CompletedProcess (text mode, output captured); never raises on a non-zero
    exit. The timeout kills a hung child (subprocess.TimeoutExpired then fails the test).
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([TESTS, *sys.path])
    full_env.pop("EXACTBLOCKS_NUM_THREADS", None)
    full_env.pop("OMP_NUM_THREADS", None)
    if env:
        for k, v in env.items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        **kw,
    )
