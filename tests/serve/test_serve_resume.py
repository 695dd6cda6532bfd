"""A request resumed from any token of its stream (``Engine.submit(resume=...)``: what a
fleet's ingress sends when a replica is lost mid-stream) sends exactly the events the
uninterrupted run sends after that token: token ids, text pieces, text offsets, logprob bits
and the finish, for greedy and seeded sampling, stop strings (text held back across the cut),
a grammar and max_tokens; bad resumes are refused before any work."""

from __future__ import annotations

import numpy as np
import pytest

from exactblocks.models import Grammar, GrammarError
from exactblocks.serve import Engine, SamplingParams

PROMPT = "Write three short sentences about the sea, the sky and the moon."


def _chat(model):
    return list(
        model.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
        )
    )


def _events(result):
    toks, fin = result
    evs = [(t.token, t.text, t.text_offset, t.logprob, t.top_logprobs) for t in toks]
    return evs, (fin.finish_reason, fin.text, fin.tail, fin.completion_tokens, fin.prompt_tokens)


def _bits(evs):
    return np.array([e[3] for e in evs], np.float32).view(np.uint32)


CASES = {
    "greedy": dict(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2),
    "seeded": dict(max_tokens=24, temperature=1.3, top_p=0.95, seed=7, logprobs=True),
    # a stop string made of common pieces: text is held back while it could still start it
    "stop": dict(max_tokens=40, temperature=0.9, seed=3, stop=(". The", "moon."), logprobs=True),
    "grammar": dict(max_tokens=30, temperature=0.8, seed=11, logprobs=True,
                    grammar=Grammar.regex(r"(sea|sky|moon)( (sea|sky|moon)){2,8}\.")),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_at_every_token_continues_the_stream(smol, case):
    ids = _chat(smol)
    params = SamplingParams(**CASES[case])
    with Engine(smol, max_batch=4, prefill_chunk=16) as eng:
        full_evs, full_fin = _events(eng.submit(ids, params).result(timeout=120))
        n = len(full_evs)
        assert n >= 4, full_evs
        # every cut: the events received so far are the first m; the rest must follow
        for m in range(1, n):
            sent = [e[0] for e in full_evs[:m]]
            h = eng.submit(ids, params, resume=sent)
            evs, fin = _events(h.result(timeout=120))
            assert [e[:3] for e in evs] == [e[:3] for e in full_evs[m:]], (case, m)
            np.testing.assert_array_equal(_bits(evs), _bits(full_evs[m:]))
            assert [e[4] for e in evs] == [e[4] for e in full_evs[m:]]
            assert fin == full_fin, (case, m)
    if case == "stop":  # the case exercises a stop string: the run really ended on one
        assert full_fin[0] == "stop"


def test_bad_resumes_are_refused(smol):
    ids = smol.tokenizer.encode(PROMPT)
    eos = smol.eos_token_ids[0]
    with Engine(smol, max_batch=2) as eng:
        p = SamplingParams(max_tokens=3, temperature=0.0)
        with pytest.raises(ValueError, match=r"resume\[1\]=.* is a stop token"):
            eng.submit(ids, p, resume=[5, eos])
        with pytest.raises(ValueError, match=r"resume\[0\]=-1 is outside the vocabulary"):
            eng.submit(ids, p, resume=[-1])
        with pytest.raises(ValueError, match="ends after 3 of them"):
            eng.submit(ids, p, resume=[5, 6, 7, 8])
        with pytest.raises(ValueError, match="nothing to resume"):
            eng.submit(ids, p, resume=[5, 6, 7])
        with pytest.raises(ValueError, match="prompt_logprobs"):
            eng.submit(ids, p, resume=[5], prompt_logprobs=1)
        g = SamplingParams(max_tokens=8, temperature=0.0, grammar=Grammar.regex("(sea|sky)+"))
        with pytest.raises(GrammarError, match=r"resume\[0\]"):
            eng.submit(ids, g, resume=smol.tokenizer.encode(" moon"))
        assert eng.stats().get("requests_submitted", 0) == 0  # nothing was queued
