"""Live writes: the async writer reads the training tensors while steps wait, or takes copies once a step arrives."""

from __future__ import annotations

import functools
import os
import threading
import warnings

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.save.async_save import AsyncSaves
from lightning_dcp.engine.save.inflight import InFlight
from lightning_dcp.engine.save.live_write import LiveWrite
from lightning_dcp.engine.save.staging import Stager, StagingRaceError


def _live_write(
    tensors: dict[str, torch.Tensor], *, patient: bool = True
) -> tuple[LiveWrite, dict[str, WriteItem], threading.Event]:
    items = {name: WriteItem(index=MetadataIndex(name, [0]), type=WriteItemType.TENSOR) for name in tensors}
    data = {item.index: tensors[name] for name, item in items.items()}
    stager = Stager(pin_memory=False)
    staged, live = stager.stage_items(items.values(), lambda i: data[i.index], defer=lambda i, t: True, live=True)
    released = threading.Event()
    return LiveWrite(staged, live, stager=stager, release=released.set, patient=patient), items, released


def test_a_hurried_live_write_hands_the_writer_copies_and_lets_steps_go_once_no_live_tensor_is_read():
    a, b, c = torch.randn(64, 64), torch.randn(64, 64), torch.randn(8)
    old = {"a": a.clone(), "b": b.clone(), "c": c.clone()}
    live_write, items, released = _live_write({"a": a, "b": b, "c": c})
    assert live_write.resolve_data(items["c"]).data_ptr() == c.data_ptr()  # written live
    assert live_write.resolve_data(items["a"]).data_ptr() == a.data_ptr()  # being written when the step arrives
    assert live_write.swap(items["a"]) is None  # no step yet: the writer goes on reading the live tensor
    live_write.hurry()  # the step: copies "a" and "c" (in progress) and "b" (not reached); none is read from yet
    assert not released.is_set()
    live_write.record_written(items["c"])  # the writer is done with "c" ...
    assert not released.is_set()
    copy_a = live_write.swap(items["a"])  # ... and takes the next piece of "a" from the copy: steps may go
    assert released.is_set() and copy_a is not None and copy_a.data_ptr() != a.data_ptr()
    a.add_(1.0), b.add_(1.0), c.add_(1.0)  # the optimizer step
    assert torch.equal(copy_a, old["a"])
    assert torch.equal(live_write.resolve_data(items["b"]), old["b"])
    live_write.finish()  # nothing changed while the writer needed it


def test_a_step_waits_for_a_writer_that_would_be_done_before_the_copies():
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    live_write, items, released = _live_write({"a": a, "b": b})
    live_write.resolve_data(items["a"])
    live_write.record_written(items["a"])  # 4 MiB written at once: the writer's rate beats a copy of "b" by far
    live_write.hurry()
    assert live_write.swap(items["b"]) is None and not released.is_set()  # not hurried: "b" is written live
    assert live_write.resolve_data(items["b"]).data_ptr() == b.data_ptr()
    live_write.record_written(items["b"])
    assert released.is_set()  # once the writer is done
    live_write.finish()


