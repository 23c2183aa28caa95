"""The hidden names beside a checkpoint fit the filesystem for every name stock Lightning can write (issue 51).

Stock Lightning writes a checkpoint name up to 255 bytes; the staging name ``.{name}.tmp-{token}`` added 18-23 bytes,
so ``DCPModelCheckpoint(filename="f" * 230 + "-{step}")`` failed every save with "File name too long". Names longer
than 228 bytes now stand as a tag (a head, ``~`` and a digest) in the hidden names, which stay within 255 bytes and
never mix two checkpoints. The tests write real directories with names at the limit.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_dcp import DCPCheckpointIO, InvalidPathError
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.names import (
    MAX_NAME_BYTES,
    SHORT_NAME_BYTES,
    is_internal_name,
    is_staging_name,
    is_staging_of,
    name_tag,
    new_token,
    snapshot_name,
    snapshot_prefix,
    staging_name,
    staging_prefix,
)


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


# Names a filesystem takes: no "/" or NUL, at most 255 bytes; any characters (1-4 bytes each), long ones often.
_CHARS = st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",))
_NAMES = st.one_of(
    st.text(_CHARS, min_size=1, max_size=80),
    st.builds(
        lambda c, n, tail: c * n + tail, st.sampled_from("fé€🙂"), st.integers(50, 255), st.text(_CHARS, max_size=8)
    ),
).filter(lambda n: _size(n) <= MAX_NAME_BYTES and n not in (".", "..") and not is_internal_name(n))
_TOKENS = st.builds(lambda kind, token: kind + token, st.sampled_from(["", "old-", "copy-"]), st.just(new_token()))


@settings(max_examples=200, deadline=None)
@given(name=_NAMES, token=_TOKENS)
def test_every_hidden_name_fits_belongs_to_its_checkpoint_and_is_no_checkpoint_name(name, token):
    staging, snapshot = staging_name(name, token), snapshot_name(name, token[-12:])
    assert _size(staging) <= MAX_NAME_BYTES and _size(snapshot) <= MAX_NAME_BYTES
    assert is_internal_name(staging) and is_internal_name(snapshot)  # listings skip them, no save may take them
    assert is_staging_of(staging, name) and staging[len(staging_prefix(name)) :] == token  # the token round-trips
    assert is_staging_name(staging) and (name.startswith(".") or not is_staging_name(name))
    assert snapshot.startswith(snapshot_prefix(name)) and snapshot[len(snapshot_prefix(name)) :] == token[-12:]
    tag = name_tag(name)
    if _size(name) <= SHORT_NAME_BYTES:
        assert tag == name  # short names keep the hidden names they always had
    else:
        assert SHORT_NAME_BYTES < _size(tag) <= 232 and name.startswith(tag[: tag.rindex("~")])


@settings(max_examples=200, deadline=None)
@given(a=_NAMES, b=_NAMES, token=_TOKENS)
def test_the_hidden_names_of_two_checkpoints_never_mix(a, b, token):
    assume(a != b)
    assert name_tag(a) != name_tag(b)
    assert not is_staging_of(staging_name(a, token), b)
    assert not snapshot_name(a, token[-12:]).startswith(snapshot_prefix(b))


@settings(max_examples=100, deadline=None)
@given(head=st.text(_CHARS, min_size=1, max_size=40), token=_TOKENS)
def test_a_name_that_only_starts_like_another_is_not_its_staging(head, token):
    assume(not is_internal_name(head))
    other = f"{head}.tmp-{head}"  # a real checkpoint name that extends `head`'s staging prefix
    assert not is_staging_of(staging_name(other, token), head)


def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4,), value)}, "global_step": int(value)}


@pytest.mark.parametrize("size", [SHORT_NAME_BYTES + 1, 242, MAX_NAME_BYTES])
def test_a_name_at_the_limit_saves_replaces_and_loads(tmp_path, size):
    name = "f" * (size - 5) + ".ckpt"
    path = str(tmp_path / name)
    io = DCPCheckpointIO()
    io.save_checkpoint(_state(1.0), path)  # the first save in the directory stages
    io.save_checkpoint(_state(2.0), path)  # over a committed checkpoint: staged, then swapped
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((4,), 2.0))
    assert os.listdir(tmp_path) == [name]  # no staging left behind
    leftover = tmp_path / staging_name(name, new_token())  # an interrupted save's staging: removed by the next save
    leftover.mkdir()
    io.save_checkpoint(_state(3.0), path)
    assert os.listdir(tmp_path) == [name]
    assert Location(path).remove_stale_staging() == []


def test_a_name_longer_than_the_filesystem_takes_is_refused_naming_the_fix(tmp_path):
    io = DCPCheckpointIO()
    io.save_checkpoint(_state(1.0), str(tmp_path / "kept.ckpt"))
    name = "g" * (MAX_NAME_BYTES - 4) + ".ckpt"
    with pytest.raises(InvalidPathError) as err:
        io.save_checkpoint(_state(2.0), str(tmp_path / name))
    message = str(err.value)
    assert "256 bytes" in message and "at most 255 bytes per name" in message and "Shorten the name" in message
    assert str(tmp_path) in message
    assert os.listdir(tmp_path) == ["kept.ckpt"]
    assert torch.equal(io.load_checkpoint(str(tmp_path / "kept.ckpt"))["state_dict"]["w"], torch.full((4,), 1.0))
