"""A fleet on Ray Serve (``exactblocks.ray.run_fleet``) on a real local Ray runtime: 2 engine
replicas of the real SmolLM2 GGUF (1 CPU each) behind one ingress, called with the official
``openai`` client, answer every request with the bits of one in-process ``exactblocks serve``
(tokens, text, logprobs, embeddings), whatever replica each landed on; shared-prefix requests
are routed to the replica that cached the prefix (its hits in ``/metrics``) and answer as a
cold server does; killing the replica that serves a set of streams mid-stream loses no token
(each stream equals the uninterrupted answer); a burst scales a 1-to-2 fleet up and idling
scales it back down.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time

import numpy as np
import pytest
from serve_helpers import live_server, require

import exactblocks

ray = require("ray", "the fleet needs ray[serve]")
serve = require("ray.serve", "the fleet needs ray[serve]")
ebray = require("exactblocks.ray", "the fleet needs ray[serve]")

pytestmark = pytest.mark.slow

NAME = "smollm2"
ENGINE = dict(max_batch=8, max_tokens_per_sequence=768, prefill_chunk=16)
SYSTEM = (
    "You are a careful assistant for a small seaside town's library. You answer in one or two "
    "short sentences, you never invent opening hours, and you suggest asking a librarian at "
    "the front desk whenever a question is about a specific book, a room booking or a fee."
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray runtime of 4 logical CPUs (2 replicas, a replacement, a scaled one); its
    workers import exactblocks from this source tree when it is not installed."""
    parent = os.path.dirname(os.path.dirname(os.path.abspath(exactblocks.__file__)))
    installed = os.path.basename(parent) in ("site-packages", "dist-packages")
    env = {}
    if not installed:
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [parent, os.environ.get(
            "PYTHONPATH")]))}}  # fmt: skip
    ray.init(num_cpus=4, runtime_env=env, include_dashboard=False, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def fleet(ray_local, smol):
    url = ebray.run_fleet(str(smol.source), port=_free_port(), app_name="fleet", replicas=2,
                          cpus_per_replica=1, model_name=NAME, **ENGINE)  # fmt: skip
    yield url
    serve.delete("fleet")


@pytest.fixture(scope="module")
def single(smol):
    """One in-process server without a prefix cache: every answer computed cold."""
    with live_server(smol, model_name=NAME, prefix_cache_mb=0, **ENGINE) as s:
        yield s


def _client(url):
    openai = require("openai", "the tests call the fleet with the official client")
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _metrics(url) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def _per_replica(text: str, name: str) -> dict:
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{model_name="[^"]*",replica="([^"]+)"\}} (\S+)$',
                         text, re.M):  # fmt: skip
        out[m.group(1)] = float(m.group(2))
    return out


def _settled_metrics(url, name, want_total=None, timeout=15.0) -> dict:
    """Per-replica values of ``name`` once the replicas' reports (every second) caught up."""
    deadline = time.monotonic() + timeout
    while True:
        got = _per_replica(_metrics(url), name)
        if want_total is None or sum(got.values()) >= want_total or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


def _bits(values) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32)


def _chat(client, i, **kw):
    msgs = [{"role": "user", "content": f"Name {i % 4 + 2} animals that live near the sea."}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, logprobs=True,
                                       top_logprobs=2, **kw)  # fmt: skip
    c = r.choices[0]
    lps = [t.logprob for t in c.logprobs.content]
    tops = [[(a.token, a.logprob) for a in t.top_logprobs] for t in c.logprobs.content]
    return c.message.content, c.finish_reason, lps, tops, r.usage.completion_tokens


def _completion(client, i, **kw):
    r = client.completions.create(model=NAME, prompt=f"The {i}th lighthouse on the coast",
                                  max_tokens=10, logprobs=2, **kw)  # fmt: skip
    c = r.choices[0]
    return c.text, c.finish_reason, c.logprobs.token_logprobs, c.logprobs.tokens, 0


