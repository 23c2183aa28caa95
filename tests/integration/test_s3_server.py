"""The tests' S3 server itself: a port someone else takes between the pick and weed's bind does not fail a test."""

from __future__ import annotations

import socket

import pytest

from harness.ranks import _ephemeral_range, free_port
from harness.s3 import S3Server
from tests._s3 import _require_weed


def test_free_ports_are_distinct_and_below_the_ephemeral_range():
    low, _ = _ephemeral_range()
    if low < 2048:
        pytest.skip(f"the ephemeral range starts at {low}: no ports below it to pick from")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(port < low for port in ports)  # never a port the kernel hands to an outgoing connection


@pytest.mark.full
def test_a_port_taken_before_weed_binds_it_is_replaced(tmp_path):
    _require_weed()
    s3fs = pytest.importorskip("s3fs")
    server = S3Server(str(tmp_path))
    picked = dict(server.ports)
    with socket.socket() as squatter:  # what a client connection did to CI stop 31: weed exited with 255
        squatter.bind(("127.0.0.1", picked["filer"]))
        squatter.listen()
        try:
            server.start()
            assert server.ports["filer"] != picked["filer"]
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
            fs.mkdir("bucket")
            fs.pipe_file("bucket/object", b"stored")
            assert fs.cat_file("bucket/object") == b"stored"
        finally:
            server.stop()
    with open(tmp_path / "weed.log", "rb") as log:
        assert b"address already in use" in log.read()  # the first attempt did meet the taken port
