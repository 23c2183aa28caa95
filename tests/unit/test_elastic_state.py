"""ElasticResume's saved state is validated like any other input (issue 40, item 5).

A state with more samples consumed than its epoch has (or fewer than none) used to resume silently at an epoch
boundary, replaying samples and skipping others; a string or a zero world size raised raw ``TypeError`` and
``ZeroDivisionError``. Every such state is now refused with a ``CheckpointError`` naming the checkpoint and the fix.
"""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dcp import ElasticResume, NotACheckpointError
from tests._models import IdLoggingModel, IndexedDataModule
from tests._trainer import make_trainer, seed


@st.composite
def _valid(draw) -> dict:
    world, batch, accumulation = draw(st.integers(1, 64)), draw(st.integers(1, 512)), draw(st.integers(1, 16))
    epoch_samples = draw(st.integers(0, 10**7))
    in_epoch = draw(st.integers(0, epoch_samples))
    order = draw(
        st.none()
        | st.fixed_dictionaries(
            {"dataset_size": st.integers(0, 10**7), "shuffle": st.booleans(), "seed": st.integers(-(2**63), 2**64 - 1)}
        )
    )
    return {
        "version": 1,
        "world_size": world,
        "batch_size": batch,
        "accumulate_grad_batches": accumulation,
        "global_batch_size": world * batch * accumulation,
        "epoch": draw(st.integers(0, 10**4)),
        "epoch_samples": epoch_samples,
        "samples_in_epoch": in_epoch,
        "samples_total": in_epoch + draw(st.integers(0, 10**9)),
        "order": order,
    }


_FIELDS = (
    "version",
    "world_size",
    "batch_size",
    "accumulate_grad_batches",
    "global_batch_size",
    "epoch",
    "epoch_samples",
    "samples_in_epoch",
    "samples_total",
    "order",
)
_BAD = st.one_of(
    st.integers(max_value=-1),
    st.text(max_size=3),
    st.floats(allow_nan=True),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(state=_valid())
def test_every_state_the_callback_writes_is_accepted(state):
    callback = ElasticResume()
    callback.load_state_dict(state)  # no error
    assert callback._restored == state


@settings(max_examples=300, deadline=None)
@given(state=_valid(), field=st.sampled_from(_FIELDS), value=_BAD)
def test_a_field_of_another_type_or_out_of_range_is_refused(state, field, value):
    state[field] = value
    if field == "order" and value is None or field == "samples_total" and type(value) is int and value >= 0:
        return  # a valid value after all
    with pytest.raises(NotACheckpointError, match=f"ElasticResume's saved state is invalid.*{field}"):
        ElasticResume().load_state_dict(state)


_COUNTS = ("world_size", "batch_size", "accumulate_grad_batches", "global_batch_size", "epoch", "epoch_samples")
INT64_MAX = 2**63 - 1


@settings(max_examples=200, deadline=None)
@given(
    state=_valid(), field=st.sampled_from(_COUNTS + ("samples_in_epoch", "samples_total")), big=st.integers(0, 2**80)
)
def test_a_count_beyond_int64_is_refused_naming_the_field(state, field, big):
    """A crafted ``batch_size=2**63`` passed on 7471de6 and failed at train start (``OverflowError``) or trained with
    an accumulation of 2**61 micro-batches per step; every count must fit an ``int64``."""
    state[field] = INT64_MAX + 1 + big
    if field == "global_batch_size":  # the product of counts that fit: only its size is wrong
        state["world_size"], state["batch_size"], state["accumulate_grad_batches"] = 2**32, 2**31, 1
        state[field] = 2**63
    with pytest.raises(NotACheckpointError, match=f"'{field}' is {state[field]}, not a .* of at most 2\\*\\*63 - 1"):
        ElasticResume().load_state_dict(state)


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(1, 2**20),
    batch=st.integers(1, 2**40),
    accumulation=st.integers(1, 2**20),
    epoch_samples=st.integers(0, INT64_MAX),
    seed=st.integers(-(2**63), 2**64 - 1),
    data=st.data(),
)
def test_counts_up_to_int64_are_accepted_when_consistent(world, batch, accumulation, epoch_samples, seed, data):
    size = world * batch * accumulation
    in_epoch = data.draw(st.integers(0, epoch_samples))
    state = {
        "version": 1,
        "world_size": world,
        "batch_size": batch,
        "accumulate_grad_batches": accumulation,
        "global_batch_size": size,
        "epoch": data.draw(st.integers(0, INT64_MAX)),
        "epoch_samples": epoch_samples,
        "samples_in_epoch": in_epoch,
        "samples_total": data.draw(st.integers(in_epoch, INT64_MAX)),
        "order": {"dataset_size": data.draw(st.integers(0, INT64_MAX)), "shuffle": True, "seed": seed},
    }
    if size > INT64_MAX:
        with pytest.raises(NotACheckpointError, match="'global_batch_size' is"):
            ElasticResume().load_state_dict(state)
    else:
        ElasticResume().load_state_dict(state)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_beyond_int64_is_refused(seed):
    state = {**ElasticResume().state_dict(), "batch_size": 2, "global_batch_size": 2}
    state["order"] = {"dataset_size": 8, "shuffle": True, "seed": seed}
    with pytest.raises(NotACheckpointError, match="'order' is .* the seed in \\[-2\\*\\*63, 2\\*\\*64 - 1\\]"):
        ElasticResume().load_state_dict(state)


