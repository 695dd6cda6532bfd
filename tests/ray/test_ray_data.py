"""exactblocks.ray on a local Ray runtime: Generate, Score and Embed over 50 rows of the real
SmolLM2-135M GGUF, every row bit-identical to that row run alone in-process with load_model,
whatever the actors (1 or 2), the batch size (1, 7, 50), the row order or the threads per actor;
bad rows get an ``error`` column; a missing model file fails the job with its path.

Each Ray pipeline loads the model once per actor, so the coverage is spread over three runs:
Generate (2 actors x 1 thread, batch 7, shuffled, 4 state slots so slots are reused), Score
(1 actor x 2 threads, batch 1, model shipped through the object store) and Embed (1 actor x 2
threads, batch 50). Embed's layer= and pooling="mean" are checked in-process.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest

try:
    import ray
    import ray.data
except ImportError as exc:  # CI installs the `test` extra, which includes `ray`: fail there
    if os.environ.get("CI"):
        raise
    pytest.skip(
        f"ray[data] cannot be imported ({exc}); pip install 'exactblocks[ray]'",
        allow_module_level=True,
    )

import exactblocks
import exactblocks.ray as ebray

pytestmark = pytest.mark.slow

N_ROWS = 50
WORDS = ["sky", "sea", "cat", "tree", "river", "moon", "bread", "city", "song", "stone"]
LONG = "hello " * 8300  # more tokens than SmolLM2's max_positions (8192)


def _rows() -> list[dict]:
    """50 short rows (text and chat, greedy and sampled) and 2 bad ones; every key in every row."""
    rows = []
    for i in range(N_ROWS):
        w = WORDS[i % len(WORDS)]
        chat = i % 5 == 4
        sampled = i % 3 == 1
        rows.append(
            {
                "row": i,
                "prompt": None if chat else f"The {w} is number {i} and",
                "messages": [{"role": "user", "content": f"Name a {w}."}] if chat else None,
                "continuation": f" {WORDS[(i + 3) % len(WORDS)]} {i}",
                "max_new_tokens": 1 + i % 4,
                "temperature": 0.8 if sampled else None,
                "seed": 1000 + i if sampled else None,
                "top_k": 40 if i % 6 == 1 else None,
                "top_p": 0.9 if i % 6 == 4 else None,
            }
        )
    bad = dict(rows[0], row=N_ROWS, prompt=LONG)  # too long for every task
    wrong = dict(rows[1], row=N_ROWS + 1, max_new_tokens=2.5, continuation=None)  # wrong types
    return rows + [bad, wrong]


ROWS = _rows()


@pytest.fixture(scope="module")
def path():
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def model(path):
    return exactblocks.load_model(path)


@pytest.fixture(scope="module")
def ray_local():
    """A local 2-CPU Ray runtime; workers import exactblocks from this source tree when it is
    not installed (a developer checkout run with PYTHONPATH=src)."""
    parent = os.path.dirname(os.path.dirname(os.path.abspath(exactblocks.__file__)))
    installed = os.path.basename(parent) in ("site-packages", "dist-packages")
    env = {}
    if not installed:
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [parent, os.environ.get(
            "PYTHONPATH")]))}}  # fmt: skip
    ray.init(num_cpus=2, runtime_env=env, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield
    ray.shutdown()


def _one_row_batch(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        arr = np.empty(1, dtype=object)
        arr[0] = v
        out[k] = arr
    return out


def _prompt_ids(model, row) -> list[int]:
    if row["prompt"] is not None:
        return model.tokenizer.encode(row["prompt"])
    return model.tokenizer.apply_chat_template(
        row["messages"], add_generation_prompt=True, tokenize=True
    )


def _bits(values) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def alone(model):
    """Every good row run alone in-process: Model.generate, Model.forward (scores)."""
    gen, score = {}, {}
    for r in ROWS[:N_ROWS]:
        ids = _prompt_ids(model, r)
        gen[r["row"]] = model.generate(
            ids,
            max_new_tokens=r["max_new_tokens"],
            temperature=r["temperature"] or 0.0,
            top_k=r["top_k"],
            top_p=r["top_p"],
            seed=r["seed"] if r["seed"] is not None else 0,
        )
        cont = model.tokenizer.encode(r["continuation"], add_special_tokens=False)
        logits = model.forward(np.asarray([ids + cont]))[0]
        lp = ebray.token_logprobs(logits[len(ids) - 1 : len(ids) + len(cont) - 1], cont)
        score[r["row"]] = (cont, lp)
    return gen, score


def _check_generated(out: dict, alone_gen) -> None:
    for i in range(N_ROWS):
        r, ref = out[i], alone_gen[i]
        assert r["error"] is None, r["error"]
        assert list(r["generated_ids"]) == ref.ids, i
        assert r["generated_text"] == ref.text, i
        assert r["num_generated_tokens"] == len(ref.ids)
        assert r["finish_reason"] == ref.finish_reason
    assert "max_positions" in out[N_ROWS]["error"] and out[N_ROWS]["generated_ids"] == []
    assert "max_new_tokens must be an int" in out[N_ROWS + 1]["error"]
    assert out[N_ROWS + 1]["generated_text"] is None


def _check_scores(out: dict, alone_score) -> None:
    for i in range(N_ROWS):
        r, (cont, lp) = out[i], alone_score[i]
        assert r["error"] is None, r["error"]
        assert list(r["continuation_ids"]) == cont
        assert np.array_equal(_bits(r["continuation_logprobs"]), lp.view(np.uint32)), i
        assert r["sum_logprob"] == math.fsum(lp.tolist())
    assert "max_positions" in out[N_ROWS]["error"] and math.isnan(out[N_ROWS]["sum_logprob"])
    assert "continuation must be a str" in out[N_ROWS + 1]["error"]


def _by_row(ds) -> dict:
    rows = ds.take_all()
    assert sorted(r["row"] for r in rows) == list(range(len(ROWS)))
    for r in rows:  # every input column is kept, a chat as a list of dicts (not pickled)
        assert set(ROWS[0]) <= set(r)
        msgs = ROWS[r["row"]]["messages"]
        if msgs is not None:  # (a block of nulls only comes back from Ray as NaN: not checked)
            assert list(r["messages"]) == msgs
    return {r["row"]: r for r in rows}


# -- Ray ----------------------------------------------------------------------------------------


def test_generate_2_actors_batch_7_shuffled(ray_local, path, alone):
    rows = list(ROWS)
    random.Random(7).shuffle(rows)
    ds = ray.data.from_items(rows).map_batches(
        ebray.Generate,
        fn_constructor_kwargs={"model": path, "max_rows": 4},
        compute=ray.data.ActorPoolStrategy(size=2),
        batch_size=7,
        num_cpus=1,
    )
    _check_generated(_by_row(ds), alone[0])


def test_score_1_actor_batch_1_object_store(ray_local, path, alone):
    ref = ray.put(ebray.pack_model(path))
    ds = ray.data.from_items(ROWS).map_batches(
        ebray.Score,
        fn_constructor_kwargs={"model_ref": ref},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=1,
        num_cpus=2,
    )
    _check_scores(_by_row(ds), alone[1])


def test_embed_1_actor_batch_50(ray_local, path, model):
    ds = ray.data.from_items(ROWS).map_batches(
        ebray.Embed,
        fn_constructor_kwargs={"model": path},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=50,
        num_cpus=2,
    )
    out = _by_row(ds)
    single = ebray.Embed(model)
    for i in range(N_ROWS):
        ref = single(_one_row_batch(ROWS[i]))["embedding"][0]
        assert out[i]["error"] is None
        emb = np.asarray(out[i]["embedding"])
        assert emb.dtype == np.float32 and emb.shape == (model.d_model,)
        assert np.array_equal(emb.view(np.uint32), ref.view(np.uint32)), i
    assert "max_positions" in out[N_ROWS]["error"]
    assert np.isnan(np.asarray(out[N_ROWS]["embedding"])).all()
    assert out[N_ROWS + 1]["error"] is None  # max_new_tokens is not an Embed option


def test_missing_model_fails_the_job_naming_the_path(ray_local):
    missing = "/nonexistent/exactblocks-ray/model.gguf"
    ds = ray.data.from_items(ROWS[:2]).map_batches(
        ebray.Generate,
        fn_constructor_kwargs={"model": missing},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=2,
        num_cpus=1,
    )
    with pytest.raises(Exception) as info:
        ds.take_all()
    assert "cannot load the model" in str(info.value) and missing in str(info.value)


# -- in-process (no Ray): the same classes on a loaded Model ----------------------------------


def test_in_process_embed_options_batch_equals_alone(model):
    """layer= and pooling="mean" (the Ray test runs the default): 12 rows in chunks of 5."""
    rows = ROWS[:10] + ROWS[N_ROWS:]
    batch = {k: np.empty(len(rows), dtype=object) for k in ROWS[0]}
    for j, r in enumerate(rows):
        for k, v in r.items():
            batch[k][j] = v
    for layer, pooling in ((2, "mean"), (-1, "last")):
        embed = ebray.Embed(model, layer=layer, pooling=pooling, max_rows=5)
        out = embed(batch)
        assert out["error"][10] is not None and np.isnan(out["embedding"][10]).all()
        for i in range(10):
            ref = embed(_one_row_batch(rows[i]))["embedding"][0]
            assert np.array_equal(out["embedding"][i].view(np.uint32), ref.view(np.uint32))


def test_embedding_is_what_the_head_reads(model):
    """layer=None, pooling="last": the final-norm hidden state; times the (tied) embedding
    table it gives the last position's logits, up to the GEMM's rounding."""
    row = ROWS[0]
    emb = ebray.Embed(model)(_one_row_batch(row))["embedding"][0]
    logits = model.forward(np.asarray([_prompt_ids(model, row)]))[0, -1]
    table = model._embed
    if hasattr(table, "chunks"):  # a tied embedding read back from the packed head
        table = np.concatenate(list(table.chunks()))
    np.testing.assert_allclose(emb @ table.T, logits, rtol=1e-4, atol=2e-3)


def test_constructor_errors(model):
    with pytest.raises(TypeError, match="exactly one of model= .* and model_ref="):
        ebray.Generate()
    with pytest.raises(ebray.ModelLoadError, match="/no/such/model.gguf"):
        ebray.Score("/no/such/model.gguf")
    with pytest.raises(ValueError, match="pooling"):
        ebray.Embed(model, pooling="max")
    with pytest.raises(ValueError, match="temperature"):
        ebray.Generate(model, temperature=-1.0)
    with pytest.raises(TypeError, match=r"Generate: model= must be a path .* got int"):
        ebray.Generate(5)
    with pytest.raises(TypeError, match=r"Generate: stop must be .* got dict"):
        ebray.Generate(model, stop={"a": 1})


def test_shipped_model_copy_is_removed(path, tmp_path, monkeypatch):
    """model_ref= writes the model to a temporary folder: removed with the object, and at once
    when the model fails to load (every actor of every job used to leave its copy behind)."""
    import gc
    import glob
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gen = ebray.Generate(model_ref=ebray.pack_model(path))
    copies = glob.glob(str(tmp_path / "exactblocks-ray-*"))
    assert len(copies) == 1 and gen.path.startswith(copies[0])
    assert os.path.getsize(gen.path) == os.path.getsize(path)
    del gen
    gc.collect()
    assert glob.glob(str(tmp_path / "exactblocks-ray-*")) == []
    junk = {"name": "junk.gguf", "is_dir": False, "files": {"junk.gguf": b"GGUF but not really"}}
    with pytest.raises(ebray.ModelLoadError, match="junk.gguf"):
        ebray.Score(model_ref=junk)
    assert glob.glob(str(tmp_path / "exactblocks-ray-*")) == []
