#!/usr/bin/env bash
# Build inferd's Debian packages for one architecture into build/deb/ARCH/ (`make deb
# ARCH=...`): inferd_VERSION_all.deb and every backend add-on of packaging/backends/
# that has upstream wheels for ARCH (inferd-backend-<id>_VERSION_ARCH.deb).
#
# Usage: build-deb.sh [ARCH]     (default: this machine's, e.g. amd64; or arm64)
#
# First packaging/build_deps.py installs what the build needs when run as root, or prints
# the apt-get line and stops. The environment may change what is built (the apt
# repository check builds a newer version on the spot this way):
#   INFERD_DEB_VERSION   a version to build instead of debian/changelog's (a changelog
#                        entry is added to the staged copy only)
#   INFERD_DEB_OUT       the output folder instead of build/deb/ARCH
#   INFERD_DEB_BACKENDS  the add-on ids to build (space-separated; default all)
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

arch=${1:-$(dpkg --print-architecture)}
python3 packaging/build_deps.py "$arch"
build_arch=$(dpkg-architecture -qDEB_BUILD_ARCH)
version=${INFERD_DEB_VERSION:-$(dpkg-parsechangelog -l packaging/debian/changelog -SVersion)}
out=${INFERD_DEB_OUT:-build/deb/$arch}
src=$out/inferd-$version
rm -rf "$out"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then cp -a --parents "$f" "$src/"; fi
done
rm -rf "$src/debian"
cp -a packaging/debian "$src/debian"
if [ "$version" != "$(dpkg-parsechangelog -l packaging/debian/changelog -SVersion)" ]; then
    { printf 'inferd (%s) unstable; urgency=medium\n\n  * Built as %s by packaging/build-deb.sh (INFERD_DEB_VERSION).\n\n' \
          "$version" "$version"
      printf ' -- inferd developers <inferd@lists.example.org>  %s\n\n' "$(date -R)"
      cat packaging/debian/changelog; } > "$src/debian/changelog"
fi
python3 packaging/stage_backends.py "$arch" "$src" .cache/wheels "$PIP_PYTHON"

cross=()
if [ "$arch" != "$build_arch" ]; then
    cross=(-a "$arch")
fi
cd "$src"
dpkg-buildpackage -us -uc -b "${cross[@]}"
cd "$ROOT"
ls -1 "$out"/*.deb