def test_no_world_size_fits_a_huge_global_batch_in_bounded_time():
    from lightning_dcp.trainer.global_order import accumulation_for

    raised: list[BaseException] = []

    def search() -> None:
        try:
            accumulation_for(INT64_MAX + 1, world_size=3, batch_size=2)  # every power of two up to 2**62 fits
        except ValueError as err:
            raised.append(err)

    worker = threading.Thread(target=search, daemon=True)  # the old search tried every world size up to 2**63
    worker.start()
    worker.join(timeout=5.0)
    assert not worker.is_alive() and len(raised) == 1, "the search for world sizes that fit did not end"
    assert "Resume on 1, 2, 4, 8, " in str(raised[0]) and "65536 rank(s) with this batch size" in str(raised[0])


@settings(max_examples=100, deadline=None)
@given(state=_valid(), extra=st.integers(1, 10**6))
def test_more_samples_than_the_epoch_has_is_refused(state, extra):
    state["samples_in_epoch"] = state["epoch_samples"] + extra
    state["samples_total"] = state["samples_in_epoch"]
    with pytest.raises(NotACheckpointError, match="more than its epoch's"):
        ElasticResume().load_state_dict(state)


def test_missing_fields_and_a_non_dict_are_refused():
    with pytest.raises(NotACheckpointError, match="'world_size' is missing"):
        ElasticResume().load_state_dict({})
    for field in _FIELDS:
        state = {**ElasticResume().state_dict(), "batch_size": 2, "world_size": 1}
        state["global_batch_size"] = 2
        del state[field]
        with pytest.raises(NotACheckpointError, match=f"'{field}' is missing"):
            ElasticResume().load_state_dict(state)
    with pytest.raises(NotACheckpointError, match="a list, not a dict"):
        ElasticResume().load_state_dict([])


class _Saves(ElasticResume):
    """Writes a given field into ElasticResume's saved state (under ElasticResume's own state key)."""

    def __init__(self, **override) -> None:
        super().__init__(verbose=False)
        self.override = override

    @property
    def state_key(self) -> str:
        return ElasticResume().state_key

    def state_dict(self) -> dict:
        return {**super().state_dict(), **self.override}


@pytest.mark.parametrize(
    "override",
    [
        {"samples_in_epoch": 10**6},
        {"samples_in_epoch": -12},
        {"samples_in_epoch": "12"},
        {"world_size": 0},
        {"batch_size": 2**63, "global_batch_size": 2**63},
    ],
    ids=["1e6", "-12", "str", "world0", "batch2**63"],
)
def test_a_resume_from_an_edited_state_fails_naming_the_checkpoint(tmp_path, override):
    seed()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(1, max_steps=3, callbacks=[_Saves(**override), ckpt])
    trainer.fit(IdLoggingModel(), datamodule=IndexedDataModule(48, batch_size=4))
    path = os.path.join(str(tmp_path), "epoch=0-step=3.ckpt")
    assert os.path.isdir(path)
    resumed = make_trainer(1, max_epochs=2, callbacks=[ElasticResume(verbose=False)])
    with pytest.raises(NotACheckpointError, match="ElasticResume's saved state is invalid") as err:
        resumed.fit(IdLoggingModel(), datamodule=IndexedDataModule(48, batch_size=4), ckpt_path=path)
    field = next(iter(override))
    assert path in str(err.value) and field in str(err.value) and "resume from another checkpoint" in str(err.value)
