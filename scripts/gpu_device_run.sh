#!/usr/bin/env bash
# Runs ON the GPU machine (device tool `run`), from the repository root, with `.whl` carried (scripts/gpu_wheels.sh):
# installs the wheels into /tmp/site, then runs the GPU test tier and/or the GPU benchmark, writing logs and results
# into $OUT (what comes back: at most 8 files, 16 MiB each). Options after `tests` go to pytest, after `bench` or
# `all` to `python -m benchmarks.run --gpu` (`all` without options: `--sizes 2 --repeats 2`).
#
#   bash scripts/gpu_device_run.sh all                                    # tier + benchmark: at most 8 min in all
#   bash scripts/gpu_device_run.sh tests                                  # pytest -m gpu tests/gpu (<= 4 min)
#   bash scripts/gpu_device_run.sh bench --sizes 2,8                      # + the training run
#   bash scripts/gpu_device_run.sh bench --sizes 20 --train-steps 0       # the 20 GB saves alone
#
# Files in $OUT: env.txt (versions, GPU, disk), gpu-tests.log + gpu-tests.xml (junit), bench.log, GPU.md, gpu.json.
# The whole call keeps within BUDGET seconds (default 450 for `all`, one device call of at most 8 minutes with
# `timeout`'s 15 s grace; 570 for one step, within the tool's 10 minutes). With `all` the tier runs under `timeout`
# TESTS_TIMEOUT (default 250 s: its 4 minutes and a margin) and the benchmark gets what is left (BENCH_TIMEOUT caps
# it), so every log comes back before the tool's limit. Exit status: the first failing step's (124: out of time).
set -uo pipefail
what=${1:?usage: gpu_device_run.sh tests|bench|all [benchmarks.run options]}
shift
if [ "$what" = all ]; then BUDGET=${BUDGET:-450}; else BUDGET=${BUDGET:-570}; fi
started=$SECONDS
left() { echo $((BUDGET - (SECONDS - started))); }
run_within() {  # run_within LIMIT LOG COMMAND...: the command under `timeout`, its output teed into LOG
    local limit=$1 log=$2
    shift 2
    [ "$limit" -gt "$(($(left) - 20))" ] && limit=$(($(left) - 20))
    if [ "$limit" -lt 30 ]; then
        echo "skipped: $limit s left of the BUDGET of $BUDGET s" | tee "$log"
        return 124
    fi
    echo "at most $limit s (budget left $(left) s): $*"
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}
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
    run_within "${TESTS_TIMEOUT:-$([ "$what" = all ] && echo 250 || echo "$BUDGET")}" "$OUT/gpu-tests.log" "$PYTHON" -m pytest -q -m gpu tests/gpu -rA \
        -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" "${extra[@]}"
    rc=$?
    [ "$status" -eq 0 ] && status=$rc
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    [ "$what" = all ] && [ $# -eq 0 ] && set -- --sizes 2 --repeats 2
    run_within "${BENCH_TIMEOUT:-$BUDGET}" "$OUT/bench.log" "$PYTHON" -m benchmarks.run --gpu --out "$OUT" "$@"
    rc=$?
    [ "$status" -eq 0 ] && status=$rc
fi
exit "$status"
