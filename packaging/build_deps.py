#!/usr/bin/env python3
"""What `make deb ARCH=...` and the package tests (`make deb-test`, `make
deb-test-systemd`, `make deb-test-arm64`) need on the build machine, installed when run
as root, or the exact apt-get lines printed (exit status 1) otherwise, as `make setup`
does for its own packages. Called first by packaging/build-deb.sh, and by the Makefile
before the tests.

make deb's list: build-essential, dpkg-dev and python3-venv (make deb fetches the
add-ons' wheels with the project's venv), every package of packaging/debian/control's
Build-Depends and Build-Depends-Arch (version constraints and build profiles dropped,
``:native`` kept native) and, to cross-build, crossbuild-essential-ARCH and the
Build-Depends-Arch libraries of ARCH (``libzmq3-dev:arm64``; ARCH is added to dpkg's
architectures first). With dpkg-dev present, dpkg-checkbuilddeps decides what is
missing; without it (a fresh machine) everything is. The tests' lists are
:data:`TEST_PACKAGES` (each test also runs make deb, which brings its own).

Usage: build_deps.py ARCH | build_deps.py --test deb-test|deb-test-systemd|deb-test-arm64
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

CONTROL = Path(__file__).resolve().parent / "debian" / "control"
TOOLS = ["build-essential", "dpkg-dev", "python3-venv"]
TEST_PACKAGES: dict[str, tuple[str | None, list[str]]] = {
    # lintian; systemd-analyze; the installed daemon's Depends (dpkg -i installs none);
    # its unit's seccomp filter emulated; users made and dropped to (passwd, setpriv)
    "deb-test": (None, ["lintian", "systemd", "procps", "python3-numpy", "python3-onnx",
                        "python3-prometheus-client", "python3-psutil", "python3-systemd",
                        "python3-zmq", "python3-seccomp", "fakeroot", "util-linux",
                        "passwd"]),
    # the Debian 12 root (mmdebstrap, tests/packaging/make_root.sh) booted with
    # systemd-nspawn; the throwaway key and apt repository (gnupg, apt-ftparchive)
    "deb-test-systemd": (None, ["mmdebstrap", "systemd-container", "gnupg", "apt-utils"]),
    # an arm64 root under qemu-user (binfmt, tests/packaging/binfmt.sh; mmdebstrap
    # checks the architecture runs with arch-test), lintian on the arm64 packages, the
    # arm64 libraries whose symbols files dpkg-shlibdeps and the cross-built example read
    "deb-test-arm64": ("arm64", ["mmdebstrap", "arch-test", "systemd-container",
                                 "qemu-user-static", "binfmt-support", "lintian",
                                 "binutils-aarch64-linux-gnu", "libc6:arm64",
                                 "libstdc++6:arm64", "libgcc-s1:arm64"]),
}
"""make target -> (the foreign architecture it adds to dpkg, or None; its packages)."""


def say(text: str) -> None:
    print(f"build_deps: {text}", file=sys.stderr, flush=True)


def fields(control: Path) -> dict[str, str]:
    """The source stanza's fields (continuation lines joined, comments dropped)."""
    text = "\n".join(line for line in control.read_text().splitlines()
                     if not line.startswith("#"))
    source = text.split("\n\n", 1)[0]
    return {m.group(1): m.group(2).replace("\n", " ") for m in
            re.finditer(r"^([\w-]+):(.*(?:\n[ \t].*)*)", source, re.M)}


def names(relation: str) -> list[str]:
    """Package names of a relation field: the first of each alternative, no versions,
    no architecture lists or build profiles."""
    out = []
    for item in relation.split(","):
        first = item.split("|")[0]
        first = re.sub(r"\(.*?\)|\[.*?\]|<.*?>", "", first).strip()
        if first:
            out.append(first)
    return out


def apt_name(name: str, arch: str, cross: bool, host_libs: set[str]) -> str:
    base = name.split(":")[0]
    if name.endswith(":native") or not cross:
        return base
    return f"{base}:{arch}" if base in host_libs else base


def wanted(arch: str, cross: bool) -> tuple[list[str], dict[str, str]]:
    f = fields(CONTROL)
    build = names(f.get("Build-Depends", ""))
    host = names(f.get("Build-Depends-Arch", ""))
    host_libs = {n.split(":")[0] for n in host}
    todo = {n.split(":")[0]: apt_name(n, arch, cross, host_libs) for n in build + host}
    extra = TOOLS + ([f"crossbuild-essential-{arch}"] if cross else [])
    return extra, todo


def missing(arch: str, cross: bool) -> list[str]:
    extra, todo = wanted(arch, cross)
    lacking = [p for p in extra if not installed(p)]
    if not installed("dpkg-dev"):
        return lacking + list(dict.fromkeys(todo.values()))
    cmd = ["dpkg-checkbuilddeps", *(["-a", arch] if cross else []), str(CONTROL)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode == 0:
        return lacking
    m = re.search(r"Unmet build dependencies: (.*)", out.stderr)
    if m is None:
        raise SystemExit(f"build_deps: {' '.join(cmd)} failed: {out.stderr.strip()}")
    unmet = names(",".join(re.sub(r"\(.*?\)", "", m.group(1)).split()))
    return lacking + list(dict.fromkeys(todo.get(n.split(":")[0], n.split(":")[0])
                                        for n in unmet if n.split(":")[0] != "build-essential"))


def installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                         capture_output=True, text=True)
    return out.returncode == 0 and "ok installed" in out.stdout


def provide(target: str, need: list[str], add_arch: str | None) -> int:
    """Install ``need`` (after ``dpkg --add-architecture add_arch``) as root, or print
    the lines that would and return 1; 0 when nothing is missing."""
    if not need and not add_arch:
        return 0
    steps = ([["dpkg", "--add-architecture", add_arch]] if add_arch else []) + [
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *need]]
    if os.geteuid() != 0:
        say(f"make {target} needs packages this machine lacks; as root:")
        for cmd in steps:
            print("  sudo " + " ".join(c for c in cmd if c not in ("-y", "-qq")),
                  file=sys.stderr)
        return 1
    say(f"installing for make {target}: {' '.join(need)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in steps:
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return 0


def foreign(arch: str | None) -> bool:
    """Whether ``arch`` is an architecture dpkg does not install yet (None: no)."""
    if arch is None:
        return False
    native = subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                            text=True, check=True).stdout.strip()
    added = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True,
                           text=True, check=True).stdout.split()
    return arch != native and arch not in added


def main(argv: list[str]) -> int:
    usage = __doc__.strip().splitlines()[-1]
    if len(argv) == 3 and argv[1] == "--test" and argv[2] in TEST_PACKAGES:
        target = argv[2]
        arch, packages = TEST_PACKAGES[target]
        lacking = [p for p in packages if not installed(p)]
        if provide(target, lacking, arch if foreign(arch) else None):
            return 1
        still = [p for p in packages if not installed(p)]
        if still:
            raise SystemExit(f"build_deps: still missing after apt-get: {' '.join(still)}")
        return 0
    if len(argv) != 2 or argv[1].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    arch = argv[1]
    build_arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                                text=True, check=True).stdout.strip()
    cross = arch != build_arch
    if provide(f"deb ARCH={arch}", missing(arch, cross), arch if foreign(arch) else None):
        return 1
    still = missing(arch, cross)
    if still:
        raise SystemExit(f"build_deps: still missing after apt-get: {' '.join(still)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
