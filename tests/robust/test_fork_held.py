"""A fork while another thread is inside a call on a state (SPEC.md 2.6): in the child that
state was refused forever with "in use by another call", although no call runs there. Its
contents may be torn (the parent's call was writing them), so it must not silently become
usable either: calls and snapshots raise a RuntimeError saying why,
and a reset of every row (or a new state) makes it usable.

Real forks of a subprocess, with the call running on a real thread of the parent.
"""

from __future__ import annotations

import os
import sys

import pytest
from robust_helpers import run_python

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = """
    import os, pickle, sys, threading, time
    import numpy as np
    sys.path.insert(0, {here!r})

    def fork_during_call(state, long_call, probe):
        # Fork while a thread runs long_call on state; in the child run probe(state) and write
        # its lines to stdout. Retried when the lock happened to be free at the fork.
        for attempt in range(20):
            t = threading.Thread(target=long_call)
            t.start()
            while not state._lock.locked() and t.is_alive():
                time.sleep(0.0005)
            pid = os.fork()
            if pid == 0:
                code = 3
                try:
                    if state._lock.forked():  # held by the parent's thread at the fork
                        lines = probe(state)
                        os.write(1, ("\\n".join(lines) + "\\n").encode())
                        code = 0
                finally:
                    os._exit(code)
            t.join()
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            if code != 3:
                return code
        return 3

    def attempt(name, fn):
        try:
            fn()
        except RuntimeError as exc:
            return f"{{name}} {{exc}}"
        return f"{{name}} ran"
"""

_BLOCK = (
    _CHILD
    + """
    import exactblocks as eb
    from robust_helpers import small_transformer

    blk = small_transformer()
    rng = np.random.default_rng(0)
    st = blk.allocate_state(2, 4096)
    x_long = rng.standard_normal((2, 4000, 32)).astype(np.float32)
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    y_fresh = blk.forward(x)

    def probe(st):
        lines = [
            attempt("CALL", lambda: blk.forward(x, st)),
            attempt("PICKLE", lambda: pickle.dumps(st)),
            attempt("SOME", lambda: st.reset([0])),
            attempt("CALL2", lambda: blk.forward(x, st)),
        ]
        st.reset()  # every row: usable again, from zero
        y = blk.forward(x, st)
        same = y.view(np.uint32).tobytes() == y_fresh.view(np.uint32).tobytes()
        lines.append(f"AFTER {{st.row_tokens.tolist()}} {{same}}")
        return lines

    sys.stdout.flush()
    code = fork_during_call(st, lambda: blk.forward(x_long, st), probe)
    print("EXIT", code)
"""
)


def _lines(res) -> dict:
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    return dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)


_WHY = (
    "the state was in use by a call on another thread when the process forked; its contents "
    "are undefined here: reset() it (all rows) or allocate a new one"
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_block_state_held_at_fork_is_refused_until_reset(core):
    out = _lines(run_python(_BLOCK.format(here=HERE), timeout=300))
    assert out["EXIT"] == "0", out
    # was: "TransformerBlockInference.forward: state is in use by another call (...)" forever
    assert out["CALL"] == f"TransformerBlockInference.forward: {_WHY}", out["CALL"]
    assert out["PICKLE"] == f"TransformerState (pickle or copy): {_WHY}", out["PICKLE"]
    # a reset of some rows cannot define the others: refused, and still refused after it
    assert out["SOME"] == f"TransformerState.reset: {_WHY}", out["SOME"]
    assert out["CALL2"] == out["CALL"]
    assert out["AFTER"] == "[3, 3] True", out["AFTER"]


_MODEL = (
    _CHILD
    + """
    import exactblocks as eb
    from exactblocks.loaders.gguf import default_smollm2_path

    m = eb.load_model(default_smollm2_path())
    st = m.allocate_state(batch_size=2, max_tokens=2048)
    ids_long = (np.arange(600)[None] * 11 % 40000 + 3).repeat(2, 0)
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    y_fresh = m.forward(ids)

    def probe(st):
        lines = [
            attempt("CALL", lambda: m.forward(ids, st)),
            attempt("COPY", lambda: pickle.dumps(st)),
            attempt("SOME", lambda: st.reset([1])),
        ]
        fresh = m.allocate_state(batch_size=2, max_tokens=64)  # a new state works at once
        lines.append(f"FRESH {{m.forward(ids, fresh).shape}}")
        st.reset()
        y = m.forward(ids, st)
        same = y.view(np.uint32).tobytes() == y_fresh.view(np.uint32).tobytes()
        lines.append(f"AFTER {{st.row_tokens.tolist()}} {{same}}")
        return lines

    sys.stdout.flush()
    code = fork_during_call(st, lambda: m.forward(ids_long, st, logits="last"), probe)
    print("EXIT", code)
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork with threads: Linux")
def test_model_state_held_at_fork_is_refused_until_reset(core):
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    out = _lines(run_python(_MODEL.format(here=HERE), timeout=300))
    assert out["EXIT"] == "0", out
    assert out["CALL"] == f"Model.forward: {_WHY}", out["CALL"]
    assert out["COPY"] == f"ModelState (pickle or copy): {_WHY}", out["COPY"]
    assert out["SOME"] == f"ModelState.reset: {_WHY}", out["SOME"]
    assert out["FRESH"] == "(2, 3, 49152)", out["FRESH"]
    assert out["AFTER"] == "[3, 3] True", out["AFTER"]