def _request(client, i):
    sampled = dict(temperature=0.9, top_p=0.95, seed=500 + i) if i % 2 else dict(temperature=0)
    return (_chat if i % 3 else _completion)(client, i, **sampled)


def test_sixteen_concurrent_requests_equal_one_server(fleet, single):
    """16 concurrent requests (chat and completions, greedy and seeded, logprobs) through
    the fleet equal the same requests on one server, bit for bit; the replicas that took
    them are recorded from /metrics (every request landed on one of the two)."""
    client = _client(fleet)
    before = _settled_metrics(fleet, "exactblocks_replica_requests_submitted_total")
    got: dict = {}

    def run(i):
        got[i] = _request(client, i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(got) == list(range(16))
    ref_client = single.client()
    for i in range(16):
        want = _request(ref_client, i)
        assert got[i][:2] == want[:2], i
        assert (_bits(got[i][2]) == _bits(want[2])).all(), i
        assert got[i][3:] == want[3:], i
    landed = _settled_metrics(fleet, "exactblocks_replica_requests_submitted_total",
                              want_total=sum(before.values()) + 16)  # fmt: skip
    assert len(landed) == 2, landed
    assert sum(landed.values()) - sum(before.values()) == 16, (before, landed)
    print("requests per replica:", {r: landed[r] - before.get(r, 0) for r in landed})
    # embeddings run on a replica too: the same bits as the single server's
    e1 = client.embeddings.create(model=NAME, input=["a quiet harbour", "the tide"])
    e2 = ref_client.embeddings.create(model=NAME, input=["a quiet harbour", "the tide"])
    for a, b in zip(e1.data, e2.data):
        assert (_bits(a.embedding) == _bits(b.embedding)).all()


def test_shared_prefix_goes_to_the_replica_that_cached_it(fleet, single):
    """Requests sharing a long system prompt, sent one after another, all land on the
    replica that cached it (its prefix-cache hits grow by one per request, the other's do
    not), and each answer equals a cold server's."""
    client, ref = _client(fleet), single.client()
    hits0 = _settled_metrics(fleet, "exactblocks_replica_prefix_cache_hits_total")
    questions = ["Can I renew a book online?", "Where are the atlases?", "Is there wifi?",
                 "Do you lend umbrellas?", "Can children join?", "Is the café open?"]  # fmt: skip
    for q in questions:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        kw = dict(model=NAME, messages=msgs, max_tokens=8, temperature=0.7, seed=9, logprobs=True)
        r, want = client.chat.completions.create(**kw), ref.chat.completions.create(**kw)
        assert r.choices[0].message.content == want.choices[0].message.content
        got_lp = [t.logprob for t in r.choices[0].logprobs.content]
        want_lp = [t.logprob for t in want.choices[0].logprobs.content]
        assert (_bits(got_lp) == _bits(want_lp)).all()
    hits = _settled_metrics(fleet, "exactblocks_replica_prefix_cache_hits_total",
                            want_total=sum(hits0.values()) + len(questions) - 1)  # fmt: skip
    gained = {r: hits[r] - hits0.get(r, 0) for r in hits}
    assert sorted(gained.values()) == [0, len(questions) - 1], gained


def _stream(client, i, out: dict, progress: list):
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Tell a long story about lighthouse number {i}."},
    ]
    sampling = dict(temperature=0.8, seed=70 + i) if i % 2 else dict(temperature=0.0)
    s = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=160, stream=True,
                                       logprobs=True, extra_body={"ignore_eos": True},
                                       **sampling)  # fmt: skip
    text, lps, fin = [], [], None
    for ch in s:
        if not ch.choices:
            continue
        c = ch.choices[0]
        text.append(c.delta.content or "")
        if c.logprobs and c.logprobs.content:
            lps += [t.logprob for t in c.logprobs.content]
        fin = c.finish_reason or fin
        progress.append(i)
    out[i] = ("".join(text), lps, fin)


