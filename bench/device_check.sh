#!/usr/bin/env bash
# The onnxruntime GPU backend for real, on a machine with an NVIDIA GPU, in a few minutes:
#
#   bench/device_check.sh [ONNXRUNTIME_GPU_WHEEL]
#
# 1. a private site directory with onnxruntime-gpu in place of onnxruntime (the two
#    cannot coexist: docs/backends.md, "Packages"): the wheel given, else the one `make
#    wheels` left in .cache/wheels/onnxruntime-gpu/ for this Python, else pip
#    (`onnxruntime-gpu[cuda,cudnn]`, needs the network); CUDA 13 and cuDNN 9 from the
#    machine or NVIDIA's pip wheels (nvidia-cublas, nvidia-cudnn-cu13: the backend calls
#    onnxruntime.preload_dlls() when they are installed);
# 2. the backend's probe, as `inferctl backends` would show it;
# 3. the contract suite on onnxruntime-gpu with INFERD_REQUIRE_GPU=1 (a skip is a
#    failure) and the GPU backend's own tests;
# 4. bench/bench_accel.py latency (onnxruntime, openvino if installed, onnxruntime-gpu).
#
# Needs python3 with numpy, pyzmq, onnx, psutil and pytest (pip installs the missing
# ones into the same site directory when the network allows). Writes its log to
# ${OUT:-/tmp}/device_check.log. Exit status: that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/inferd-gpu-site}
LOG=${OUT:-/tmp}/device_check.log
exec > >(tee "$LOG") 2>&1

tag=$($PY -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheel=${1:-$(ls "$ROOT"/.cache/wheels/onnxruntime-gpu/onnxruntime_gpu-*-"$tag"-*.whl 2>/dev/null \
             | tail -1)}
echo "== device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
echo "== python: $($PY --version), site $SITE"
mkdir -p "$SITE"
if [ -n "$wheel" ]; then
    echo "== installing $wheel"
    $PY -m pip install -q --no-deps --no-compile --upgrade --target "$SITE" "$wheel" || exit 1
else
    echo "== no wheel given or cached: pip install onnxruntime-gpu[cuda,cudnn]"
    $PY -m pip install -q --no-compile --upgrade --target "$SITE" \
        'onnxruntime-gpu[cuda,cudnn]' || exit 1
fi
for mod in numpy zmq onnx psutil pytest; do
    $PY -c "import $mod" 2>/dev/null || $PY -m pip install -q --target "$SITE" \
        "$( [ $mod = zmq ] && echo pyzmq || echo $mod )" || echo "missing $mod"
done
export PYTHONPATH="$SITE:$ROOT/build/pysrc"
# inferd itself, importable as `inferd.*` without installing it (the package maps the
# top-level folders onto inferd.daemon, inferd.ipc, inferd.libbackends).
mkdir -p build/pysrc/inferd
for part in daemon ipc libbackends; do ln -sfn "$ROOT/$part" "build/pysrc/inferd/$part"; done

echo "== onnxruntime: $($PY -c 'import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())')"
echo "== probe"
$PY -c '
from inferd.libbackends.onnxruntime_gpu import OnnxRuntimeGpuBackend
p = OnnxRuntimeGpuBackend().probe()
print("available" if p.available else "UNAVAILABLE", p.devices, p.reason)'

echo "== contract suite and GPU backend tests (INFERD_REQUIRE_GPU=1)"
INFERD_REQUIRE_GPU=1 timeout 300 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
    --rootdir "$ROOT" tests/libbackends/test_contract_suite.py -k "onnxruntime-gpu" \
    tests/libbackends/test_onnxruntime_gpu.py -m "not slow"
status=$?

echo "== benchmark: latency, 1 thread, batch 1"
[ -e models/ocr-cls/1/model.onnx ] || echo "models/ missing: run make setup here first"
timeout 300 $PY bench/bench_accel.py latency
echo "== done: tests exit status $status, log $LOG"
exit $status
