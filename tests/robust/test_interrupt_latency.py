"""Ctrl-C, or a signal handler that raises, stops a long call within about 100 ms and leaves the
state exactly as before the call; a retry then gives the bits of an uninterrupted call
(SPEC.md 2.5), instead of waiting for the whole call (seconds for a long prefill).

Each case runs in a subprocess (real signals): for 1 and 2 threads, a prefill sized to take
about 2.5 s is started on the main thread and interrupted after 0.5 s, once by SIGINT
(KeyboardInterrupt) and once by an interval timer whose handler raises an exception of its own.
The latency from the signal to the exception is printed and must stay under LATENCY_LIMIT: the
design target is 100 ms (a poll every 20 ms, pieces of 10 ms), and the limit leaves room for a
loaded 2-core machine. The reference is the same call made, uninterrupted, on another thread
(where nothing is polled and regions run whole), so the retry's bits also show that polling
and pieces never move a bit.
"""

from __future__ import annotations

import os
import sys

import pytest
from robust_helpers import TESTS, run_python

LATENCY_LIMIT = 0.5  # seconds from the signal to the exception
HERE = os.path.dirname(os.path.abspath(__file__))

_CASE = """
    import copy, os, signal, subprocess, sys, threading, time
    # SIGINT at its default and not blocked, as from a terminal, whatever this test run's
    # process passed down (in the whole suite its children once started with SIGINT lost)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    import numpy as np
    sys.path[:0] = [{here!r}, {tests!r}]
    import exactblocks as eb
    from helpers import make_mamba2_weights, make_transformer_weights
    from robust_helpers import differing, model_state_bytes, state_bytes

    KIND, LIMIT, TARGET = {kind!r}, {limit!r}, 2.5

    class Stop(Exception):
        pass

    def snapshot(st):
        return model_state_bytes(st) if isinstance(st, eb.ModelState) else state_bytes(st)

    rng = np.random.default_rng(11)
    if KIND in ("model", "model_run"):
        model = eb.load_model({folder!r})
        L, HIST = 2048, 7
        def make_state(B):
            st = model.allocate_state(B, L + HIST)
            model.forward(rng.integers(0, 320, (B, HIST)), st)
            return st
        def make_input(B):
            return rng.integers(0, 320, (B, L))
        call = model.forward
    else:
        if KIND == "mamba2":
            blk = eb.Mamba2BlockInference(
                make_mamba2_weights(4, d=256, di=512, nh=8, ns=64, ng=2), n_groups=2)
            L, d, HIST = 6000, 256, 5
            def alloc(B):
                return blk.allocate_state(B)
        else:
            w = make_transformer_weights(rng, 384, 6, 2, 64, 1024)
            window = 300 if KIND == "transformer_window" else 0
            blk = eb.TransformerBlockInference(w, n_heads=6, window=window, max_positions=8192)
            L, d, HIST = 3000, 384, 9
            def alloc(B):
                return blk.allocate_state(B, L + HIST)
        def make_state(B):
            st = alloc(B)
            blk.forward(rng.standard_normal((B, HIST, d)).astype(np.float32), st)
            return st
        def make_input(B):
            return rng.standard_normal((B, L, d)).astype(np.float32)
        call = blk.forward

    def off_main(fn, *args):
        # a call on another thread: not watched, so no poll and no pieces
        out = {{}}
        def run():
            out["y"] = fn(*args)
        th = threading.Thread(target=run)
        th.start()
        th.join()
        return out["y"]

    def interrupted(how, x, st):
        # seconds from the signal to the exception, the call started 0.5 s before the signal
        if how == "sigint":
            # sent by another process, as a terminal's Ctrl-C is: a thread of this one would
            # need the GIL to send it, which a loaded machine can hand it late
            sender = subprocess.Popen(
                [sys.executable, "-c", "import os, sys, time; time.sleep(0.5); "
                 "print(time.monotonic(), flush=True); os.kill(int(sys.argv[1]), 2)",
                 str(os.getpid())], stdout=subprocess.PIPE, text=True)
            try:
                call(x, st)
                sys.exit(f"{{KIND}}: the call completed before SIGINT stopped it")
            except KeyboardInterrupt:
                got = time.monotonic()
            sent = float(sender.communicate()[0])
            return got - sent
        def handler(signum, frame):
            raise Stop()
        old = signal.signal(signal.SIGALRM, handler)
        fired = time.monotonic() + 0.5
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            call(x, st)
            sys.exit(f"{{KIND}}: the call completed before the timer's handler stopped it")
        except Stop:
            got = time.monotonic()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        return got - fired

    for nt in (1, 2):
        eb.set_num_threads(nt)
        # rows so that the call takes about TARGET seconds (its cost is linear in the rows)
        off_main(call, make_input(1), make_state(1))  # warm-up: threads, workspaces
        t0 = time.monotonic()
        off_main(call, make_input(1), make_state(1))
        one = time.monotonic() - t0
        B = max(1, min(16, int(np.ceil(TARGET / one))))
        while True:
            st, x = make_state(B), make_input(B)
            before = snapshot(st)
            ref = copy.deepcopy(st)
            t0 = time.monotonic()
            y_ref = off_main(call, x, ref)
            full = time.monotonic() - t0
            # the signal comes 0.5 s into the call: a machine that sped up since the estimate
            # gets more rows rather than a call that ends first
            if full >= 1.5 or B >= 64:
                break
            B *= 2
        for how in ("sigint", "raise"):
            lat = interrupted(how, x, st)
            print(f"{{KIND}} threads={{nt}} rows={{B}} {{how}}: latency {{lat * 1000:.1f}} ms "
                  f"(uninterrupted call {{full:.2f}} s)")
            changed = differing(snapshot(st), before)
            if changed:
                sys.exit(f"{{KIND}} threads={{nt}} {{how}}: the state changed: {{changed[:6]}}")
            if lat > LIMIT:
                sys.exit(f"{{KIND}} threads={{nt}} {{how}}: latency {{lat:.3f}} s > {{LIMIT}} s")
        y = call(x, st)  # the retry, on the main thread (watched: polls and pieces)
        if y.view(np.uint32).tobytes() != y_ref.view(np.uint32).tobytes():
            sys.exit(f"{{KIND}} threads={{nt}}: the retry's output differs from the reference")
        changed = differing(snapshot(st), snapshot(ref))
        if changed:
            sys.exit(f"{{KIND}} threads={{nt}}: after the retry {{changed[:6]}} differ")
    print("ok")
"""