def _replica_actor(app: str, replica: str):
    name = f"SERVE_REPLICA::{app}#EngineReplica#{replica}"
    return ray.get_actor(name, namespace="serve")


def test_killed_replica_mid_stream_loses_no_token(fleet, single):
    """Four streams (two greedy, two seeded) share a prefix, so they run on one replica;
    that replica's actor is killed while they stream. Every stream completes on the other
    replica with exactly the text and logprobs of an uninterrupted run."""
    client = _client(fleet)
    sub0 = _settled_metrics(fleet, "exactblocks_replica_requests_submitted_total")
    out: dict = {}
    progress: list = []
    threads = [threading.Thread(target=_stream, args=(client, i, out, progress)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(set(progress)) < 4 or len(progress) < 24:  # every stream has sent chunks
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    sub = _settled_metrics(fleet, "exactblocks_replica_requests_submitted_total",
                           want_total=sum(sub0.values()) + 4)  # fmt: skip
    busy = [r for r in sub if sub[r] - sub0.get(r, 0) > 0]
    chunks_at_kill = len(progress)
    for r in busy:  # (one replica when affinity kept them together; both otherwise)
        if r != max(busy, key=lambda r: sub[r] - sub0.get(r, 0)):
            continue
        ray.kill(_replica_actor("fleet", r), no_restart=True)
    for t in threads:
        t.join(240)
    assert sorted(out) == [0, 1, 2, 3]
    assert chunks_at_kill < 4 * 160, "the streams had finished before the kill"
    ref = single.client()
    for i in range(4):
        want: dict = {}
        _stream(ref, i, want, [])
        assert out[i][0] == want[i][0], i
        assert (_bits(out[i][1]) == _bits(want[i][1])).all(), i
        assert out[i][2] == want[i][2] == "length"
    failovers = re.search(r"^exactblocks_failovers_total (\S+)$", _metrics(fleet), re.M)
    assert failovers and float(failovers.group(1)) >= 1


def _running_replicas(app: str) -> int:
    st = serve.status().applications[app].deployments["EngineReplica"]
    return st.replica_states.get("RUNNING", 0)


def test_a_burst_scales_up_and_idling_scales_down(ray_local, smol, fleet):
    serve.delete("fleet")  # its replicas' CPUs and its route for this one
    port = int(fleet.rsplit(":", 1)[1])  # Ray Serve's HTTP proxy keeps the port it started on
    # this fleet's replicas get the model through the object store (pack_model), not a path
    ref = ray.put(ebray.pack_model(str(smol.source)))
    url = ebray.run_fleet(model_ref=ref, port=port, app_name="scale", replicas=1,
                          max_replicas=2, model_name=NAME, max_batch=2, max_queue=8,
                          autoscaling={"target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                                       "downscale_delay_s": 3, "metrics_interval_s": 0.5,
                                       "look_back_period_s": 1},
                          max_tokens_per_sequence=512)  # fmt: skip
    try:
        assert _running_replicas("scale") == 1
        client = _client(url)
        out: dict = {}
        progress: list = []
        threads = [threading.Thread(target=_stream, args=(client, i, out, progress))
                   for i in range(6)]  # fmt: skip
        for t in threads:
            t.start()
        peak, deadline = 1, time.monotonic() + 90
        while peak < 2 and time.monotonic() < deadline:
            peak = max(peak, _running_replicas("scale"))
            time.sleep(0.2)
        for t in threads:
            t.join(300)
        assert peak == 2, "the burst did not add a replica"
        assert sorted(out) == list(range(6))
        deadline = time.monotonic() + 90
        while _running_replicas("scale") > 1:
            assert time.monotonic() < deadline, "the fleet did not scale back down"
            time.sleep(0.5)
        assert _running_replicas("scale") == 1
    finally:
        serve.delete("scale")
