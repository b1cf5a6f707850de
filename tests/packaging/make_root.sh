#!/usr/bin/env bash
# Prints the path of a cached Debian 12 root for ARCH (amd64 or arm64) holding the
# packages of tests/packaging/root-packages.txt, building it first with mmdebstrap if
# the cache has none for that list.
#
# Usage: make_root.sh ARCH          (root; prints the root's directory on stdout)
#
# Roots live under $INFERD_CI_CACHE (default /var/cache/inferd-ci/), outside the
# clone, so that a second CI run on the same machine reuses them. A root is keyed by
# its architecture, package list, apt sources and this script's ROOT_FORMAT: change
# any of them and a new root is built (the old one of that architecture is removed).
# Tests never write into a cached root: they boot it with `systemd-nspawn
# --volatile=overlay` (tests/packaging/container.py), so it stays pristine.
# A foreign architecture needs qemu-user-static and binfmt (tests/packaging/binfmt.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
arch=${1:?usage: make_root.sh ARCH}
cache=${INFERD_CI_CACHE:-/var/cache/inferd-ci}
list=$here/root-packages.txt
ROOT_FORMAT=1  # bump when the way a root is made changes

say() { echo "make_root($arch): $*" >&2; }

packages=$(sed -e 's/#.*//' "$list" | tr -s ' \n' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
# The machine's own Debian sources (deb.debian.org on CI), as one-line sources.
sources=$(python3 - <<'EOF'
import glob, re
lines = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for para in open(path).read().split("\n\n"):
        f = dict(re.findall(r"^(\w[\w-]*):[ \t]*(.*)$", para, re.M))
        for uri in f.get("URIs", "").split():
            if f.get("Types") == "deb" and "debian.org" in uri:
                for suite in f.get("Suites", "").split():
                    lines.append(f"deb {uri} {suite} {f.get('Components', 'main')}")
for path in glob.glob("/etc/apt/sources.list"):
    for line in open(path, errors="ignore"):
        line = line.split("#")[0].strip()
        if line.startswith("deb ") and "debian.org" in line and "bookworm" in line:
            lines.append(line)
print("\n".join(dict.fromkeys(lines)) or "deb http://deb.debian.org/debian bookworm main")
EOF
)
key=$(printf '%s\n%s\n%s\n%s\n' "$ROOT_FORMAT" "$arch" "$packages" "$sources" | sha256sum | cut -c1-12)
root=$cache/root-$arch-$key

mkdir -p "$cache"
exec 9>"$cache/.lock-$arch"
flock 9
if [ -f "$root/.complete" ]; then
    say "cached: $root ($(du -sh --apparent-size "$root" | cut -f1))"
    echo "$root"
    exit 0
fi
# An interrupted mmdebstrap leaves /proc, /sys and /dev/{pts,shm} mounted in its .tmp
# root: unmount them first, and never let rm follow a mount (the host's /dev/shm).
remove_root() {
    awk -v d="$1/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$1"
}
for old in "$cache"/root-"$arch"-*; do
    [ -e "$old" ] && [ "$old" != "$root" ] && { say "removing stale $old"; remove_root "$old"; }
done
remove_root "$root"
remove_root "$root.tmp"
say "building $root from: $packages"
start=$(date +%s)
mirrors=()
while IFS= read -r line; do mirrors+=("$line"); done <<<"$sources"
# Documentation, manuals and translations of the root's own packages are left out
# (a third of the size); the dpkg filter is removed afterwards, so what the tests
# install later (inferd's man pages) is installed whole.
mmdebstrap --quiet --arch="$arch" --variant=minbase --include="$packages" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -f "$1"/etc/dpkg/dpkg.cfg.d/99mmdebstrap' \
    --customize-hook='echo inferd-ci > "$1"/etc/hostname' \
    bookworm "$root.tmp" "${mirrors[@]}" >&2
mv "$root.tmp" "$root"
printf 'arch=%s\npackages=%s\nbuilt_s=%s\n' "$arch" "$packages" "$(( $(date +%s) - start ))" \
    > "$root/.complete"
say "built in $(( $(date +%s) - start )) s: $(du -sh --apparent-size "$root" | cut -f1)"
echo "$root"
