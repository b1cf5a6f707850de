#!/usr/bin/env python3
"""The apt repository half of `make deb-test-systemd` (issue 23): a signed repository
of the built packages made by packaging/apt-repo.sh (what `make apt-repo` runs) with a
throwaway key, a board's view of it (the keyring, inferd.sources with Signed-By, apt
update), and the upgrade cycle: install from it, upgrade to a version built on the spot
while a libinferd client is served, downgrade, purge, install again, purge.

check_systemd.py runs these; they use its container helpers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from check_systemd import (
    MEMBER,
    SHARE,
    UNIT,
    add_users,
    check_purge,
    cursor_now,
    figures,
    main_pid,
    serve_models,
    step,
    unit_events,
)
from container import Container

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
KEYRING = "/usr/share/keyrings/inferd-archive-keyring.gpg"
SOURCES = f"{SHARE}/apt/inferd.sources"
UPGRADED = ("inferd", "inferd-backend-onnxruntime", "libinferd0", "libinferd-dev")
"""What the upgrade cycle installs, upgrades, downgrades, purges and installs again."""


class Repository:
    """A signed apt repository at SHARE/apt, made by packaging/apt-repo.sh (what `make
    apt-repo` runs) with a throwaway signing key."""

    def __init__(self, share: Path) -> None:
        self.dir = share / "apt"
        self.gnupg = Path(tempfile.mkdtemp(prefix="inferd-gpg-"))
        self.env = {**os.environ, "GNUPGHOME": str(self.gnupg)}
        subprocess.run(["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "",
                        "--quick-gen-key", "inferd deb-test <deb-test@inferd.invalid>",
                        "ed25519", "sign", "1d"], env=self.env, check=True, capture_output=True)
        listing = subprocess.run(["gpg", "--batch", "--with-colons", "--list-secret-keys"],
                                 env=self.env, check=True, capture_output=True, text=True).stdout
        self.key = next(line.split(":")[9] for line in listing.splitlines()
                        if line.startswith("fpr:"))

    def add(self, build: Path) -> None:
        """The debs of BUILD into the pool; indices made again and signed."""
        out = subprocess.run([str(ROOT / "packaging" / "apt-repo.sh"), str(self.dir), self.key,
                              str(build)], env={**self.env, "APT_ARCHS": "amd64"},
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        for path in [self.dir, *self.dir.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)

    def close(self) -> None:
        subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=self.env, capture_output=True)
        shutil.rmtree(self.gnupg, ignore_errors=True)


def use_repository(c: Container) -> None:
    """A board's side of docs/install.md: the key in /usr/share/keyrings, the deb822
    sources file apt-repo.sh wrote (its URIs where the container sees the repository)
    with Signed-By in /etc/apt/sources.list.d, `apt-get update`."""
    c.run("cp", f"{SHARE}/apt/inferd-archive-keyring.gpg", KEYRING)
    sources = re.sub(r"^URIs: .*$", f"URIs: file:{SHARE}/apt", c.run("cat", SOURCES).stdout,
                     flags=re.M)
    assert f"Signed-By: {KEYRING}" in sources and f"Suites: {SUITE}" in sources, sources
    c.run("tee", "/etc/apt/sources.list.d/inferd.sources", input=sources)
    c.run("mkdir", "-p", "/etc/apt/inferd-only.d")
    c.run("cp", "/etc/apt/sources.list.d/inferd.sources", "/etc/apt/inferd-only.d/")
    apt_update(c)


def apt_update(c: Container) -> None:
    # inferd's source only: the container needs no other index (the packages'
    # dependencies are in its root) and the test no network. apt refuses a repository
    # whose InRelease does not verify with Signed-By's key: this proves the signature.
    out = c.run("apt-get", "update", "-o", "Dir::Etc::SourceList=/dev/null", "-o",
                "Dir::Etc::SourceParts=/etc/apt/inferd-only.d", timeout=300)
    assert "W:" not in out.stderr and "E:" not in out.stderr, out.stdout + out.stderr


def apt(c: Container, *args: str) -> str:
    out = c.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y",
                "--no-install-recommends", *args, timeout=900)
    return out.stdout


def install_from_repo(c: Container, packages: list[str], models: list[str],
                      preload: list[str]) -> float:
    """PACKAGES installed with apt from the repository (not from ./file.deb), then the
    models served as install() does; the seconds the restart took."""
    use_repository(c)
    out = apt(c, "install", *packages)
    assert "Setting up inferd " in out, out
    return serve_models(c, models, preload)


def versions(c: Container, packages: tuple[str, ...]) -> dict[str, str]:
    out = c.run("dpkg-query", "-W", "-f=${Package} ${Version}\n", *packages).stdout
    return dict(line.split() for line in out.splitlines())


def deb_version(build: Path) -> str:
    return sorted(build.glob("inferd_*_all.deb"))[-1].name.split("_")[1]


def build_newer(build: Path) -> tuple[str, Path]:
    """UPGRADED again, at a version above BUILD's, built on the spot (build-deb.sh with
    INFERD_DEB_VERSION; the CPU add-on only; its unit tests ran for BUILD)."""
    version = f"{deb_version(build)}+upgrade1"
    out = ROOT / "build" / "deb-upgrade" / "amd64"
    env = {**os.environ, "INFERD_DEB_VERSION": version, "INFERD_DEB_OUT": str(out),
           "INFERD_DEB_BACKENDS": "onnxruntime", "DEB_BUILD_OPTIONS": "nocheck"}
    started = time.monotonic()
    log = ROOT / "build" / "deb-upgrade.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        done = subprocess.run([str(ROOT / "packaging" / "build-deb.sh"), "amd64"], env=env,
                              stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    assert done.returncode == 0, f"building {version} failed: see {log}"
    built = {deb.name.split("_")[0] for deb in out.glob(f"*_{version}_*.deb")}
    assert set(UPGRADED) <= built, built
    figures["newer version built"] = f"{version} in {time.monotonic() - started:.0f} s"
    step(f"built {version} on the spot ({', '.join(sorted(built))}) in "
         f"{time.monotonic() - started:.0f} s")
    return version, out


TRIPLETS = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}


def build_against_dev(build: Path, arch: str, source: str, binary: Path) -> None:
    """SOURCE compiled for ARCH against BUILD's libinferd-dev package (its header, its .so
    link and its inferd.pc, unpacked; `pkg-config --cflags --libs inferd` gives the
    flags) into BINARY. SOURCE is a path, or one inside the unpacked packages (the example
    libinferd-dev ships)."""
    tmp = Path(tempfile.mkdtemp(prefix="inferd-dev-"))
    try:
        for package in ("libinferd0", "libinferd-dev"):
            deb = sorted(build.glob(f"{package}_*_{arch}.deb"))[-1]
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
        triplet = TRIPLETS[arch]
        env = {**os.environ, "PKG_CONFIG_SYSROOT_DIR": str(tmp),
               "PKG_CONFIG_LIBDIR": str(tmp / "usr/lib" / triplet / "pkgconfig")}
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "inferd"], env=env,
                               check=True, capture_output=True, text=True).stdout.split()
        src = Path(source) if Path(source).is_absolute() else tmp / source
        cc = "gcc" if arch == "amd64" else f"{triplet}-gcc"
        out = subprocess.run([cc, "-O2", "-Wall", "-Werror", "-o", str(binary), str(src),
                              *flags], capture_output=True, text=True)
        assert out.returncode == 0, f"{cc} {src.name}: {out.stderr}"
        binary.chmod(0o755)
    finally:
        shutil.rmtree(tmp)


def build_serving_client(build: Path, share: Path) -> None:
    """tests/packaging/serving_client.c, built against the libinferd-dev package."""
    build_against_dev(build, "amd64", str(Path(__file__).with_name("serving_client.c")),
                      share / "serving_client")


class Serving:
    """serving_client running in the container as a member of group inferd; a thread
    reads its lines as they come, so that it never waits on a full pipe."""

    def __init__(self, c: Container) -> None:
        self.proc = c.popen(f"{SHARE}/serving_client", "ipc:///run/inferd/inferd.sock",
                            user=MEMBER)
        self.lines: list[str] = []
        self.ok = 0
        self.reader = threading.Thread(target=self._read, name="serving-client", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.ok += line.startswith("OK")

    def wait_ok(self, more: int, timeout: float = 300) -> None:
        """Until MORE calls more completed OK."""
        want, deadline = self.ok + more, time.monotonic() + timeout
        while self.ok < want:
            assert self.proc.poll() is None, f"serving_client ended: {self.lines[-5:]}"
            assert time.monotonic() < deadline, f"{self.ok} of {want} OK: {self.lines[-5:]}"
            time.sleep(0.05)

    def stop(self) -> dict[str, int]:
        assert self.proc.stdin
        self.proc.stdin.close()
        assert self.proc.wait(120) == 0, self.lines[-5:]
        self.reader.join(30)
        summary = self.lines[-1]
        assert summary.startswith("summary "), self.lines[-5:]
        return {k: int(v) for k, v in (w.split("=") for w in summary.split()[1:])}


def conffile_md5(c: Container) -> tuple[str, str]:
    """(md5 of /etc/inferd/inferd.toml now, md5 dpkg recorded for the package's copy)."""
    now = c.run("md5sum", "/etc/inferd/inferd.toml").stdout.split()[0]
    listed = c.run("dpkg-query", "-W", "-f=${Conffiles}", "inferd").stdout.split()
    return now, listed[listed.index("/etc/inferd/inferd.toml") + 1]


def check_upgrade(c: Container, repo: Repository, old: str, new: str, newer: Path) -> None:
    """apt upgrade to NEW while the daemon serves a client: the conffile edit, the model
    repository and the user inferd kept, one clean notify restart, every call answered."""
    edit = "\n# edited on this board: kept across upgrades (deb-test-systemd)\n"
    c.run("sh", "-c", f"printf '{edit}' >> /etc/inferd/inferd.toml")
    edited, pristine = conffile_md5(c)
    assert edited != pristine
    user = c.run("getent", "passwd", "inferd").stdout.strip()
    pid, restarts = main_pid(c), c.show(UNIT, "NRestarts")["NRestarts"]
    client = Serving(c)
    client.wait_ok(20)
    repo.add(newer)
    apt_update(c)
    cursor = cursor_now(c)
    started = time.monotonic()
    out = apt(c, "upgrade")
    upgrade_s = time.monotonic() - started
    assert versions(c, UPGRADED) == {p: new for p in UPGRADED}, out
    client.wait_ok(20)  # served again by the new daemon, over the same connection
    counts = client.stop()
    ev = unit_events(c, cursor, "Stopping ", "Deactivated successfully", "Started ",
                     "Failed with result", "Main process exited")
    assert "Failed with result" not in ev and "Started " in ev, ev
    assert "Deactivated successfully" in ev, ev  # a clean exit, not a kill
    props = c.show(UNIT, "MainPID", "ActiveState", "SubState", "NRestarts", "StatusText")
    assert int(props["MainPID"]) != pid, props
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    assert props["NRestarts"] == restarts and props["StatusText"].startswith("ready;"), props
    assert conffile_md5(c) == (edited, pristine), "the conffile edit was not kept"
    assert c.run("getent", "passwd", "inferd").stdout.strip() == user
    c.run("test", "-f", "/var/lib/inferd/models/ocr-cls/1/model.onnx")
    assert counts["other"] == 0 and counts["different"] == 0, (counts, client.lines[-20:])
    gap = ev["Started "] - ev["Stopping "]
    figures["upgrade"] = (f"{old} -> {new}: apt-get upgrade {upgrade_s:.1f} s, the daemon "
                          f"stopped -> READY {gap:.1f} s; the client's calls: {counts['ok']} "
                          f"OK, {counts['unavailable']} UNAVAILABLE, {counts['other']} other "
                          f"or lost, results identical")
    step(f"apt-get upgrade {old} -> {new} under a serving client: conffile edit, models and "
         f"user inferd kept; one clean restart (Stopping -> Deactivated successfully -> "
         f"Started, NRestarts {restarts}); {figures['upgrade']}")


def check_downgrade(c: Container, old: str) -> None:
    edited = conffile_md5(c)
    apt(c, "install", "--allow-downgrades", *(f"{p}={old}" for p in UPGRADED))
    assert versions(c, UPGRADED) == {p: old for p in UPGRADED}
    props = c.show(UNIT, "ActiveState", "SubState", "StatusText")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    assert "models warm: 1 (ocr-cls)" in props["StatusText"], props
    assert conffile_md5(c) == edited
    out = c.run("inferctl", "--socket", "ipc:///run/inferd/inferd.sock", "infer", "ocr-cls",
                "-i", f"x={SHARE}/x.npy", user=MEMBER)
    assert "float32[1, 2]" in out.stdout, out.stdout
    step(f"apt-get install --allow-downgrades ...={old}: back to {old}, running with ocr-cls "
         "warm, conffile edit kept, serving")


def check_purge_reinstall(c: Container, new: str) -> None:
    uid = c.run("id", "-u", "inferd").stdout.strip()
    check_purge(c, list(UPGRADED))
    apt(c, "install", *UPGRADED)
    assert versions(c, UPGRADED) == {p: new for p in UPGRADED}
    props = c.show(UNIT, "ActiveState", "SubState", "StatusText")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    now, pristine = conffile_md5(c)
    assert now == pristine, "a purged conffile came back with the old edits"
    assert c.run("id", "-u", "inferd").stdout.strip() == uid
    out = c.run("inferctl", "--socket", "ipc:///run/inferd/inferd.sock", "ping", user=MEMBER)
    assert "pong" in out.stdout, out.stdout
    check_purge(c, list(UPGRADED))
    step(f"purge, then apt-get install {new} again: running, the package's own conffile, the "
         f"same user inferd (uid {uid}); purged again: nothing left")


def check_upgrade_cycle(root: Path, share: Path, repo: Repository, build: Path) -> None:
    """Install from the repository, upgrade to a version built now while a client is
    served, downgrade, purge, install again, purge: one container of its own."""
    old = deb_version(build)
    new, newer = build_newer(build)
    with Container(root, share) as c:
        try:
            install_from_repo(c, [f"{p}={old}" for p in UPGRADED], ["ocr-cls"], ["ocr-cls"])
            assert versions(c, UPGRADED) == {p: old for p in UPGRADED}
            add_users(c)
            check_upgrade(c, repo, old, new, newer)
            check_downgrade(c, old)
            check_purge_reinstall(c, new)
        except BaseException:
            print("--- journal of inferd ---\n" + c.journal("-u", UNIT, "-n", "80"),
                  file=sys.stderr)
            raise
