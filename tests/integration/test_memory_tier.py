"""A slice of the memory-tier chaos pass (tests/chaos/memory.py, ``nox -s chaos_memory``): 2 simulated nodes of 2
DDP ranks, a real ``kill -9`` of the whole job at a random moment (saves, replication and persistence run every few
steps), then ``fit(ckpt_path="last")``: it must resume the newest checkpoint complete in the memory areas, with the
weights and optimizer state hashed at its save."""

from __future__ import annotations

import random

import pytest

from tests.chaos.memory import trial


@pytest.mark.full
def test_whole_job_kill_resumes_from_memory_with_the_exact_state(tmp_path):
    result = trial(str(tmp_path / "trial"), "whole_job", random.Random(11))
    assert result["expected"] is not None, result  # something was committed in memory before the kill
    assert result["resumed_steps"] == [result["expected"][0]], result
    assert result["lost"] == 0 and result["torn"] == 0 and result["failed"] == 0, result
