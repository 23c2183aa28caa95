#!/usr/bin/env bash
# Runs ON the GPU machine (device tool `run`), from the repository root, with `.whl` carried (scripts/gpu_wheels.sh):
# installs the wheels into /tmp/site, then runs the GPU test tier and/or the GPU benchmark, writing logs and results
# into $OUT (what comes back: at most 8 files, 16 MiB each). Options after `tests` go to pytest, after `bench` or
# `all` to `python -m benchmarks.run --gpu`.
#
#   bash scripts/gpu_device_run.sh tests                                  # pytest -m gpu tests/gpu (~5 min)
#   bash scripts/gpu_device_run.sh bench --sizes 2,8                      # + the training run (~5 min)
#   bash scripts/gpu_device_run.sh bench --sizes 20 --train-steps 0       # the 20 GB saves alone
#   bash scripts/gpu_device_run.sh all ...                                # both: up to twice the 540 s timeouts
#
# Files in $OUT: env.txt (versions, GPU, disk), gpu-tests.log + gpu-tests.xml (junit), bench.log, GPU.md, gpu.json.
# Each step runs under `timeout` (TESTS_TIMEOUT / BENCH_TIMEOUT seconds) so its log comes back before the tool's
# 10-minute limit. Exit status: the first failing step's.
set -uo pipefail
what=${1:?usage: gpu_device_run.sh tests|bench|all [benchmarks.run options]}
shift
OUT=${OUT:-/tmp/lightning_dcp_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed: was .whl carried?" | tee "$OUT/env.txt"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PYTHON" - <<'PY'
import importlib.metadata as md
import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), torch.cuda.device_count())
for name in ("lightning", "pytorch-lightning", "lightning-utilities", "fsspec", "xxhash", "pytest", "numpy"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
import lightning_dcp

print("lightning_dcp from", lightning_dcp.__file__)
PY
    df -hT . /tmp
    nproc
    free -g
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    extra=()
    [ "$what" = tests ] && extra=("$@")  # `tests -k name`: options for pytest
    timeout -k 15 "${TESTS_TIMEOUT:-540}" "$PYTHON" -m pytest -q -m gpu tests/gpu -rA -p no:cacheprovider \
        --junitxml="$OUT/gpu-tests.xml" "${extra[@]}" 2>&1 | tee "$OUT/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$rc
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout -k 15 "${BENCH_TIMEOUT:-540}" "$PYTHON" -m benchmarks.run --gpu --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$rc
fi
exit "$status"
