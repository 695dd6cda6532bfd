"""The server on a Mamba-2 model (tiny, random, no tokenizer: prompts as token ids), called
with the official client: concurrent answers equal the same requests alone, and prefix-cache
hits (the whole SSM state restored at a boundary) equal cold answers."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from serve_helpers import live_server, tiny_model


def _ask(client, prompt, seed):
    r = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0.9,
                                  seed=seed, logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    return (lp.tokens, lp.token_logprobs, lp.top_logprobs), r.usage.prompt_tokens_details


def test_mamba2_server_batch_invariant_and_prefix_exact(tmp_path):
    model = tiny_model("mamba2", tmp_path)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 300, 40).tolist()  # boundaries at 16 and 32 inside
    prompts = [shared + rng.integers(0, 300, 3 + i).tolist() for i in range(6)]
    with live_server(model, model_name="m", prefix_cache_mb=0, max_batch=1) as cold_srv:
        cold = [_ask(cold_srv.client(), p, i)[0] for i, p in enumerate(prompts)]
    with live_server(model, model_name="m", max_batch=3, prefill_chunk=16) as srv:
        client = srv.client()
        first, details = _ask(client, prompts[0], 0)  # saves the shared boundaries
        assert first == cold[0] and details.cached_tokens == 0
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: _ask(srv.client(), prompts[i], i), range(6)))
        for i in range(6):
            assert got[i][0] == cold[i], i
        assert all(d.cached_tokens >= 32 for _, d in got[1:])
        assert got[0][1].cached_tokens == len(prompts[0])  # the whole prompt was saved


def test_non_streaming_client_that_leaves_frees_its_row(tmp_path):
    model = tiny_model("mamba2", tmp_path)
    with live_server(model, model_name="m", max_batch=1) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4000}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        deadline = time.monotonic() + 30
        while srv.engine.stats().get("generation_tokens_total", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        conn.sock.close()  # gone before the answer (4000 tokens) is ready
        conn.close()
        srv.wait_idle(timeout=20)
        stats = srv.engine.stats()
        assert stats["requests_abort"] == 1 and stats["generation_tokens_total"] < 4000
