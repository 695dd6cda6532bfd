"""One generation core under every surface: the same seeded request gives the same tokens, text
and logprob bits from ``Model.generate``, the real server (loopback, the official ``openai``
client) and ``exactblocks.ray.Generate`` on a real local Ray runtime; and the stop rules,
sampling checks and logprob spelling they share (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from serve_helpers import live_server, require

import exactblocks
import exactblocks.ray
from exactblocks.models.generate import SamplingParams

PROMPT = "The capital of France is"
KW = dict(temperature=0.8, top_k=40, top_p=0.95, seed=7)
HTTP_KW = dict(temperature=0.8, top_p=0.95, seed=7, extra_body={"top_k": 40})  # openai's names


def _bits(values) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def reference(smol):
    return smol.generate(PROMPT, max_new_tokens=10, logprobs=True, **KW)


def test_generate_server_and_ray_agree_bit_for_bit(smol, reference):
    ref = reference
    assert len(ref.ids) == len(ref.logprobs) > 0
    assert all(isinstance(v, np.float32) and v <= 0 for v in ref.logprobs)
    spelled = [smol.tokenizer.decode([i]) for i in ref.ids]
    with live_server(smol, max_batch=2, max_tokens_per_sequence=256) as srv:
        client = srv.client()
        for prompt in (PROMPT, smol.tokenizer.encode(PROMPT)):  # text, and token ids
            r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=10,
                                          logprobs=0, **HTTP_KW)  # fmt: skip
            c = r.choices[0]
            assert c.text == ref.text and c.finish_reason == ref.finish_reason
            assert r.usage.completion_tokens == len(ref.ids)
            assert c.logprobs.tokens == spelled
            assert (_bits(c.logprobs.token_logprobs) == _bits(ref.logprobs)).all()
        # the chat endpoint reports the same bits for its own prompt
        msgs = [{"role": "user", "content": "Name a colour."}]
        ids = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        chat_ref = smol.generate(ids, max_new_tokens=8, logprobs=True, **KW)
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                           logprobs=True, **HTTP_KW)  # fmt: skip
        got = [t.logprob for t in r.choices[0].logprobs.content]
        assert r.choices[0].message.content == chat_ref.text
        assert (_bits(got) == _bits(chat_ref.logprobs)).all()

    require("ray.data", "the Ray surface needs ray[data]")
    import ray
    import ray.data

    import exactblocks.ray as ebray

    parent = os.path.dirname(os.path.dirname(os.path.abspath(exactblocks.__file__)))
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [parent, os.environ.get(
        "PYTHONPATH")]))}}  # fmt: skip
    ray.init(num_cpus=1, runtime_env=env, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.from_items([{"prompt": PROMPT}]).map_batches(
            ebray.Generate,
            fn_constructor_kwargs={
                "model": str(smol.source),
                "max_new_tokens": 10,
                "logprobs": True,
                **KW,
            },  # fmt: skip
            compute=ray.data.ActorPoolStrategy(size=1),
            batch_size=1,
            num_cpus=1,
        )
        (row,) = ds.take_all()
    finally:
        ray.shutdown()
    assert row["error"] is None, row["error"]
    assert list(row["generated_ids"]) == ref.ids and row["generated_text"] == ref.text
    assert row["finish_reason"] == ref.finish_reason
    assert (_bits(list(row["generated_logprobs"])) == _bits(ref.logprobs)).all()


def test_logprobs_are_the_library_float32_ones(smol, reference):
    """Each reported logprob is sampling.token_logprobs of the position's logits."""
    from exactblocks.sampling import token_logprobs

    ids = smol.tokenizer.encode(PROMPT) + reference.ids
    logits = smol.forward(np.asarray([ids]))[0]
    n = len(ids) - len(reference.ids)
    want = token_logprobs(logits[n - 1 : len(ids) - 1], np.asarray(reference.ids))
    assert (_bits(want) == _bits(reference.logprobs)).all()


def test_a_str_stop_is_one_stop_string_everywhere(smol):
    free = smol.generate(PROMPT, max_new_tokens=12, stop=())
    assert len(free.text) > 4
    needle = free.text[2:5]  # three characters: as single letters they would cut earlier
    cut = smol.generate(PROMPT, max_new_tokens=12, stop=needle)
    assert cut.text == free.text[: free.text.find(needle)] and cut.finish_reason == "stop"
    assert SamplingParams(max_tokens=1, stop="answer").stop == ("answer",)
    gen = exactblocks.ray.Generate(smol, max_new_tokens=12, stop=needle)
    out = gen({"prompt": np.asarray([PROMPT], dtype=object)})
    assert out["generated_text"][0] == cut.text


def test_end_tokens_stop_beside_stop_strings_unless_ignored(smol):
    msgs = [{"role": "user", "content": "Say hi."}]
    ids = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    plain = smol.generate(ids, max_new_tokens=60)
    assert plain.finish_reason == "stop" and len(plain.ids) < 60  # <|im_end|> stopped it
    with_stop = smol.generate(ids, max_new_tokens=60, stop=["zzz"])
    assert with_stop.ids == plain.ids and with_stop.finish_reason == "stop"
    ignored = smol.generate(ids, max_new_tokens=len(plain.ids) + 3, ignore_eos=True)
    assert ignored.ids[: len(plain.ids)] == plain.ids and len(ignored.ids) == len(plain.ids) + 3
    assert ignored.ids[len(plain.ids)] in smol.eos_token_ids
    col = np.empty(1, dtype=object)
    col[0] = msgs
    out = exactblocks.ray.Generate(smol, max_new_tokens=60, stop=["zzz"])({"messages": col})
    assert list(out["generated_ids"][0]) == plain.ids


def test_sampling_arguments_have_one_check(smol):
    """The same bad value is refused by the same check on every surface, naming it."""
    with pytest.raises(ValueError, match=r"^Model\.generate: top_k=0 must be >= 1$"):
        smol.generate(PROMPT, max_new_tokens=2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"^SamplingParams: top_k=0 must be >= 1$"):
        SamplingParams(max_tokens=2, top_k=0)
    with pytest.raises(TypeError, match=r"max_new_tokens must be an int; got float"):
        smol.generate(PROMPT, max_new_tokens=2.5)
    with pytest.raises(ValueError, match="temperature=-1.0 must be >= 0"):
        exactblocks.ray.Generate(smol, temperature=-1.0)
    # the server has no private cap of its own: 150 is a valid temperature of the core
    assert SamplingParams(max_tokens=1, temperature=150.0).temperature == 150.0


def test_pickling_a_model_is_refused_by_name(smol):
    with pytest.raises(TypeError, match=r"^Model: a loaded model cannot be pickled"):
        pickle.dumps(smol)


def test_streamed_pieces_join_to_the_text_with_a_stop_string(smol):
    free = smol.generate(PROMPT, max_new_tokens=12, stop=())
    needle = free.text[5:8]
    for stop in (needle, "zzz"):
        out = smol.generate(PROMPT, max_new_tokens=12, stop=stop)
        stream = smol.generate(PROMPT, max_new_tokens=12, stop=stop, stream=True)
        assert "".join(stream) == out.text == stream.output.text
