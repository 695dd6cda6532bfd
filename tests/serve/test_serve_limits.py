"""Stop strings and body sizes at the limits, against a real server on SmolLM2.

A ``stop`` that is empty, too long a list or not strings gets a 400 naming ``stop`` with a
message that says which rule it broke. A body over the 4 MiB limit gets a 413 with an OpenAI
error body that the client can read: the server reads and discards the body before it answers
(else the client, still sending, sees a broken pipe or a reset), with ``Content-Length`` or
chunked, from ``urllib.request`` and ``http.client``; the next request is served normally.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import pytest

from exactblocks.serve.handling import MAX_BODY_BYTES

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


def _error(status, payload, want_status, needles=(), param=None):
    assert status == want_status, payload
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err
    return err


def _served(srv):
    ok, _, answer = srv.request("POST", COMP, {"model": "smollm2", "prompt": "Hi",
                                               "max_tokens": 1, "seed": 0})  # fmt: skip
    assert ok == 200 and answer["usage"]["completion_tokens"] == 1, answer


@pytest.mark.parametrize(
    ("stop", "needles"),
    [
        ([""], ["stop[0] is an empty string", "non-empty"]),
        ("", ["stop is an empty string", "non-empty"]),
        (["a", ""], ["stop[1] is an empty string"]),
        (["a", "b", "c", "d", "e"], ["stop has 5 strings", "at most 4"]),
        ([1], ["stop must be a string or a list of at most 4 strings", "[1]"]),
        (5, ["stop must be a string or a list of at most 4 strings", "5"]),
        (["a", None], ["stop must be a string or a list", "null"]),
        ({"a": 1}, ["stop must be a string or a list"]),
    ],
    ids=repr,
)
@pytest.mark.parametrize("path", [COMP, CHAT])
def test_a_bad_stop_names_the_rule(srv, path, stop, needles):
    body = {"model": "smollm2", "stop": stop, "max_tokens": 1}
    body.update({"prompt": "Hi"} if path == COMP else {"messages": MSG})
    status, _, payload = srv.request("POST", path, body)
    err = _error(status, payload, 400, needles, param="stop")
    assert "\n" not in err["message"]
    _served(srv)


def test_four_stop_strings_are_accepted(srv):
    status, _, payload = srv.request(
        "POST",
        COMP,
        {
            "model": "smollm2",
            "prompt": "Hi",
            "max_tokens": 1,
            "stop": ["a", "b", "c", "d"],
        },  # fmt: skip
    )
    assert status == 200, payload


def _big_body() -> bytes:
    body = b'{"model": "smollm2", "prompt": "' + b"a" * (5 << 20) + b'"}'
    assert len(body) > MAX_BODY_BYTES
    return body


def _too_big(status, payload):
    err = _error(status, payload, 413, [str(MAX_BODY_BYTES), "bytes"])
    assert err["code"] == "body_too_large", err


def test_a_body_over_the_limit_gets_a_413_with_urllib(srv):
    req = urllib.request.Request(
        srv.url + COMP, data=_big_body(), headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    _too_big(info.value.code, json.loads(info.value.read()))
    _served(srv)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_a_413_with_http_client(srv, chunked):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        data = _big_body()
        if chunked:
            parts = (data[i : i + 65536] for i in range(0, len(data), 65536))
            conn.request("POST", COMP, body=parts, encode_chunked=True,
                         headers={"Content-Type": "application/json"})  # fmt: skip
        else:
            conn.request("POST", COMP, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        _too_big(resp.status, json.loads(resp.read()))
    finally:
        conn.close()
    _served(srv)
