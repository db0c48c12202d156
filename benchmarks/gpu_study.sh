#!/usr/bin/env bash
# The GPU study (benchmarks/gpu_study.py) as one prepared device call.
#
#   benchmarks/gpu_study.sh prepare   # here: fill .device/ (git-ignored) with what the GPU machine lacks
#   benchmarks/gpu_study.sh device    # there, with .device carried: install it, run, JSON under $OUT
#
# The GPU machine reaches no registry and has no Debian dataset package: `prepare` copies
# Fashion-MNIST's four files and downloads the wheels of the Python packages its image lacks (for
# its Python, 3.12). FFCV publishes no wheel: build one for CPython 3.12 on a machine that has it
# (`pip wheel ffcv==1.0.2`, with libturbojpeg and OpenCV's headers) and put it in .device/wheels;
# `prepare` says so when it is missing. The device call:
#   run(command="benchmarks/gpu_study.sh device", carry=[".device"], timeout_s=560)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEVICE_DIR="$ROOT/.device"
FASHION_MNIST_DIR=/usr/share/datasets/fashion-mnist
# what the device image lacks (its package list: the device tool's KINDS.md)
WHEELS=(ray optuna pydantic pydantic-core annotated-types typing-inspection alembic sqlalchemy colorlog mako
        greenlet jsonschema jsonschema-specifications referencing rpds-py)

die() { printf 'gpu_study.sh: error: %s\n' "$*" >&2; exit 2; }

prepare() {
    mkdir -p "$DEVICE_DIR/fashion-mnist" "$DEVICE_DIR/wheels"
    grep -qx '/.device/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$ROOT/.git/info/exclude"
    [ -f "$FASHION_MNIST_DIR/train-images-idx3-ubyte.gz" ] || die "no Fashion-MNIST here: apt-get install dataset-fashion-mnist"
    cp "$FASHION_MNIST_DIR"/*.gz "$DEVICE_DIR/fashion-mnist/"
    python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$DEVICE_DIR/wheels" "${WHEELS[@]}"
    ls "$DEVICE_DIR"/wheels/ffcv-*cp312*.whl >/dev/null 2>&1 \
        || die "no FFCV wheel for CPython 3.12 in .device/wheels (see this script's header); the rest is ready"
    du -sh "$DEVICE_DIR"
}

device() {
    [ -d "$DEVICE_DIR/fashion-mnist" ] || die "no .device/: run 'benchmarks/gpu_study.sh prepare' here and carry .device"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$DEVICE_DIR"/wheels/*.whl
    export PYTHONPATH="$ROOT:/tmp/site" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "${OUT:-/tmp}/gpu.txt"
    python3 -m benchmarks gpu_study --data-dir "$DEVICE_DIR/fashion-mnist" "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_study.log"
    cp "$ROOT"/benchmarks/results/gpu_study-*.json "${OUT:-/tmp}/" 2>/dev/null || true
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    device) shift; device "$@" ;;
    *) die "usage: benchmarks/gpu_study.sh prepare|device [gpu_study options]" ;;
esac