# model_run: eight transformer layers in one native call (Model._stack_run); each layer has
# its own watch, so a stop is seen in whichever layer the call is in
@pytest.mark.parametrize(
    "kind", ["transformer", "transformer_window", "mamba2", "model", "model_run"]
)
def test_long_call_stops_quickly_and_rolls_back(core, kind, request):
    fixture = {"model": "hybrid_folder", "model_run": "long_run_folder"}.get(kind)
    folder = request.getfixturevalue(fixture) if fixture else None
    code = _CASE.format(here=HERE, tests=TESTS, kind=kind, limit=LATENCY_LIMIT, folder=folder)
    res = run_python(code, timeout=600)
    sys.stdout.write(res.stdout)  # the measured latencies (pytest -s shows them)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.rstrip().endswith("ok"), res.stdout


_NESTED = """
    import signal, sys, threading, time
    import numpy as np
    sys.path[:0] = [{here!r}, {tests!r}]
    import exactblocks as eb
    from helpers import make_transformer_weights
    from robust_helpers import small_transformer

    eb.set_num_threads({threads})
    rng = np.random.default_rng(2)
    blk = eb.TransformerBlockInference(
        make_transformer_weights(rng, 384, 6, 2, 64, 1024), n_heads=6, max_positions=4096)
    x = rng.standard_normal((4, 2000, 384)).astype(np.float32)
    small = small_transformer()
    xs = rng.standard_normal((3, 40, 32)).astype(np.float32)
    ys_ref = small.forward(xs)
    out = {{}}
    th = threading.Thread(target=lambda: out.setdefault("y", blk.forward(x)))
    th.start()
    th.join()

    # A handler that calls into the core while the long call is stopped at a poll: the inner
    # call must not touch the outer call's scratch (it gets a workspace of its own).
    seen = []
    def handler(signum, frame):
        ys = small.forward(xs)
        seen.append(ys.view(np.uint32).tobytes() == ys_ref.view(np.uint32).tobytes())
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
    y = blk.forward(x)
    during = len(seen)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if during < 2:
        sys.exit(f"the handler ran {{during}} times during the call (polls did not run it)")
    if not all(seen):
        sys.exit("a call made by the handler gave other bits")
    if y.view(np.uint32).tobytes() != out["y"].view(np.uint32).tobytes():
        sys.exit("the long call's output changed under the handler's calls")
    print("ok", during)
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_handler_calling_the_core_during_a_long_call(core, threads):
    res = run_python(_NESTED.format(here=HERE, tests=TESTS, threads=threads), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.startswith("ok"), res.stdout
