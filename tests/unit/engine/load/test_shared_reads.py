"""How shared reads cut the units among ranks and into rounds (engine/load/shared_reads.py), property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lightning_dcp.engine.load.shared_reads import Unit, owners, rounds

units_st = st.lists(st.builds(Unit, st.integers(0, 5000), st.booleans()), min_size=1, max_size=60)


@given(units_st, st.integers(1, 6))
def test_owners_are_contiguous_and_balanced_by_bytes(units, world_size):
    owner = owners(units, world_size)
    assert owner == sorted(owner) and all(0 <= o < world_size for o in owner)
    per_rank = [sum(u.nbytes for u, o in zip(units, owner, strict=True) if o == r) for r in range(world_size)]
    ideal = sum(u.nbytes for u in units) / world_size
    largest = max(u.nbytes for u in units)
    assert all(abs(b - ideal) <= largest for b in per_rank), (per_rank, ideal)


@given(units_st, st.integers(1, 4), st.integers(1, 4000))
def test_rounds_cover_every_unit_in_order_within_the_byte_budget(units, world_size, round_bytes):
    found = rounds(units, world_size=world_size, round_bytes=round_bytes)
    assert [i for r in found for i in r] == list(range(len(units)))
    for r in found:  # a round over the budget is one unit alone
        assert len(r) == 1 or sum(units[i].nbytes for i in r) <= round_bytes * world_size, r
