"""The one grouping of a file's records into reads (lightning_dcp/engine/load/reading.py ``runs``), used by both
restores (the record index's and DCP's storage reader), and the errors both name a bad record with."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.engine.load.reading import GAP, SMALL_RECORD, corrupt_record, runs, undecodable_record
from lightning_dcp.errors import CorruptCheckpointError

_LENGTHS = st.one_of(st.integers(1, 4096), st.integers(SMALL_RECORD - 8, SMALL_RECORD + 8), st.integers(1, 3 << 20))


@st.composite
def _files(draw):
    """A file's records by offset: lengths from tiny to over ``SMALL_RECORD``, gaps from none to over ``GAP``."""
    lengths = draw(st.lists(_LENGTHS, min_size=0, max_size=60))
    offsets, at = [], 0
    for length in lengths:
        at += draw(st.sampled_from([0, 0, 0, 7, GAP, GAP + 1, 3 * GAP]))
        offsets.append(at)
        at += length
    return offsets, lengths


@settings(max_examples=300, deadline=None)
@given(_files(), st.sampled_from([2 << 20, 16 << 20]), st.sampled_from([1, 2, 5, 341, 10**9]))
def test_runs_cover_every_record_once_in_order_within_their_limits_and_each_as_long_as_allowed(file, span, most):
    offsets, lengths = file
    groups = list(runs(offsets, lengths, span=span, most=most))
    assert [i for i, j, _ in groups for i in range(i, j)] == list(range(len(offsets)))  # each once, in order
    for i, j, end in groups:
        assert end == max(offsets[k] + lengths[k] for k in range(i, j))
        if lengths[i] > SMALL_RECORD:  # a large record is read alone
            assert j == i + 1
            continue
        assert j - i <= most and end - offsets[i] <= max(span, lengths[i])
        for k in range(i + 1, j):  # small, close to the record before, inside the span
            previous_end = max(offsets[m] + lengths[m] for m in range(i, k))
            assert lengths[k] <= SMALL_RECORD and offsets[k] - previous_end <= GAP
        if j < len(offsets) and j - i < most:  # the next record could not have joined
            reach = max(offsets[m] + lengths[m] for m in range(i, j))
            assert lengths[j] > SMALL_RECORD or offsets[j] - reach > GAP or offsets[j] + lengths[j] - offsets[i] > span


def test_both_restores_name_a_bad_record_with_the_file_and_the_fix():
    corrupt = corrupt_record("/ckpt/step=1/__0_0.distcp", "__0_0.distcp", "state_dict.w")
    assert isinstance(corrupt, CorruptCheckpointError) and corrupt.file == "__0_0.distcp"
    assert str(corrupt) == (
        "/ckpt/step=1/__0_0.distcp is corrupt: record 'state_dict.w' does not match the checksum recorded at save."
        " Restore the file or resume from another checkpoint."
    )
    bad = undecodable_record("/c/__1_0.distcp", "__1_0.distcp", "x", ValueError("bad"), described_by="the metadata")
    assert bad.file == "__1_0.distcp"
    assert str(bad).startswith("/c/__1_0.distcp: record 'x' cannot be read as the metadata describes it (")
