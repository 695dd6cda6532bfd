"""Fixtures of the server tests; the helpers live in serve_helpers.py."""

from __future__ import annotations

import pytest
from serve_helpers import live_server, smollm2

import exactblocks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One exactblocks thread while the servers run (restored after each module).

    Answers never depend on the thread count; speed does: on a shared 2-core machine a call
    split over 2 threads waits for the busier core (README "Threads and SIMD paths"), and
    these tests run beside other work.
    """
    before = exactblocks.get_num_threads()
    exactblocks.set_num_threads(1)
    yield
    exactblocks.set_num_threads(before)


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, loaded once per session (read-only: servers share it)."""
    return smollm2()


@pytest.fixture(scope="module")
def srv(smol):
    """A real server on SmolLM2: 8 rows, 512 tokens per sequence, 64-token prefill chunks."""
    with live_server(smol, max_batch=8, max_tokens_per_sequence=512, max_queue=64) as s:
        yield s
