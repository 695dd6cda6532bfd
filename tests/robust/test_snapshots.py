"""Snapshots of a state (pickle, copy, deepcopy, keys, values) take the state's lock: taken while
another thread's call runs, they wait for it and show the state after it, never a mix (SPEC.md
2.6)."""

from __future__ import annotations

import copy
import pickle
import threading
import time

import numpy as np
import pytest
from helpers import make_mamba2_weights, make_transformer_weights
from robust_helpers import differing, small_transformer, state_bytes


def _long_call_case(kind):
    """A block, a state and x whose forward takes a good fraction of a second on one thread."""
    import exactblocks as eb

    rng = np.random.default_rng(5)
    if kind == "transformer":
        w = make_transformer_weights(rng, 256, 8, 4, 32, 1024)
        blk = eb.TransformerBlockInference(w, n_heads=8, window=200)
        st = blk.allocate_state(2, 1024)
        x = rng.standard_normal((2, 700, 256)).astype(np.float32)
    else:
        blk = eb.Mamba2BlockInference(
            make_mamba2_weights(5, d=256, di=512, nh=8, ns=64, ng=2), n_groups=2
        )
        st = blk.allocate_state(2)
        x = rng.standard_normal((2, 1200, 256)).astype(np.float32)
    return blk, st, x


SNAPSHOTS = {
    "pickle": lambda st: pickle.loads(pickle.dumps(st)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


@pytest.mark.parametrize("how", sorted(SNAPSHOTS))
@pytest.mark.parametrize("kind", ["transformer", "mamba2"])
def test_snapshot_during_a_call_waits_for_it(core, kind, how):
    import exactblocks as eb

    blk, st, x = _long_call_case(kind)
    saved = eb.get_num_threads()
    eb.set_num_threads(1)
    errors = []

    def call():
        try:
            blk.forward(x, st)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 10
        while not st._lock.locked() and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert st._lock.locked(), "the call did not start, or ended before it could be seen"
        t0 = time.perf_counter()
        snap = SNAPSHOTS[how](st)
        waited = time.perf_counter() - t0
        t.join()
    finally:
        eb.set_num_threads(saved)
    assert not errors, errors
    # The snapshot is the state after the call, byte for byte (it waited for the call).
    stale = differing(state_bytes(snap), state_bytes(st))
    assert not stale, (
        f"{how} during a call: {stale} differ from the state after it ({waited:.3f} s)"
    )
    assert not st._lock.locked() and not snap._lock.locked()


def test_keys_and_values_wait_too(core):
    import exactblocks as eb

    blk, st, x = _long_call_case("transformer")
    saved = eb.get_num_threads()
    eb.set_num_threads(1)
    try:
        t = threading.Thread(target=blk.forward, args=(x, st))
        t.start()
        while not st._lock.locked() and t.is_alive():
            time.sleep(0.0005)
        k = st.keys(row=1)
        t.join()
    finally:
        eb.set_num_threads(saved)
    np.testing.assert_array_equal(k.view(np.uint32), st.keys(row=1).view(np.uint32))


def test_snapshot_inside_a_call_of_the_same_thread_is_refused(core):
    # A snapshot cannot wait for a call of its own thread (say, a signal handler running while
    # the call's Python part runs): RuntimeError at once instead of a deadlock.
    blk = small_transformer()
    st = blk.allocate_state(1, 4)
    with st._lock.claim("held by the test"):
        for how, fn in SNAPSHOTS.items():
            with pytest.raises(RuntimeError, match="same thread") as info:
                fn(st)
            assert "TransformerState" in str(info.value), how
    assert pickle.loads(pickle.dumps(st)).row_tokens.tolist() == [0]


def test_snapshot_wait_is_bounded(core, monkeypatch):
    import exactblocks._state as state_mod

    monkeypatch.setattr(state_mod, "SNAPSHOT_TIMEOUT", 0.2)
    blk = small_transformer()
    st = blk.allocate_state(1, 4)
    held, release = threading.Event(), threading.Event()

    def hold():
        with st._lock.claim("held by the test"):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"did not finish within 0\.2"):
            pickle.dumps(st)
        assert time.perf_counter() - t0 < 5
    finally:
        release.set()
        t.join()
    pickle.dumps(st)  # free again


MODEL_SNAPSHOTS = {
    "pickle": lambda st: pickle.loads(pickle.dumps(st)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


@pytest.mark.parametrize("how", sorted(MODEL_SNAPSHOTS))
def test_model_state_snapshot_during_a_call_waits_for_it(core, hybrid_folder, how):
    from robust_helpers import model_state_bytes

    import exactblocks as eb

    model = eb.load_model(hybrid_folder)
    st = model.allocate_state(1, 1100)
    ids = np.random.default_rng(3).integers(0, 320, (1, 1100))
    saved = eb.get_num_threads()
    eb.set_num_threads(1)
    errors = []

    def call():
        try:
            model.forward(ids, st)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 10
        while not st._lock.locked() and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert st._lock.locked(), "the call did not start, or ended before it could be seen"
        snap = MODEL_SNAPSHOTS[how](st)
        t.join()
    finally:
        eb.set_num_threads(saved)
    assert not errors, errors
    assert snap.row_tokens.tolist() == [1100]
    stale = differing(model_state_bytes(snap), model_state_bytes(st))
    assert not stale, f"{how} of a ModelState during a call: {stale[:6]} differ from after it"
    assert not st._lock.locked() and not snap._lock.locked()


def test_model_state_snapshot_inside_a_call_of_the_same_thread_is_refused(core, tiny_hybrid_folder):
    import exactblocks as eb

    model = eb.load_model(tiny_hybrid_folder)
    st = model.allocate_state(1, 8)
    with st._lock.claim("held by the test"):
        for how, fn in MODEL_SNAPSHOTS.items():
            with pytest.raises(RuntimeError, match="same thread") as info:
                fn(st)
            assert "ModelState" in str(info.value), how
    assert pickle.loads(pickle.dumps(st)).row_tokens.tolist() == [0]
