"""Async saves whose staging copies run in the background while the next optimizer step waits for them."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.save.staging import Stager, StagingRaceError


class _Net(torch.nn.Module):
    """Two large optimizer-held weights, a BatchNorm (buffers a forward pass changes) and an EMA copy of a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(512, 512)
        self.b = torch.nn.Linear(512, 512)
        self.norm = torch.nn.BatchNorm1d(512)
        self.ema = torch.nn.Parameter(self.a.weight.detach().clone(), requires_grad=False)  # no optimizer holds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x))).square().mean()


def _step(net: _Net, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    net(torch.randn(8, 512)).backward()
    optimizer.step()
    with torch.no_grad():  # an EMA callback after the step: changes a parameter no optimizer holds
        net.ema.mul_(0.9).add_(net.a.weight, alpha=0.1)


def _tree(net: _Net, optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    return {"state_dict": {k: v.detach() for k, v in net.state_dict().items()}, "optimizer": state["state"]}


def _saved(path: str) -> dict:
    return Checkpointer().load(path).tree


def test_cpu_tensors_but_buffers_are_copied_in_the_background_and_the_next_step_waits(tmp_path, caplog):
    torch.manual_seed(0)
    net = _Net()
    optimizer = torch.optim.AdamW([p for n, p in net.named_parameters() if n != "ema"], lr=0.1)
    _step(net, optimizer)
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))  # deferred staging is the default
    for i in range(3):
        expected = {k: v.clone() for k, v in _tree(net, optimizer)["state_dict"].items()}
        path = str(tmp_path / f"s{i}.ckpt")
        checkpointer.save(_tree(net, optimizer), path, objects={}, volatile=list(net.buffers()))
        deferred = checkpointer._async.last_deferred
        _step(net, optimizer)  # forward (BatchNorm statistics), step, EMA: right after the save
        checkpointer.wait()
        saved = _saved(path)["state_dict"]
        assert expected.keys() == saved.keys()
        for key, value in expected.items():
            assert torch.equal(saved[key], value), (i, key)
        assert os.path.isfile(os.path.join(path, ".commit"))
        # Weights, AdamW state and the EMA copy (changed only after steps) are copied in the background ...
        assert {"state_dict.a.weight", "state_dict.norm.weight", "optimizer.0.exp_avg", "state_dict.ema"} <= set(
            deferred
        )
        # ... the buffers the next forward pass changes (BatchNorm statistics) at the call.
        assert not any(".running_" in k or "num_batches" in k for k in deferred)
        assert checkpointer.last_step_wait is not None and checkpointer.last_step_wait >= 0.0
    # Without the volatile tensors named (Lightning's own strategies), everything is copied at the call.
    checkpointer.save(_tree(net, optimizer), str(tmp_path / "plain.ckpt"), objects={})
    assert checkpointer._async.last_deferred == []
    checkpointer.close()
    assert "dropped" not in caplog.text


def test_a_tensor_changed_before_its_background_copy_drops_the_save_with_a_warning_never_tears_it(tmp_path):
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(40)]  # 160 MiB copied in the background
    optimizer = torch.optim.SGD(weights, lr=0.1)
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))

    def step() -> None:
        for w in weights:
            w.grad = torch.ones_like(w)
        optimizer.step()

    step()
    tree = lambda: {"w": {str(i): w.detach() for i, w in enumerate(weights)}}  # noqa: E731
    # The first save plans in the call; later ones plan in the background (after copying what they wrote last).
    for round_, changed in enumerate((39, 38)):
        last = weights[changed]
        before = last.detach().clone()
        path = str(tmp_path / f"raced{round_}.ckpt")
        checkpointer.save(tree(), path, objects={}, volatile=[])
        assert f"w.{changed}" in checkpointer._async.last_deferred
        with torch.no_grad():
            last.mul_(2.0)  # right after the call, outside a step: before its background copy in all likelihood
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpointer.wait()
        dropped = [w for w in caught if "was dropped" in str(w.message)]
        if os.path.exists(os.path.join(path, ".commit")):  # the copy won the race: the checkpoint holds the old value
            assert dropped == [] and torch.equal(_saved(path)["w"][str(changed)], before)
        else:  # never committed, never torn; the warning names the tensor, which is copied at the call from now on
            assert len(dropped) == 1 and f"'w.{changed}'" in str(dropped[0].message)
            checkpointer.save(tree(), str(tmp_path / f"after{round_}.ckpt"), objects={}, volatile=[])
            deferred = checkpointer._async.last_deferred
            assert f"w.{changed}" not in deferred and "w.0" in deferred
            checkpointer.wait()
            assert torch.equal(_saved(str(tmp_path / f"after{round_}.ckpt"))["w"][str(changed)], last)
    checkpointer.close()


