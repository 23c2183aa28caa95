"""The one checked ``torch.load`` door for bytes read from a checkpoint (``format.archive.load_checked``)."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from lightning_dcp.engine.format.archive import UnsafeArchiveError, load_checked


class Custom:
    """A class no allow-list names."""

    def __eq__(self, other):
        return type(other) is Custom


def _archive(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", [bytes, memoryview, io.BytesIO])
def test_every_form_of_the_bytes_loads_the_same(kind):
    value = {"w": torch.arange(6.0).view(2, 3), "step": 3}
    data = _archive(value)
    loaded = load_checked(kind(data))
    assert loaded["step"] == 3 and torch.equal(loaded["w"], value["w"])


def test_weights_only_refuses_a_class_outside_its_list_unless_told_otherwise():
    data = _archive(Custom())
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        load_checked(data)
    assert load_checked(data, weights_only=False) == Custom()


def test_an_archive_claiming_more_than_it_holds_is_refused_before_torch_load():
    data = bytearray(_archive(torch.zeros(4)))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    # the central directory's uncompressed size of data.pkl: claim 1 TiB
    at = data.rindex(b"PK\x01\x02", 0, len(data))
    while True:
        name_len = int.from_bytes(data[at + 28 : at + 30], "little")
        if bytes(data[at + 46 : at + 46 + name_len]).decode() == info.filename:
            break
        at = data.rindex(b"PK\x01\x02", 0, at)
    data[at + 24 : at + 28] = (0xFFFFFFF0).to_bytes(4, "little")
    with pytest.raises(UnsafeArchiveError):
        load_checked(bytes(data))
