"""The save records the metrics come from: an async save's record sums its call and every later wait for it."""

from __future__ import annotations

import time

import pytest

from lightning_dcp.engine.save_log import SaveLog, save_metrics


def test_an_async_records_blocked_time_is_its_call_plus_every_wait_and_it_is_logged_once_settled():
    saves = SaveLog()
    record = saves.begin("/ckpt/a", step=3, tier="durable", started=time.perf_counter(), background=True)
    saves.returned(record, call_s=0.25)
    saves.waited(record, 0.5)  # the next optimizer step, at the gate
    saves.committed(record)
    assert saves.drain() == [] and saves.announce(record) is None  # a wait for it may still come
    saves.waited(record, 1.0)  # the next call waited for the write (back-pressure)
    saves.settled(record)
    (done,) = saves.drain()
    assert done.call_s == 0.25 and done.waits_s == 1.5
    assert save_metrics(done)["checkpoint/save_blocked_s"] == pytest.approx(1.75)
    assert done.save_s >= done.blocked_s  # the loop cannot wait for a save longer than the save lasts
    assert "the loop waited 1.750 s" in saves.announce(done)


def test_a_wait_before_the_call_returned_counts_too_and_a_sync_record_needs_no_settling():
    saves = SaveLog()
    record = saves.begin("/ckpt/b", step=1, tier="durable", started=time.perf_counter(), background=True)
    saves.waited(record, 0.125)  # a step in another thread while the call still ran (no blocked time yet)
    assert record.blocked_s is None
    saves.returned(record, call_s=0.5)
    assert record.blocked_s == 0.625
    saves.committed(record)
    sync = saves.begin("/ckpt/c", step=2, tier="durable", started=time.perf_counter())
    saves.committed(sync)
    saves.returned(sync)
    assert [r.url for r in saves.drain()] == ["/ckpt/c"]  # the async one is committed, not settled
    saves.settled(record)
    assert [r.url for r in saves.drain()] == ["/ckpt/b"]
