"""Every setup of the zoo resumes through lightning_dcp with the state stock Lightning's resume gives.

At 1 and 2 ranks and resharded 2 -> 1 (:mod:`tests.setups._run`): each setup trained to an epoch's end, saved,
resumed in new objects, the restored state compared bit for bit with stock Lightning's resume of the same run, and
our resumed run's end with our uninterrupted run's (stock does not restore RNG states). The default run takes the
setups marked ``ci``; ``nox -s zoo`` (``LIGHTNING_DCP_ZOO=all``) every setup.
"""

from __future__ import annotations

import pytest

from harness.ranks import spawn
from tests._trainer import assert_same
from tests.setups import zoo  # noqa: F401  (registers the setups)
from tests.setups._base import SETUPS, selected
from tests.setups._run import load_results, run_zoo

NAMES = selected()
TWO_RANKS = [name for name in NAMES if 2 in SETUPS[name].ranks]


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="module")
def two_ranks(zoo_root: str) -> list[dict]:
    spawn(run_zoo, 2, zoo_root, {"train": TWO_RANKS}, timeout=900)
    return [load_results(zoo_root, "train", 2, rank) for rank in range(2)]


@pytest.fixture(scope="module")
def one_rank_runs(zoo_root: str, two_ranks: list[dict]) -> str:
    """One process: every setup trained and resumed at 1 rank, and the 2-rank checkpoints resumed (resharded)."""
    spawn(run_zoo, 1, zoo_root, {"train": NAMES, "reshard": TWO_RANKS}, timeout=900)
    return zoo_root


@pytest.fixture(scope="module")
def one_rank(one_rank_runs: str) -> list[dict]:
    return [load_results(one_rank_runs, "train", 1, 0)]


@pytest.fixture(scope="module")
def resharded(one_rank_runs: str) -> list[dict]:
    return [load_results(one_rank_runs, "reshard", 1, 0)]


def _check(results: list[dict], name: str, *, final: bool) -> None:
    final = final and SETUPS[name]().continues_at(len(results))
    for rank, per_rank in enumerate(results):
        out = per_rank[name]
        assert "error" not in out, f"rank {rank}:\n{out.get('error')}"
        assert_same(out["ours"], out["stock"], f"rank{rank}.restored")
        assert_same(out["ours_loaded"], out["stock_loaded"], f"rank{rank}.loaded")
        if final:
            for key in ("model", "optimizers", "schedulers", "global_step", "epoch", "extra"):  # no buffer that no
                # checkpoint holds (non-persistent)
                assert_same(out["ours_final"][key], out["ours_full"][key], f"rank{rank}.final.{key}")


@pytest.mark.parametrize("name", NAMES)
def test_resume_one_rank(name: str, one_rank: list[dict]) -> None:
    _check(one_rank, name, final=True)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_resume_two_ranks(name: str, two_ranks: list[dict]) -> None:
    _check(two_ranks, name, final=True)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_resume_resharded_two_to_one(name: str, resharded: list[dict]) -> None:
    _check(resharded, name, final=False)
