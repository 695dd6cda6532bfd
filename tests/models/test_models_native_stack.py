"""A model call runs each run of transformer layers in one native call (``_core.layer_stack``,
``Model._stack_run``): the same bits and state updates as the blocks' own calls one by one, and,
for anything the native call will not run (a busy layer state, a non-finite cache slot, a layer
state made read-only, an open decode session), the block's own error, named after the model
call and the layer, with the state unchanged.

The per-layer path is what a model call did before the native call: it is forced here by
turning the native call off (white-box: ``Model._native_layers``).
"""

from __future__ import annotations

import numpy as np
import pytest
from models_helpers import bits

import exactblocks as eb


def _layer_bytes(state) -> list:
    return [
        (st.k_cache.tobytes(), st.v_cache.tobytes(), st.row_tokens.tobytes()) for st in state.layers
    ]


def _state_bytes(state) -> list:
    """Every buffer and counter of every layer (either kind), as bytes."""
    return [
        tuple(getattr(st, name).tobytes() for name in (*type(st)._BUFFERS, "row_tokens"))
        for st in state.layers
    ]


def _per_layer(model):
    """The same model, its layers called one by one through the blocks (the reference path)."""
    object.__setattr__(model, "_native_layers", False)
    return model


@pytest.fixture(scope="module")
def llama(tiny):
    folder, _ = tiny("llama")
    return eb.load_model(folder), _per_layer(eb.load_model(folder))


def test_native_stack_is_bitwise_the_per_layer_path(llama):
    fast, slow = llama
    n = len(fast.blocks)
    probe = fast.allocate_state(1, 8)
    x = fast._lookup(np.array([5]))
    _, ran = fast._stack_run(x, probe, None, 0, undo=None, workspace=None)
    assert ran == n  # every layer in one native call
    ids = np.array([[5, 9, 3, 7, 1, 2], [4, 8, 6, 0, 0, 0]])
    states = [m.allocate_state(2, 32) for m in (fast, slow)]
    outs = [m.forward(ids, st, lengths=[6, 3]) for m, st in zip((fast, slow), states)]
    assert np.array_equal(bits(outs[0]), bits(outs[1]))
    for tok in ([11, 12], [13, 14], [15, 16]):
        steps = [m.step(tok, st) for m, st in zip((fast, slow), states)]
        assert np.array_equal(bits(steps[0]), bits(steps[1]))
    assert _layer_bytes(states[0]) == _layer_bytes(states[1])
    # decode == prefill through the native path, as through the blocks
    full = fast.forward(np.array([[5, 9, 3, 7, 1, 2, 11, 13, 15]]))
    assert np.array_equal(bits(steps[0][0, 0]), bits(full[0, -1]))
    # generate (its own state and workspace) gives the same tokens either way
    g = [m.generate([5, 9, 3], max_new_tokens=8).ids for m in (fast, slow)]
    assert g[0] == g[1] and len(g[0]) == 8


def test_busy_layer_state_is_refused_naming_the_layer(llama):
    fast, _ = llama
    st = fast.allocate_state(1, 16)
    fast.forward(np.array([[5, 9, 3]]), st)
    before = _layer_bytes(st)
    with st.layers[1]._lock.claim("TransformerBlockInference.step: state is in use"):
        with pytest.raises(RuntimeError, match=r"^Model\.step: layer 1: .*in use"):
            fast.step([7], st)
    assert _layer_bytes(st) == before  # layer 0 ran natively, and was rolled back
    ref = fast.allocate_state(1, 16)
    fast.forward(np.array([[5, 9, 3]]), ref)
    assert np.array_equal(bits(fast.step([7], st)), bits(fast.step([7], ref)))


def test_nonfinite_cache_slot_of_a_late_layer_is_named(llama):
    fast, _ = llama
    st = fast.allocate_state(1, 16)
    fast.forward(np.array([[5, 9, 3]]), st)
    st.layers[1].k_cache[0, 1, 2, 3] = np.nan
    before = _layer_bytes(st)
    with pytest.raises(ValueError, match=r"^Model\.step: layer 1: state\.k_cache\[0, 1, 2, 3\]"):
        fast.step([7], st)
    assert _layer_bytes(st) == before


