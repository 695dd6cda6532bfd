"""lm-evaluation-harness itself (``--model local-completions``) against a real server on
SmolLM2: a small multiple-choice task from local JSON data (no download). Its scores are the
same at batch sizes 1, 4 and 16, and equal to the scores computed in-process from
``Model.forward`` logits, every loglikelihood bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from serve_helpers import live_server, require

from exactblocks.sampling import token_logprobs

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What color is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
    ("What is 2 + 2?", ["4", "5", "3", "22"], 0),
    ("Which animal says meow?", ["dog", "cat", "cow", "duck"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wax paper"], 2),
    ("Which is the largest ocean?", ["Arctic", "Indian", "Atlantic", "Pacific"], 3),
]

TASK_YAML = """task: eb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def hf_tokenizer_dir(folder) -> str:
    """SmolLM2's tokenizer read from its GGUF file by transformers and saved as a Hugging Face
    tokenizer (what the harness loads), as docs/serving-api.md shows."""
    import os

    transformers = require("transformers", "the harness tokenizes with transformers")
    from exactblocks.loaders.gguf import default_smollm2_path

    path = default_smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    tok.save_pretrained(str(folder))
    return str(folder)


def in_process_loglikelihood(model, hf_tok, context: str, continuation: str):
    """The harness's split of (context, continuation) into tokens, scored with
    ``Model.forward`` logits and the library's float32 log-softmax."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = hf_tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(hf_tok.encode(context, add_special_tokens=False))
    logits = model.forward(np.asarray([whole], np.int64))[0]
    lps = token_logprobs(logits[n_ctx - 1 : len(whole) - 1], whole[n_ctx:])
    greedy = all(int(np.argmax(logits[t - 1])) == whole[t] for t in range(n_ctx, len(whole)))
    return sum(float(v) for v in lps), greedy


def test_lm_eval_scores_are_batch_invariant_and_match_forward(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    lm_eval = require("lm_eval", "the test runs lm-evaluation-harness (pip install lm-eval)")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "eb_mc.yaml").write_text(TASK_YAML.format(data=data))
    tok_dir = hf_tokenizer_dir(tmp_path / "tokenizer")
    manager = TaskManager(include_path=str(tasks))

    runs = {}
    with live_server(smol, max_batch=8, max_tokens_per_sequence=512, max_queue=64) as srv:
        for batch_size in (1, 4, 16):
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={
                    "model": "smollm2",
                    "base_url": srv.url + "/v1/completions",
                    "tokenizer": tok_dir,
                    "tokenizer_backend": "huggingface",
                    "tokenized_requests": True,
                    "max_retries": 1,
                },
                tasks=["eb_mc"],
                batch_size=batch_size,
                task_manager=manager,
                log_samples=True,
            )
            samples = sorted(out["samples"]["eb_mc"], key=lambda s: s["doc_id"])
            runs[batch_size] = (
                out["results"]["eb_mc"]["acc,none"],
                [[tuple(r[0]) for r in s["resps"]] for s in samples],
                [[tuple(a) for a in s["arguments"]] for s in samples],
            )
    acc1, resps1, args1 = runs[1]
    for batch_size in (4, 16):
        acc, resps, _ = runs[batch_size]
        assert acc == acc1
        assert resps == resps1  # every (loglikelihood, is_greedy), exactly

    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    correct = 0
    for (_q, choices, gold), resps, args in zip(QUESTIONS, resps1, args1):
        assert len(args) == len(choices) == len(resps)
        want = [in_process_loglikelihood(smol, hf_tok, ctx, cont) for ctx, cont in args]
        assert [r[0] for r in resps] == [w[0] for w in want]  # bit for bit (float64 sums)
        assert [bool(r[1]) for r in resps] == [w[1] for w in want]
        correct += int(np.argmax([w[0] for w in want]) == gold)
    assert acc1 == pytest.approx(correct / len(QUESTIONS), abs=0)