def test_a_tensor_changed_before_its_deferred_copy_drops_the_save_naming_it():
    live = torch.randn(256, 1024)
    other = torch.randn(16)
    items = [WriteItem(index=MetadataIndex(name, [0]), type=WriteItemType.TENSOR) for name in ("w", "small")]
    data = {"w": live, "small": other}
    stager = Stager(pin_memory=False)
    staged, deferred = stager.stage_items(items, lambda i: data[i.index.fqn], defer=lambda i, t: i.index.fqn == "w")
    assert [d.name for d in deferred] == ["w"] and staged[items[0].index] is deferred[0].buffer
    expected = other.clone()
    other.add_(1.0)  # copied at the call: later changes are not seen
    assert torch.equal(staged[items[1].index], expected)
    live.add_(1.0)  # changed in place after the save was planned, before the background copy
    with pytest.raises(StagingRaceError, match="'w' changed in place") as err:
        Stager.finish(deferred)
    assert err.value.names == ["w"]
    assert isinstance(pickle_round_trip(err.value), StagingRaceError)


def pickle_round_trip(error: Exception) -> Exception:
    import pickle

    return pickle.loads(pickle.dumps(error))


def test_a_save_whose_keys_changed_since_the_last_one_is_never_dropped_by_the_next_step(tmp_path):
    # The first save runs before any optimizer step (no AdamW state yet); the second one has new keys (the moments),
    # so its plan names tensors the previous save did not write: the next step must wait for all of them. Many
    # parameters: planning in the background takes long enough for an early step to win the race to the moments.
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(200)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)

    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    for i in range(3):
        optimizer.zero_grad()
        net(torch.randn(4, 64)).square().mean().backward()
        tree = {"state_dict": net.state_dict(), "optimizer": optimizer.state_dict()["state"]}
        expected = {k: v.clone() for k, v in tree["state_dict"].items()}
        moments = {k: {n: t.clone() for n, t in s.items()} for k, s in tree["optimizer"].items()}
        path = str(tmp_path / f"s{i}.ckpt")
        checkpointer.save(tree, path, objects={}, volatile=[])
        optimizer.step()  # right after the call: AdamW changes every moment in place
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpointer.wait()
        assert [str(w.message) for w in caught if "was dropped" in str(w.message)] == [], i
        assert os.path.isfile(os.path.join(path, ".commit")), i
        saved = _saved(path)
        for key, value in expected.items():
            assert torch.equal(saved["state_dict"][key], value), (i, key)
        assert len(saved.get("optimizer", {})) == len(moments) == (0 if i == 0 else 400), i
        for key, state in moments.items():
            for name, value in state.items():
                assert torch.equal(saved["optimizer"][str(key)][name], value), (i, key, name)
    checkpointer.close()


def test_a_closure_step_waits_for_pending_copies_after_its_closure_and_other_steps_before_theirs():
    """Lightning runs forward and backward inside ``optimizer.step(closure)``: they overlap the copies, the step not."""
    import threading
    import time

    from lightning_dcp.engine.save.async_save import STEP_GATE

    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=1.0)
    other = torch.nn.Parameter(torch.ones(4))
    other_optimizer = torch.optim.SGD([other], lr=1.0)
    copied = threading.Event()
    seen: dict[str, object] = {}

    def closure() -> torch.Tensor:
        seen["closure_ran_while_pending"] = not copied.is_set()
        optimizer.zero_grad()
        loss = (param * 2).sum()
        loss.backward()
        return loss

    STEP_GATE.hold(copied, lambda seconds: seen.setdefault("waited", seconds))
    timer = threading.Timer(0.3, copied.set)
    timer.start()
    try:
        with STEP_GATE.after_closure(optimizer, closure) as closure_then_wait:
            optimizer.step(closure_then_wait)
        seen["param_changed_after_copies"] = copied.is_set()
        assert torch.equal(param.detach(), torch.full((4,), -1.0))  # the step ran once, with the closure's gradient
        # Another optimizer's step is not exempt while a closure step is in flight.
        copied2 = threading.Event()
        STEP_GATE.hold(copied2)
        threading.Timer(0.2, copied2.set).start()
        other.grad = torch.ones(4)
        start = time.perf_counter()
        with STEP_GATE.after_closure(optimizer, closure):
            other_optimizer.step()
        assert copied2.is_set() and time.perf_counter() - start >= 0.15
        STEP_GATE.release(copied2)
        assert torch.equal(other.detach(), torch.zeros(4))
    finally:
        timer.cancel()
        STEP_GATE.release(copied)
    assert seen["closure_ran_while_pending"] is True
    assert seen["param_changed_after_copies"] is True
    assert 0.1 <= seen["waited"] < 5.0

    # An optimizer from outside torch.optim may change parameters before its closure (SAM-like): it waits first.
    class Perturbing(torch.optim.SGD):
        def step(self, closure=None):
            with torch.no_grad():
                param.add_(0.5)  # the perturbation, before the closure
            return super().step(closure)

    perturbing = Perturbing([param], lr=1.0)
    copied4 = threading.Event()
    STEP_GATE.hold(copied4)
    threading.Timer(0.2, copied4.set).start()
    with STEP_GATE.after_closure(perturbing, closure) as passed:
        assert passed is closure
        perturbing.step(passed)
    STEP_GATE.release(copied4)
    assert seen["closure_ran_while_pending"] is False
    # Outside the context, a step waits in its pre-hook as before.
    copied3 = threading.Event()
    STEP_GATE.hold(copied3)
    threading.Timer(0.2, copied3.set).start()
    optimizer.step(closure)
    STEP_GATE.release(copied3)
    assert copied3.is_set()
    assert seen["closure_ran_while_pending"] is False


