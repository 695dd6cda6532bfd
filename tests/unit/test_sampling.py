"""exactblocks.sampling: pick_token against a plain reference, the Detokenizer on real UTF-8.

The reference below is written from pick_token's documented definition with Python lists,
``sorted`` and Python float (binary64) sums, one step per line of the Notes; the only library
piece it uses is the float32 ``exp`` the definition names. pick_token must return the same
token and leave the generator in the same state, over many random logits with ties, signed
zeros, temperatures, top_k, top_p and seeds, and at real vocabulary sizes.

pick_token runs the native ``_core.sample_token`` (csrc/ops/sample.hpp); the NumPy
implementation it replaced is kept as ``sampling._pick_token_reference``. The two must return
the same token and consume the generator identically, on every ISA and from parallel threads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactblocks import _ext
from exactblocks.sampling import _pick_token_reference, pick_token
from exactblocks.text import Detokenizer


def _exp32(x: np.ndarray) -> np.ndarray:
    return _ext.core().elementwise("exp", np.ascontiguousarray(x, dtype=np.float32))


def reference_pick(logits, temperature, top_k, top_p, rng) -> int:
    """pick_token's Notes, step by step, without any cleverness."""
    V = logits.size
    if temperature == 0.0:
        best = 0
        for i in range(V):
            if logits[i] > logits[best]:
                best = i
        return best
    # 1. z in float32
    z = logits if temperature == 1.0 else logits / np.float32(temperature)
    # 2. ids by z descending, then id ascending (-0.0 == +0.0 as Python floats)
    order = sorted(range(V), key=lambda i: (-float(z[i]), i))
    # 3. top_k: z >= the k-th entry's z
    if top_k is not None and top_k < V:
        kth = z[order[top_k - 1]]
        order = [i for i in order if z[i] >= kth]
    # 4. e = exp(z - z[order[0]]) in float32, summed left to right in binary64
    zs = np.array([z[i] for i in order], dtype=np.float32)
    e = _exp32(zs - zs[0])
    c, s = [], 0.0
    for v in e.tolist():
        s = s + v
        c.append(s)
    # 5. top_p: entries whose sum before them is < top_p * total, at least one
    n = len(order)
    if top_p is not None and top_p < 1.0:
        n = max(1, sum(1 for j in range(len(c)) if (c[j - 1] if j else 0.0) < top_p * c[-1]))
    # 6. one draw; the first entry whose running sum exceeds it
    u = rng.random() * c[n - 1]
    for i in range(n):
        if c[i] > u:
            return order[i]
    return order[n - 1]


def _random_logits(rs: np.random.Generator, V: int) -> np.ndarray:
    kind = rs.integers(5)
    if kind == 0:  # many ties
        z = rs.integers(-4, 5, V).astype(np.float32)
    elif kind == 1:  # real-model-like spread
        z = rs.normal(0.0, 3.0, V).astype(np.float32) + np.float32(rs.normal(0, 5))
    elif kind == 2:  # a peaked distribution
        z = rs.normal(-10.0, 2.0, V).astype(np.float32)
        z[rs.integers(0, V, 3)] = rs.normal(8.0, 1.0, 3).astype(np.float32)
    elif kind == 3:  # a huge spread: exp underflows for most
        z = rs.normal(0.0, 80.0, V).astype(np.float32)
    else:  # signed zeros among ties and small values
        z = rs.choice(np.array([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5], np.float32), V)
    return np.ascontiguousarray(z, dtype=np.float32)


@pytest.mark.parametrize("block", range(4))
def test_pick_token_equals_reference_on_random_logits(block):
    rs = np.random.default_rng(1000 + block)
    for case in range(300):
        V = int(rs.choice([1, 2, 3, 7, 16, 33, 100, 257, 1000]))
        logits = _random_logits(rs, V)
        temp = float(rs.choice([0.0, 0.05, 0.3, 0.7, 1.0, 1.3, 3.0]))
        top_k = rs.choice([None, 1, 2, 5, int(rs.integers(1, V + 1)), V, V + 3])
        top_k = None if top_k is None else int(top_k)
        top_p = rs.choice([None, 1e-9, 0.1, 0.5, 0.9, 0.99, 1.0])
        top_p = None if top_p is None else float(top_p)
        seed = int(rs.integers(2**63))
        ga, gb = np.random.default_rng(seed), np.random.default_rng(seed)
        kw = dict(temperature=temp, top_k=top_k, top_p=top_p)
        got = [pick_token(logits, rng=ga, **kw) for _ in range(4)]
        want = [reference_pick(logits, temp, top_k, top_p, gb) for _ in range(4)]
        cfg = dict(case=case, V=V, seed=seed, **kw)
        assert got == want, cfg
        assert ga.bit_generator.state == gb.bit_generator.state, cfg  # one draw per token


