"""Bad and hostile input against a real server on SmolLM2: each malformed request gets an
OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` with its status, and the
next request is served normally; the API key guards every route but /health."""

from __future__ import annotations

import pytest
from serve_helpers import live_server, require

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]

# (name, path, body (bytes = raw), status, param or None)
CASES = [
    ("malformed JSON", CHAT, b'{"model": "smollm2", "messages": [', 400, None),
    ("not an object", CHAT, b"[1, 2, 3]", 400, None),
    ("empty body", COMP, b"", 400, None),
    ("unknown field", CHAT, {"model": "smollm2", "messages": MSG, "bogus": 1}, 400, "bogus"),
    ("string temperature", CHAT, {"model": "smollm2", "messages": MSG, "temperature": "hot"},
     400, "temperature"),
    ("string max_tokens", COMP, {"model": "smollm2", "prompt": "Hi", "max_tokens": "5"}, 400,
     "max_tokens"),
    ("bool max_tokens", COMP, {"model": "smollm2", "prompt": "Hi", "max_tokens": True}, 400,
     "max_tokens"),
    ("float max_tokens", COMP, {"model": "smollm2", "prompt": "Hi", "max_tokens": 2.5}, 400,
     "max_tokens"),
    ("negative max_tokens", COMP, {"model": "smollm2", "prompt": "Hi", "max_tokens": -1}, 400,
     "max_tokens"),
    ("max_tokens beyond the sequence", COMP,
     {"model": "smollm2", "prompt": "Hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("temperature too high", CHAT, {"model": "smollm2", "messages": MSG, "temperature": 9.0},
     400, "temperature"),
    ("negative seed", CHAT, {"model": "smollm2", "messages": MSG, "seed": -1}, 400, "seed"),
    ("top_p zero", CHAT, {"model": "smollm2", "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("n beyond the cap", CHAT, {"model": "smollm2", "messages": MSG, "n": 17}, 400, "n"),
    ("top_logprobs without logprobs", CHAT,
     {"model": "smollm2", "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("too many top_logprobs", CHAT,
     {"model": "smollm2", "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("bad role", CHAT, {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ("no messages", CHAT, {"model": "smollm2", "messages": []}, 400, "messages"),
    ("missing model", CHAT, {"messages": MSG}, 400, "model"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "model"),
    ("token id outside the vocabulary", COMP, {"model": "smollm2", "prompt": [1, 10**9]}, 400,
     "prompt"),
    ("empty prompt", COMP, {"model": "smollm2", "prompt": ""}, 400, "prompt"),
    ("prompt longer than a sequence", COMP,
     {"model": "smollm2", "prompt": "word " * 600}, 400, "prompt"),
    ("prompt longer than a sequence (chat)", CHAT,
     {"model": "smollm2", "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "messages"),
    ("body over 4 MiB", COMP, b'{"model": "smollm2", "prompt": "' + b"a" * (5 << 20) + b'"}',
     413, None),
    ("penalty", CHAT, {"model": "smollm2", "messages": MSG, "presence_penalty": 1.0}, 400,
     "presence_penalty"),
    ("suffix", COMP, {"model": "smollm2", "prompt": "Hi", "suffix": "!"}, 400, "suffix"),
]  # fmt: skip


# (name, path, body (bytes = raw), status, param, text the message holds)
MESSAGE_CASES = [
    ("NaN temperature", CHAT,
     b'{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], '
     b'"temperature": NaN}', 400, "temperature", "temperature: must be finite; got NaN"),
    ("Infinity top_p", COMP, b'{"model": "smollm2", "prompt": "Hi", "top_p": Infinity}', 400,
     "top_p", "top_p: must be finite; got Infinity"),
    ("stream_options without stream", CHAT,
     {"model": "smollm2", "messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream_options: only allowed when stream is true"),
    ("text part without text", CHAT,
     {"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0.text", "messages.0.content.0.text: Field required"),
    ("image part", CHAT,
     {"model": "smollm2", "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'"),
    ("content a number", CHAT,
     {"model": "smollm2", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", "Input should be a valid string or a valid array; got 5"),
    ("a string in token ids", COMP, {"model": "smollm2", "prompt": [1, "a"]}, 400, "prompt.1",
     "prompt.1: Input should be a valid integer"),
    ("token id outside the vocabulary, its position", COMP,
     {"model": "smollm2", "prompt": [1, 2, 10**9]}, 400, "prompt",
     "prompt.2: token id 1000000000 is outside the vocabulary [0, 49152)"),
    ("token id outside the vocabulary, batch", COMP,
     {"model": "smollm2", "prompt": [[1], [-3, 2]]}, 400, "prompt.1",
     "prompt.1.0: token id -3 is outside the vocabulary [0, 49152)"),
]  # fmt: skip


def _check_error(status, payload, want_status, want_param=None):
    assert status == want_status, payload
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if want_param is not None:
        assert err["param"] == want_param, err


def test_malformed_requests_get_errors_and_the_next_is_served(srv):
    for name, path, body, status, param in CASES:
        got, _, payload = srv.request("POST", path, body)
        _check_error(got, payload, status, param)
        ok, _, answer = srv.request(
            "POST", COMP, {"model": "smollm2", "prompt": "Hi", "max_tokens": 1, "seed": 0}
        )
        assert ok == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length"), name
    for name, path, body, status, param, says in MESSAGE_CASES:
        got, _, payload = srv.request("POST", path, body)
        _check_error(got, payload, status, param)
        assert says in payload["error"]["message"], (name, payload)
    srv.wait_idle()
    got, _, payload = srv.request("GET", "/v1/nothing-here")
    _check_error(got, payload, 404)
    got, _, payload = srv.request("GET", CHAT)
    _check_error(got, payload, 405)


def test_official_client_raises_typed_errors(srv):
    openai = require("openai", "the tests call the server with the official client")
    client = srv.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=MSG, n=17)
    assert info.value.body["param"] == "n"


def test_api_key_guards_every_route_but_health(smol):
    openai = require("openai", "the tests call the server with the official client")
    with live_server(smol, api_key="s3cret", max_batch=1, max_tokens_per_sequence=128) as s:
        assert s.request("GET", "/health")[0] == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", COMP),
                             ("POST", CHAT)]:  # fmt: skip
            got, _, payload = s.request(method, path, {"model": "smollm2", "prompt": "x"})
            _check_error(got, payload, 401)
            got, _, payload = s.request(method, path, {}, headers={"Authorization": "Bearer no"})
            _check_error(got, payload, 401)
        for header in ("Basic s3cret", "s3cret", "Bearer s3cret2", "Bearers3cret"):
            got, _, payload = s.request("GET", "/v1/models", headers={"Authorization": header})
            _check_error(got, payload, 401)
        for header in ("bearer s3cret", "BEARER  s3cret"):  # the scheme is case-insensitive
            assert s.request("GET", "/v1/models", headers={"Authorization": header})[0] == 200
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = s.client().completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--port", "99999", "expected an int in [0, 65535]; got 99999"),
        ("--port", "http", "expected an int in [0, 65535]; got 'http'"),
        ("--prefix-cache-mb", "-1", "expected a finite number of MiB >= 0; got '-1'"),
        ("--prefix-cache-mb", "nan", "expected a finite number of MiB >= 0; got 'nan'"),
        ("--prefill-ratio", "-0.5", "expected a finite number >= 0; got '-0.5'"),
        ("--prefill-ratio", "inf", "expected a finite number >= 0; got 'inf'"),
        ("--prefill-ratio", "half", "expected a number >= 0; got 'half'"),
    ],
)
def test_serve_options_are_checked_before_the_model_loads(flag, value, expected):
    """A bad --port or --prefix-cache-mb is an argparse error (exit 2) naming the option, raised
    before the model loads: the model path here does not exist, and no traceback follows."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "exactblocks", "serve", "/nonexistent/model.gguf", flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"argument {flag}: {expected}" in proc.stderr
    assert "Traceback" not in proc.stderr
