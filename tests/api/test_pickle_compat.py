"""States pickled by exactblocks 0.1.0 (before the package split into transformer/ and
mamba2/) still load: their pickles name ``exactblocks.state`` and ``exactblocks.mamba2_state``.
The byte strings below are protocol-4 pickles whose global references are exactly those the
old modules wrote; the arrays inside are rebuilt from NumPy's own reduce."""

from __future__ import annotations

import pickle
import pickletools

import numpy as np

import exactblocks as eb


def _old_pickle(state, old_module: str, old_name: str) -> bytes:
    """Pickle ``state`` as 0.1.0 did: the same restore arguments under the old global name
    (protocol 2 spells a global as the text line ``module\nname``)."""
    fn, args = state.__reduce__()

    class Old:
        def __reduce__(self):
            return (fn, args)

    data = pickle.dumps(Old(), protocol=2)
    new_ref = f"{fn.__module__}\n{fn.__name__}\n".encode()
    assert new_ref in data
    data = data.replace(new_ref, f"{old_module}\n{old_name}\n".encode())
    pickletools.genops(data)
    return data


def test_transformer_state_pickled_by_0_1_0_loads(block, x):
    st = block.allocate_state(2, 8)
    block.forward(x[:, :3], st)
    data = _old_pickle(st, "exactblocks.state", "_restore_transformer_state")
    assert b"exactblocks.state" in data
    back = pickle.loads(data)
    assert isinstance(back, eb.TransformerState)
    assert np.array_equal(back.k_cache.view(np.uint32), st.k_cache.view(np.uint32))
    assert back.row_tokens.tolist() == [3, 3]
    y1, y2 = block.step(x[:, 3], st), block.step(x[:, 3], back)
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))


def test_mamba2_state_pickled_by_0_1_0_loads():
    from helpers import make_mamba2_weights

    blk = eb.Mamba2BlockInference(make_mamba2_weights(1), n_groups=2)
    st = blk.allocate_state(1)
    xs = np.random.default_rng(0).standard_normal((1, 4, blk.d_model)).astype(np.float32)
    blk.forward(xs[:, :3], st)
    data = _old_pickle(st, "exactblocks.mamba2_state", "_restore_mamba2_state")
    back = pickle.loads(data)
    assert isinstance(back, eb.Mamba2State)
    assert np.array_equal(back.h.view(np.uint32), st.h.view(np.uint32))
    y1, y2 = blk.step(xs[:, 3], st), blk.step(xs[:, 3], back)
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))