@pytest.mark.parametrize("V", [49152, 262144])
def test_pick_token_equals_reference_at_vocabulary_size(V):
    """SmolLM2's and Gemma 3's vocabulary sizes, logits with a real model's spread."""
    rs = np.random.default_rng(V)
    logits = rs.normal(0.0, 3.5, V).astype(np.float32)
    logits[rs.integers(0, V, 40)] = rs.normal(12.0, 2.0, 40).astype(np.float32)
    logits[rs.integers(0, V, V // 50)] = np.float32(-1.5)  # a block of ties
    for temp, top_k, top_p, seed in [(1.0, None, None, 1), (0.7, None, 0.95, 2), (1.3, 50, 0.9, 3)]:
        ga, gb = np.random.default_rng(seed), np.random.default_rng(seed)
        kw = dict(temperature=temp, top_k=top_k, top_p=top_p)
        got = [pick_token(logits, rng=ga, **kw) for _ in range(2)]
        want = [reference_pick(logits, temp, top_k, top_p, gb) for _ in range(2)]
        assert got == want, kw


def test_pick_token_known_values():
    four = np.zeros(4, np.float32)  # e = 1, 1, 1, 1; c = 1, 2, 3, 4
    # top_p=0.5: c[j-1] < 2 for j = 0, 1 only: ids 0 and 1, never 2 or 3
    drawn = {pick_token(four, temperature=1.0, top_p=0.5, rng=np.random.default_rng(s))
             for s in range(200)}  # fmt: skip
    assert drawn == {0, 1}
    drawn = {pick_token(four, temperature=1.0, rng=np.random.default_rng(s)) for s in range(200)}
    assert drawn == {0, 1, 2, 3}
    logits = np.array([2.0, 5.0, -1.0, 5.0, 4.0], np.float32)
    assert pick_token(logits, temperature=0.0) == 1  # the lowest id among the maxima
    # top_k=2 keeps both 5.0s and nothing else; top_k=3 adds the 4.0
    drawn = {pick_token(logits, temperature=2.0, top_k=2, rng=np.random.default_rng(s))
             for s in range(200)}  # fmt: skip
    assert drawn == {1, 3}
    drawn = {pick_token(logits, temperature=2.0, top_k=3, rng=np.random.default_rng(s))
             for s in range(200)}  # fmt: skip
    assert drawn == {1, 3, 4}
    g = np.random.default_rng(5)
    before = g.bit_generator.state
    pick_token(logits, temperature=0.0, rng=g)
    assert g.bit_generator.state == before  # greedy draws nothing


def test_pick_token_errors_name_the_argument():
    ok = np.zeros(3, np.float32)
    g = np.random.default_rng(0)
    cases = [
        (TypeError, "logits has dtype float64", dict(logits=np.zeros(3), temperature=1.0)),
        (TypeError, "logits must be a numpy.ndarray", dict(logits=[0.0], temperature=1.0)),
        (ValueError, r"logits has shape \(1, 3\)", dict(logits=ok[None], temperature=1.0)),
        (ValueError, r"logits has shape \(0,\)", dict(logits=ok[:0], temperature=1.0)),
        (ValueError, "temperature=-1.0 must be", dict(logits=ok, temperature=-1.0)),
        (TypeError, "temperature must be a real", dict(logits=ok, temperature=True)),
        (ValueError, "top_k=0 must be >= 1", dict(logits=ok, temperature=1.0, top_k=0)),
        (TypeError, "top_k must be an int", dict(logits=ok, temperature=1.0, top_k=2.0)),
        (ValueError, r"top_p=1.5 must be in \(0, 1\]", dict(logits=ok, temperature=1.0, top_p=1.5)),
        (ValueError, "pass rng=", dict(logits=ok, temperature=1.0, rng=None)),
        (
            TypeError,
            "rng must be a numpy.random.Generator",
            dict(logits=ok, temperature=1.0, rng=0),
        ),
    ]
    for exc, match, kw in cases:
        kw.setdefault("rng", g)
        with pytest.raises(exc, match=match):
            pick_token(kw.pop("logits"), **kw)
    bad = np.array([0.0, 1.0, np.inf], np.float32)
    with pytest.raises(ValueError, match=r"pick_token: logits\[2\]=.*inf.* is not finite"):
        pick_token(bad, temperature=0.0)
    before = g.bit_generator.state
    big = np.array([0.0, 3e38], np.float32)
    with pytest.raises(ValueError, match="temperature=1e-30 is too small"):
        pick_token(big, temperature=1e-30, rng=g)
    assert g.bit_generator.state == before  # nothing drawn on a refused call


def _native_vs_numpy(logits, kw, seed, draws=3):
    """Tokens of pick_token (native) and _pick_token_reference (NumPy), and both generators."""
    ga, gb = np.random.default_rng(seed), np.random.default_rng(seed)
    got = [pick_token(logits, rng=ga, **kw) for _ in range(draws)]
    want = [_pick_token_reference(logits, rng=gb, **kw) for _ in range(draws)]
    return got, want, ga.bit_generator.state, gb.bit_generator.state


@pytest.fixture(params=_ext.core().available_isas())
def isa(request):
    core = _ext.core()
    saved = core.get_isa()
    core.set_isa(request.param)
    yield request.param
    core.set_isa(saved)


_EDGE_VALUES = np.array(
    [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 0.5, -0.5, 1.0, 88.0, -88.0, 3e38, -3e38],
    np.float32,
)


def _edge_logits(rs: np.random.Generator, V: int) -> np.ndarray:
    kind = rs.integers(4)
    if kind == 0:  # ties everywhere, signed zeros, subnormals, huge values
        z = rs.choice(_EDGE_VALUES, V)
    elif kind == 1:  # a k-th value shared by many entries
        z = rs.integers(-2, 3, V).astype(np.float32)
    elif kind == 2:  # differences on both sides of exp's underflow (-103.97) and cut (-110)
        z = rs.uniform(-130.0, 0.0, V).astype(np.float32)
    else:
        z = _random_logits(rs, V)
    return np.ascontiguousarray(z, dtype=np.float32)


@pytest.mark.parametrize("block", range(3))
def test_native_equals_numpy_reference_on_edge_logits(block, isa):
    """Same token and generator state as the NumPy twin: ties at the k-th value, signed zeros,
    subnormals, temperatures from 1e-30 (overflow: both refuse, nothing drawn) to 1e30,
    top_p from 1e-12 to 1 - 1e-16, vocabulary sizes 1 and 2 included, on every ISA."""
    rs = np.random.default_rng(7000 + block)
    for case in range(250):
        V = int(rs.choice([1, 2, 3, 5, 64, 1000, 4099]))
        logits = _edge_logits(rs, V)
        temp = float(rs.choice([1e-30, 1e-6, 0.01, 0.5, 1.0, 1.0 + 1e-9, 2.0, 1e6, 1e30]))
        top_k = rs.choice([None, 1, 2, 3, int(rs.integers(1, V + 1)), V, V + 1])
        top_p = rs.choice([None, 1e-12, 0.25, 0.9, 1.0 - 1e-16, 1.0])
        kw = dict(
            temperature=temp,
            top_k=None if top_k is None else int(top_k),
            top_p=None if top_p is None else float(top_p),
        )
        seed = int(rs.integers(2**63))
        cfg = dict(case=case, V=V, seed=seed, isa=isa, **kw)
        try:
            got, want, sa, sb = _native_vs_numpy(logits, kw, seed)
        except ValueError as exc:  # the overflow refusal: both must refuse, before a draw
            assert "is too small for these logits" in str(exc), cfg
            ga, gb = np.random.default_rng(seed), np.random.default_rng(seed)
            with pytest.raises(ValueError, match="is too small for these logits"):
                pick_token(logits, rng=ga, **kw)
            with pytest.raises(ValueError, match="is too small for these logits"):
                _pick_token_reference(logits, rng=gb, **kw)
            assert ga.bit_generator.state == gb.bit_generator.state
            assert ga.bit_generator.state == np.random.default_rng(seed).bit_generator.state
            continue
        assert got == want, cfg
        assert sa == sb, cfg  # one draw per token, in both


@pytest.mark.parametrize("V", [1, 2, 49152, 262144])
def test_native_equals_numpy_reference_at_vocabulary_size(V, isa):
    rs = np.random.default_rng(V + 11)
    for case in range(4 if V > 1000 else 40):
        logits = rs.normal(0.0, 3.5, V).astype(np.float32)
        if V > 1000:
            logits[rs.integers(0, V, 40)] = rs.normal(12.0, 2.0, 40).astype(np.float32)
            logits[rs.integers(0, V, V // 50)] = np.float32(-1.5)  # a block of ties
            logits[rs.integers(0, V, 50)] = np.float32(-0.0)
            logits[rs.integers(0, V, 50)] = np.float32(0.0)
        k = [None, 40, 50, V][case % 4]  # 40 and 50: the k-th value may sit in a tie block
        kw = dict(
            temperature=[1.0, 0.7, 1.3, 0.05][case % 4], top_k=k, top_p=[None, 0.95][case % 2]
        )
        got, want, sa, sb = _native_vs_numpy(logits, kw, seed=case)
        assert got == want, (case, kw)
        assert sa == sb, (case, kw)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=300
    ),
    temperature=st.floats(1e-3, 1e3),
    top_k=st.none() | st.integers(1, 320),
    top_p=st.none() | st.floats(1e-9, 1.0),
    seed=st.integers(0, 2**32),
)
def test_native_equals_numpy_reference_hypothesis(values, temperature, top_k, top_p, seed):
    logits = np.array(values, np.float32)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    try:
        got, want, sa, sb = _native_vs_numpy(logits, kw, seed, draws=2)
    except ValueError:  # logits / temperature overflows: the twin must refuse as well
        with pytest.raises(ValueError, match="is too small for these logits"):
            _pick_token_reference(logits, rng=np.random.default_rng(seed), **kw)
        return
    assert got == want
    assert sa == sb


def test_native_from_parallel_threads_equals_serial():
    """The GIL is released in sample_token and its scratch is per thread: rows sampled on a
    thread pool (as the serving engine does) give the tokens of a serial loop."""
    rs = np.random.default_rng(3)
    rows = [rs.normal(0.0, 3.0, 49152).astype(np.float32) for _ in range(8)]
    kw = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=30)]

    def run(i):
        g = np.random.default_rng(i)
        return [pick_token(rows[i], rng=g, **kw[i % 2]) for _ in range(5)]

    serial = [run(i) for i in range(len(rows))]
    want = [
        [_pick_token_reference(rows[i], rng=g, **kw[i % 2]) for _ in range(5)]
        for i, g in ((i, np.random.default_rng(i)) for i in range(len(rows)))
    ]
    assert serial == want
    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(run, range(len(rows)))) == serial


