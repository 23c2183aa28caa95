"""The Fabric front end in one process (``dcp_single_device``): Fabric's save/load semantics and the tools on it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lightning.fabric import Fabric
from safetensors.torch import load_file
from torch import nn

import lightning_dcp
from lightning_dcp import StateDictMismatchError, consolidate, inspect_checkpoint, load_model_weights, verify_checkpoint
from lightning_dcp.consolidate import main as consolidate_main
from lightning_dcp.engine.catalog import metadata
from lightning_dcp.fabric import DCPDDPStrategy, DCPSingleDeviceStrategy, latest_checkpoint
from lightning_dcp.fabric.state import split_state
from lightning_dcp.inspect import main as inspect_main
from lightning_dcp.verify import main as verify_main
from tests._trainer import assert_same


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.head(self.body(x))


class Counter:
    """A stateful object (``state_dict``/``load_state_dict``) that is neither a module nor an optimizer."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _fabric(strategy="dcp_single_device") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model, optimizer = fabric.setup(model, optimizer)
    return model, optimizer, scheduler


def _train(fabric, model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


@pytest.fixture
def saved(tmp_path):
    """A Fabric checkpoint of every kind of value, the live objects after the save and the next random draw."""
    fabric = _fabric()
    model, optimizer, scheduler = _setup(fabric)
    _train(fabric, model, optimizer, scheduler, 3)
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "counter": Counter(5),
        "step": 3,
        "ema": {"weight": torch.arange(6.0), "decay": 0.9},
        "note": {"text": "kept", "ids": {1: "one"}},
    }
    path = str(tmp_path / "ckpts" / "step-3")
    fabric.save(path, state)
    return path, state, torch.rand(4)


def test_save_then_load_in_place_restores_everything(saved):
    path, state, draw = saved
    assert sorted(os.listdir(path)) == [".commit", ".metadata", "__0_0.distcp"]
    fabric = _fabric()
    model, optimizer, scheduler = _setup(fabric, seed=1)
    counter = Counter()
    target = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "counter": counter, "step": 0}
    metadata._PARSED.clear()
    remainder = fabric.load(path, target)
    assert metadata._PARSED == {}  # the load's parses of .metadata are forgotten (engine/catalog/metadata.py)
    assert torch.equal(torch.rand(4), draw)  # the RNG continues exactly where the save left it
    assert_same(model.state_dict(), state["model"].state_dict(), "model")
    assert_same(optimizer.state_dict(), state["optimizer"].state_dict(), "optimizer")
    assert scheduler.state_dict() == state["scheduler"].state_dict()
    assert counter.n == 5 and target["step"] == 3  # in place / replaced, as Fabric does
    assert sorted(remainder) == ["ema", "note"]  # what was saved and not asked for, tensors as full CPU tensors
    assert torch.equal(remainder["ema"]["weight"], torch.arange(6.0)) and remainder["ema"]["decay"] == 0.9
    assert remainder["note"] == {"text": "kept", "ids": {1: "one"}}


def test_load_without_state_and_load_raw(saved):
    path, state, _ = saved
    fabric = _fabric()
    full = fabric.load(path)
    assert sorted(full) == ["counter", "ema", "model", "note", "optimizer", "scheduler", "step"]
    assert_same(full["model"], state["model"].state_dict(), "model")
    # optimizer state comes back as `optimizer.state_dict()` gives it (integer ids): a plain optimizer takes it
    assert_same(full["optimizer"], state["optimizer"].state_dict(), "optimizer")
    plain = Net()
    fresh = torch.optim.AdamW(plain.parameters(), lr=0.5)
    fresh.load_state_dict(full["optimizer"])
    assert fresh.param_groups[0]["lr"] == state["optimizer"].param_groups[0]["lr"]
    # load_raw: the checkpoint's only module into a plain module (and from a raw state-dict file)
    fabric.load_raw(path, plain)
    assert_same(plain.state_dict(), state["model"].state_dict(), "load_raw")
    raw = os.path.join(os.path.dirname(path), "raw.pt")
    torch.save({k: v + 1 for k, v in plain.state_dict().items()}, raw)
    fabric.load_raw(raw, plain)
    assert torch.equal(plain.head.bias, state["model"].head.bias + 1)


