"""``exactblocks run`` and ``exactblocks chat`` on a tiny folder, and the models' doctests."""

from __future__ import annotations

import doctest
import importlib
import io

import pytest

from exactblocks.cli import main


def test_run_streams_text_then_a_summary(tiny, capsys):
    folder, _ = tiny("llama")
    assert main(["run", folder, "--prompt", "Hello world", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("[prefill ") and "decode" in out[-1] and "threads" in out[-1]
    import exactblocks

    model = exactblocks.load_model(folder)
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True, tokenize=True
    )
    assert "\n".join(out[:-1]) == model.generate(ids, max_new_tokens=6).text


def test_run_sampling_with_a_seed_is_reproducible(tiny, capsys):
    folder, _ = tiny("llama")
    args = ["run", folder, "--prompt", "Hi", "--max-new-tokens", "8", "--temperature", "0.9"]
    main(args + ["--seed", "7"])
    a = capsys.readouterr().out.splitlines()[:-1]
    main(args + ["--seed", "7"])
    assert capsys.readouterr().out.splitlines()[:-1] == a


def test_chat_loop_ends_on_exit(tiny, monkeypatch, capsys):
    folder, _ = tiny("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n\nHow are you?\n/exit\nnot read\n"))
    assert main(["chat", folder, "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant: ") == 2 and out.count("user: ") == 4


def test_chat_without_a_tokenizer_fails_before_the_first_prompt(tiny, monkeypatch, capsys):
    folder, _ = tiny("mistral")  # saved without a tokenizer
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # was: the prompt shown, then exit 0
    assert main(["chat", folder]) == 2
    cap = capsys.readouterr()
    assert "user: " not in cap.out
    assert "the model has no tokenizer" in cap.err


def test_run_reports_a_bad_model_path(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [
        "exactblocks.models.model",
        "exactblocks.models.state",
        "exactblocks.models.generate",
        "exactblocks.models.loading",
        "exactblocks.models._config",
        "exactblocks.loaders.safetensors",
        "exactblocks.loaders.hf_tokenizer",
    ],
)
def test_docstring_examples(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert res.failed == 0
