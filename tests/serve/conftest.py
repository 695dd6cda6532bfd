"""Fixtures of the server tests; the helpers live in serve_helpers.py."""

from __future__ import annotations

import pytest
from serve_helpers import live_server, smollm2


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, loaded once per session (read-only: servers share it)."""
    return smollm2()


@pytest.fixture(scope="module")
def srv(smol):
    """A real server on SmolLM2: 8 rows, 512 tokens per sequence, 64-token prefill chunks."""
    with live_server(smol, max_batch=8, max_tokens_per_sequence=512, max_queue=64) as s:
        yield s