def test_strict_filter_and_mismatch_errors(saved, tmp_path):
    path, state, _ = saved
    fabric = _fabric()
    model, optimizer, _ = _setup(fabric, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError, match="missing_key"):
        fabric.load(path, {"model": model, "missing_key": 0})
    assert_same(model.state_dict(), before, "nothing loaded")  # checked before anything is read
    assert fabric.load(path, {"model": model, "missing_key": 0}, strict=False)["step"] == 3

    # filter= as Fabric applies it: only the matching items of that key's state dict are saved
    filtered = str(tmp_path / "filtered")
    fabric.save(filtered, {"model": model, "step": 1}, filter={"model": lambda name, _: name.startswith("body.")})
    other = Net()
    other_head = other.head.weight.clone()
    with pytest.raises(StateDictMismatchError, match="model.head.weight"):
        fabric.load(filtered, {"model": other})
    fabric.load(filtered, {"model": other}, strict=False)
    assert torch.equal(other.body[0].weight, model.body[0].weight) and torch.equal(other.head.weight, other_head)

    class Wider(Net):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 4)

    with pytest.raises(StateDictMismatchError, match=r"saved shape \(3, 8\)"):
        fabric.load(path, {"model": Wider()}, strict=False)  # shapes must match even when not strict
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(StateDictMismatchError, match="saved from a torch.optim.adamw.AdamW, which is not a SGD"):
        fabric.load(path, {"model": model, "optimizer": sgd})
    with pytest.raises(lightning_dcp.CheckpointError, match="no single module"):
        fabric.save(str(tmp_path / "orphan"), {"optimizer": sgd})
    with pytest.raises(TypeError, match="takes no CheckpointIO"):
        DCPDDPStrategy(checkpoint_io=object())


