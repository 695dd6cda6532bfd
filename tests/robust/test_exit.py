"""Leaving the interpreter while a thread is inside a call prints nothing (nanobind
would report the objects the running call still referenced as leaks)."""

from __future__ import annotations

import os

from robust_helpers import run_python

HERE = os.path.dirname(os.path.abspath(__file__))


def test_exit_during_a_call_prints_no_leak_report(core):
    code = """
        import sys, threading, time
        import numpy as np
        sys.path.insert(0, {here!r})
        import exactblocks as eb
        from helpers import make_transformer_weights
        w = make_transformer_weights(np.random.default_rng(0), 256, 8, 4, 32, 1024)
        blk = eb.TransformerBlockInference(w, n_heads=8)
        st = blk.allocate_state(1, 4096)
        x = np.random.default_rng(1).standard_normal((1, 4000, 256)).astype(np.float32)
        t = threading.Thread(target=blk.forward, args=(x, st), daemon=True)
        t.start()
        while not st._lock.locked():
            time.sleep(0.001)
        print("exiting", flush=True)
    """
    res = run_python(code.format(here=HERE), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "exiting"
    assert "leak" not in res.stderr.lower(), res.stderr[-3000:]
    assert res.stderr.strip() == "", res.stderr[-3000:]