def test_layer_errors_carry_structured_fields(llama):
    """A layer's error says where, which layer, what kind and the block's detail as fields
    (read from the block's exception, not parsed out of its message)."""
    fast, _ = llama
    st = fast.allocate_state(1, 16)
    fast.forward(np.array([[5, 9, 3]]), st)
    st.layers[1].k_cache[0, 1, 2, 3] = np.nan
    with pytest.raises(ValueError) as err:
        fast.step([7], st)
    e = err.value
    assert (e.where, e.layer, e.kind) == ("Model.step", 1, "invalid")
    assert e.detail.startswith("state.k_cache[0, 1, 2, 3]") and "must be finite" in e.detail
    assert str(e) == f"Model.step: layer 1: {e.detail}; the state is unchanged"
    import pickle

    back = pickle.loads(pickle.dumps(e))  # the fields cross processes (Ray, multiprocessing)
    assert (back.where, back.layer, back.kind, back.detail) == (e.where, 1, e.kind, e.detail)
    x = fast._lookup(np.array([[7]]))
    x[0, 0, 3] = np.inf  # what an overflowing embedding would hand layer 0
    want = r"^Model\.forward: the activations overflowed in the embedding \(x\[0, 0, 3\] = inf "
    with pytest.raises(ValueError, match=want + r"entering layer 0\)") as err:
        fast._run_blocks(x, None, None, step=False, where="Model.forward")
    assert (err.value.layer, err.value.kind) == (0, "overflow")


def test_read_only_layer_buffer_and_open_session_are_refused(llama):
    fast, _ = llama
    st = fast.allocate_state(1, 16)
    fast.forward(np.array([[5, 9, 3]]), st)
    before = _layer_bytes(st)
    st.layers[1].v_cache.setflags(write=False)
    try:
        with pytest.raises(ValueError, match=r"^Model\.step: layer 1: .*v_cache"):
            fast.step([7], st)
    finally:
        st.layers[1].v_cache.setflags(write=True)
    assert _layer_bytes(st) == before
    with fast.blocks[1].decode_session(st.layers[1]):
        with pytest.raises(ValueError, match=r"^Model\.step: layer 1: .*decode session"):
            fast.step([7], st)
    assert _layer_bytes(st) == before


def _tamper(st, how: str) -> None:
    """Swap a buffer of layer 1 the way SPEC 2.5's buffer check guards against."""
    layer = st.layers[1]
    k = layer.k_cache
    if how == "alias":  # v_cache the very array of k_cache
        object.__setattr__(layer, "v_cache", k)
    elif how == "capacity":  # a k_cache with more slots than the state's capacity
        bigger = np.zeros(k.shape[:2] + (k.shape[2] + 4,) + k.shape[3:], np.float32)
        object.__setattr__(layer, "k_cache", bigger)
    elif how == "byteorder":  # the same values, big-endian
        object.__setattr__(layer, "k_cache", k.astype(">f4"))
    elif how == "unaligned":  # float32 values one byte off a float's alignment
        raw = np.zeros(k.nbytes + 1, np.uint8)
        view = raw[1:].view(np.float32).reshape(k.shape)
        view[...] = k
        object.__setattr__(layer, "k_cache", view)
    elif how == "fortran":  # the same values in Fortran order (not C-contiguous)
        object.__setattr__(layer, "v_cache", np.asfortranarray(layer.v_cache))
    elif how == "strided":  # row_tokens as a strided view (the native call must not copy it)
        wide = np.zeros(2 * layer.row_tokens.shape[0], np.int64)
        wide[::2] = layer.row_tokens
        object.__setattr__(layer, "row_tokens", wide[::2])
    elif how == "counters":  # row_tokens past max_tokens
        layer.row_tokens[0] = layer.max_tokens + 1


@pytest.mark.parametrize(
    "how", ["alias", "capacity", "byteorder", "unaligned", "fortran", "strided", "counters"]
)
def test_tampered_layer_state_gives_the_per_layer_error(llama, how):
    # the native call refuses what the block's own call refuses, so the model raises the same
    # error, naming layer 1, whichever path runs, and changes nothing
    messages = []
    for model in llama:
        st = model.allocate_state(2, 16)
        model.forward(np.array([[5, 9, 3], [4, 8, 6]]), st)
        _tamper(st, how)
        before = _layer_bytes(st)
        with pytest.raises(ValueError, match=r"^Model\.step: layer 1: ") as err:
            model.step([7, 2], st)
        assert _layer_bytes(st) == before
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_copied_and_unpickled_states_run_natively(llama):
    # a state restored from a pickle holds the fingerprint as a str: still recognised as the
    # model's, so its layers run in the native call, with the same bits as the original
    import copy
    import pickle

    fast, _ = llama
    st = fast.allocate_state(1, 16)
    fast.forward(np.array([[5, 9, 3]]), st)
    n = len(fast.blocks)
    x = fast._lookup(np.array([7]))
    outs = []
    for other in (copy.copy(st), pickle.loads(pickle.dumps(st)), st):
        y, ran = fast._stack_run(x, other, None, 0, undo=None, workspace=None)
        assert ran == n
        outs.append(bits(y))
    assert np.array_equal(outs[0], outs[2]) and np.array_equal(outs[1], outs[2])


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h", "granitemoehybrid", "gemma3"])
def test_native_stack_is_bitwise_the_per_layer_path_for_every_layer_kind(tiny, family):
    # Mamba-2 layers run in the same native call as transformer layers (hybrids: one call for
    # the whole stack), with the bits and state bytes of the blocks' own calls
    folder, _ = tiny(family)
    fast, slow = eb.load_model(folder), _per_layer(eb.load_model(folder))
    n = len(fast.blocks)
    probe = fast.allocate_state(1, 8)
    _, ran = fast._stack_run(fast._lookup(np.array([5])), probe, None, 0, undo=None,
                             workspace=None)  # fmt: skip
    assert ran == n
    ids = np.array([[5, 9, 3, 7, 1, 2, 8, 4], [4, 8, 6, 0, 0, 0, 0, 0]])
    states = [m.allocate_state(2, 32) for m in (fast, slow)]
    outs = [m.forward(ids, st, lengths=[8, 3]) for m, st in zip((fast, slow), states)]
    assert np.array_equal(bits(outs[0]), bits(outs[1]))
    for tok in ([11, 12], [13, 14], [15, 16]):
        steps = [m.step(tok, st) for m, st in zip((fast, slow), states)]
        assert np.array_equal(bits(steps[0]), bits(steps[1]))
    assert _state_bytes(states[0]) == _state_bytes(states[1])
    g = [m.generate([5, 9, 3], max_new_tokens=6, temperature=0.8, seed=3).ids for m in (fast, slow)]
    assert g[0] == g[1] and len(g[0]) == 6


