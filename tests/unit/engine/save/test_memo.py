"""What a save remembers of its plan: checkpointers that save in turn each keep their own."""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch

from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.save import dcp_io, saving
from lightning_dcp.engine.save.memo import PlanMemo, forget_all


def test_a_memo_finds_values_by_the_owner_s_identity_and_forgets_the_least_recently_used():
    memo = PlanMemo(size=2)
    a, b, c = [1], [2], [3]
    memo.put(a, "k", "A")
    memo.put(b, "k", "B")
    assert memo.get(a, "k") == "A"  # a is now the most recently used
    assert memo.get([1], "k") is None  # an equal but different plan is not the same plan
    assert memo.get(a, "other") is None
    memo.put(c, "k", "C")  # evicts b, not a
    assert memo.get(b, "k") is None
    assert (memo.get(a, "k"), memo.get(c, "k")) == ("A", "C")
    forget_all()  # every memo of the process, as in a fresh one
    assert (memo.get(a, "k"), memo.get(c, "k")) == (None, None)


def _state(n: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(4, 4, generator=generator) for i in range(n)}}


def test_two_plans_saved_in_turn_are_planned_and_pickled_once_each(tmp_path, monkeypatch):
    pickled = []
    dumps = pickle.dumps

    def counting_dumps(obj, *args, **kwargs):
        if type(obj).__name__ == "Metadata":
            pickled.append(len(obj.state_dict_metadata))
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(dcp_io.pickle, "dumps", counting_dumps)
    checkpointer = Checkpointer(
        CheckpointerConfig(async_save=True)
    )  # one checkpoint IO, a full checkpoint and a smaller one in turn
    for round_ in range(3):
        for name, state in (("full", _state(30, round_)), ("small", _state(50, round_ + 7))):
            path = str(tmp_path / f"{name}-{round_}.ckpt")
            checkpointer.save(state, path, objects={})
            checkpointer.wait()
            loaded = Checkpointer().load(path).tree["model"]
            for key, value in state["model"].items():
                assert torch.equal(loaded[key], value), (round_, key)
    # Each plan's .metadata is pickled once, at its first save; the saves in turn after it reuse the bytes.
    assert sorted(pickled) == sorted({n for n in pickled}) and len(pickled) == 2, pickled
    checkpointer.close()


def test_the_same_keys_nested_otherwise_keep_their_own_paths(tmp_path):
    """``{"x": [a, b]}`` and ``{"x": {"0": a, "1": b}}`` flatten to the same keys: each save keeps its own nesting."""
    a, b = torch.arange(3.0), torch.arange(3.0, 6.0)
    checkpointer = Checkpointer()
    as_list, as_dict = str(tmp_path / "list.ckpt"), str(tmp_path / "dict.ckpt")
    for _ in range(2):  # the second round plans nothing anew: every plan comes from the memos
        checkpointer.save({"model": {"x": [a, b]}}, as_list, objects={})
        checkpointer.save({"model": {"x": {"0": b, "1": a}}}, as_dict, objects={})
        listed = Checkpointer().load(as_list).tree["model"]["x"]
        keyed = Checkpointer().load(as_dict).tree["model"]["x"]
        assert isinstance(listed, list) and len(listed) == 2
        assert torch.equal(listed[0], a) and torch.equal(listed[1], b)
        assert isinstance(keyed, dict) and sorted(keyed) == ["0", "1"]
        assert torch.equal(keyed["0"], b) and torch.equal(keyed["1"], a)


def test_global_plans_are_named_uniquely_across_processes():
    """A plan's generation names its process: a group whose coordinator is another process never matches it."""
    code = "from lightning_dcp.engine.save import saving; print(saving._next_generation()[0].hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    mine, first = saving._next_generation()
    assert saving._next_generation() == (mine, first + 1)
    assert len(other) == 32 and other != mine.hex()