def test_tools_on_a_fabric_checkpoint(saved, tmp_path, capsys):
    path, state, _ = saved
    verify_checkpoint(path)
    assert verify_main([path]) == 0
    report = inspect_checkpoint(path)
    assert report["front_end"] == "fabric" and report["modules"] == ["model"] and report["optimizers"] == ["optimizer"]
    assert report["objects"] == ["counter", "ema", "note", "scheduler", "step"]
    weights = {t["name"] for t in report["tensors"] if t["weight"]}
    assert weights == set(state["model"].state_dict())
    assert inspect_main([path]) == 0 and "modules ['model']" in capsys.readouterr().out

    # one .pt in Fabric's own format: stock Fabric (rank-0 torch.load) and plain PyTorch read it
    pt = str(tmp_path / "step-3.pt")
    assert consolidate_main([path, "-o", pt, "--no-progress"]) == 0
    out = torch.load(pt, weights_only=True)
    assert_same(out["model"], state["model"].state_dict(), "model")
    assert_same(out["optimizer"], state["optimizer"].state_dict(), "optimizer")
    assert out["step"] == 3 and out["counter"] == {"n": 5} and "lightning_dcp" not in out
    stock = Fabric(accelerator="cpu", devices=1)
    stock.launch()
    model, optimizer, scheduler = _setup(stock, seed=1)
    remainder = stock.load(pt, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    assert_same(model.state_dict(), state["model"].state_dict(), "stock fabric")
    assert_same(optimizer.state_dict(), state["optimizer"].state_dict(), "stock fabric optimizer")
    assert remainder["step"] == 3
    # ... and our strategies read the .pt as well (full state dicts, distributed to this rank)
    fabric = _fabric()
    model, optimizer, _ = _setup(fabric, seed=2)
    fabric.load(pt, {"model": model, "optimizer": optimizer})
    assert_same(optimizer.state_dict(), state["optimizer"].state_dict(), "dcp strategy from .pt")

    st = consolidate(path, dst=str(tmp_path / "model.safetensors"))
    tensors = load_file(st)
    assert_same(tensors, {k: v for k, v in state["model"].state_dict().items()}, "safetensors")
    assert json.loads(json.dumps(report))  # JSON-serializable


def test_weights_across_front_ends_and_latest(saved, tmp_path):
    path, state, _ = saved
    net = Net()
    report = load_model_weights(net, path)  # the only module of a Fabric checkpoint
    assert_same(net.state_dict(), state["model"].state_dict(), "weights")
    assert report.missing_keys == [] and report.unexpected_keys == []
    two = str(tmp_path / "ckpts" / "two")
    fabric = _fabric()
    fabric.save(two, {"student": Net(), "teacher": state["model"]})
    with pytest.raises(lightning_dcp.CheckpointError, match=r"choose one with `key=`"):
        load_model_weights(Net(), two)
    load_model_weights(net, two, key="teacher")
    assert_same(net.state_dict(), state["model"].state_dict(), "teacher")
    assert latest_checkpoint(str(tmp_path / "ckpts")) == two
    os.remove(os.path.join(two, ".commit"))  # an interrupted save is never the latest
    assert latest_checkpoint(str(tmp_path / "ckpts")) == path
    assert latest_checkpoint(str(tmp_path / "none")) is None


def test_split_state_puts_each_value_where_it_round_trips():
    model = Net()
    tree, objects, info = split_state(
        {
            "model": model,
            "t": torch.ones(2),
            "tensors": {"a": torch.zeros(1), "k": 3, "names": ["x", "y"]},
            "int_keys": {0: torch.zeros(1)},  # DCP would turn 0 into a list index: kept whole in the blob
            "tensor_list": [torch.zeros(1)],
            "empty": {},
            "plain": {"a": 1},
        },
        filters={"model": lambda name, _: name != "seen", "plain": lambda *_: False},
    )
    assert sorted(tree) == ["model", "t", "tensors"]
    assert "seen" not in tree["model"] and "head.weight" in tree["model"]
    assert sorted(objects) == ["empty", "int_keys", "tensor_list"]  # "plain" was filtered out entirely
    assert info["modules"] == ["model"] and info["optimizers"] == [] and info["front_end"] == "fabric"


def test_strategy_names_and_classes():
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_single_device")
    assert isinstance(fabric.strategy, DCPSingleDeviceStrategy) and fabric.strategy.root_device.type == "cpu"
    assert lightning_dcp.DCPDDPStrategy.__module__ == "lightning_dcp.trainer.strategies"
    assert lightning_dcp.DCPDDPStrategy is not DCPDDPStrategy  # the top-level names stay the Trainer's


def test_an_optimizers_own_load_state_dict_and_hooks_run_on_load(tmp_path):
    """``fabric.load`` gives each optimizer its state through what the optimizer defines: a ``load_state_dict`` set
    on the instance, a subclass's, load hooks (no install shortcut around them)."""
    fabric = _fabric()
    model, optimizer, scheduler = _setup(fabric)
    _train(fabric, model, optimizer, scheduler, 2)
    path = str(tmp_path / "own")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    saved = optimizer.state_dict()

    calls: list[str] = []

    class Own(torch.optim.AdamW):
        def load_state_dict(self, state_dict):
            calls.append("subclass")
            super().load_state_dict(state_dict)

    for make in ("instance", "subclass", "hooks"):
        torch.manual_seed(1)
        net = Net()
        fresh = Own(net.parameters(), lr=0.01) if make == "subclass" else torch.optim.AdamW(net.parameters(), lr=0.01)
        torch.optim.lr_scheduler.StepLR(fresh, step_size=2)  # as at the save (its ``initial_lr`` option)
        if make == "instance":
            stock = fresh.load_state_dict
            fresh.load_state_dict = lambda state, stock=stock: (calls.append("instance"), stock(state))
        if make == "hooks":
            fresh.register_load_state_dict_pre_hook(lambda opt, state: calls.append("pre") or None)
            fresh.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
        fabric.load(path, {"model": net, "optimizer": fresh})
        assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"]), make
    assert calls == ["instance", "subclass", "pre", "post"]


def test_consolidated_fabric_checkpoint_keeps_the_loader_position(tmp_path):
    """A stateful loader in ``fabric.save``'s state is saved per rank; the consolidated ``.pt`` holds rank 0's state
    under the loader's key, as a stock Fabric checkpoint does, so stock ``fabric.load`` with the loader in the state
    (litgpt's resume) continues the epoch where the save was made."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(torch.arange(40.0).view(20, 2), batch_size=2, shuffle=True)

    fabric = _fabric()
    model, optimizer, _ = _setup(fabric)
    torch.manual_seed(3)
    train = loader()
    batches = iter(train)
    for _ in range(3):
        next(batches)
    saved_position = train.state_dict()
    path = str(tmp_path / "step-3")
    fabric.save(path, {"model": model, "optimizer": optimizer, "train_dataloader": train, "iter_num": 3})
    expected = [next(batches) for _ in range(2)]

    for flags in ([], ["--weights-only"]):
        pt = str(tmp_path / f"step-3{''.join(flags)}.pt")
        assert consolidate_main([path, "-o", pt, "--no-progress", *flags]) == 0
        out = torch.load(pt, weights_only=True)
        assert sorted(out) == ["iter_num", "model", *(["optimizer"] if not flags else []), "train_dataloader"]
        assert_same(out["train_dataloader"], saved_position, f"loader state {flags}")
        stock = Fabric(accelerator="cpu", devices=1)
        stock.launch()
        state = {"model": _setup(stock, seed=1)[0], "train_dataloader": loader(), "iter_num": 0}
        stock.load(pt, state)  # strict: a checkpoint without the loader's key raises KeyError here
        resumed = iter(state["train_dataloader"])
        assert state["iter_num"] == 3
        assert_same([next(resumed) for _ in range(2)], expected, f"next batches {flags}")
