"""The memory area at the door (issue 40 item 9, issue 42 item 5): what is refused, named and created, with real files.

An area that cannot be written is a ``StorageAccessError`` (a read-only tmpfs, a path under a file); a
``MemoryCheckpoint`` refused at set-up creates nothing; a checkpoint of another model in the area is named as the
checkpoint, not as the temporary copy assembled to load it; data files are exactly as long as their records.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import lightning_dcp  # noqa: F401  (registers the dcp_* strategies)
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.errors import CheckpointError, StateDictMismatchError, StorageAccessError
from lightning_dcp.trainer.memory import MemoryCheckpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer


def test_a_memory_dir_under_a_file_is_a_storage_access_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tier = MemoryTier(tmp_path / "file" / "shm")
    with pytest.raises(StorageAccessError, match=r"memory area cannot be written.*file/shm.*`memory_dir`"):
        tier.setup(distributed=False)


def test_a_read_only_memory_area_is_a_storage_access_error(tmp_path):
    area = tmp_path / "ro"
    area.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(area)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        with pytest.raises(StorageAccessError, match=r"Read-only file system"):
            MemoryTier(area / "shm").setup(distributed=False)
    finally:
        subprocess.run(["umount", "-l", str(area)], check=False)


def test_a_memory_checkpoint_refused_at_setup_creates_nothing(tmp_path):
    memory = MemoryCheckpoint(tmp_path / "shm", dirpath=tmp_path / "ckpts", every_n_train_steps=1)
    trainer = make_trainer(1, strategy="auto", callbacks=[memory], max_steps=2)
    with pytest.raises(CheckpointError, match="dcp_"):
        trainer.fit(TinyModel(), datamodule=RandomDataModule())
    assert not (tmp_path / "shm").exists() and not (tmp_path / "ckpts").exists()


def test_a_checkpoint_of_another_model_is_named_not_its_temporary_copy(tmp_path):
    checkpointer = Checkpointer(
        CheckpointerConfig(memory=MemoryTier(tmp_path / "shm", replicas=0, async_save=False, persist_every=0))
    )
    checkpointer.memory_route.bind(Location(str(tmp_path / "durable")))
    with checkpointer.into_memory():
        checkpointer.save(
            {"state_dict": {"a": torch.ones(4)}}, str(tmp_path / "durable" / "memory-step=3"), objects={}, step=3
        )
    with pytest.raises(StateDictMismatchError) as caught:
        checkpointer.load(str(tmp_path / "durable" / "last"), target={"state_dict": {"b": torch.zeros(4)}})
    checkpointer.close()
    message = str(caught.value)
    assert "'memory-step=3' in the memory tier" in message and ".load-" not in message, message
    assert ".load-" not in caught.value.path
    assert not [e for e in os.listdir(tmp_path / "shm") if e.startswith(".load-")]


def test_a_data_file_is_as_long_as_its_records(tmp_path):
    checkpointer = Checkpointer(
        CheckpointerConfig(memory=MemoryTier(tmp_path / "shm", replicas=0, async_save=False, persist_every=0))
    )
    checkpointer.memory_route.bind(Location(str(tmp_path / "durable")))
    for step, size in ((1, 1000), (2, 3000), (3, 500)):  # grows, then shrinks, through the reused slot
        with checkpointer.into_memory():
            checkpointer.save(
                {"state_dict": {"a": torch.ones(size)}}, str(tmp_path / "durable" / f"s{step}"), objects={}
            )
        checkpointer.wait()
        (part,) = checkpointer.memory.store.parts()
        recorded = part.marker["files"]["__0_0.distcp"]["size"]
        st = os.stat(os.path.join(part.path, "__0_0.distcp"))
        assert st.st_size == recorded and recorded < 4 * size + 4096  # no room to spare on disk (ls shows it)
        assert st.st_blocks * 512 <= -(-recorded // 4096) * 4096 + 4096  # du: the pages the records take
    checkpointer.close()


def _fit(tmp_path, *, free_at_end: bool, replicas: int = 0):
    memory = MemoryCheckpoint(
        tmp_path / "shm", dirpath=tmp_path / "ckpts", every_n_train_steps=2, replicas=replicas, free_at_end=free_at_end
    )
    trainer = make_trainer(1, strategy="dcp_single_device", callbacks=[memory], max_steps=4)
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    return memory


def test_free_at_end_persists_the_newest_then_frees_the_area(tmp_path, caplog):
    with caplog.at_level("INFO"):
        _fit(tmp_path, free_at_end=True)
    assert Location(str(tmp_path / "ckpts" / "memory-step=4.ckpt")).is_committed()  # durable first
    assert sorted(os.listdir(tmp_path / "shm")) == ["last"]  # then every part and free slot gone
    assert any("freed" in r.getMessage() and str(tmp_path / "shm") in r.getMessage() for r in caplog.records)


def test_by_default_the_area_is_kept_and_the_end_of_fit_says_so(tmp_path, caplog):
    with caplog.at_level("INFO"):
        memory = _fit(tmp_path, free_at_end=False)
    assert [p.name for p in memory.tier.store.parts()] == ["memory-step=4.ckpt"]
    said = [r.getMessage() for r in caplog.records if "keeps" in r.getMessage()]
    assert said and "free_at_end=True" in said[0] and "MiB" in said[0], said


def test_replicas_on_one_node_warn_that_nothing_is_replicated(tmp_path):
    with pytest.warns(UserWarning, match=r"`replicas=1` but every rank shares one memory area"):
        _fit(tmp_path, free_at_end=False, replicas=1)


def test_a_memory_resume_says_it_came_from_the_memory_tier_not_a_durable_path(tmp_path, caplog):
    def fit(max_steps: int, **kwargs) -> None:
        memory = MemoryCheckpoint(tmp_path / "shm", dirpath=tmp_path / "ckpts", every_n_train_steps=2, replicas=0)
        memory.tier.persist_every = 0  # never persisted: the checkpoint exists in memory only
        trainer = make_trainer(1, strategy="dcp_single_device", callbacks=[memory], max_steps=max_steps)
        trainer.fit(TinyModel(), datamodule=RandomDataModule(), **kwargs)

    fit(4)
    with caplog.at_level("INFO"):
        fit(6, ckpt_path="last")
    said = [r.getMessage() for r in caplog.records if "designates" in r.getMessage()]
    assert len(said) == 1, said
    assert "'memory-step=4.ckpt' from the memory tier (not persisted)" in said[0], said
    assert f"this node's own part in {tmp_path / 'shm'}" in said[0] and str(tmp_path / "ckpts") not in said[0], said


def test_a_durable_resume_names_its_tier_and_a_location_that_exists(tmp_path):
    from lightning_dcp.engine.catalog.lookup import source_of
    from lightning_dcp.engine.load.restore import Loaded

    local_dir = Location(str(tmp_path / "local"))
    remote = Loaded(url="s3://bucket/run1/epoch=1-step=20.ckpt", kind="dcp", tree={}, objects={})
    local = Loaded(url=str(tmp_path / "local" / "epoch=1-step=20.ckpt"), kind="dcp", tree={}, objects={})
    plain = Loaded(url=str(tmp_path / "run1" / "epoch=1-step=20.ckpt"), kind="dcp", tree={}, objects={})
    assert source_of(remote, local_dir=local_dir) == "'s3://bucket/run1/epoch=1-step=20.ckpt' (the remote store)"
    assert source_of(local, local_dir=local_dir) == f"{local.url!r} (local_dir, the local tier)"
    assert source_of(plain, local_dir=local_dir) == repr(plain.url)
