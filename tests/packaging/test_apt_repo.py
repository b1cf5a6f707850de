"""packaging/apt-repo.sh (`make apt-repo`) on small packages made here: per-architecture
indices, a Release that covers them, signatures that verify with the exported key and
fail with another, older versions kept beside newer ones. The real packages go through
the same script in `make deb-test-systemd` (tests/packaging/check_systemd.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "packaging" / "apt-repo.sh"


def tiny_deb(folder: Path, name: str, version: str, arch: str) -> Path:
    tree = folder / f"{name}-{version}-{arch}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: {arch}\n"
        f"Maintainer: test <t@example.org>\nDescription: test package\n a test\n")
    (tree / "usr" / "share" / name).mkdir(parents=True)
    (tree / "usr" / "share" / name / "f").write_text(version)
    deb = folder / f"{name}_{version}_{arch}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    shutil.rmtree(tree)
    return deb


@pytest.fixture
def gnupg() -> Iterator[dict[str, str]]:
    home = tempfile.mkdtemp(prefix="inferd-gpg-")
    env = {**os.environ, "GNUPGHOME": home}
    for uid in ("signer <s@inferd.invalid>", "stranger <x@inferd.invalid>"):
        subprocess.run(["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "",
                        "--quick-gen-key", uid, "ed25519", "sign", "1d"], env=env, check=True,
                       capture_output=True)
    yield env
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=env, capture_output=True)
    shutil.rmtree(home, ignore_errors=True)


def fingerprint(env: dict[str, str], who: str) -> str:
    out = subprocess.run(["gpg", "--batch", "--with-colons", "--list-secret-keys", who],
                         env=env, check=True, capture_output=True, text=True).stdout
    return next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))


def packages(repo: Path, arch: str) -> set[tuple[str, str]]:
    text = (repo / "dists/bookworm/main" / f"binary-{arch}" / "Packages").read_text()
    return {(p.split("Package: ")[1].split("\n")[0], p.split("Version: ")[1].split("\n")[0])
            for p in text.split("\n\n") if p.strip()}


def run_script(repo: Path, key: str, env: dict[str, str], *dirs: Path) -> str:
    out = subprocess.run([str(SCRIPT), str(repo), key, *map(str, dirs)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stderr


def test_repository_indices_signature_and_history(short_tmp, gnupg):
    if shutil.which("apt-ftparchive") is None and os.geteuid() != 0:
        pytest.fail("apt-ftparchive is required (apt-get install apt-utils)")
    amd, arm, newer = (short_tmp / d for d in ("amd64", "arm64", "newer"))
    for d in (amd, arm, newer):
        d.mkdir()
    tiny_deb(amd, "inferd", "0.1.0", "all")
    tiny_deb(amd, "libinferd0", "0.1.0", "amd64")
    tiny_deb(arm, "libinferd0", "0.1.0", "arm64")
    key = fingerprint(gnupg, "signer")
    repo = short_tmp / "apt"
    run_script(repo, key, gnupg, amd, arm)
    assert packages(repo, "amd64") == {("inferd", "0.1.0"), ("libinferd0", "0.1.0")}
    assert packages(repo, "arm64") == {("inferd", "0.1.0"), ("libinferd0", "0.1.0")}
    release = (repo / "dists/bookworm/Release").read_text()
    assert "Suite: bookworm" in release and "Architectures: amd64 arm64" in release
    for index in ("main/binary-amd64/Packages", "main/binary-arm64/Packages.gz"):
        assert index in release, release
    keyring = repo / "inferd-archive-keyring.gpg"
    dist = repo / "dists/bookworm"
    ok = subprocess.run(["gpgv", "--keyring", str(keyring), str(dist / "InRelease")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    ok = subprocess.run(["gpgv", "--keyring", str(keyring), str(dist / "Release.gpg"),
                         str(dist / "Release")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    sources = (repo / "inferd.sources").read_text()
    assert f"URIs: file:{repo}" in sources
    assert "Signed-By: /usr/share/keyrings/inferd-archive-keyring.gpg" in sources

    # a key other than the exported one does not verify it
    other = short_tmp / "other.gpg"
    other.write_bytes(subprocess.run(["gpg", "--batch", "--export", fingerprint(gnupg,
                                      "stranger")], env=gnupg, check=True,
                                     capture_output=True).stdout)
    bad = subprocess.run(["gpgv", "--keyring", str(other), str(dist / "InRelease")],
                         capture_output=True, text=True)
    assert bad.returncode != 0

    # a newer version joins the pool; the older one stays, for downgrades
    tiny_deb(newer, "inferd", "0.1.0+1", "all")
    run_script(repo, key, gnupg, newer)
    assert packages(repo, "arm64") == {("inferd", "0.1.0"), ("inferd", "0.1.0+1"),
                                       ("libinferd0", "0.1.0")}


def test_refuses_without_a_key_it_can_sign_with(short_tmp, gnupg):
    (short_tmp / "d").mkdir()
    tiny_deb(short_tmp / "d", "inferd", "0.1.0", "all")
    out = subprocess.run([str(SCRIPT), str(short_tmp / "apt"), "no-such-key",
                          str(short_tmp / "d")], env=gnupg, capture_output=True, text=True)
    assert out.returncode == 1 and "no secret key 'no-such-key'" in out.stderr, out.stderr
    out = subprocess.run(["make", "-s", "-C", str(ROOT), "apt-repo", "APT_ARCHS=",
                          "GPG_KEY="], capture_output=True, text=True)
    assert out.returncode != 0 and "make apt-repo: give the signing key" in out.stderr, \
        out.stderr
