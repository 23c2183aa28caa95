"""The zoo's setups that exist in Fabric, through ``fabric.save`` / ``fabric.load`` (:mod:`tests.setups._fabric`).

At 1 and 2 ranks (DDP) what our load restored equals what stock Fabric's load of its own file restored, and our
resumed loop ends where our uninterrupted loop ends. Under FSDP2 (DTensor state, ours only) what the load restored
equals the state at the save. Both 2-rank saves are loaded at 1 rank too (FSDP2's into a plain single-device model).
The default run takes the setups marked ``ci``; ``nox -s zoo`` (``LIGHTNING_DCP_ZOO=all``) every setup.
"""

from __future__ import annotations

import pytest

from harness.ranks import spawn
from tests._trainer import assert_same
from tests.setups import zoo  # noqa: F401  (registers the setups)
from tests.setups._base import SETUPS, selected
from tests.setups._fabric import load_fabric_results, run_fabric_zoo

NAMES = selected(fabric=True)
TWO_RANKS = [name for name in NAMES if 2 in SETUPS[name].ranks]
FSDP2 = [name for name in TWO_RANKS if SETUPS[name].fsdp2]


@pytest.fixture(scope="module")
def fabric_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fabric_zoo"))


@pytest.fixture(scope="module")
def two_ranks(fabric_root: str) -> list[dict]:
    spawn(run_fabric_zoo, 2, fabric_root, {"ddp": TWO_RANKS, "fsdp2": FSDP2}, timeout=900)
    return [
        {**load_fabric_results(fabric_root, "ddp", 2, r), "fsdp2": load_fabric_results(fabric_root, "fsdp2", 2, r)}
        for r in range(2)
    ]


@pytest.fixture(scope="module")
def one_rank_runs(fabric_root: str, two_ranks: list[dict]) -> str:
    """One process: every setup at 1 rank, and the 2-rank saves loaded (resharded)."""
    spawn(run_fabric_zoo, 1, fabric_root, {"ddp": NAMES, "reshard": TWO_RANKS}, timeout=900)
    return fabric_root


@pytest.fixture(scope="module")
def one_rank(one_rank_runs: str) -> list[dict]:
    return [load_fabric_results(one_rank_runs, "ddp", 1, 0)]


@pytest.fixture(scope="module")
def resharded(one_rank_runs: str) -> list[dict]:
    return [load_fabric_results(one_rank_runs, "reshard", 1, 0)]


def _check(out: dict, where: str, *, reference: str, final: bool) -> None:
    assert "error" not in out, f"{where}:\n{out.get('error')}"
    assert_same(out["ours"], out[reference], f"{where}.restored")
    if final:
        for key in ("model", "optimizers", "schedulers"):
            assert_same(out["ours_final"][key], out["ours_full"][key], f"{where}.final.{key}")


@pytest.mark.parametrize("name", NAMES)
def test_fabric_resume_one_rank(name: str, one_rank: list[dict]) -> None:
    _check(one_rank[0][name], "rank0", reference="stock", final=SETUPS[name]().continues_at(1))


@pytest.mark.parametrize("name", TWO_RANKS)
def test_fabric_resume_two_ranks(name: str, two_ranks: list[dict]) -> None:
    for rank, results in enumerate(two_ranks):
        _check(results[name], f"rank{rank}", reference="stock", final=SETUPS[name]().continues_at(2))


@pytest.mark.parametrize("name", FSDP2)
def test_fabric_resume_fsdp2(name: str, two_ranks: list[dict]) -> None:
    # every rank restores rank 0's state (gathered whole): FSDP2 leaves buffers per rank, and a save keeps rank 0's
    # (as stock's), so rank 1's own run goes on from its own buffers: only rank 0's end is the uninterrupted one's
    saved = two_ranks[0]["fsdp2"][name]
    for rank, results in enumerate(two_ranks):
        out = {**results["fsdp2"][name], "saved": saved.get("ours_saved")}
        _check(out, f"rank{rank}", reference="saved", final=rank == 0 and SETUPS[name]().continues_at(2))


@pytest.mark.parametrize("name", TWO_RANKS)
def test_fabric_resume_resharded_two_to_one(name: str, resharded: list[dict], two_ranks: list[dict]) -> None:
    out = resharded[0][name]
    assert "error" not in out, out.get("error")
    _check(out["ddp"], "ddp 2->1", reference="stock", final=False)
    if out["fsdp2"] is not None:  # FSDP2's save, loaded into one plain model: the state saved (gathered)
        assert_same(out["fsdp2"]["ours"], two_ranks[0]["fsdp2"][name]["ours_saved"], "fsdp2 2->1")
