#!/usr/bin/env bash
# Build inferd's Debian packages for one architecture into build/deb/ARCH/ (`make deb
# ARCH=...`): inferd_VERSION_all.deb and every backend add-on of packaging/backends/
# that has upstream wheels for ARCH (inferd-backend-<id>_VERSION_ARCH.deb).
#
# Usage: build-deb.sh [ARCH]     (default: this machine's, e.g. amd64; or arm64)
#
# Stages the tracked (and untracked, not ignored) files into
# build/deb/ARCH/inferd-VERSION/ with packaging/debian as debian/, lets
# packaging/stage_backends.py add each add-on built for ARCH (its control stanza, and its
# wheels fetched once with pip into .cache/wheels/<id>/; the package build itself needs
# no network), then runs dpkg-buildpackage -us -uc -b, with -a ARCH when cross-building
# (that needs binutils-aarch64-linux-gnu and libc6, libstdc++6, libgcc-s1 of ARCH
# installed through multiarch, for dpkg-shlibdeps; see docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PIP_PYTHON=${PIP_PYTHON:-$ROOT/.venv/bin/python}
# A pyenv (or venv) python3 first in PATH breaks pybuild: Debian's tools only.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin

build_arch=$(dpkg-architecture -qDEB_BUILD_ARCH)
arch=${1:-$build_arch}
version=$(dpkg-parsechangelog -l packaging/debian/changelog -SVersion)
out=build/deb/$arch
src=$out/inferd-$version
rm -rf "$out"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then cp -a --parents "$f" "$src/"; fi
done
rm -rf "$src/debian"
cp -a packaging/debian "$src/debian"
python3 packaging/stage_backends.py "$arch" "$src" .cache/wheels "$PIP_PYTHON"

cross=()
if [ "$arch" != "$build_arch" ]; then
    cross=(-a "$arch")
fi
cd "$src"
dpkg-buildpackage -us -uc -b "${cross[@]}"
cd "$ROOT"
ls -1 "$out"/*.deb
