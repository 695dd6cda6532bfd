"""Robustness of the core's threads (native part): the thread pool of csrc/base/pool.

Each risky case runs in a subprocess bounded by a timeout, so a hang, an abort or an
``exit(1)`` fails the test instead of the suite:

- a fork after a 2-thread call: calls in the child complete and give the parent's bits;
- a tight ``RLIMIT_AS``: a 2-thread call raises MemoryError (state untouched) or completes with
  the right bits, never ``terminate``/abort/``exit(1)``;
- the conv scratch of a Mamba-2 step with a 50000-tap conv over 4 channels stays small;
- the interpreter exiting while another thread is inside a long call prints no leak warnings;
- thread-count invariance with the pool: 1, 2, 3 and 8 threads, compact weights, and
  concurrent calls from two Python threads (one of them then runs without the pool).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import exactblocks as eb
from exactblocks import _ext

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from helpers import (  # noqa: E402
    force_num_threads,
    make_mamba2_weights,
    make_transformer_weights,
)

TIMEOUT = 120  # seconds per subprocess: a hung fork child or pool fails here, not the suite

# Shared prelude of the subprocess scripts: a transformer block with bfloat16-valued weights
# (stored compact: the GEMM rebuilds panels into per-thread scratch) and a prefill input.
PRELUDE = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import exactblocks as eb
    from helpers import make_transformer_weights

    def bf16(a):
        return (np.ascontiguousarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(
            np.float32)

    w = {{k: bf16(v) for k, v in make_transformer_weights(
        np.random.default_rng(0), 128, 4, 2, 32, 256).items()}}
    blk = eb.TransformerBlockInference(w, n_heads=4, n_kv_heads=2, head_dim=32)
    assert {{f for _, f, _ in blk.weight_storage()}} == {{"bf16"}}, blk.weight_storage()
    x = np.random.default_rng(1).standard_normal((2, 48, 128)).astype(np.float32)
    """
)


def run_script(body: str, env=None, timeout=TIMEOUT):
    """Run PRELUDE + body in a fresh interpreter; returns the CompletedProcess.

    A timeout (a hang) fails the calling test with the script's output so far.
    """
    code = PRELUDE.format(tests=TESTS) + textwrap.dedent(body)
    try:
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"subprocess hung for {timeout} s; stderr: {exc.stderr!r}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_fork_after_threaded_call_child_completes_with_same_bits():
    """libgomp's team does not survive fork(): the child of a process that had made a 2-thread
    call hung in a futex on its first call. The pool's atfork handler drops the parent's pool
    and the child builds its own (helpers included)."""
    res = run_script(
        """
        import time
        eb.set_num_threads(2)
        ref = blk.forward(x)
        st = blk.allocate_state(2, 64)
        ref_st = blk.forward(x, st).tobytes() + st.k_cache.tobytes()
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: calls with 2 threads (new pool), then 1, then 2 again
            os.close(r)
            ok = True
            for n in (2, 1, 2):
                eb.set_num_threads(n)
                ok = ok and blk.forward(x).tobytes() == ref.tobytes()
                st2 = blk.allocate_state(2, 64)
                ok = ok and blk.forward(x, st2).tobytes() + st2.k_cache.tobytes() == ref_st
            os.write(wfd, b"same" if ok else b"diff")
            os._exit(0)
        os.close(wfd)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
            sys.exit(3)
        print(os.read(r, 16).decode(), os.waitstatus_to_exitcode(status))
        # the parent's own pool still works after the fork
        print(blk.forward(x).tobytes() == ref.tobytes())
        """
    )
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert res.stdout.split() == ["same", "0", "True"], (res.stdout, res.stderr)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_multiprocessing_fork_pool_after_threaded_call():
    """The same through ``multiprocessing`` with the fork start method (the default before
    Python 3.14 on Linux)."""
    res = run_script(
        """
        import multiprocessing as mp
        eb.set_num_threads(2)
        ref = blk.forward(x).tobytes()

        def work(_):
            return blk.forward(x).tobytes() == ref

        with mp.get_context("fork").Pool(2) as pool:
            print(all(pool.map(work, range(4), chunksize=1)))
        """
    )
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert res.stdout.split() == ["True"], (res.stdout, res.stderr)


