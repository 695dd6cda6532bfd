"""exactblocks.ray's stages, in-process, on families with an embedding scale (Gemma 2's
sqrt(hidden_size), Granite's multiplier) and one without: Generate equals Model.generate and
Score equals Model.forward's log-softmax, bit for bit (the Ray runtime is not needed)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from models_helpers import make_tokenizer

import exactblocks
import exactblocks.ray as ebray


@pytest.mark.parametrize("name", ["gemma2", "granite", "llama"])
def test_generate_and_score_equal_the_model(tiny, tmp_path, name):
    folder, _ = tiny(name)
    path = tmp_path / name
    shutil.copytree(folder, path)
    make_tokenizer(str(path))
    model = exactblocks.load_model(str(path))
    prompts = ["The quick brown fox", "Hello world! How are"]
    batch = {
        "prompt": np.asarray(prompts, dtype=object),
        "continuation": np.asarray([" jumps over", " you today?"], dtype=object),
    }
    out = ebray.Generate(model, max_new_tokens=5, stop=[])(batch)
    scored = ebray.Score(model)(batch)
    for i, text in enumerate(prompts):
        ids = model.tokenizer.encode(text)
        assert out["generated_ids"][i] == model.generate(ids, max_new_tokens=5, stop=()).ids
        cont = scored["continuation_ids"][i]
        logits = model.forward(np.asarray([ids + cont]))[0, len(ids) - 1 : -1]
        want = ebray.token_logprobs(logits, np.asarray(cont))
        got = np.asarray(scored["continuation_logprobs"][i], np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, i)
