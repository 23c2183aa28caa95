"""What a file given as a checkpoint is, from its first bytes (issue 51): real files of each format, property-tested.

A safetensors file as ``ckpt_path`` failed with "Unsupported operand 120" (``torch.load``'s unpickler reading its
first byte). ``identify`` names it (and GGUF, NumPy, HDF5, gzip, empty and text files); a file ``torch.save`` wrote is
never named, in either of its formats.
"""

from __future__ import annotations

import io
import string

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.engine.format.file_kinds import HEAD_BYTES, describe, identify

safetensors_torch = pytest.importorskip("safetensors.torch")

_NAMES = st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=40)
_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
_TENSORS = st.dictionaries(
    _NAMES,
    st.tuples(st.lists(st.integers(0, 5), max_size=3), _DTYPES).map(lambda s: torch.zeros(s[0], dtype=s[1])),
    max_size=6,
)


def _kind(data: bytes):
    return identify(data[:HEAD_BYTES], size=len(data))


@settings(max_examples=150, deadline=None)
@given(tensors=_TENSORS, metadata=st.none() | st.dictionaries(_NAMES, _NAMES, max_size=3))
def test_every_safetensors_file_is_named_and_points_at_load_model_weights(tensors, metadata):
    data = safetensors_torch.save(tensors, metadata=metadata)
    kind = _kind(data)
    assert kind is not None and kind.name == "safetensors" and kind.weights
    message = describe("/ckpt/model.safetensors", kind)
    assert "is a safetensors file" in message
    assert "`lightning_dcp.load_model_weights(model, '/ckpt/model.safetensors')`" in message


@settings(max_examples=150, deadline=None)
@given(tensors=_TENSORS, step=st.integers(0, 2**40), legacy=st.booleans())
def test_a_file_torch_save_wrote_is_never_named(tensors, step, legacy):
    buffer = io.BytesIO()
    torch.save({"state_dict": tensors, "global_step": step}, buffer, _use_new_zipfile_serialization=not legacy)
    assert _kind(buffer.getvalue()) is None


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64), size=st.none() | st.integers(0, 2**40))
def test_any_bytes_are_judged_without_error(data, size):
    kind = identify(data[:HEAD_BYTES], size=size)
    assert kind is None or (kind.name and kind.what and describe("x", kind).startswith("'x' is "))


def test_other_formats_are_named(tmp_path):
    npy = io.BytesIO()
    np.save(npy, np.arange(4))
    samples = {
        "numpy": npy.getvalue(),
        "gguf": b"GGUF\x03\x00\x00\x00" + bytes(24),
        "hdf5": b"\x89HDF\r\n\x1a\n" + bytes(24),
        "gzip": b"\x1f\x8b\x08\x00" + bytes(24),
        "empty": b"",
        "text": b"model:\n  hidden: 32\nlr: 0.001\n",
    }
    for name, data in samples.items():
        kind = _kind(data)
        assert kind is not None and kind.name == name and not kind.weights, (name, kind)
        assert describe("f", kind).endswith("Pass a checkpoint saved by the Trainer, Fabric or `torch.save`.")
    assert identify(bytes(8) + b"{", size=9) is None  # a header length of 0 is no safetensors file
    assert identify((100).to_bytes(8, "little") + b"{", size=50) is None  # a header longer than the file