def test_under_skip_a_step_copies_the_rest_even_when_the_writer_would_be_done_sooner():
    """``patient=False`` (``when_busy="skip"``): the step that arrives never waits for the storage, only for copies."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    old_b = b.clone()
    live_write, items, released = _live_write({"a": a, "b": b}, patient=False)
    live_write.resolve_data(items["a"])
    live_write.record_written(items["a"])  # the same fast writer as above
    live_write.hurry()
    assert released.is_set()  # "b" was copied: steps go on before the writer reaches it
    copy_b = live_write.resolve_data(items["b"])
    assert copy_b.data_ptr() != b.data_ptr()
    b.add_(1.0)  # the optimizer step
    assert torch.equal(copy_b, old_b)
    live_write.record_written(items["b"])
    live_write.finish()


def test_skip_makes_the_checkpointers_live_writes_impatient():
    assert Checkpointer(CheckpointerConfig(async_save=True, when_busy="skip"))._async.steps_wait_for_writer is False
    assert Checkpointer(CheckpointerConfig(async_save=True))._async.steps_wait_for_writer is True


def test_a_live_tensor_changed_before_the_writer_is_done_with_it_fails_the_write_naming_it():
    a, b = torch.randn(32), torch.randn(32)
    live_write, items, released = _live_write({"a": a, "b": b})
    live_write.resolve_data(items["a"])
    a.mul_(2.0)  # in place, outside a step, while it is written
    live_write.record_written(items["a"])
    b.add_(1.0)  # before the writer reached it: caught when the step copies it
    live_write.hurry()
    assert released.is_set()
    with pytest.raises(StagingRaceError) as err:
        live_write.finish()
    assert sorted(err.value.names) == ["a", "b"]


def test_the_next_save_writes_live_unless_the_last_one_kept_steps_waiting():
    saves = AsyncSaves(defer=True)

    def done(*, live: bool, ready: float, window: float, waited: float) -> bool:
        inflight = InFlight(None, 0, lambda: None, lambda: None)  # type: ignore[arg-type]
        inflight.live, inflight.called_at, inflight.step_at = live, 0.0, window
        inflight.written_at, inflight.step_wait = ready, waited
        saves._learn(inflight)
        return saves._live_next

    assert done(live=True, ready=1.0, window=2.0, waited=0.0)  # written before the step came
    assert done(live=True, ready=1.0, window=0.9, waited=0.02)  # hurried, but waited 2% of the write
    assert not done(live=True, ready=1.0, window=0.5, waited=0.3)  # waited 30%: staging copies next time
    assert not done(live=False, ready=1.0, window=0.8, waited=0.0)  # a live write would not be done in time
    assert done(live=False, ready=0.5, window=0.8, waited=0.0)  # it would: live again


@pytest.mark.parametrize("live", [True, False])
def test_a_step_right_after_an_async_save_never_reaches_the_checkpoint(tmp_path, live):
    """Large tensors (records of several pieces) and an optimizer step at once: the step waits, hurrying a live
    write (the writer takes copies mid-record); the checkpoint holds the values of the save call."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(3000, 3000)) for _ in range(4)]  # 36 MB each: 3 pieces per record
    optimizer = torch.optim.SGD(weights, lr=0.5)
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    checkpointer._async.live = live
    tree = lambda: {"w": {str(i): w.detach() for i, w in enumerate(weights)}}  # noqa: E731
    for w in weights:  # made before the save calls, so that each step follows its call within microseconds
        w.grad = torch.ones_like(w)
    hurried = []
    for round_ in range(3):
        expected = [w.detach().clone() for w in weights]
        path = str(tmp_path / f"s{round_}.ckpt")
        checkpointer.save(tree(), path, objects={}, volatile=[])
        optimizer.step()  # at once: waits for the writer to be done with the live tensors, or copies the rest
        assert checkpointer._async.last_live is live
        inflight = checkpointer._async._inflight
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing dropped
            checkpointer.wait()
        hurried.append(inflight.hurried)
        saved = Checkpointer().load(path).tree["w"]
        assert os.path.isfile(os.path.join(path, ".commit"))
        for i, value in enumerate(expected):
            assert torch.equal(saved[str(i)], value), (round_, i)
            assert not torch.equal(weights[i], value)  # the step did run
    checkpointer.close()
    if live:
        assert any(hurried)  # a step this early finds the write going on


def test_only_optimizer_steps_hurry_a_save_other_waits_only_wait():
    from lightning_dcp.engine.save.step_gate import STEP_GATE

    for step in (False, True):
        copied, hurried = threading.Event(), []
        STEP_GATE.hold(copied, None, hurry=functools.partial(hurried.append, True))
        timer = threading.Timer(0.05, copied.set)
        timer.start()
        try:
            STEP_GATE.wait_all(step=step)  # e.g. the end of training (False), an optimizer step (True)
        finally:
            timer.join()
            STEP_GATE.release(copied)
        assert copied.is_set() and hurried == ([True] if step else [])


def test_nothing_global_keeps_a_finished_async_save_alive(tmp_path):
    """The step gate forgets a save once it is waited for: a Checkpointer kept alive until interpreter exit keeps its
    gloo group alive too, and the group's threads, torn down during finalization, abort the process."""
    import gc
    import weakref

    weights = torch.nn.Parameter(torch.randn(256, 256))
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    checkpointer.save({"w": weights.detach()}, str(tmp_path / "a.ckpt"), objects={}, volatile=[])
    checkpointer.close()  # no optimizer step after the save: the gate's watch was never triggered
    alive = weakref.ref(checkpointer)
    del checkpointer
    gc.collect()
    assert alive() is None