def test_nonfinite_mamba2_state_is_named(tiny):
    folder, _ = tiny("nemotron_h")
    model = eb.load_model(folder)
    i = next(j for j, b in enumerate(model.blocks) if isinstance(b, eb.Mamba2BlockInference))
    st = model.allocate_state(1, 16)
    model.forward(np.array([[5, 9, 3]]), st)
    st.layers[i].h[0, 0, 0, 1] = np.inf
    before = _state_bytes(st)
    with pytest.raises(ValueError, match=rf"^Model\.step: layer {i}: state\.h\[0, 0, 0, 1\]"):
        model.step([7], st)
    assert _state_bytes(st) == before


def test_late_failure_on_another_thread_says_which_rows_are_left_inconsistent(tiny):
    # off the main thread nothing is saved: a layer after the first failing leaves the rows the
    # earlier layers advanced inconsistent, and the error says so (as well as naming the value)
    import threading

    folder, _ = tiny("nemotron_h")
    model = eb.load_model(folder)
    i = max(j for j, b in enumerate(model.blocks) if isinstance(b, eb.Mamba2BlockInference))
    assert i > 0
    st = model.allocate_state(2, 16)
    model.forward(np.array([[5, 9, 3], [4, 8, 6]]), st)
    st.layers[i].h[1, 0, 0, 1] = np.nan
    errors = []

    def run():
        try:
            model.step([7, 2], st)
        except ValueError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1
    assert errors[0].startswith(f"Model.step: layer {i}: state.h[1, 0, 0, 1]"), errors[0]
    assert errors[0].endswith(
        "state rows [0, 1] are left inconsistent (the call ran on another "
        "thread than the main one): reset() them"
    ), errors[0]
    with pytest.raises(ValueError, match=r"rows \[0, 1\] are inconsistent"):
        model.step([7, 2], st)


def test_hidden_states_and_logits_are_the_bits_of_forward(llama):
    """The public calls apps use (exactblocks.ray): a block's output and the head on chosen
    rows, through the native layer path, give forward's bits; a ragged row equals it alone."""
    fast, slow = llama
    ids = np.array([[5, 9, 3, 7], [4, 8, 0, 0]])
    lens = np.array([4, 2])
    want = fast.forward(ids, lengths=lens)
    h = fast.hidden_states(ids, lengths=lens, layer=-1)
    assert h.shape == (2, 4, fast.d_model) and h.dtype == np.float32
    got = fast.logits(h[1, :2])
    assert np.array_equal(bits(got), bits(want[1, :2]))
    assert np.array_equal(bits(fast.logits(h[0])), bits(want[0]))
    alone = fast.hidden_states(ids[1:, :2], layer=0)[0]
    assert np.array_equal(bits(alone), bits(fast.hidden_states(ids, lengths=lens, layer=0)[1, :2]))
    assert np.array_equal(bits(alone), bits(slow.blocks[0].forward(fast._lookup(ids[1:, :2]))[0]))
    normed = fast.hidden_states(ids, lengths=lens)
    assert np.isfinite(normed[1, :2]).all() and not np.array_equal(normed[1, :2], h[1, :2])
    with pytest.raises(ValueError, match=r"^Model\.hidden_states: layer=9; the model has"):
        fast.hidden_states(ids, layer=9)
    with pytest.raises(ValueError, match=r"^Model\.logits: hidden has shape \(3,\); expected"):
        fast.logits(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"^Model\.logits: hidden has dtype float64"):
        fast.logits(np.zeros((1, fast.d_model)))
