#!/usr/bin/env bash
# Build (or update) a signed Debian repository of inferd's packages: `make apt-repo
# GPG_KEY=...` runs it on build/deb/amd64 and build/deb/arm64 (docs/install.md,
# "Installing from an apt repository").
#
# Usage: apt-repo.sh OUT KEY DEBDIR...
#
#   OUT/pool/main/            every .deb of the DEBDIRs, added to those it holds already
#                             (older versions stay: boards can pin or downgrade)
#   OUT/dists/SUITE/main/binary-ARCH/Packages(.gz)   per architecture (APT_ARCHS, default
#                             "amd64 arm64"), with apt-ftparchive
#   OUT/dists/SUITE/Release, InRelease, Release.gpg  signed by KEY (a key id or
#                             fingerprint in gpg's keyring, $GNUPGHOME if set)
#   OUT/inferd-archive-keyring.gpg   the public key, for a board's Signed-By
#   OUT/inferd.sources        a deb822 sources file pointing at OUT (edit its URIs)
#
# SUITE is bookworm (APT_SUITE). Needs apt-utils (apt-ftparchive) and gnupg: installed
# when run as root, else the apt-get line is printed.
set -euo pipefail
out=${1:?usage: apt-repo.sh OUT KEY DEBDIR...}
key=${2:?usage: apt-repo.sh OUT KEY DEBDIR... (KEY: make apt-repo GPG_KEY=...)}
shift 2
[ $# -gt 0 ] || { echo "apt-repo: no DEBDIR given" >&2; exit 2; }
suite=${APT_SUITE:-bookworm}
archs=${APT_ARCHS:-amd64 arm64}
component=main

say() { echo "apt-repo: $*" >&2; }

missing=()
command -v apt-ftparchive >/dev/null || missing+=(apt-utils)
command -v gpg >/dev/null || missing+=(gnupg)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        say "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    else
        say "needs: sudo apt-get install --no-install-recommends ${missing[*]}"
        exit 1
    fi
fi
gpg --batch --list-secret-keys "$key" >/dev/null 2>&1 || {
    say "no secret key '$key' in gpg's keyring${GNUPGHOME:+ ($GNUPGHOME)}"; exit 1; }

mkdir -p "$out/pool/$component"
for dir in "$@"; do
    debs=("$dir"/*.deb)
    [ -e "${debs[0]}" ] || { say "no .deb in $dir: run make deb (ARCH=...) first"; exit 1; }
    cp -f "${debs[@]}" "$out/pool/$component/"
done
out=$(cd "$out" && pwd)
cd "$out"
dist=dists/$suite
rm -rf "$dist"
for arch in $archs; do
    dir=$dist/$component/binary-$arch
    mkdir -p "$dir"
    apt-ftparchive --arch "$arch" packages "pool/$component" > "$dir/Packages"
    gzip -9n < "$dir/Packages" > "$dir/Packages.gz"
    say "$arch: $(grep -c '^Package:' "$dir/Packages") package versions"
done
apt-ftparchive \
    -o APT::FTPArchive::Release::Origin=inferd \
    -o APT::FTPArchive::Release::Label=inferd \
    -o APT::FTPArchive::Release::Suite="$suite" \
    -o APT::FTPArchive::Release::Codename="$suite" \
    -o APT::FTPArchive::Release::Architectures="$archs" \
    -o APT::FTPArchive::Release::Components="$component" \
    -o APT::FTPArchive::Release::Description="inferd packages" \
    release "$dist" > Release.new
mv Release.new "$dist/Release"
gpg --batch --yes --local-user "$key" --clearsign -o "$dist/InRelease" "$dist/Release"
gpg --batch --yes --local-user "$key" --armor --detach-sign -o "$dist/Release.gpg" "$dist/Release"
gpg --batch --yes --export "$key" > inferd-archive-keyring.gpg
cat > inferd.sources <<EOF
Types: deb
URIs: file:$out
Suites: $suite
Components: $component
Signed-By: /usr/share/keyrings/inferd-archive-keyring.gpg
EOF
say "signed $dist/InRelease with $key; public key inferd-archive-keyring.gpg"
