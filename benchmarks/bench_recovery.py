"""Time to recover from a dead rank under ``torchrun --max-restarts``, phase by phase, with the memory tier.

Each trial runs ``torchrun --nproc-per-node 2 --max-restarts 1`` on CPU (``dcp_ddp``, gloo) with
``MemoryCheckpoint(every_n_train_steps=EVERY)`` and ``fit(ckpt_path="last")``; in the first attempt rank
``--victim`` (``--kill rank``) or every rank (``--kill job``) SIGKILLs itself after step ``--kill-at``; the agent
restarts both workers and they resume from the newest memory checkpoint. With ``--kill node`` two simulated nodes
(one ``torchrun --nnodes 2`` agent of one worker each, c10d rendezvous, a memory area each, one core's worth of
threads each: ``OMP_NUM_THREADS=1``) run instead; at
``--kill-at`` one node (``a`` and ``b`` in turn) wipes its memory area and SIGKILLs its agent and worker, and a new
node ``c`` (a fresh area) joins: the lost node's part comes from the survivor's replica. ``--kill mixed`` draws
each trial's kind, rank and step (``--seed``). Phases, from the workers' and the agent's clocks (one machine):

- detection: the kill to the agent's "failed" log line;
- restart: from there to the restarted worker's interpreter running this module (a node loss: the survivor's
  agent waits in the rendezvous until the lost node's heartbeats have lapsed and the new node has joined);
- imports: torch, Lightning, lightning_dcp;
- process group: the strategy's ``setup_distributed``;
- find: ``Checkpointer.resumable`` (is anything committed, across memory and the durable directory);
- restore: the strategy's ``load_checkpoint`` (the newest committed checkpoint found and read into the model and
  optimizer);
- first step: from ``on_train_start`` to the end of the first step after resuming;
- total: the kill to that step's end ("training again"), less the seconds the benchmark's own check took (a hash of
  the weights at ``on_train_start``: 0.3-0.6 s for 0.2 GB here, which no user pays).

Every trial also checks that the resumed state is the newest memory save's (its hash) and counts hangs (a trial over
``--timeout`` seconds) and failed restarts (torchrun's non-zero exit).

    python -m benchmarks.bench_recovery --trials 10 --gb 0.6          # one rank's death, ~0.6 GB of state per rank
    python -m benchmarks.bench_recovery --trials 4 --kill job         # every rank killed at once
    python -m benchmarks.bench_recovery --trials 4 --kill node        # a node lost (its memory too), a new one joins
    python -m benchmarks.bench_recovery --trials 30 --kill mixed --kill-at 11 --kill-at-max 14 --seed 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

START = time.time()  # the worker's interpreter is running this module

_AGENT_FAILED = re.compile(r"^E(\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*failed \(exitcode")


def _worker(args: argparse.Namespace) -> None:
    import hashlib
    import signal

    import torch
    from lightning.pytorch import Callback, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dcp import DCPDDPStrategy, MemoryCheckpoint

    # 0 before the kill, 1 after: not TORCHELASTIC_RESTART_COUNT, which a replacement node's agent counts from 0 and
    # a restart for a node joining does not advance
    marker = os.path.join(args.workdir, "killed")
    attempt = 1 if os.path.exists(marker) else 0
    rank = int(os.environ["RANK"])
    node = os.environ.get("BENCH_NODE")  # --kill node: this simulated node's name (its own memory area)
    path = os.path.join(args.workdir, f"times-{rank}.jsonl")

    def note(event: str, **extra) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), "attempt": attempt, **extra}) + "\n")

    import faulthandler

    note("start", t0=START)
    note("imported")
    import atexit

    atexit.register(note, "exit")  # registered first, so run last: the interpreter's own teardown is what follows

    def digest(model: nn.Module) -> str:
        h = hashlib.sha256()
        for value in model.state_dict().values():
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    class Timed(DCPDDPStrategy):
        def setup_distributed(self) -> None:
            note("pg_start")
            super().setup_distributed()
            note("pg_end")

        def setup(self, trainer) -> None:
            checkpointer = self._dcp_io.checkpointer
            resumable = checkpointer.resumable

            def timed(**kwargs):
                note("find_start")
                try:
                    return resumable(**kwargs)
                finally:
                    note("find_end")

            checkpointer.resumable = timed
            super().setup(trainer)

        def load_checkpoint(self, *a, **k):
            note("restore_start")
            try:
                return super().load_checkpoint(*a, **k)
            finally:
                note("restore_end")

    class Probe(Callback):
        first = True
        timings: dict = {}

        def on_exception(self, trainer, module, exception) -> None:
            note("exception", error=type(exception).__name__)

        def on_train_start(self, trainer, module) -> None:
            begun = time.time()
            value = digest(module)
            note("train_start", step=trainer.global_step, hash=value, hash_s=time.time() - begun)

        def on_train_batch_end(self, trainer, module, *rest) -> None:
            # a step that has not ended 15 s after this one (steps take 1-2 s here): where every thread is, in the log
            faulthandler.dump_traceback_later(15, exit=False)
            step = trainer.global_step
            if self.first:
                self.first = False
                note("first_step", step=step)
            if step % args.every == 0:
                note("saved", step=step, hash=digest(module))
            memory = trainer.strategy._dcp_io.checkpointer.memory
            timings = dict(memory.timings) if memory is not None else {}
            if timings != self.timings:  # the tier's last save, once a step of it is done (write, replicate)
                self.timings = timings
                note("tier", step=step, **{k: round(v, 3) for k, v in timings.items()})
            if attempt == 0 and step == args.kill_at and args.kill == "node" and node == args.lose:
                shutil.rmtree(area, ignore_errors=True)  # the node's memory goes with it (in no time, for a real node)
                open(marker, "w").close()
                note("kill", step=step, node=node)
                os.kill(os.getppid(), signal.SIGKILL)  # its agent
                os.kill(os.getpid(), signal.SIGKILL)
            killed = args.kill == "job" or (args.kill == "rank" and rank == args.victim)
            if attempt == 0 and step == args.kill_at and killed:
                note("kill", step=step)
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    width = args.width
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(args.layers)])

    class Module(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, index):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    data = DataLoader(TensorDataset(torch.randn(64 * args.max_steps, width)), batch_size=4)
    area = _area(args.workdir, node)
    memory = MemoryCheckpoint(
        area,
        every_n_train_steps=args.every,
        persist_every=0,
        dirpath=os.path.join(args.workdir, "durable"),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1 if node else 2,
        num_nodes=2 if node else 1,
        strategy=Timed(),
        max_steps=args.max_steps,
        callbacks=[memory, Probe()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), data, ckpt_path="last")
    note("done", step=trainer.global_step)


def _area(workdir: str, node: str | None) -> str:
    """The memory area of a trial's node (one area for ``--kill rank`` and ``job``: one node)."""
    return os.path.join("/dev/shm", os.path.basename(workdir) + (f"-{node}" if node else ""))


