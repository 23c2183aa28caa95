"""The page-cache prefetch ahead of a restore (engine/load/page_cache.py): what it reads, in which order, where it
stops, and that the Trainer and Fabric front ends start it for the resumes that read every file."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

import lightning_dcp  # noqa: F401  (registers the dcp_* strategy names)
from lightning_dcp import CorruptCheckpointError
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.format.record_index import parse_index, record_ends
from lightning_dcp.engine.load import page_cache
from tests._models import RandomDataModule, TinyModel


def _saved(tmp_path) -> str:
    path = str(tmp_path / "c.ckpt")
    tree = {"state_dict": {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}}
    Checkpointer().save(tree, path, objects={"epoch": 1})
    return path


@pytest.fixture
def filled(monkeypatch):
    """The files each prefetch reads, in order (``(name, end)``), instead of reading them."""
    calls: list[list[tuple[str, int]]] = []
    monkeypatch.setattr(page_cache, "fill_page_cache", lambda files: calls.append(list(files)))
    return calls


def _names(files: list[tuple[str, int]]) -> list[str]:
    return [os.path.basename(path) for path, _ in files]


def test_a_listing_prefetch_reads_the_marker_and_metadata_first_then_the_data_files_by_name(tmp_path, filled):
    path = _saved(tmp_path)
    for name in ("__2_0.distcp", "__1_0.distcp"):  # three data files, as three ranks would write
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x")
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert len(data) == 3
    assert page_cache.prefetch(path)
    assert page_cache.wait(path, timeout=10)
    (files,) = filled
    assert _names(files) == [".commit", ".metadata", *data]  # the order every rank's restore reads them in
    assert all(end == -1 for _, end in files)  # whole files


def test_an_index_prefetch_reads_no_further_than_the_last_record(tmp_path, filled):
    path = _saved(tmp_path)
    records = parse_index(json.loads(open(os.path.join(path, ".commit")).read()))
    assert page_cache.prefetch(path, ends=lambda: record_ends(records))
    assert page_cache.wait(path, timeout=10)
    (files,) = filled
    ends = record_ends(records)
    assert {os.path.basename(p): end for p, end in files} == ends
    assert all(0 < end <= os.path.getsize(os.path.join(path, name)) for name, end in ends.items())


def test_the_fill_stops_at_its_budget_and_skips_what_is_not_a_regular_file(tmp_path):
    huge = tmp_path / "huge.distcp"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: read whole, this would take minutes
    fifo = tmp_path / "fifo.distcp"
    os.mkfifo(fifo)  # opened without blocking, never read
    files = [(str(fifo), -1), (str(tmp_path / "missing"), -1), (str(huge), -1)]
    thread = threading.Thread(target=page_cache.fill_page_cache, args=(files, 1 << 20), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()  # stopped after 1 MiB
    assert page_cache._half_the_memory() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def test_a_data_file_replaced_by_a_fifo_never_blocks_the_prefetch_and_fails_the_restore(tmp_path):
    path = _saved(tmp_path)
    name = next(n for n in sorted(os.listdir(path)) if n.endswith(".distcp"))
    os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))
    assert page_cache.prefetch(path)
    assert page_cache.wait(path, timeout=10)
    with pytest.raises(CorruptCheckpointError, match=name):
        Checkpointer().load(path, target={"state_dict": {f"layer{i}.weight": torch.zeros(64, 64) for i in range(8)}})


def test_one_prefetch_per_directory_at_a_time_and_none_for_what_is_no_local_directory(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    gate = threading.Event()
    monkeypatch.setattr(page_cache, "fill_page_cache", lambda files: gate.wait(10))
    assert page_cache.prefetch(path)
    assert not page_cache.prefetch(path)  # the first still runs
    assert not page_cache.prefetch(os.path.join(path, ".", ""))  # the same directory by another spelling
    gate.set()
    assert page_cache.wait(path, timeout=10)
    assert page_cache.prefetch(path) and page_cache.wait(path, timeout=10)
    checkpointer = Checkpointer()
    assert not checkpointer.prefetch(os.path.join(path, ".commit"))  # a file
    assert not checkpointer.prefetch(str(tmp_path / "missing"))
    assert not checkpointer.prefetch("memory://bucket/c.ckpt")  # not local
    assert not checkpointer.prefetch("s3://bucket//c.ckpt")  # refused path: the load reports it, not the prefetch


def test_a_trainer_resume_prefetches_the_checkpoint_before_the_strategy_sets_up(tmp_path, filled, monkeypatch):
    def trainer(**kwargs) -> Trainer:
        return Trainer(
            accelerator="cpu",
            devices=1,
            strategy="dcp_single_device",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            **kwargs,
        )

    torch.manual_seed(0)
    first = trainer(max_steps=2)
    first.fit(TinyModel(), datamodule=RandomDataModule(n=16, batch_size=4))
    path = str(tmp_path / "resume.ckpt")
    first.save_checkpoint(path)
    saved = {k: v.clone() for k, v in first.lightning_module.state_dict().items()}
    events: list[str] = []
    start = page_cache.prefetch

    def prefetch(path, **kwargs):  # each prefetch runs to its end before the caller goes on
        events.append("prefetch")
        started = start(path, **kwargs)
        page_cache.wait(path, timeout=10)
        return started

    monkeypatch.setattr(page_cache, "prefetch", prefetch)

    class Recording(TinyModel):
        def configure_optimizers(self):
            events.append("configure_optimizers")
            return super().configure_optimizers()

    resumed = trainer(max_steps=2)
    model = Recording()
    resumed.fit(model, datamodule=RandomDataModule(n=16, batch_size=4), ckpt_path=path)
    assert page_cache.wait(path, timeout=10)
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert [_names(files) for files in filled] == [[".commit", ".metadata", *data]]  # one, never read twice
    assert events[:2] == ["prefetch", "configure_optimizers"], events  # the disk reads while the strategy sets up
    assert resumed.global_step == 2  # restored (step 2 of max_steps=2: nothing left to train)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_fabric_resume_prefetches_and_a_module_only_load_does_not(tmp_path, filled):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_single_device")
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    path = str(tmp_path / "fabric.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.load(path, {"model": model})
    assert filled == []  # a part of the files: no prefetch
    fabric.load(path, {"model": model, "optimizer": optimizer})
    assert page_cache.wait(path, timeout=10)
    assert len(filled) == 1 and _names(filled[0])[:2] == [".commit", ".metadata"]
