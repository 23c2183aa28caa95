"""What both restores (the record index's and DCP's storage reader) share (lightning_dcp/engine/load/reading.py): the
grouping of a file's records into reads (``runs``), the landing loop of a run read in one call (``land_run``), and the
errors both name a bad record with."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.engine.format.marker import checksum
from lightning_dcp.engine.format.records import record_frame
from lightning_dcp.engine.load.reading import (
    GAP,
    SMALL_RECORD,
    corrupt_record,
    land_run,
    runs,
    undecodable_record,
)
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


_KINDS = st.sampled_from(["ours", "other framing", "bytes", "corrupt"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_KINDS, st.integers(0, 40), st.sampled_from([0, 0, 3, 64])), min_size=1, max_size=25))
def test_a_run_lands_its_records_framed_as_ours_and_hands_over_every_other_checked_one(records):
    """Each record of a run: framed as its target's, its tensor bytes reach the target (and nothing else does);
    another framing of the same length, or a bytes entry, reaches ``other`` whole; a record that is not its
    checksum reaches ``failed``, whose error ends the run there."""
    span, entries, sources, targets = bytearray(), [], {}, {}
    for i, (kind, numel, gap) in enumerate(records):
        span += b"\xee" * gap
        if kind == "bytes":
            record, frame, into = bytes(range(numel % 256)) * 3 or b"x", None, 0
        else:
            source = torch.arange(numel, dtype=torch.float32) + i
            frame = record_frame(torch.float32, (numel,))
            prefix = frame[3] if kind != "other framing" else bytes([frame[3][0] ^ 1]) + frame[3][1:]
            record = prefix + source.numpy().tobytes() + frame[4]
            sources[i], targets[i] = source, torch.zeros(numel, dtype=torch.float32)
            into = targets[i].data_ptr()
        expected = checksum(record) ^ (1 if kind == "corrupt" else 0)
        entries.append((len(span), len(record), expected, frame, into, i, record))
        span += record
    buffer = (ctypes.c_char * max(len(span), 1)).from_buffer(span or bytearray(1))
    handed, failed = [], []

    def on_failed(entry, record):
        failed.append(entry[5])
        raise CorruptCheckpointError(f"record {entry[5]}", file="f")

    def other(entry, record):
        assert bytes(record) == entry[6]  # the record's own bytes, whole
        handed.append(entry[5])

    first_bad = next((i for i, (kind, _, _) in enumerate(records) if kind == "corrupt"), None)
    if first_bad is None:
        land_run(memoryview(span), ctypes.addressof(buffer), 0, entries, failed=on_failed, other=other)
    else:
        with pytest.raises(CorruptCheckpointError, match=f"record {first_bad}"):
            land_run(memoryview(span), ctypes.addressof(buffer), 0, entries, failed=on_failed, other=other)
    done = len(records) if first_bad is None else first_bad
    assert failed == ([] if first_bad is None else [first_bad])
    assert handed == [i for i in range(done) if records[i][0] in ("other framing", "bytes")]
    for i, target in targets.items():
        landed = i < done and records[i][0] == "ours"
        assert torch.equal(target, sources[i] if landed else torch.zeros_like(target)), (i, records[i][0])
