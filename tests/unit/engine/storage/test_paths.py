"""The path door's canonical form, property-tested in one process (the stores themselves: test_path_door.py)."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp import InvalidPathError
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.paths import canonical_url

_CHARS = string.ascii_letters + string.digits + "/._-=?#*[]\\ %é\t\n"
remote = st.tuples(st.sampled_from(["s3", "gs", "az", "memory"]), st.text(alphabet=_CHARS, max_size=40))


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(remote)
def test_remote_urls_are_canonical_or_refused(parts):
    scheme, rest = parts
    url = f"{scheme}://{rest}"
    segments = [s for s in rest.split("/") if s]
    refused = (
        any(c in rest for c in "?#*[]\\") or any(ord(c) < 0x20 for c in rest) or any(s in (".", "..") for s in segments)
    )
    if refused:
        with pytest.raises(InvalidPathError) as err:
            canonical_url(url)
        assert repr(url)[1:-1][:20] in str(err.value) or url[:20] in str(err.value)
        return
    canonical = canonical_url(url)
    assert canonical == f"{scheme}://" + "/".join(segments)
    assert canonical_url(canonical) == canonical  # idempotent
    assert "//" not in canonical[len(scheme) + 3 :] and not canonical[len(scheme) + 3 :].endswith("/")


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.text(alphabet=_CHARS.replace("\x00", ""), max_size=40))
def test_local_paths_are_the_operating_systems(path):
    if "://" in path or "::" in path:
        return
    assert canonical_url(path) == path


def test_a_listing_with_names_no_checkpoint_can_have_is_skipped():
    """A bucket may hold objects other tools wrote (``a?b``): "last" never fails because of them."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/skip-odd/notes?v=1/readme.txt", b"not ours")
    fs.pipe("/skip-odd/[draft]/x", b"not ours")
    assert committed_checkpoints(Location("memory://skip-odd")) == []