def _agent_failed_at(log: str, year: int) -> float | None:
    for line in log.splitlines():
        match = _AGENT_FAILED.match(line)
        if match:
            month, day, hour, minute, second = match.groups()
            stamp = datetime.datetime(year, int(month), int(day), int(hour), int(minute), tzinfo=datetime.timezone.utc)
            return stamp.timestamp() + float(second)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(workdir: str, rank: int) -> list[dict]:
    path = os.path.join(workdir, f"times-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


_STORE_HOST = (  # the rendezvous store, outside both nodes (as on a cluster's head node): either node can be lost
    "import sys, time, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True)\n"
    "while True: time.sleep(60)"
)


def _run_one(args: argparse.Namespace, workdir: str, env: dict, worker: list[str]) -> tuple[int | str, str]:
    """``--kill rank`` and ``job``: one ``torchrun`` of 2 workers; its exit code ("hang" past ``--timeout``), log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    command += ["--master-port", str(_free_port()), *worker]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        return done.returncode, done.stderr
    except subprocess.TimeoutExpired as hang:
        return "hang", (hang.stderr or b"").decode(errors="replace")


def _run_nodes(args: argparse.Namespace, workdir: str, env: dict, worker: list[str], lose: str) -> tuple:
    """``--kill node``: two simulated nodes ``a`` and ``b`` (one ``torchrun`` agent of 1 worker each, c10d
    rendezvous on a store outside both), node ``lose`` killed with its agent and its memory area wiped at
    ``--kill-at``, and a replacement node ``c`` started then. The survivor's and the replacement's exit codes
    ("hang" past ``--timeout``) and the survivor agent's log."""
    port = _free_port()
    store = subprocess.Popen([sys.executable, "-c", _STORE_HOST, str(port)], start_new_session=True)
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d"]
    conf = f"is_host=0,keep_alive_interval={args.keep_alive},keep_alive_max_attempt=3"
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--rdzv-conf", conf]
    if args.agent_store == "fresh":
        env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        # one of the machine's cores per simulated node, as torchrun gives each of --kill rank's 2 workers
        # (it sets OMP_NUM_THREADS=1 only with more than one worker per node): else both nodes' workers use every core
        node_env = {"OMP_NUM_THREADS": "1", **env, "BENCH_NODE": name}
        with open(os.path.join(workdir, f"agent-{name}.log"), "w") as log:
            command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, *worker]
            agents[name] = subprocess.Popen(
                command, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    deadline = time.monotonic() + args.timeout
    survivor = "a" if lose == "b" else "b"
    try:
        start("a")
        start("b")
        while time.monotonic() < deadline and agents[lose].poll() is None:
            time.sleep(0.02)
        start("c")
        codes: list[int | str] = []
        for name in (survivor, "c"):
            try:
                codes.append(agents[name].wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append("hang")
    finally:
        for process in (*agents.values(), store):
            if process.poll() is None:
                os.killpg(process.pid, 9)
            process.wait()
        for name in ("a", "b", "c"):
            shutil.rmtree(_area(workdir, name), ignore_errors=True)
    with open(os.path.join(workdir, f"agent-{survivor}.log")) as f:
        log = f.read()
    failed = [code for code in codes if code != 0]
    return (failed[0] if failed else 0), log


def trial(args: argparse.Namespace, index: int, *, kind: str, victim: int, kill_at: int) -> dict:
    """One elastic run with a ``kind`` kill (of rank ``victim`` for ``rank``) after step ``kill_at`` and a restart;
    the phases in seconds (see the module docstring)."""
    workdir = tempfile.mkdtemp(prefix=f"bench_recovery_{index}_", dir=args.dir)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    env["TZ"] = "UTC"
    lose = "b" if index % 2 == 0 else "a"  # --kill node: the node lost, in turn
    worker = ["-m", "benchmarks.bench_recovery", "--worker", "--workdir", workdir, "--kill", kind, "--lose", lose]
    worker += ["--victim", str(victim), "--kill-at", str(kill_at), "--every", str(args.every)]
    worker += ["--max-steps", str(args.max_steps), "--width", str(args.width), "--layers", str(args.layers)]
    result: dict = {"trial": index, "kill": kind, "kill_at": kill_at}
    if kind == "rank":
        result["victim"] = victim
    if kind == "node":
        result["lost"] = lose
        result["rc"], log = _run_nodes(args, workdir, env, worker, lose)
    else:
        result["rc"], log = _run_one(args, workdir, env, worker)
    events = [_events(workdir, rank) for rank in range(2)]
    shutil.rmtree(os.path.join("/dev/shm", os.path.basename(workdir)), ignore_errors=True)
    if args.keep:
        with open(os.path.join(workdir, "torchrun.log"), "w") as f:
            f.write(log)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)

    def at(rank: int, event: str, attempt: int) -> dict | None:  # the last: a restart may be restarted again
        return next((e for e in reversed(events[rank]) if e["event"] == event and e["attempt"] == attempt), None)

    kills = [e["t"] for r in range(2) for e in events[r] if e["event"] == "kill"]
    if result["rc"] != 0 or not kills:
        result["log"] = log[-3000:]
        return result
    kill = min(kills)
    failed = _agent_failed_at(log, datetime.datetime.fromtimestamp(kill, datetime.timezone.utc).year)
    starts = [at(r, "start", 1) for r in range(2)]
    last = max(range(2), key=lambda r: starts[r]["t0"])  # the phases of the slower rank: the group waits for it

    def span(a: str, b: str) -> float:
        return at(last, b, 1)["t"] - at(last, a, 1)["t"]

    saved = {e["step"]: e["hash"] for e in events[0] if e["event"] == "saved" and e["attempt"] == 0}
    resumed = at(0, "train_start", 1)
    newest = max(s for s in saved if s <= kill_at)
    result.update(
        detection=(failed - kill) if failed else None,
        restart=starts[last]["t0"] - (failed or kill),
        imports=starts[last]["t"] - starts[last]["t0"],
        process_group=span("pg_start", "pg_end"),
        find=span("find_start", "find_end"),
        restore=span("restore_start", "restore_end"),
        first_step=span("train_start", "first_step"),
        # less the benchmark's own hash at on_train_start (the slower rank's: the first step waits for both)
        total=max(at(r, "first_step", 1)["t"] for r in range(2))
        - kill
        - max(at(r, "train_start", 1)["hash_s"] for r in range(2)),
        resumed_step=resumed["step"],
        exact=resumed["step"] == newest and resumed["hash"] == saved[newest],
        # the state of the step resumed equals that step's save (an older one after a node loss that took the only
        # copy of the newest save's part: its replication had not finished)
        state_ok=resumed["hash"] == saved.get(resumed["step"]),
        # a rank's step end logged the newest save's replication as done before the kill (its replica committed)
        replicated=any(
            e["event"] == "tier" and "replicate" in e and e["attempt"] == 0 and newest < e["step"] and e["t"] <= kill
            for r in range(2)
            for e in events[r]
        ),
        starts=sum(e["event"] == "start" and e["attempt"] == 1 for e in events[0]),  # > 1: restarted again
    )
    return result


PHASES = ("detection", "restart", "imports", "process_group", "find", "restore", "first_step", "total")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument(
        "--kill",
        choices=("rank", "job", "node", "mixed"),
        default="rank",
        help="mixed: each trial draws rank, job or node, the rank killed and the step (--kill-at to --kill-at-max)",
    )
    parser.add_argument("--seed", type=int, default=0, help="--kill mixed: the draws' seed")
    parser.add_argument("--kill-at-max", type=int, default=None, help="--kill mixed: the latest kill step")
    parser.add_argument("--victim", type=int, default=1, help="--kill rank: the rank killed")
    parser.add_argument("--lose", default="b", help=argparse.SUPPRESS)
    parser.add_argument(
        "--agent-store",
        choices=("fresh", "shared"),
        default="fresh",
        help="--kill node: a store per rendezvous round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) or torch's default",
    )
    parser.add_argument(
        "--keep-alive",
        type=int,
        default=1,
        help="--kill node: seconds between the agents' rendezvous heartbeats (torch's default: 5); a node is dead"
        " after 3 missed",
    )
    parser.add_argument("--kill-at", type=int, default=13)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--gb", type=float, default=0.6, help="state per rank: weights + AdamW's two moments")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None, help="default: from --gb")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a trial counts as a hang")
    parser.add_argument("--dir", default=None, help="where the trials' directories go")
    parser.add_argument("--keep", action="store_true", help="keep the trials' directories")
    parser.add_argument("--out", default=None, help="write the trials as JSON here")
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = max(1, round(args.gb * 1e9 / (12 * (args.width * args.width + args.width))))
    if args.worker:
        _worker(args)
        return 0
    gb = 12 * args.layers * (args.width * args.width + args.width) / 1e9
    print(f"{args.trials} trials, kill={args.kill}, {gb:.2f} GB of state per rank ({args.layers} x {args.width}^2)")
    results = []
    draws = random.Random(args.seed)
    for index in range(args.trials):
        if args.kill == "mixed":
            kind = draws.choice(("rank", "job", "node"))
            victim, kill_at = draws.randrange(2), draws.randint(args.kill_at, args.kill_at_max or args.kill_at)
        else:
            kind, victim, kill_at = args.kill, args.victim, args.kill_at
        result = trial(args, index, kind=kind, victim=victim, kill_at=kill_at)
        results.append(result)
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in result.items() if k != "log"}
        print(json.dumps(shown), flush=True)
        if "log" in result:
            print(result["log"], flush=True)
    good = [r for r in results if r.get("rc") == 0 and "total" in r]
    print(
        f"ok {len(good)}/{len(results)}, exact {sum(bool(r.get('exact')) for r in good)}, "
        f"state of the step resumed {sum(bool(r.get('state_ok')) for r in good)}, "
        f"hangs {sum(r.get('rc') == 'hang' for r in results)}, "
        f"failed {sum(r.get('rc') not in (0, 'hang') for r in results)}"
    )
    nodes = [r for r in good if r["kill"] == "node"]
    if nodes:  # a node loss resumes the newest save if its replica was committed, else the one before
        print(
            f"node losses {len(nodes)}: newest resumed with its replica committed before the kill"
            f" {sum(r['exact'] and r['replicated'] for r in nodes)}, older resumed without"
            f" {sum(not r['exact'] and not r['replicated'] for r in nodes)}, neither"
            f" {sum(r['exact'] != r['replicated'] for r in nodes)}"
        )
    for phase in PHASES:
        values = [r[phase] for r in good if r.get(phase) is not None]
        if values:
            print(f"  {phase:14s} median {statistics.median(values):6.2f} s  range {min(values):.2f}-{max(values):.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "trials": results}, f, indent=1)
    return 0 if len(good) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
