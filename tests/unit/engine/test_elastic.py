"""engine.elastic: the ranks of one elastic start agree on keys of their own in a store that outlives them.

The store is a real ``TCPStore`` on loopback (the agent's, in a run); ranks are threads with clients of their own,
as workers are processes with clients of their own. What an earlier start left in the store is planted first.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dcp.engine.elastic import agree_attempt, attempt_store

TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield store


def _client(server: dist.TCPStore, timeout: timedelta = TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)


def _start(server: dist.TCPStore, world_size: int, *, ranks=None, delays=None, timeout: timedelta = TIMEOUT) -> dict:
    """Run ``agree_attempt`` on ``ranks`` (default: all), each in a thread with its own client; rank -> token/error."""
    ranks = list(range(world_size)) if ranks is None else ranks
    delays = delays or {}
    results: dict[int, object] = {}

    def one(rank: int) -> None:
        time.sleep(delays.get(rank, 0.0))
        try:
            results[rank] = agree_attempt(_client(server, timeout), rank=rank, world_size=world_size, timeout=timeout)
        except Exception as error:  # noqa: BLE001 (the test reads it)
            results[rank] = error

    threads = [threading.Thread(target=one, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout.total_seconds() + 10)
    return results


def test_every_rank_of_a_start_gets_one_token_and_the_next_start_another(server):
    first = _start(server, 3, delays={0: 0.2, 2: 0.1})  # rank 0 last: the others wait for it
    assert len(set(first.values())) == 1
    token = first[0]
    assert isinstance(token, str) and len(token) == 32

    second = _start(server, 3, delays={1: 0.3})  # the store still holds the first start's keys
    assert len(set(second.values())) == 1
    assert second[0] != token


def test_an_earlier_starts_unanswered_nonce_and_its_counts_do_not_mislead_the_next(server):
    # an earlier start died mid-agreement: rank 2 had appended its nonce, rank 0 never answered it
    client = _client(server)
    client.append("lightning_dcp/attempts/world_3/hellos", "deadbeef" * 4 + ",")
    before = _start(server, 3)
    assert len(set(before.values())) == 1
    # the counts of an earlier token do not count for a new one: a start of 2 ranks of world 3 does not finish
    partial = _start(server, 3, ranks=[0, 1], timeout=timedelta(seconds=1))
    assert isinstance(partial[0], TimeoutError)
    assert "1 of the 2 other ranks" in str(partial[0])


def test_attempt_store_is_none_outside_an_agent_and_a_prefixed_view_under_one(server, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(host="127.0.0.1", port=server.port, rank=0, world_size=1, timeout=TIMEOUT) is None

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    monkeypatch.setenv("WORLD_SIZE", "1")
    views = [attempt_store(host="127.0.0.1", port=server.port, rank=0, world_size=1, timeout=TIMEOUT) for _ in "ab"]
    views[0].set("k", "first")
    views[1].set("k", "second")
    assert views[0].get("k") == b"first"  # two starts never share a key
    assert views[1].get("k") == b"second"
    assert not server.check(["k"])  # nothing lands outside the prefix
