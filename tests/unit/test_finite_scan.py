"""The native finiteness scans that guard every call (SPEC 2.4): they find the FIRST non-finite
element whatever the thread count and ISA, and see NaN, +inf and -inf but no finite value
(largest finite, subnormals, -0.0)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import force_num_threads, make_transformer_weights

import exactblocks as eb
from exactblocks import _ext


@pytest.fixture(scope="module")
def core():
    return _ext.core()


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    saved = eb.get_num_threads()
    force_num_threads(request.param)
    yield request.param
    eb.set_num_threads(saved)


@pytest.fixture(params=_ext.core().available_isas())
def isa(request, core):
    saved = core.get_isa()
    core.set_isa(request.param)
    yield request.param
    core.set_isa(saved)


def test_first_nonfinite_finds_first(core, threads, isa):
    a = np.linspace(-3e38, 3e38, 600_001, dtype=np.float32)  # > one parallel piece
    a[1::7] = np.float32(1e-45)  # subnormal
    a[2::11] = np.float32(-0.0)
    a[3] = np.finfo(np.float32).max
    assert core.first_nonfinite(a) == -1
    assert core.first_nonfinite(a[:0]) == -1
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[[599_999, 400_000, 123_457]] = bad
        assert core.first_nonfinite(b) == 123_457
        b[5] = bad
        assert core.first_nonfinite(b) == 5
        assert core.first_nonfinite(b.reshape(600_001, 1)) == 5


def test_first_nonfinite_spans(core, threads, isa):
    cache = np.ones((3, 2, 4000, 16), np.float32)  # (B, KV, cap, hd)
    spans = np.array([[0, 0, 4000], [2, 100, 3000], [2, 3500, 3900]], np.int64)
    assert core.first_nonfinite_spans(cache, spans) is None
    cache[2, 1, 3600, 5] = np.nan  # in span 2
    cache[1, 0, 10, 0] = np.inf  # row 1 is not read: never reported
    cache[2, 0, 99, 3] = np.nan  # just before span 1: not read
    assert core.first_nonfinite_spans(cache, spans) == (2, 1, 3600, 5)
    cache[2, 1, 2999, 15] = -np.inf  # last element of span 1, KV head 1
    assert core.first_nonfinite_spans(cache, spans) == (1, 1, 2999, 15)
    cache[2, 0, 2000, 1] = np.nan  # KV head 0 of span 1 comes first
    assert core.first_nonfinite_spans(cache, spans) == (1, 0, 2000, 1)
    # A row's spans are searched head by head: (row, KV head, position) order, so head 0's
    # later span beats head 1's earlier one.
    cache[2, 0, 2000, 1] = 1.0
    cache[2, 0, 3800, 0] = np.inf
    assert core.first_nonfinite_spans(cache, spans) == (2, 0, 3800, 0)
    assert core.first_nonfinite_spans(cache, spans[:1]) is None


def test_state_error_names_first_bad_slot_of_a_wrapped_window():
    rng = np.random.default_rng(5)
    d, H, KV, hd = 32, 4, 2, 8
    w = make_transformer_weights(rng, d, H, KV, hd, 48, scale=0.3)
    blk = eb.TransformerBlockInference(w, n_heads=H, n_kv_heads=KV, window=5)
    st = blk.allocate_state(2, 64)
    x = rng.standard_normal((2, 7, d)).astype(np.float32)
    blk.forward(x, st)  # positions 0..6 -> ring slots 0,1,2,3,4,0,1 (capacity 5)
    # The next query (7) reads positions 3..6 = slots 3, 4, 0, 1: two spans of the ring.
    st.v_cache[1, 0, 0, 2] = np.nan  # row 1, position 5
    st.k_cache[1, 1, 4, 7] = np.inf  # row 1, position 4
    st.k_cache[0, 0, 2, 0] = np.nan  # slot 2 (position 7's own slot): not read
    before = (st.k_cache.copy(), st.v_cache.copy(), st.row_tokens.copy())
    with pytest.raises(ValueError, match=r"state\.k_cache\[1, 1, 4, 7\] \(row 1, position 4,"):
        blk.step(x[:, 0], st)
    st.k_cache[1, 1, 4, 7] = 0.0
    with pytest.raises(ValueError, match=r"state\.v_cache\[1, 0, 0, 2\] \(row 1, position 5,"):
        blk.step(x[:, 0], st)
    assert np.array_equal(st.row_tokens, before[2])
    st.v_cache[1, 0, 0, 2] = 0.0
    blk.step(x[:, 0], st)


@pytest.mark.parametrize("fed", [3, 6])  # window 4: the ring has not / has wrapped
def test_state_error_order_does_not_depend_on_the_ring(fed):
    """The first bad element is chosen in (row, k before v, KV head, position) order."""
    rng = np.random.default_rng(7)
    d, H, KV, hd = 32, 4, 2, 8
    w = make_transformer_weights(rng, d, H, KV, hd, 48, scale=0.3)
    blk = eb.TransformerBlockInference(w, n_heads=H, n_kv_heads=KV, window=4)
    st = blk.allocate_state(1, 64)
    x = rng.standard_normal((1, fed, d)).astype(np.float32)
    blk.forward(x, st)
    q = fed  # the next query reads positions q-3 .. q-1
    oldest, newest = (q - 3) % 4, (q - 1) % 4
    st.k_cache[0, 1, oldest, 0] = np.nan  # KV head 1, oldest position read
    st.k_cache[0, 0, newest, 0] = np.nan  # KV head 0, newest position read
    with pytest.raises(
        ValueError,
        match=rf"state\.k_cache\[0, 0, {newest}, 0\] \(row 0, "
        rf"position {q - 1},",
    ):
        blk.step(x[:, 0], st)


def _readable_bad(k, v, start, lens, window):
    """Reference of SPEC 5's reading rule: does any row read a non-finite cache slot?"""
    cap = k.shape[2]
    for b in range(k.shape[0]):
        q0 = int(start[b])
        if lens[b] == 0 or q0 == 0:
            continue
        j0 = max(0, q0 - window + 1) if window > 0 else 0
        slots = [j % cap for j in range(j0, q0)]
        if not (np.isfinite(k[b][:, slots]).all() and np.isfinite(v[b][:, slots]).all()):
            return True
    return False


