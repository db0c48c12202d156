#!/usr/bin/env bash
# Run this project on the lent GPU machine (the device tool): one prepared call.
#
#   benchmarks/device.sh prepare                 # here: pack .dev/ (git-ignored), under the 64 MiB a call carries
#   benchmarks/device.sh claims IDS [IDS...]     # there: unpack, then `search claims --profile gpu --only ID...`
#                                                #   per stage (IDS: claim IDs joined by commas) while time is left
#   benchmarks/device.sh gpu_study [OPTIONS]     # there: unpack, then benchmarks/gpu_study.py
#
# The device call:  run(command="benchmarks/device.sh claims refiner-ratio", carry=[".dev"], timeout_s=590)
#
# The GPU machine reaches no registry, has Python 3.12 with torch, timm, numpy, numba, pyarrow and
# OpenCV (the device tool's KINDS.md), and no Debian dataset package. A call carries 64 MiB with the
# working tree, and Ray's wheel alone is 79 MB, so `prepare` packs one xz archive instead of wheels:
#   - Ray without what a search never loads (Java jars, RLlib, Serve, LLM, the runtime-env agent's own
#     copy of aiohttp: the machine has one), its three programs stripped of symbols;
#   - the other packages a search needs that the machine lacks (the cp312 wheels, unpacked);
#   - FFCV from this machine's build: its C library is loaded by ctypes and touches no Python ABI but
#     PyInit, so the cp311 build runs under 3.12 once renamed; the shared libraries it links
#     (OpenCV's core and imgproc, libturbojpeg, ...) go in lib/. distutils left Python in 3.12:
#     the one FFCV module that imports it gets warnings.warn instead;
#   - Fashion-MNIST's images recompressed with xz (the labels as they are).
# Results come back under $OUT: the page, the studies' stores as one tarball, the log.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV="$ROOT/.dev"
FASHION_MNIST_DIR=/usr/share/datasets/fashion-mnist
RAY_VERSION=2.60.0
die() { printf 'device.sh: error: %s\n' "$*" >&2; exit 2; }

