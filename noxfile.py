"""Sessions behind the README's commands: ``nox -s demo`` (the main job), ``tests``, ``full`` (every test), ``zoo``
(every training setup), ``gpu``, ``lint``, ``bench``, ``chaos`` (the fault-injection campaign), ``exits`` (the exit
campaign), ``docs`` (the API reference), ``litgpt`` (a client's real training script through our Fabric strategy).

Every session installs ``TORCH`` first (default ``torch==2.13.0``: a CPU wheel that needs no CUDA download where a
local wheel is offered), then the package with its extras; the package's own ranges stay broad (``torch>=2.6``).
Set ``LIGHTNING_DCP_TORCH`` to install another torch (e.g. ``"torch>=2.6"`` on a GPU machine).
"""

from __future__ import annotations

import ast
import os
import re
import shutil

import nox

TORCH = os.environ.get("LIGHTNING_DCP_TORCH", "torch==2.13.0")
PYTHON = os.environ.get("LIGHTNING_DCP_PYTHON")  # None: the Python that runs nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


# LitData declares torchvision, and resolving that replaces the CPU torch by a CUDA build: LitData is installed without
# dependencies, its runtime ones (all but torchvision, which it does not need here) in the same resolution as the
# package, so that boto3 agrees with the botocore that s3fs pins.
LITDATA = "litdata>=0.2.76,<0.3"
LITDATA_DEPS = ("boto3", "filelock", "numpy", "obstore", "requests", "tifffile", "urllib3")


