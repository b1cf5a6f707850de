#!/usr/bin/env bash
# Build inferd's Debian packages into build/deb/ (`make deb`): inferd (all) and the
# add-ons inferd-backend-onnxruntime and inferd-backend-rknn (this architecture).
#
# Stages the tracked (and untracked, not ignored) files into build/deb/inferd-VERSION/
# with packaging/debian as debian/, puts the onnxruntime wheel for this architecture
# and Debian's Python into debian/vendor/ (downloaded once with pip into
# .cache/wheels/onnxruntime/; the package build itself needs no network), then runs
# dpkg-buildpackage -us -uc -b.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PIP_PYTHON=${PIP_PYTHON:-$ROOT/.venv/bin/python}
ORT_VERSION=${ORT_VERSION:-1.32.0}
# A pyenv (or venv) python3 first in PATH breaks pybuild: Debian's tools only.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin

arch=$(dpkg-architecture -qDEB_HOST_ARCH)
case "$arch" in
    amd64) machine=x86_64 ;;
    arm64) machine=aarch64 ;;
    *) echo "build-deb: onnxruntime publishes no wheel for $arch" >&2; exit 1 ;;
esac
pyver=$(python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')
cache=.cache/wheels/onnxruntime
wheel=$(ls "$cache"/onnxruntime-"$ORT_VERSION"-cp"$pyver"-cp"$pyver"-*"$machine".whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    mkdir -p "$cache"
    "$PIP_PYTHON" -m pip download --quiet --no-deps --only-binary :all: \
        --implementation cp --python-version "${pyver:0:1}.${pyver:1}" --abi "cp$pyver" \
        --platform "manylinux_2_27_$machine" --platform "manylinux_2_28_$machine" \
        -d "$cache" "onnxruntime==$ORT_VERSION"
    wheel=$(ls "$cache"/onnxruntime-"$ORT_VERSION"-cp"$pyver"-*"$machine".whl | head -1)
fi

# inferd-backend-rknn: on arm64 it carries the board runtime rknn-toolkit-lite2 (RKNNLite;
# aarch64 wheels only). On amd64 the package holds the plugin alone, whose probe says why
# it cannot run there.
RKNN_LITE_VERSION=${RKNN_LITE_VERSION:-2.5.0}
lite=""
if [ "$machine" = aarch64 ]; then
    lite_cache=.cache/wheels/rknn
    lite=$(ls "$lite_cache"/rknn_toolkit_lite2-"$RKNN_LITE_VERSION"-cp"$pyver"-*aarch64.whl \
           2>/dev/null | head -1 || true)
    if [ -z "$lite" ]; then
        mkdir -p "$lite_cache"
        "$PIP_PYTHON" -m pip download --quiet --no-deps --only-binary :all: \
            --implementation cp --python-version "${pyver:0:1}.${pyver:1}" --abi "cp$pyver" \
            --platform "manylinux_2_17_aarch64" -d "$lite_cache" \
            "rknn-toolkit-lite2==$RKNN_LITE_VERSION"
        lite=$(ls "$lite_cache"/rknn_toolkit_lite2-"$RKNN_LITE_VERSION"-*aarch64.whl | head -1)
    fi
fi

version=$(dpkg-parsechangelog -l packaging/debian/changelog -SVersion)
out=build/deb
src=$out/inferd-$version
rm -rf "$out"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then cp -a --parents "$f" "$src/"; fi
done
rm -rf "$src/debian"
cp -a packaging/debian "$src/debian"
mkdir -p "$src/debian/vendor"
cp "$wheel" "$src/debian/vendor/"
if [ -n "$lite" ]; then cp "$lite" "$src/debian/vendor/"; fi

cd "$src"
dpkg-buildpackage -us -uc -b
cd "$ROOT"
ls -1 "$out"/*.deb