prepare() {
    local py="${PYTHON:-$HOME/.cache/locality-search/venv/bin/python}" work
    [ -x "$py" ] || die "no project venv at $py: run ./with-deps true first (or set PYTHON)"
    [ -f "$FASHION_MNIST_DIR/train-images-idx3-ubyte.gz" ] || die "no Fashion-MNIST here: apt-get install dataset-fashion-mnist"
    grep -qx '/.dev/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.dev/' >> "$ROOT/.git/info/exclude"
    work=$(mktemp -d)
    mkdir -p "$DEV/fmnist" "$work/wheels" "$work/site/lib"
    local download=("$py" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp
                    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                    --platform any -d "$work/wheels" -c "$ROOT/constraints.txt")
    "${download[@]}" "ray[default,tune]==$RAY_VERSION" optuna pydantic
    "${download[@]}" --no-deps timm colorlog greenlet cachetools rsa opencensus-context
    # what the machine has already (KINDS.md), or what a search never imports
    (cd "$work/wheels" && rm -f pyarrow-* numpy-* pandas-* virtualenv-* cryptography-* cffi-* pycparser-* py_spy-* \
        distlib-* python_discovery-* platformdirs-* grpcio-* tqdm-* fsspec-* python_dateutil-* certifi-* urllib3-* \
        idna-* charset_normalizer-* requests-* packaging-* attrs-* filelock-* click-* pyyaml-* msgpack-* aiohttp-3* \
        multidict-* yarl-* propcache-* frozenlist-* wrapt-* prometheus_client-* aiohappyeyeballs-* aiosignal-* \
        markupsafe-* six-*)
    for wheel in "$work"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$work/site"; done
    (cd "$work/site/ray" && rm -rf jars rllib serve llm _private/runtime_env/agent/thirdparty_files \
        dashboard/client/build/static/js/*.map
     strip --strip-unneeded _raylet.so core/src/ray/gcs/gcs_server core/src/ray/raylet/raylet)
    local ffcv_dir so
    ffcv_dir=$("$py" -c 'import ffcv, os; print(os.path.dirname(ffcv.__file__))')
    cp -a "$ffcv_dir" "$work/site/ffcv"
    rm -rf "$work"/site/ffcv/benchmarks && find "$work/site/ffcv" -name __pycache__ -prune -exec rm -rf {} +
    so=$(ls "$work"/site/ffcv/_libffcv.cpython-3*-x86_64-linux-gnu.so)
    mv "$so" "$work/site/ffcv/_libffcv.cpython-312-x86_64-linux-gnu.so"
    sed -i 's/^from distutils.log import warn$/from warnings import warn  # distutils left Python in 3.12/' \
        "$work/site/ffcv/pipeline/graph.py"
    ldd "$work/site/ffcv/_libffcv.cpython-312-x86_64-linux-gnu.so" | awk '/=>/ {print $3}' | while read -r lib; do
        case $(basename "$lib") in libc.so*|libm.so*|libstdc++*|libgcc_s*|libz.so*) ;; *) cp -L "$lib" "$work/site/lib/";; esac
    done
    # the three large programs last and together: xz's 192 MiB window then shares their common code
    (cd "$work/site" && { find . -type f ! -name _raylet.so ! -name gcs_server ! -name raylet | sort
                          printf '%s\n' ./ray/_raylet.so ./ray/core/src/ray/gcs/gcs_server ./ray/core/src/ray/raylet/raylet; } \
        | tar -cf - -T - | xz -T1 -9e --lzma2=dict=192MiB > "$DEV/site.tar.xz")
    for images in train-images-idx3-ubyte t10k-images-idx3-ubyte; do
        zcat "$FASHION_MNIST_DIR/$images.gz" | xz -T1 -9e > "$DEV/fmnist/$images.xz"
    done
    cp "$FASHION_MNIST_DIR"/*labels-idx1-ubyte.gz "$DEV/fmnist/"
    rm -rf "$work"
    du -sh "$DEV"
}

# there: the packages under /tmp/site, the data where the catalog looks for it
unpack() {
    [ -f "$DEV/site.tar.xz" ] || die "no .dev/: run 'benchmarks/device.sh prepare' here and carry .dev"
    mkdir -p /tmp/site "$FASHION_MNIST_DIR"
    [ -f /tmp/site/.unpacked ] || { xz -dc "$DEV/site.tar.xz" | tar -xf - -C /tmp/site && touch /tmp/site/.unpacked; }
    # unzipped wheels keep no modes: Ray starts these two as programs
    chmod +x /tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet
    for images in train-images-idx3-ubyte t10k-images-idx3-ubyte; do
        [ -f "$FASHION_MNIST_DIR/$images.gz" ] || xz -dc "$DEV/fmnist/$images.xz" | gzip -1 > "$FASHION_MNIST_DIR/$images.gz"
    done
    cp "$DEV"/fmnist/*labels-idx1-ubyte.gz "$FASHION_MNIST_DIR/"
    export PYTHONPATH="$ROOT:/tmp/site" LD_LIBRARY_PATH="/tmp/site/lib:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1
    export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -c 'import ray, optuna, pydantic, timm, torch, ffcv.loader; print("ray", ray.__version__, "optuna",
optuna.__version__, "timm", timm.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
}

claims() {
    # each argument a stage: claim IDs joined by commas, run while time is left (DEVICE_DEADLINE_S from
    # the start of the call, before the call's own limit), so a later stage killed leaves the earlier pages
    [ $# -gt 0 ] || die "name the claims: benchmarks/device.sh claims ID[,ID...] [ID[,ID...] ...]"
    unpack
    local deadline=${DEVICE_DEADLINE_S:-540} stage=0 ids id left status=0
    for ids in "$@"; do
        stage=$((stage + 1))
        left=$((deadline - SECONDS))
        [ "$left" -gt 60 ] || { echo "claims: stage $stage ($ids) not started: ${left} s left" | tee -a "$OUT/claims.log"; break; }
        local only=()
        for id in ${ids//,/ }; do only+=(--only "$id"); done
        echo "claims: stage $stage ($ids) at ${SECONDS} s, ${left} s left" | tee -a "$OUT/claims.log"
        status=0
        timeout "$left" python3 -m search claims --profile gpu --storage /tmp/claims-gpu \
            --out "$OUT/claims-gpu-$stage.md" "${only[@]}" 2>&1 | tee -a "$OUT/claims.log" || status=$?
        echo "claims: stage $stage exit $status at ${SECONDS} s" | tee -a "$OUT/claims.log"
        [ "$status" -eq 0 ] || break
    done
    tar -czf "$OUT/claims-gpu-stores.tar.gz" --exclude='checkpoint_*' --exclude='*.beton' -C /tmp claims-gpu || true
    return "$status"
}

gpu_study() {
    unpack
    python3 -m benchmarks gpu_study --data-dir "$FASHION_MNIST_DIR" "$@" 2>&1 | tee "$OUT/gpu_study.log"
    cp "$ROOT"/benchmarks/results/gpu_study-*.json "$OUT/" 2>/dev/null || true
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    claims) shift; claims "$@" ;;
    gpu_study) shift; gpu_study "$@" ;;
    *) die "usage: benchmarks/device.sh prepare | claims ID [ID...] | gpu_study [OPTIONS]" ;;
esac