def _install(session: nox.Session, extras: str, *more: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]", *more)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Unit, distributed (gloo, 2-4 ranks) and integration tests. Azurite (the Azure Blob emulator, npm ``azurite``)
    is installed into ``.azurite/`` first where Node.js and npm exist; without them the Azure tests skip, saying why."""
    _install(session, "test", *LITDATA_DEPS)
    session.install("--no-deps", LITDATA)
    session.run("python", "-c", "from harness.stores import install_azurite; print('azurite:', install_azurite())")
    session.run("python", "-m", "pytest", "-q", "--durations=15", "-m", "not full", *session.posargs)


@nox.session(python=PYTHON)
def full(session: nox.Session) -> None:
    """Every test: the default run plus the heavier variants marked ``full`` (more ranks, kills and restarts of what
    the default run covers once; about 6 more minutes on 2 cores) and the whole zoo of training setups."""
    _install(session, "test", *LITDATA_DEPS)
    session.install("--no-deps", LITDATA)
    session.run("python", "-c", "from harness.stores import install_azurite; print('azurite:', install_azurite())")
    session.run("python", "-m", "pytest", "-q", "--durations=30", *session.posargs, env={"LIGHTNING_DCP_ZOO": "all"})


LITGPT = "litgpt>=0.5.13,<0.6"


@nox.session(python=PYTHON)
def litgpt(session: nox.Session) -> None:
    """litgpt's real ``pretrain`` through lightning_dcp's Fabric strategy (examples/litgpt_pretrain.py) against
    litgpt's stock run, kill -9 and resume, consolidation for litgpt's own loaders: tests/clients/test_litgpt.py
    (docs/clients.md). Not in ``tests`` nor CI. The torch installed first is pinned by a constraints file while litgpt
    resolves (nothing may swap it for a CUDA build); LitData, which declares torchvision, goes in without its
    dependencies, as for ``tests``."""
    session.install(TORCH)
    version = session.run("python", "-c", "import importlib.metadata as m; print(m.version('torch'))", silent=True)
    constraints = os.path.join(session.create_tmp(), "torch-constraint.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={version.strip()}\n")
    session.install("-c", constraints, LITGPT, "-e", ".[test]", *LITDATA_DEPS)
    session.install("-c", constraints, "--no-deps", LITDATA)
    no_torchvision = "import importlib.util as u, torch; assert u.find_spec('torchvision') is None; print(torch)"
    session.run("python", "-c", no_torchvision)
    session.run("python", "-m", "pytest", "-q", "-p", "no:logging", "--durations=10", "tests/clients", *session.posargs)


@nox.session(python=PYTHON)
def zoo(session: nox.Session) -> None:
    """The whole zoo of training setups (tests/setups, docs/setups.md): each one resumed through lightning_dcp and
    compared bit for bit with stock Lightning's resume, Trainer and Fabric, at 1 and 2 ranks, resharded 2 -> 1 and
    under FSDP2 (about 4 minutes on 2 cores). The default test run takes a slice of it (the setups marked ``ci``)."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", "tests/setups", *session.posargs, env={"LIGHTNING_DCP_ZOO": "all"})


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The GPU tier (tests/gpu, marker ``gpu``) on one CUDA device; every test skips without one ("needs a CUDA
    device"). On a GPU machine set ``LIGHTNING_DCP_TORCH`` to a CUDA torch (e.g. ``"torch>=2.6"``)."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff over the package, tests, examples and benchmarks; import-linter holds the layering (pyproject.toml)."""
    _install(session, "lint")
    session.run("ruff", "check", "lightning_dcp", "tests", "examples", "benchmarks", "harness", "noxfile.py")
    session.run("ruff", "format", "--check", "lightning_dcp", "tests", "harness", "benchmarks")
    session.run("lint-imports")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The API reference (mkdocs.yml, docs/api/): ``mkdocs build --strict``, so a docstring's broken cross-reference or
    a warning fails it. mkdocstrings reads the sources without importing them: no torch, no package install."""
    with open("pyproject.toml") as f:  # the `docs` extra (no tomllib on Python 3.10)
        session.install(*ast.literal_eval(re.search(r"^docs = (\[.*\])$", f.read(), re.MULTILINE).group(1)))
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: train the byte-level GPT on the stdlib sources with DDP over 2 CPU processes, checkpointing
    through lightning_dcp; resume it on 1 process; consolidate and verify the last checkpoint."""
    _install(session, "examples")
    run = os.path.abspath("outputs/demo")
    shutil.rmtree(run, ignore_errors=True)
    where = [f"ckpt_dir={run}/checkpoints", f"hydra.run.dir={run}/train"]
    session.run("python", "examples/train.py", *where, *session.posargs)
    session.run(
        "python",
        "examples/train.py",
        *where[:1],
        f"hydra.run.dir={run}/resume",
        "ckpt_path=last",
        "trainer.devices=1",
        "trainer.max_steps=80",
        "model.max_steps=60",
        *session.posargs,
    )
    session.run("python", "-m", "lightning_dcp.verify", f"{run}/checkpoints/last.ckpt")
    session.run(
        "python",
        "-m",
        "lightning_dcp.consolidate",
        f"{run}/checkpoints/last.ckpt",
        "--output",
        f"{run}/last.consolidated.ckpt",
        "--overwrite",
    )


@nox.session(python=PYTHON)
def demo_fabric(session: nox.Session) -> None:
    """The same job as a hand-written Fabric loop: 2 processes (DDP, async saves), resume on 1, then on 2 with FSDP2
    (the checkpoints reshard between the strategies); consolidate and verify the last checkpoint."""
    _install(session, "examples")
    run = os.path.abspath("outputs/demo_fabric")
    shutil.rmtree(run, ignore_errors=True)
    script = ["python", "examples/fabric_train.py", f"ckpt_dir={run}/checkpoints"]
    session.run(*script, f"hydra.run.dir={run}/train", *session.posargs)
    session.run(*script, f"hydra.run.dir={run}/resume", "max_steps=80", "fabric.devices=1", *session.posargs)
    session.run(
        *script,
        f"hydra.run.dir={run}/fsdp2",
        "max_steps=100",
        "fabric.strategy._target_=lightning_dcp.fabric.DCPModelParallelStrategy",
        *session.posargs,
    )
    session.run("python", "-m", "lightning_dcp.verify", f"{run}/checkpoints/step-000100")
    session.run(
        "python",
        "-m",
        "lightning_dcp.consolidate",
        f"{run}/checkpoints/step-000100",
        "--output",
        f"{run}/last.pt",
        "--overwrite",
    )


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """The fault-injection campaign (tests/chaos): kill -9 of 2-rank DDP runs during sync and async saves, then
    fuzzing of every checkpoint reader; bounded in count and time, seeds printed, summary in
    outputs/chaos/summary.json. Options after `--` (`nox -s chaos -- --help`): --sync-kills, --async-kills,
    --fuzz-examples, --seed, --kill-time-limit, --out, ..."""
    _install(session, "test")
    session.run("python", "-m", "tests.chaos", *session.posargs)


@nox.session(python=PYTHON)
def exits(session: nox.Session) -> None:
    """The exit campaign (tests/chaos/exits.py): hundreds of short Trainer and Fabric runs (single device, DDP, FSDP2,
    sync, async, the memory tier, 1 and 2 ranks; stock Lightning as the baseline) beside a CPU hog, counting non-zero
    exits after success, aborts at exit, final checkpoints lost at exit and commits that fail ``verify``; summary in
    outputs/exits/summary.json. Options after ``--`` (``nox -s exits -- --help``): --runs, --cases, --hogs, --seed."""
    _install(session, "test")
    session.run("python", "-m", "tests.chaos.exits", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks (benchmarks/README.md): writes benchmarks/results/*.md and *.png; ``-- --gpu`` for the GPU one,
    ``-- --tiered`` for tiered saves to S3."""
    _install(session, "test")
    session.install("matplotlib")
    session.run("python", "-m", "benchmarks.run", *session.posargs)


LIGHTNING_TESTS_TAG = "2.6.5"
LIGHTNING_TESTS = [
    "tests_pytorch/checkpointing",
    "--ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py",  # needs Lightning's legacy checkpoint archive
    "tests_pytorch/models/test_restore.py",
    "tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
]


@nox.session(python=PYTHON)
def lightning_tests(session: nox.Session) -> None:
    """Lightning's own checkpoint tests (tag 2.6.5) with ``DCPCheckpointIO`` swapped into every Trainer that picks no
    strategy or CheckpointIO of its own (tests/lightning_suite/swap_plugin.py); prints passed / format-bound /
    behavioural counts and writes outputs/lightning_tests.json. The tests come from a git clone of
    ``$LIGHTNING_REPO`` (default: GitHub; a local clone or mirror works) into ``.lightning-tests/``. Not in CI.
    Arguments after ``--`` go to pytest (e.g. ``-k hparams``)."""
    _install(session, "test")
    session.install("cloudpickle", "scikit-learn", "pandas", "psutil", "tensorboard")
    src = os.path.abspath(f".lightning-tests/{LIGHTNING_TESTS_TAG}")
    if not os.path.isdir(os.path.join(src, "tests", "tests_pytorch")):  # only the tests and pytest's settings
        repo = os.environ.get("LIGHTNING_REPO", "https://github.com/Lightning-AI/pytorch-lightning")
        shutil.rmtree(src, ignore_errors=True)
        git = ("git", "-C", src)
        tag = LIGHTNING_TESTS_TAG
        session.run("git", "clone", "--quiet", "--no-checkout", "--branch", tag, repo, src, external=True)
        wanted = ("/pyproject.toml", "/tests/tests_pytorch/")  # pytest's settings and the tests, nothing else
        session.run(*git, "sparse-checkout", "set", "--no-cone", *wanted, external=True)
        session.run(*git, "checkout", "--quiet", tag, external=True, success_codes=[0, 1, 128])  # a mirror may lack
        # blobs outside the sparse set: git then reports them, yet checks out the tests
    os.makedirs("outputs", exist_ok=True)
    env = {
        "PYTHONPATH": os.pathsep.join([os.path.abspath("tests/lightning_suite"), os.path.join(src, "tests")]),
        "LIGHTNING_SUITE_REPORT": os.path.abspath("outputs/lightning_tests.json"),
    }
    with session.chdir(os.path.join(src, "tests")):
        session.run(
            "python",
            "-m",
            "pytest",
            "-q",
            "-p",
            "swap_plugin",
            "-p",
            "no:cacheprovider",
            *LIGHTNING_TESTS,
            *session.posargs,
            env=env,
            success_codes=[0, 1],
        )


@nox.session(python=PYTHON)
def kill_tiered(session: nox.Session) -> None:
    """kill -9 campaign over tiered saves to S3 with top-k pruning (benchmarks/kill_tiered.py; ``-- --kills 30 --seed
    1``): prints the counts of unresumable runs, corrupt, re-saved, orphaned or resurrected checkpoints and stale
    ``last.ckpt`` pointers (all must be 0)."""
    _install(session, "test")
    session.run("python", "benchmarks/kill_tiered.py", *session.posargs)


@nox.session(python=PYTHON)
def remote_faults(session: nox.Session) -> None:
    """Store outages during tiered training (tests/chaos/remote.py; ``-- --outages 20 --seed 1``): SeaweedFS stopped
    and restarted, connections refused, reset or hung, HTTP 5xx and latency through a fault proxy; prints the counts of
    crashed fits, lost or extra checkpoints and stale pointers (all must be 0)."""
    _install(session, "test")
    session.run("python", "-m", "tests.chaos.remote", *session.posargs)


@nox.session(python=PYTHON)
def chaos_memory(session: nox.Session) -> None:
    """The memory tier's chaos pass (tests/chaos/memory.py; ``-- --trials 42 --seed 1``): whole-job kill -9, node loss
    with its memory area wiped and the durable tiers hidden, resume on one node fewer; prints the counts of lost
    committed memory checkpoints, torn states and failed resumes (all must be 0)."""
    _install(session, "test")
    session.run("python", "-m", "tests.chaos.memory", *session.posargs)
