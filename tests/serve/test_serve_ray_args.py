"""The fleet's bad arguments are refused before anything starts (no Ray runtime, no model
load): ``exactblocks.ray.fleet_app``'s TypeError / ValueError / FileNotFoundError naming the
argument, and ``exactblocks serve``'s ``--ray-*`` flag errors (exit 2, the flag named);
``prefix_hashes`` chains whole blocks only."""

from __future__ import annotations

import pytest
import xxhash
from serve_helpers import require

ray = require("ray", "the fleet needs ray[serve]")
require("ray.serve", "the fleet needs ray[serve]")

from exactblocks.cli import main  # noqa: E402
from exactblocks.ray import serving  # noqa: E402


@pytest.fixture(scope="module")
def gguf():
    from helpers import smollm2_path

    return smollm2_path()


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({}, TypeError, "exactly one of model= .* and model_ref="),
        ({"model": "M", "model_ref": {}}, TypeError, "exactly one of"),
        ({"model": "/nonexistent/model.gguf"}, FileNotFoundError, "does not exist"),
        ({"replicas": 0}, ValueError, r"replicas must be an int >= 1; got 0"),
        ({"replicas": True}, ValueError, r"replicas must be an int >= 1; got True"),
        ({"cpus_per_replica": 1.5}, ValueError, r"cpus_per_replica must be an int >= 1"),
        ({"replicas": 3, "max_replicas": 2}, ValueError, "max_replicas=2 is below replicas=3"),
        ({"max_batsh": 4}, TypeError, r"unknown engine option\(s\) \['max_batsh'\]"),
    ],
)
def test_fleet_app_refuses_bad_arguments(gguf, kw, exc, match):
    kw = dict(kw)
    if "model" not in kw and "model_ref" not in kw and kw:
        kw["model"] = gguf
    with pytest.raises(exc, match=match):
        serving.fleet_app(**kw)
    assert not ray.is_initialized()  # nothing was started


@pytest.mark.parametrize(
    "flags, flag, says",
    [
        (["--ray-max-replicas", "3"], "--ray-max-replicas", "needs --ray-replicas N"),
        (["--ray-address", "auto"], "--ray-address", "needs --ray-replicas N"),
        (["--ray-replicas", "2", "--threads", "1"], "--threads", "--ray-cpus-per-replica"),
        (["--ray-replicas", "2", "--ray-max-replicas", "1"], "--ray-max-replicas",
         "1 is below --ray-replicas 2"),
        (["--ray-replicas", "0"], "--ray-replicas", "expected a positive integer, got '0'"),
    ],
)  # fmt: skip
def test_serve_ray_flags_are_refused_before_loading(gguf, capsys, flags, flag, says):
    with pytest.raises(SystemExit) if flags[1] == "0" else _nothing():
        rc = main(["serve", gguf, *flags])
        assert rc == 2
    err = capsys.readouterr().err
    assert flag in err and says in err, err
    assert "loading" not in err and not ray.is_initialized()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_prefix_hashes_chain_whole_blocks():
    ids = list(range(100, 150))
    h = serving.prefix_hashes(ids, 16)
    assert len(h) == 3  # 50 tokens: three whole blocks of 16, the last 2 tokens not hashed
    import numpy as np

    b0 = np.arange(100, 116, dtype=np.int64).tobytes()
    b1 = np.arange(116, 132, dtype=np.int64).tobytes()
    assert h[0] == xxhash.xxh64_intdigest(b0, seed=0)
    assert h[1] == xxhash.xxh64_intdigest(b1, seed=h[0])
    assert serving.prefix_hashes(ids[:40], 16) == h[:2]  # a prefix's hashes are a prefix
    assert serving.prefix_hashes([1] + ids[1:], 16)[0] != h[0]
    assert serving.prefix_hashes(ids[:15], 16) == []
