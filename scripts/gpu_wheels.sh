#!/usr/bin/env bash
# Download the wheels the GPU machine (device tool) needs beside its own packages into .whl/ (ignored by git).
#
# That machine runs Python 3.12 with torch 2.11 and pytorch-lightning 2.6.6 and reaches no package index.
# lightning_dcp imports the unified `lightning` package (lightning.pytorch), which pytorch-lightning does not
# provide, so `lightning` travels, with the libraries our ranges name (pinned to what CI tests with). torch,
# numpy, pytest, PyYAML, packaging, tqdm, torchmetrics and typing-extensions are already there.
#
#   bash scripts/gpu_wheels.sh            # then name ".whl" in the run tool's `carry` (see benchmarks/README.md)
#
# PYTHON picks the interpreter whose pip downloads (default: python3). The wheels are cp312 / manylinux x86_64
# whatever this machine is; the script fails if their total exceeds 32 MiB (the whole tree travels in 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
    lightning==2.6.6
    lightning-utilities==0.15.3
    fsspec==2026.9.0
    xxhash==4.1.0
)
rm -rf .whl
mkdir -p .whl
for spec in "${WHEELS[@]}"; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $total bytes in $(ls .whl/*.whl | wc -l) wheels"
if [ "$total" -gt $((32 * 1024 * 1024)) ]; then
    echo "error: the wheels take more than 32 MiB; the device tool carries 64 MiB with the tree" >&2
    exit 1
fi
