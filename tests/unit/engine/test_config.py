"""``CheckpointerConfig``: one keyword-only set of the engine's options, checked when made; the engine is made of it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_dcp import DCPCheckpointIO, MemoryTier
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.tiers import Tiers
from lightning_dcp.fabric import DCPDDPStrategy, DCPSingleDeviceStrategy, DCPStrategyMixin


def test_the_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        CheckpointerConfig({"anon": True})  # type: ignore[misc]
    config = CheckpointerConfig(thread_count=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.thread_count = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"thread_count": 0}, "`thread_count` must be a positive integer, got 0."),
        ({"thread_count": 1.5}, "`thread_count` must be a positive integer, got 1.5."),
        ({"when_busy": "later"}, "`when_busy` must be one of ('wait', 'skip'), got 'later'."),
        ({"local_dir": "/tmp/x", "local_keep": 0}, "`local_keep` must be a positive integer, got 0."),
        ({"local_dir": "s3://bucket/x"}, "`local_dir` must be a directory on a local disk, got 's3://bucket/x'."),
    ],
)
def test_bad_options_are_refused_when_the_config_is_made(options, message):
    with pytest.raises(ValueError) as info:
        CheckpointerConfig(**options)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("options", "message"), [({"thread_count": 0}, "thread_count"), ({"when_busy": "x"}, "when_busy")]
)
def test_the_front_end_refuses_them_with_the_same_error(options, message):
    with pytest.raises(ValueError, match=message):
        DCPCheckpointIO(**options)


def test_the_checkpointer_is_made_of_those_options(tmp_path):
    config = CheckpointerConfig(
        storage_options={"anon": True}, thread_count=3, sync_files=False, when_busy="skip", local_dir=tmp_path / "fast"
    )
    checkpointer = Checkpointer(config)
    assert isinstance(checkpointer, Checkpointer)
    assert checkpointer.storage_options == {"anon": True}
    assert (checkpointer.thread_count, checkpointer.sync_files, checkpointer.async_save) == (3, False, False)
    assert checkpointer.when_busy == "skip"
    assert isinstance(checkpointer.tiers, Tiers) and checkpointer.tiers.keep == 2
    assert checkpointer.incremental is None and checkpointer.memory is None
    assert checkpointer.config is config
    assert Checkpointer().tiers is None and Checkpointer().config == CheckpointerConfig()


def test_the_trainer_plugin_builds_its_engine_from_a_config(tmp_path):
    io = DCPCheckpointIO(thread_count=2, local_dir=tmp_path / "fast", local_keep=3, incremental=True)
    assert io.checkpointer.thread_count == 2
    assert io.checkpointer.tiers.keep == 3 and io.checkpointer.incremental is not None


@pytest.mark.parametrize("front_end", [DCPCheckpointIO, DCPSingleDeviceStrategy, DCPDDPStrategy])
def test_every_option_a_front_end_offers_reaches_its_engine(front_end, tmp_path):
    not_default = {
        "storage_options": {"use_listings_cache": False},
        "thread_count": 3,
        "sync_files": False,
        "async_save": True,
        "defer_staging": False,
        "when_busy": "skip",
        "local_dir": str(tmp_path / "fast"),
        "local_keep": 5,
        "incremental": True,
        "memory": MemoryTier(str(tmp_path / "memory")),
    }
    fields = {field.name for field in dataclasses.fields(CheckpointerConfig)}
    assert set(not_default) == fields  # a new option gets a value here
    declared = DCPStrategyMixin.__init__ if issubclass(front_end, DCPStrategyMixin) else front_end.__init__
    offered = [name for name in inspect.signature(declared).parameters if name in fields]
    assert len(offered) >= 7  # the six options both front ends share, and each one's own
    config = front_end(**{name: not_default[name] for name in offered}).checkpointer.config
    for name in fields:
        expected = not_default[name] if name in offered else getattr(CheckpointerConfig(), name)
        assert getattr(config, name) == expected, name
