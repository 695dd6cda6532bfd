"""A call that cannot get its memory raises MemoryError naming the call and the bytes, leaves the
state byte-identical, and keeps no scratch alive (SPEC.md 2.5, 2.7).

Run in a subprocess under an address-space limit (RLIMIT_AS) that leaves room for the output but
not for the scratch of a long prefill through a wide MLP.
"""

from __future__ import annotations

import os
import sys

import pytest
from robust_helpers import run_python

HERE = os.path.dirname(os.path.abspath(__file__))

_CODE = """
    import resource, sys
    import numpy as np
    sys.path.insert(0, {here!r})
    import exactblocks as eb
    from exactblocks import _ext
    from helpers import make_transformer_weights, make_mamba2_weights
    from robust_helpers import state_bytes, differing

    kind = {kind!r}
    rng = np.random.default_rng(0)
    if kind == "transformer":
        blk = eb.TransformerBlockInference(
            make_transformer_weights(rng, 32, 4, 2, 8, 8192), n_heads=4
        )
        st = blk.allocate_state(1, 4096)
        d = 32
    else:
        blk = eb.Mamba2BlockInference(
            make_mamba2_weights(0, d=32, di=4096, nh=64, ns=16, ng=1), n_groups=1
        )
        st = blk.allocate_state(1)
        d = 32
    blk.forward(rng.standard_normal((1, 3, d)).astype(np.float32), st)  # warm: threads, scratch
    x = rng.standard_normal((1, 4000, d)).astype(np.float32)
    before = state_bytes(st)
    core = _ext.core()

    def vm_bytes():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (48 << 20), hard))
    try:
        blk.forward(x, st)
    except MemoryError as exc:
        msg = str(exc)
    else:
        msg = None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    print("MSG", msg)
    print("SAME", not differing(state_bytes(st), before))
    print("SCRATCH", core._thread_workspace_bytes())
    y = blk.forward(x, st)  # room again: the call runs, from the untouched state
    print("AFTER", int(st.row_tokens[0]), bool(np.isfinite(y).all()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
@pytest.mark.parametrize("kind", ["transformer", "mamba2"])
def test_scratch_memory_error_names_the_call_and_changes_nothing(core, kind):
    res = run_python(_CODE.format(here=HERE, kind=kind), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    cls = "TransformerBlockInference" if kind == "transformer" else "Mamba2BlockInference"
    msg = out["MSG"]
    assert msg.startswith(f"{cls}.forward: "), msg
    assert "bytes" in msg and "4000 tokens" in msg and "state is unchanged" in msg, msg
    assert out["SAME"] == "True"
    assert out["SCRATCH"] == "0", "the failed call's scratch stayed alive"
    assert out["AFTER"].split() == ["4003", "True"]


def test_output_memory_error_names_the_call(core):
    # The output itself cannot be allocated (a state-less call whose real tokens are none).
    code = """
        import resource, sys
        import numpy as np
        sys.path.insert(0, {here!r})
        from robust_helpers import small_transformer
        blk = small_transformer(max_positions=1 << 20)
        x = np.zeros((1, 300000, 32), np.float32)
        blk.forward(x[:, :3])
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))
        try:
            blk.forward(x, lengths=[0])
        except MemoryError as exc:
            print(exc)
    """
    res = run_python(code.format(here=HERE), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    msg = res.stdout.strip()
    assert msg.startswith("TransformerBlockInference.forward: cannot allocate the output"), msg
    assert "(1, 300000, 32)" in msg and "38400000 bytes" in msg, msg