def test_optimizers_whose_steps_skip_the_hooks_are_found_and_make_saves_stage_at_the_call(tmp_path):
    import gc

    from lightning_dcp.engine.save.step_gate import STEP_GATE

    class SkipsInit(torch.optim.SGD):
        def __init__(self, params) -> None:  # never calls Optimizer.__init__: its step is never wrapped
            self.param_groups = [{"params": list(params), "lr": 0.1}]
            self.state = {}
            self.defaults = {}

        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                p.data.add_(1.0)

    class NotAnOptimizer:
        def step(self) -> None:
            pass

    param = torch.nn.Parameter(torch.ones(4))
    hooked = torch.optim.AdamW([param])
    assert STEP_GATE.check(hooked) and not STEP_GATE.bypassed()
    scheduled = torch.optim.AdamW([param])
    torch.optim.lr_scheduler.StepLR(scheduled, step_size=1)  # wraps `scheduled.step` on the instance
    assert "step" in vars(scheduled) and STEP_GATE.check(scheduled) and not STEP_GATE.bypassed()
    shadowed = torch.optim.SGD([param], lr=0.1)
    shadowed.step = lambda closure=None: None  # an instance attribute shadows the wrapped method
    assert not STEP_GATE.check(shadowed) and STEP_GATE.bypassed()
    del shadowed
    gc.collect()
    assert not STEP_GATE.bypassed()  # remembered while it lives
    skips = SkipsInit([param])
    with pytest.warns(UserWarning, match="`.*SkipsInit` does not run torch.optim's step hooks") as record:
        assert not STEP_GATE.check(skips) and not STEP_GATE.check(NotAnOptimizer())
    assert sum("SkipsInit" in str(w.message) for w in record) == 1
    # While it lives, saves copy everything at the call, even with the volatile tensors named (deferred staging).
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    checkpointer.save({"state_dict": {"w": param.detach()}}, str(tmp_path / "a"), objects={}, volatile=[])
    assert checkpointer._async.last_deferred == []
    skips.step()  # right after the save, through .data, no hook: the checkpoint still holds the value at the call
    checkpointer.close()
    assert torch.equal(_saved(str(tmp_path / "a"))["state_dict"]["w"], torch.ones(4))
    del skips, record
    gc.collect()
    assert not STEP_GATE.bypassed()
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    checkpointer.save({"state_dict": {"w": param.detach()}}, str(tmp_path / "b"), objects={}, volatile=[])
    assert checkpointer._async.last_deferred == ["state_dict.w"]
    checkpointer.close()


def test_queued_gpu_copies_are_waited_for_on_the_next_step_or_by_code_outside_steps():
    """The step gate's side of CUDA stream staging, with a CPU stand-in for the queued copies (no GPU here)."""
    from lightning_dcp.engine.save.step_gate import STEP_GATE

    class Queued:  # the contract of StreamCopies: at_step() before an update, wait() elsewhere
        def __init__(self) -> None:
            self.calls: list[str] = []

        def at_step(self) -> None:
            self.calls.append("at_step")

        def wait(self) -> None:
            self.calls.append("wait")

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    optimizer = torch.optim.SGD([param], lr=1.0)
    stepped, waited, released = Queued(), Queued(), Queued()
    STEP_GATE.hold_stream(stepped)
    assert STEP_GATE.pending()
    optimizer.step()  # the first step makes its update wait for the copies (on the GPU), once
    optimizer.step()
    assert stepped.calls == ["at_step"] and not STEP_GATE.pending()
    STEP_GATE.hold_stream(waited)
    STEP_GATE.wait_all(step=False)  # e.g. validation start: blocks until the copies landed
    optimizer.step()
    assert waited.calls == ["wait"]
    STEP_GATE.hold_stream(released)
    STEP_GATE.release_stream(released)  # the writer waited for them itself
    optimizer.step()
    assert released.calls == [] and not STEP_GATE.pending()
