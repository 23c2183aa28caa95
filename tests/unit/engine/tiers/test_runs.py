"""Which run a memory area's checkpoints belong to (issue 40 item 3): a run never resumes another run's area silently.

Real files, one process, a real memory tier (``replicas=0``) in a temporary directory: two runs (their own durable
directories) save into one ``memory_dir``; a restarted run resumes its own newest step, not the other's newer one; a
new run with a fresh, empty durable directory (another path, or the same path emptied) resumes nothing from the old
area and says so.
"""

from __future__ import annotations

import glob
import os
import shutil
import warnings

import pytest
import torch

from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.format.marker import is_run_token
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import runs
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.engine.tiers.runs import RUN_FILE
from lightning_dcp.errors import CheckpointNotFoundError


def _tree(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64,), value)}}


def _run(area, durable) -> Checkpointer:
    checkpointer = Checkpointer(
        CheckpointerConfig(memory=MemoryTier(area, replicas=0, async_save=False, persist_every=0))
    )
    checkpointer.memory_route.bind(Location(str(durable)))
    return checkpointer


def _save(checkpointer: Checkpointer, durable, step: int, value: float) -> None:
    with checkpointer.into_memory():
        checkpointer.save(_tree(value), f"{durable}/memory-step={step}", objects={"step": step}, step=step)
    checkpointer.wait()


def _resume(area, durable) -> tuple[int, float, list[str]]:
    checkpointer = _run(area, durable)
    target = _tree(0.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = checkpointer.load(f"{durable}/last", target=target)
        return loaded.objects["step"], float(target["state_dict"]["w"][0]), [str(w.message) for w in caught]
    finally:
        checkpointer.close()


def test_two_runs_on_one_area_each_resume_their_own_state(tmp_path):
    area = tmp_path / "shm"
    a, b = _run(area, tmp_path / "a"), _run(area, tmp_path / "b")
    _save(a, tmp_path / "a", 4, 1.0)
    _save(b, tmp_path / "b", 6, 2.0)  # newer, and with the same kind of name
    _save(a, tmp_path / "a", 8, 3.0)
    _save(b, tmp_path / "b", 10, 4.0)
    a.close()
    b.close()
    assert {p.name for p in MemoryTier(area).store.parts()} >= {"memory-step=8", "memory-step=10"}
    step, value, warned = _resume(area, tmp_path / "a")  # A restarted (its durable directory holds its token)
    assert (step, value) == (8, 3.0)
    assert any("another run" in w and "memory-step=10" in w for w in warned), warned
    step, value, _ = _resume(area, tmp_path / "b")
    assert (step, value) == (10, 4.0)


@pytest.mark.parametrize("same_path", [False, True])
def test_a_new_run_with_an_empty_dirpath_does_not_resume_an_old_area(tmp_path, same_path):
    area = tmp_path / "shm"
    old = _run(area, tmp_path / "old")
    _save(old, tmp_path / "old", 27, 5.0)
    old.close()
    assert (tmp_path / "old" / RUN_FILE).is_file()
    fresh = tmp_path / ("old" if same_path else "new")
    if same_path:
        shutil.rmtree(fresh)  # the same dirpath, emptied for a new run
    fresh.mkdir(exist_ok=True)
    checkpointer = _run(area, fresh)
    with pytest.warns(UserWarning, match=r"another run \(\['memory-step=27'\]; run\(s\) \w+\), not of this run \(none"):
        with pytest.raises(CheckpointNotFoundError):  # nothing of this run anywhere: not the old run's step 27
            checkpointer.load(f"{fresh}/last", target=_tree(0.0))
    checkpointer.close()
    assert {p.name for p in MemoryTier(area).store.parts()} == {"memory-step=27"}  # left in place, not deleted


def test_emptying_dirpath_with_a_shell_glob_starts_a_new_run(tmp_path):
    """``rm -rf dirpath/*`` (a glob skips hidden names) must not leave the old run's token behind."""
    area, durable = tmp_path / "shm", tmp_path / "run"
    old = _run(area, durable)
    _save(old, durable, 27, 5.0)
    old.close()
    for entry in glob.glob(os.path.join(durable, "*")):
        shutil.rmtree(entry) if os.path.isdir(entry) else os.unlink(entry)
    assert os.listdir(durable) == []
    checkpointer = _run(area, durable)
    with pytest.warns(UserWarning, match=r"another run"):
        with pytest.raises(CheckpointNotFoundError):
            checkpointer.load(f"{durable}/last", target=_tree(0.0))
    checkpointer.close()


def test_the_same_job_restarted_into_another_folder_is_the_same_run(tmp_path, monkeypatch):
    """A torchrun restart with Lightning's default folder: the attempt persists into ``version_1``, not ``version_0``;
    the job (torchrun's run id) makes it the same run, and it resumes its memory checkpoint. Another job does not."""
    area = tmp_path / "shm"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _run(area, tmp_path / "version_0")
    _save(first, tmp_path / "version_0", 12, 3.0)
    first.close()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _resume(area, tmp_path / "version_1")[:2] == (12, 3.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")  # another job, the same folder names
    checkpointer = _run(area, tmp_path / "version_0")
    with pytest.warns(UserWarning, match=r"not of this run \(torchelasticjobx2d8, from the job's identity"):
        with pytest.raises(CheckpointNotFoundError):
            checkpointer.load(f"{tmp_path / 'version_0'}/last", target=_tree(0.0))
    checkpointer.close()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}, "torchelasticabc"),
        ({"TORCHELASTIC_RUN_ID": "a-b", "TORCHELASTIC_RESTART_COUNT": "0"}, "torchelasticax2db"),
        ({"TORCHELASTIC_RUN_ID": "abc"}, None),  # not started by an agent
        ({"SLURM_JOB_ID": "4711"}, "slurm4711"),
        ({"SLURM_JOB_ID": "4711", "SLURM_ARRAY_TASK_ID": "3"}, "slurm4711a3"),
    ],
)
def test_the_job_token_follows_the_launchers_job_id(environ, expected):
    assert runs.job(environ) == expected
    if expected is not None:
        assert is_run_token(expected)


def test_torchruns_default_run_id_names_the_agent_process():
    """torchrun's default ``--rdzv-id`` is "none" for every job: the agent (this worker's parent) tells them apart."""
    token = runs.job({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert token is not None and token.startswith(f"torchrun{os.getppid()}at") and token.isalnum()
    assert token == runs.job({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "3"})  # every attempt
