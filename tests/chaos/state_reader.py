"""Fuzzing ElasticResume's saved state (issue 40, item 5): the callback state a checkpoint carries is input too.

Each example is a state as :meth:`ElasticResume.state_dict` writes it with some fields replaced by hostile values
(other types, negative or huge counts, missing keys). ``load_state_dict`` must refuse it with a ``CheckpointError``
or accept it only when it is consistent: at least one rank, positive batch sizes, no more samples consumed than its
epoch has. A raw ``TypeError`` or ``ZeroDivisionError`` (what such states gave before) is a finding.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from lightning_dcp import ElasticResume
from tests.chaos._checks import Finding, call
from tests.chaos.readers import Reader

__all__ = ["ElasticStateReader"]

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
_VALUES = st.one_of(
    st.integers(-(10**7), 10**7),
    st.just(10**6),
    st.just(0),
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.floats(allow_nan=True),
    st.lists(st.integers(), max_size=2),
    st.fixed_dictionaries({"dataset_size": st.integers(-5, 100), "shuffle": st.booleans(), "seed": st.integers()}),
)


class ElasticStateReader(Reader):
    name = "elastic"

    def strategy(self) -> st.SearchStrategy[dict]:
        edits = st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=3)
        dropped = st.sets(st.sampled_from(_FIELDS), max_size=1)
        return st.tuples(edits, dropped).map(lambda pair: _state(*pair))

    def check(self, state: dict) -> str:
        callback = ElasticResume(verbose=False)
        outcome, value = call(lambda: callback.load_state_dict(state), self.stats)
        if outcome != "ok":
            return f"refused:{type(value).__name__}"
        world, batch = state.get("world_size"), state.get("batch_size")
        in_epoch, epoch = state.get("samples_in_epoch"), state.get("epoch_samples")
        if not (
            type(world) is int
            and world >= 1
            and (batch is None or (type(batch) is int and batch >= 1))
            and type(in_epoch) is int
            and type(epoch) is int
            and 0 <= in_epoch <= epoch
        ):
            raise Finding("lenient", f"an inconsistent state was accepted: {state!r:.200}")
        return "accepted"


def _state(edits: dict[str, Any], dropped: set[str]) -> dict[str, Any]:
    state = dict(ElasticResume().state_dict())
    state.update(batch_size=4, global_batch_size=8, world_size=2, epoch_samples=48, samples_in_epoch=24)
    state.update(samples_total=72, order={"dataset_size": 48, "shuffle": True, "seed": 7})
    state.update(edits)
    for key in dropped:
        state.pop(key, None)
    return state