@pytest.mark.parametrize("window", [0, 5, 24])
def test_cache_check_in_the_kernel_matches_the_reading_rule(window, threads):
    """The call checks the slots it reads while reading them (decode rows, short chunks and
    prefill rows of >= 16 tokens): it raises exactly when SPEC 5's rule finds a non-finite
    read slot, and then leaves the state untouched."""
    rng = np.random.default_rng(100 + window)
    d, H, KV, hd = 16, 4, 2, 8
    w = make_transformer_weights(rng, d, H, KV, hd, 24, scale=0.3)
    blk = eb.TransformerBlockInference(w, n_heads=H, n_kv_heads=KV, window=window)
    raised = passed = 0
    for case in range(60):
        st = blk.allocate_state(3, 96)
        pre = rng.integers(0, 40, size=3)
        x = rng.standard_normal((3, int(pre.max()) or 1, d)).astype(np.float32)
        blk.forward(x, st, lengths=np.minimum(pre, x.shape[1]))
        for _ in range(int(rng.integers(1, 4))):  # poison a few slots, read or not
            buf = st.k_cache if rng.random() < 0.5 else st.v_cache
            idx = tuple(int(rng.integers(0, s)) for s in buf.shape)
            buf[idx] = rng.choice([np.nan, np.inf, -np.inf])
        n_new = int(rng.choice([1, 3, 20]))  # decode, short chunk, prefill block
        lens = rng.integers(0, n_new + 1, size=3)
        xn = rng.standard_normal((3, n_new, d)).astype(np.float32)
        before = (st.k_cache.copy(), st.v_cache.copy(), st.row_tokens.copy())
        start = st.row_tokens.copy()
        want_error = _readable_bad(st.k_cache, st.v_cache, start, lens, window)
        try:
            y = blk.forward(xn, st, lengths=lens)
        except ValueError as exc:
            assert want_error, (case, str(exc))
            assert "must be finite" in str(exc)
            for a, b in zip(before, (st.k_cache, st.v_cache, st.row_tokens)):
                assert a.tobytes() == b.tobytes()
            raised += 1
        else:
            assert not want_error, case
            for b in range(3):
                assert np.isfinite(y[b, : lens[b]]).all()
            passed += 1
    assert raised > 5 and passed > 5, (raised, passed)


def test_non_finite_error_carries_its_fields_through_pickle():
    import pickle

    from exactblocks._validation import NonFiniteError, check_finite

    with pytest.raises(NonFiniteError) as err:
        check_finite(np.array([[1.0, 2.0], [np.nan, 3.0]], np.float32), "x", "Block.forward")
    e = pickle.loads(pickle.dumps(err.value))
    assert isinstance(e, ValueError) and str(e) == str(err.value)
    assert (e.where, e.name, e.index, e.flat_index) == ("Block.forward", "x", (1, 0), None)
    assert np.isnan(e.value)
