"""Every code block of README.md and docs/*.md runs (the rules: tests/_docs.py): python blocks in order, one namespace
per document, against the loopback S3 (and Azure) servers; shell blocks command by command, some in a reduced form."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
import sys
import warnings
from typing import Any

import fsspec
import pytest
import tomllib
from torch.utils.data import DataLoader, TensorDataset

from tests import _docs
from tests._models import RandomDataModule, TinyModel

ALL = [b for d in _docs.DOCUMENTS for b in _docs.blocks(d)]
CODE = [b for b in ALL if b.language not in ("text", "")]
_documents: dict[str, dict[str, Any]] = {}
"""Per document: its working directory and the namespace its python blocks share."""


class DocModel(TinyModel):
    """``model`` in the documents: a LightningModule with its own data (it logs ``train_loss``)."""

    def train_dataloader(self) -> DataLoader:
        return RandomDataModule().train_dataloader()

    def val_dataloader(self) -> DataLoader:
        data = RandomDataModule()
        return DataLoader(TensorDataset(data.x[:8], data.y[:8]), batch_size=4)


def test_every_block_says_what_it_is():
    unlabelled = [b.id for b in ALL if not b.language]
    assert not unlabelled, f"fenced blocks without a language (use `text` for diagrams and output): {unlabelled}"
    unexplained = [b.id for b in ALL if "norun" in b.flags and not b.reason]
    assert not unexplained, f"`norun` blocks need a `<!-- norun: why -->` line before them: {unexplained}"
    assert len(CODE) >= 12  # README.md and docs/*.md as of issue 22; grows with the docs


@pytest.fixture(scope="module")
def loopback(s3_server, tmp_path_factory):
    """``s3://bucket`` on the loopback SeaweedFS server, reached as a reader reaches their store: through the ``AWS_*``
    environment variables that s3fs (botocore) reads (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), which the documents name where they use them."""
    import s3fs

    s3 = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    if not s3.exists("bucket"):
        s3.mkdir("bucket")
    previous = {key: os.environ.get(key) for key in s3_server.env()}
    os.environ.update(s3_server.env())
    fsspec.config.conf.pop("s3", None)
    s3fs.S3FileSystem.clear_instance_cache()  # a reader's fresh process: no instance made before these variables
    yield s3_server.storage_options()
    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def fast(monkeypatch):
    """Trainers and Fabric as the documents build them, reduced to a few steps on one CPU process."""
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    trainer_init, fabric_init = Trainer.__init__, Fabric.__init__

    @functools.wraps(trainer_init)  # signatures stay Lightning's (LightningCLI reads them)
    def trainer(self, *args, **kwargs):
        trainer_init(self, *args, **_docs.fast_trainer_defaults(kwargs))

    @functools.wraps(fabric_init)
    def fabric(self, *args, **kwargs):
        kwargs.update(accelerator="cpu", devices=1)
        fabric_init(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", trainer)
    monkeypatch.setattr(Fabric, "__init__", fabric)


def _document(block: _docs.Block, tmp_path_factory, options: dict[str, Any]) -> dict[str, Any]:
    if block.document not in _documents:
        cwd = str(tmp_path_factory.mktemp(block.document.replace("/", "_")))
        namespace = {"__name__": "__docs__", "model": DocModel(), "dm": RandomDataModule()}
        _documents[block.document] = {"cwd": cwd, "namespace": namespace, "prepared": False}
    return _documents[block.document]


def _prepare(cwd: str) -> None:
    """What the documents' commands read: committed checkpoints at ``run1/`` and ``s3://bucket/run1/`` (with
    ``last.ckpt``), and a Fabric checkpoint at ``checkpoints/fabric-bytegpt-tiny/step-000100``."""
    import torch
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    from lightning_dcp import DCPModelCheckpoint

    for dirpath in ("run1", "s3://bucket/run1"):
        checkpoint = DCPModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last="link")
        Trainer(strategy="dcp_single_device", max_steps=2, callbacks=[checkpoint]).fit(DocModel())
    fabric = Fabric(strategy="dcp_single_device")
    module = fabric.setup_module(torch.nn.Linear(4, 2))
    fabric.save("checkpoints/fabric-bytegpt-tiny/step-000100", {"model": module, "step": 100})


@pytest.mark.parametrize("block", CODE, ids=[b.id for b in CODE])
def test_block_runs(block, loopback, fast, tmp_path_factory, request, monkeypatch):
    if "norun" in block.flags:
        pytest.skip(f"norun: {block.reason}")
    state = _document(block, tmp_path_factory, loopback)
    monkeypatch.chdir(state["cwd"])
    monkeypatch.syspath_prepend(_docs.ROOT)
    if "AZURE_STORAGE_CONNECTION_STRING" in block.code:
        azure = request.getfixturevalue("azure_server")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure.connection_string())
        if not azure.fs().exists("container"):
            azure.fs().mkdir("container")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if block.language == "python":
            code = block.code.replace('"/local_nvme/', f'"{state["cwd"]}/local_nvme/')  # a path outside the sandbox
            code = code.replace('"/dev/shm/', f'"{state["cwd"]}/dev_shm/')  # a memory area of this test's own
            exec(compile(code, block.id, "exec"), state["namespace"])
        elif block.language in _docs.SHELLS:
            if not state["prepared"]:
                _prepare(state["cwd"])
                state["prepared"] = True
            for argv in _docs.commands(block.code):
                _run(argv)
        else:
            pytest.fail(f"{block.id}: no runner for {block.language!r} blocks (use python, bash or text)")


def _run(argv: list[str]) -> None:
    """One documented command, in-process (see tests/_docs.py for the reduced forms)."""
    where = " ".join(argv)
    session = _docs.nox_session(argv)
    module = _docs.python_module_command(argv)
    script = _docs.script_command(argv)
    if session is not None:
        _check_nox_session(*session)
    elif module is not None and module[0] == "pip" or argv[:2] == ["pip", "install"]:
        _check_installed(argv[argv.index("install") + 1 :])
    elif module is not None and module[0].split(".")[0] == "lightning_dcp":
        main = importlib.import_module(module[0] if module[0] != "lightning_dcp" else "lightning_dcp.__main__").main
        assert main(module[1]) == 0, where
    elif module is not None and module[0].startswith("benchmarks."):
        assert importlib.import_module(module[0]).main(_docs.reduced_benchmark_args(module[1])) == 0, where
    elif script is not None and script[0] == "examples/cli.py":
        from examples.cli import ByteGPTCLI
        from examples.data import StdlibTextDataModule
        from examples.gpt import ByteGPT

        with contextlib.chdir(_docs.ROOT), pytest.raises(SystemExit) as exit_:  # parse, print the config, stop
            ByteGPTCLI(ByteGPT, StdlibTextDataModule, args=[*script[1], "--print_config"])
        assert exit_.value.code in (0, None), where
    elif script is not None and script[0].startswith("examples/"):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=os.path.join(_docs.ROOT, "configs"), version_base="1.3"):
            compose(config_name=_docs.config_name_of(script[0]), overrides=script[1])
    else:
        pytest.fail(f"no runner for the documented command {where!r}: add one to tests/integration/test_docs.py")


def _check_nox_session(name: str, posargs: list[str]) -> None:
    import nox.registry

    sys.modules.pop("noxfile", None)
    spec = importlib.util.spec_from_file_location("noxfile", os.path.join(_docs.ROOT, "noxfile.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert name in nox.registry.get(), f"noxfile.py has no session {name!r}"
    if name == "chaos" and posargs:
        from tests.chaos.__main__ import parse

        parse(posargs)


def _check_installed(specs: list[str]) -> None:
    with open(os.path.join(_docs.ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    for spec in [s for s in specs if not s.startswith("-")]:
        name = spec.split("[")[0]
        if name in (".", project["name"]):
            for extra in _docs.extras(spec):
                for requirement in project["optional-dependencies"][extra]:
                    importlib.metadata.version(requirement.split(">")[0].split("=")[0].split("[")[0])
        else:
            importlib.metadata.version(name)
