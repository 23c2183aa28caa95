"""harness.ranks.spawn: ranks forked from the zygotes are real processes that end as a user's script does.

What the suite relies on when its ranks no longer start as new interpreters: the interpreter's whole exit runs in each
rank (atexit work, its exit status checked), the test's environment and directory reach the ranks, the ranks of one
run hash strings differently (as separately started processes do), and a rank's failure fails the run with its
traceback.
"""

from __future__ import annotations

import atexit
import os

import pytest

from harness.ranks import RankFailed, spawn


def _probe(rank: int, world_size: int, directory: str) -> None:
    def at_exit() -> None:  # runs only in the interpreter's own exit
        with open(os.path.join(directory, f"exit{rank}"), "w") as f:
            f.write(f"{hash('probe')} {os.getcwd()} {os.environ.get('HARNESS_PROBE')} {os.environ['RANK']}")

    atexit.register(at_exit)


def _status_at_exit(rank: int, world_size: int) -> None:
    if rank == 1:
        atexit.register(os._exit, 3)  # an exit that fails after the rank's work succeeded


def _raises(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("the probe failed on rank 0")


def test_ranks_run_the_interpreters_exit_with_the_tests_environment_and_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_PROBE", "set-by-the-test")
    spawn(_probe, 2, str(tmp_path))
    seen = [(tmp_path / f"exit{rank}").read_text().split() for rank in range(2)]
    assert [s[1:] for s in seen] == [[str(tmp_path), "set-by-the-test", str(rank)] for rank in range(2)]
    assert seen[0][0] != seen[1][0]  # separate interpreters: separate hash seeds


def test_a_rank_whose_exit_fails_fails_the_run_with_its_exit_code():
    with pytest.raises(RankFailed, match="rank 1 of 2 ended with exit code 3"):
        spawn(_status_at_exit, 2)


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(
        RankFailed, match="(?s)rank 0 of 2 ended with exit code 1.*ValueError: the probe failed on rank 0"
    ):
        spawn(_raises, 2)
