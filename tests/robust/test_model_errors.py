"""A Model call's errors name the model call, never an inner block, and a MemoryError is never a
bare ``std::bad_alloc`` (SPEC.md 2.7).

The memory cases run SmolLM2 in a subprocess under an address-space limit (RLIMIT_AS); the
overflow case builds a tiny Llama through transformers whose first layer overflows.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from robust_helpers import run_python


def _smollm2_path() -> str:
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


_MEMORY = """
    import os, resource, threading
    import numpy as np
    import exactblocks as eb

    m = eb.load_model({path!r})
    eb.set_num_threads(2)
    st = m.allocate_state(batch_size=2, max_tokens=3000)
    m.forward(np.arange(1, 17)[None].repeat(2, 0), st)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)

    def limit(extra_mb):
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (extra_mb << 20), hard))

    def attempt(name, fn):
        try:
            fn()
        except MemoryError as exc:
            print(name, "MemoryError", exc)
        else:
            print(name, "ok")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    # the whole state: 8 x 2048 positions of 30 layers do not fit in 200 MB more
    limit(200)
    attempt("STATE", lambda: m.allocate_state(8, 2048))
    # the embedding rows of 2.4 M tokens (5.5 GB) do not fit in 1 GB more
    big = np.full((300, 8000), 5, np.int64)
    limit(1024)
    attempt("EMBED", lambda: m.forward(big, logits="last"))

    # a long prefill on a worker thread, with 40 MB more: a layer's scratch does not fit
    def prefill():
        for L in (64, 256, 1024, 2048):
            m.forward((np.arange(L)[None] * 13 % 40000 + 3).repeat(2, 0), st, logits="last")

    def on_thread():
        t = threading.Thread(target=lambda: attempt("THREAD", prefill))
        t.start()
        t.join()

    limit(40)
    on_thread()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_model_memory_errors_name_the_model_call(core):
    res = run_python(_MEMORY.format(path=_smollm2_path()), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    # was: "TransformerBlockInference.allocate_state: ... of shape (8, 3, 2048, 64) ... 25165888
    # bytes" (one layer's)
    assert out["STATE"] == (
        "MemoryError Model.allocate_state: cannot allocate a state of batch_size=8, "
        "max_tokens=2048: its 30 layers need 754976640 bytes (0.703 GiB)"
    ), out["STATE"]
    # was: a bare "std::bad_alloc" from the embedding lookup
    assert out["EMBED"].startswith(
        "MemoryError Model.forward: cannot allocate the embeddings of 300 x 8000 tokens"
    ), out["EMBED"]
    # was: "TransformerBlockInference.forward: cannot allocate scratch ..."
    msg = out["THREAD"]
    assert re.match(r"MemoryError Model\.forward: layer \d+: cannot allocate scratch memory", msg)
    assert msg.endswith("the state is unchanged") or "are left inconsistent" in msg, msg
    for text in out.values():
        assert "BlockInference" not in text and "std::bad_alloc" not in text, text


def _overflowing_llama():
    """A 3-layer Llama (transformers) whose first layer's MLP overflows to inf."""
    if os.environ.get("CI"):  # CI has them: fail rather than skip there
        import torch
        import transformers
    else:  # pragma: no cover - local convenience only
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        mlp = hf.model.layers[0].mlp
        mlp.down_proj.weight.fill_(3e38)
        mlp.up_proj.weight.fill_(1e30)
        mlp.gate_proj.weight.fill_(1e30)
    return hf


def test_overflow_inside_the_stack_names_the_layer(core):
    import threading

    import numpy as np

    import exactblocks as eb

    model = eb.load_model(_overflowing_llama())
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    # was: "TransformerBlockInference.forward: x[0, 0, 0] must be finite; got inf" (no x given)
    expected = r"^Model\.forward: the activations overflowed in layer 0 \(x\[0, 0, 0\] = inf "
    expected += r"entering layer 1\)"
    with pytest.raises(ValueError, match=expected + "$"):
        model.forward(ids)
    st = model.allocate_state(2, 16)
    with pytest.raises(ValueError, match=expected + "; the state is unchanged$"):
        model.forward(ids, st)
    assert st.row_tokens.tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"^Model\.step: the activations overflowed in layer 0"):
        model.step(np.array([1, 2]), st)
    # on another thread layer 0 has written: the message says the rows are left inconsistent
    errors = []

    def run():
        try:
            model.forward(ids, st)
        except ValueError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1 and re.match(expected, errors[0]), errors
    assert errors[0].endswith("state rows [0, 1] are left inconsistent (the call ran on another "
                              "thread than the main one): reset() them"), errors[0]  # fmt: skip
    with pytest.raises(ValueError, match=r"rows \[0, 1\] are inconsistent"):
        model.step(np.array([1, 2]), st)


_LOAD = """
    import os, resource
    import exactblocks as eb

    vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + ({extra} << 20), resource.RLIM_INFINITY))
    try:
        eb.load_model({path!r})
    except BaseException as exc:
        msg = f"{{type(exc).__name__}} {{exc}}"
    else:
        msg = "loaded"
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(msg)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
@pytest.mark.parametrize(
    ("extra_mb", "stage"),
    [
        # was: ValueError "cannot read ... as a GGUF model: [Errno 12] Cannot allocate memory"
        (50, "reading '"),
        # was: a bare "MemoryError: std::bad_alloc" from a block's constructor
        (200, "building layer "),
    ],
)
def test_load_model_out_of_memory_is_a_named_memory_error(core, extra_mb, stage):
    path = _smollm2_path()
    res = run_python(_LOAD.format(path=path, extra=extra_mb), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    msg = res.stdout.strip()
    assert msg.startswith(f"MemoryError load_model: out of memory while {stage}"), msg
    assert path in msg and "std::bad_alloc" not in msg, msg