def test_overflow_with_temperature_rounding_to_zero_is_refused():
    """float32(1e-300) == 0: logits / 0 is inf or NaN, z[order[0]] is not finite; refused with
    the overflow error before a draw, with and without top_k."""
    logits = np.array([0.0, -1.0, -2.0], np.float32)
    for top_k in (None, 1):
        g = np.random.default_rng(1)
        before = g.bit_generator.state
        with pytest.raises(ValueError, match="temperature=1e-300 is too small"):
            pick_token(logits, temperature=1e-300, top_k=top_k, rng=g)
        assert g.bit_generator.state == before


class _Utf8Bytes:
    """A byte-level tokenizer: id = one byte, decode = UTF-8 with replacement (Python's codec)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_releases_final_text_only():
    ids = list("naïve — done. END tail".encode())
    d = Detokenizer(_Utf8Bytes(), ["END"])
    pieces = []
    for t in ids:
        piece = d.push(t)
        assert "\ufffd" not in piece  # an incomplete character waits
        pieces.append(piece)
        if d.stopped:
            break
    pieces.append(d.finish())
    assert d.stopped and d.text == "naïve — done. "
    assert "".join(pieces) == d.text
    # without a stop string: everything, and the held-back tail comes with finish()
    d = Detokenizer(_Utf8Bytes())
    out = "".join(d.push(t) for t in "héllo".encode()) + d.finish()
    assert out == d.text == "héllo" and not d.stopped
    # a trailing incomplete character is decoded as it is by finish()
    d = Detokenizer(_Utf8Bytes())
    assert d.push(0xC3) == "" and d.finish() == "\ufffd"
    with pytest.raises(ValueError, match="stop string is empty"):
        Detokenizer(_Utf8Bytes(), [""])
    with pytest.raises(TypeError, match="must be a str"):
        Detokenizer(_Utf8Bytes(), [5])


def test_logprobs_errors_name_the_argument():
    from exactblocks.sampling import logprobs, token_logprobs

    z = np.arange(10, dtype=np.float32)
    cases = [
        (ValueError, r"logprobs: token=10 is outside the vocabulary \[0, 10\)", (z, 10)),
        (ValueError, r"logprobs: token=-1 is outside the vocabulary \[0, 10\)", (z, -1)),
        (TypeError, "logprobs: token must be an int; got float", (z, 1.0)),
        (TypeError, "logprobs: token must be an int; got bool", (z, True)),
        (ValueError, "logprobs: top_logprobs=-1 must be >= 0", (z, 1, -1)),
        (TypeError, "logprobs: top_logprobs must be an int; got str", (z, 1, "2")),
        (ValueError, r"logprobs: logits has shape \(1, 10\)", (z[None], 1)),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            logprobs(*args)
    # top_logprobs beyond the vocabulary lists every token (documented clamp)
    lp, top = logprobs(z, 3, 11)
    assert [i for i, _ in top] == list(range(9, -1, -1))
    assert lp == token_logprobs(z[None], [3])[0]
    with pytest.raises(ValueError, match=r"targets\[1\]=10 is outside the vocabulary \[0, 10\)"):
        token_logprobs(np.stack([z, z]), [0, 10])