MEMORY_LIMIT_BODY = """
import resource, threading
margin, warm = int(sys.argv[1]), sys.argv[2] == "warm"
eb.set_num_threads(1)  # no helper exists before the limited call


def reference():
    st_ref = blk.allocate_state(2, 64)
    blk.forward(x[:, :8], st_ref)
    return blk.forward(x[:, 8:], st_ref), st_ref


if warm:  # on this thread: the limited call finds its workspace grown
    y_ref, st_ref = reference()
else:  # on another OS thread: the limited call must grow this thread's workspace
    out = []
    t = threading.Thread(target=lambda: out.append(reference()))
    t.start()
    t.join()
    y_ref, st_ref = out[0]
st = blk.allocate_state(2, 64)
blk.forward(x[:, :8], st)
before = (st.k_cache.tobytes(), st.v_cache.tobytes(), st.row_tokens.tobytes())
eb.set_num_threads(2)
size = 0
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmSize:"):
            size = int(line.split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + margin, resource.RLIM_INFINITY))
try:
    y = blk.forward(x[:, 8:], st)  # 40 tokens: the workspace must grow
    outcome = "completed"
except MemoryError:
    outcome = "memoryerror"
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
if outcome == "completed":
    ok = y.tobytes() == y_ref.tobytes() and st.k_cache.tobytes() == st_ref.k_cache.tobytes()
else:
    ok = (st.k_cache.tobytes(), st.v_cache.tobytes(), st.row_tokens.tobytes()) == before
print(outcome, ok)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's"
)
# KiB above the process size: tight ones fail the call's first allocation or the helper's
# 8 MiB stack; with a warm workspace 8448 (8.25 MiB) let OpenMP start its thread and then failed
# that thread's rebuild buffer (std::bad_alloc, terminate).
@pytest.mark.parametrize("workspace", ["warm", "cold"])
@pytest.mark.parametrize("margin_kib", [0, 256, 1024, 4096, 8448, 8704, 16384])
def test_memory_limit_gives_memoryerror_or_result_never_abort(margin_kib, workspace):
    """With RLIMIT_AS just above the process size, the first 2-thread call used to end in
    ``terminate called after throwing std::bad_alloc`` (a thread_local rebuild buffer allocated
    by a worker inside the parallel region) or libgomp's ``Thread creation failed`` exit(1).
    Now the GEMM scratch is reserved before the first state write, and a helper that cannot be
    created just leaves fewer threads."""
    code = PRELUDE.format(tests=TESTS) + textwrap.dedent(MEMORY_LIMIT_BODY)
    try:
        res = subprocess.run(
            [sys.executable, "-c", code, str(margin_kib << 10), workspace],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung: {exc.stderr!r}")
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
    assert "terminate" not in res.stderr and "Thread creation failed" not in res.stderr
    outcome, ok = res.stdout.split()
    assert outcome in ("completed", "memoryerror")
    assert ok == "True", (outcome, "wrong bits" if outcome == "completed" else "state changed")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="peak RSS read from getrusage (Linux: KiB)"
)
def test_mamba2_conv_scratch_follows_the_real_shapes():
    """A Mamba-2 step reserved 2*K*256 floats of conv scratch per thread whatever conv_dim
    was: K = 50000 taps over conv_dim 4 cost ~196 MiB. It is now 2*K*min(256, conv_dim)."""
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import resource, sys
                import numpy as np
                sys.path.insert(0, {TESTS!r})
                import exactblocks as eb
                from helpers import make_mamba2_weights
                w = make_mamba2_weights(0, d=8, di=2, nh=1, ns=1, ng=1, k=50000)
                blk = eb.Mamba2BlockInference(w, n_groups=1)
                eb.set_num_threads(2)
                st = blk.allocate_state(1)
                x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
                peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                y = blk.step(x, st)
                assert np.isfinite(y).all()
                peak1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                print((peak1 - peak0) // 1024)
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    grew_mib = int(res.stdout.split()[-1])
    # the window itself (4 x 50000 floats) and two threads' scratch (2 x 2 x 50000 x 4 floats)
    # are ~2.3 MiB; the old sizing touched ~196 MiB
    assert grew_mib < 24, f"a step grew the peak RSS by {grew_mib} MiB"


def test_exit_while_a_thread_is_inside_a_call_prints_no_leak_warnings():
    """The interpreter exits while a daemon thread is inside a long native call (GIL released,
    seconds long: the process ends before it returns): nanobind then saw the objects that call
    holds as leaked and printed warnings."""
    res = run_script(
        """
        import threading, time
        eb.set_num_threads(2)
        big = np.random.default_rng(2).standard_normal((2, 8192, 128)).astype(np.float32)
        started = threading.Event()

        def long_calls():
            started.set()
            blk.forward(big)

        threading.Thread(target=long_calls, daemon=True).start()
        started.wait()
        time.sleep(0.3)
        print("exiting")
        """
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.split() == ["exiting"]
    assert "leak" not in res.stderr.lower(), res.stderr[-2000:]


def _bf16(a):
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


@pytest.mark.parametrize("compact", [False, True], ids=["float32", "bf16"])
def test_pool_thread_counts_and_concurrent_calls_give_the_same_bits(compact):
    """The pool hands chunks to whichever thread is free; every output keeps its bits on 1, 2,
    3 and 8 threads (prefill with the GEMM's rebuilt panels, continuation, decode), and when two
    Python threads call at once (one of them then finds the pool owned and runs alone)."""
    w = make_transformer_weights(np.random.default_rng(3), 128, 4, 2, 32, 256)
    if compact:
        w = {k: _bf16(v) for k, v in w.items()}
    blk = eb.TransformerBlockInference(w, n_heads=4, n_kv_heads=2, head_dim=32)
    x = np.random.default_rng(4).standard_normal((3, 70, 128)).astype(np.float32)

    def run_all():
        st = blk.allocate_state(3, 80)
        y = blk.forward(x[:, :60], st)
        y2 = blk.forward(x[:, 60:], st)
        s = blk.step(x[:, 0], st)
        return y.tobytes() + y2.tobytes() + s.tobytes() + st.k_cache.tobytes()

    saved = eb.get_num_threads()
    try:
        eb.set_num_threads(1)
        ref = run_all()
        for n in (2, 3, 8):
            force_num_threads(n)  # set_num_threads would cap 3 and 8 at the usable CPUs
            assert _ext.core().get_num_threads() == n
            assert run_all() == ref, f"{n} threads"
        eb.set_num_threads(2)
        out = [None] * 4

        def worker(i):
            out[i] = [run_all() for _ in range(3)]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert all(o is not None and all(r == ref for r in o) for o in out)
    finally:
        eb.set_num_threads(saved)


def test_mamba2_thread_counts_give_the_same_bits():
    """The Mamba-2 block (conv scratch sized by the real shapes) on 1, 2, 3 and 8 threads."""
    blk = eb.Mamba2BlockInference(make_mamba2_weights(5, k=7), n_groups=2)
    x = np.random.default_rng(6).standard_normal((3, 40, 24)).astype(np.float32)
    saved = eb.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            force_num_threads(n)  # set_num_threads would cap 3 and 8 at the usable CPUs
            assert _ext.core().get_num_threads() == n
            st = blk.allocate_state(3)
            y = blk.forward(x, st)
            outs.append(y.tobytes() + blk.step(x[:, 0], st).tobytes() + st.conv_window.tobytes())
    finally:
        eb.set_num_threads(saved)
    assert all(o == outs[0] for o in outs[1:])
