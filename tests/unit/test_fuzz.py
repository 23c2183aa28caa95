"""A fixed-seed slice of the fuzzing pass (tests/chaos/fuzz.py; the full pass runs in ``nox -s chaos``).

Every reader gets hostile input of its kind; only a CheckpointError or a load of exactly what the files hold may
come out, within a time and memory limit, and nothing in the files may run. A finding fails the test with
hypothesis's smallest input.
"""

from __future__ import annotations

import pytest

from tests.chaos.campaign import verdict
from tests.chaos.fuzz import fuzz_reader

SEED = 20261123
EXAMPLES = {
    "commit": 12,
    "metadata": 10,
    "pointer": 10,
    "blob": 12,
    "record": 10,
    "codec": 10,
    "index": 10,
    "elastic": 15,
}  # ~25 s in all on 2 cores; nox -s chaos: 2000 each


@pytest.mark.parametrize(("reader", "examples"), EXAMPLES.items(), ids=EXAMPLES.keys())
def test_reader_refuses_hostile_input_cleanly(tmp_path, reader, examples):
    stats = fuzz_reader(reader, root=str(tmp_path), examples=examples, seed=SEED, keep_going=False)
    assert stats.examples >= examples
    assert stats.findings == []
    refused = sum(n for outcome, n in stats.outcomes.items() if outcome.startswith("refused:"))
    assert refused > examples // 3, stats.outcomes  # the inputs reach the readers' checks


def _resume(loaded, step, digest, rank):
    return {"loaded": loaded, "global_step": step, "hash": digest, "rank": rank}


def test_kill_verdicts_tell_each_failure_apart():
    """The campaign's classifier (tests/chaos/campaign.py) flags every way a resume can go wrong."""
    a, b = {"run": "r0", "step": 2, "hash": "h2"}, {"run": "r0", "step": 4, "hash": "h4"}
    saves = {("r0", 2): {"hash": "h2"}, ("r0", 4): {"hash": "h4"}, ("r0", 6): {"hash": "h6"}}
    state = {"committed": [{**a, "name": "step=2.ckpt"}, {**b, "name": "step=4.ckpt"}], "newest": {**b}}
    both = lambda loaded, step, digest: [_resume(loaded, step, digest, r) for r in (0, 1)]  # noqa: E731
    assert verdict(state, saves, both(b, 4, "h4")) == "ok"
    assert verdict(state, saves, None) == "unresumable"
    assert verdict(state, saves, both(None, 0, "x")) == "started_fresh"
    assert verdict({"committed": [], "newest": None}, saves, both(None, 0, "x")) == "fresh_ok"
    assert verdict(state, saves, both(a, 2, "h2")) == "resumed_older"
    assert verdict(state, saves, both(b, 4, "h2")) == "resumed_uncommitted_or_torn"  # state differs from the save
    uncommitted = {"run": "r0", "step": 6, "hash": "h6"}
    assert verdict(state, saves, both(uncommitted, 6, "h6")) == "resumed_uncommitted_or_torn"
    torn_rank = [_resume(b, 4, "h4", 0), _resume(b, 4, "other", 1)]
    assert verdict(state, saves, torn_rank) == "resumed_uncommitted_or_torn"
