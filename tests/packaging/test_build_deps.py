"""packaging/build_deps.py, what `make deb` runs first: the package list it derives from
debian/control (host libraries qualified for a cross build), and the apt-get line it
prints, instead of installing, when it does not run as root: the script itself, run by
a user who is not root against this machine's dpkg, nothing stubbed."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# loaded from its file: packaging/ on sys.path would make packaging/rknn (a folder of
# requirements) importable as a namespace package `rknn`, and the RKNN backend's probe
# would take it for rknn-toolkit2 in every later test of the run
_spec = importlib.util.spec_from_file_location("build_deps", ROOT / "packaging" / "build_deps.py")
assert _spec is not None and _spec.loader is not None
build_deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_deps)


def test_the_list_comes_from_the_control_file():
    tools, native = build_deps.wanted("amd64", cross=False)
    assert tools == ["build-essential", "dpkg-dev", "python3-venv"]
    assert {"debhelper-compat", "dh-python", "libzmq3-dev", "libjansson-dev",
            "python3-zmq"} <= set(native.values())
    tools, cross = build_deps.wanted("arm64", cross=True)
    assert "crossbuild-essential-arm64" in tools
    # the libraries libinferd links are the host's; the tools and :native ones the build's
    assert cross["libzmq3-dev"] == "libzmq3-dev:arm64"
    assert cross["libjansson-dev"] == "libjansson-dev:arm64"
    assert cross["python3-numpy"] == "python3-numpy" and cross["dh-python"] == "dh-python"


def _unprivileged(where: Path, *args: str,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``make ...`` or ``build_deps.py ...`` (``args``) run for real by a user who is not
    root: this one, or nobody (65534) when the tests run as root. The Makefile,
    packaging/build_deps.py and debian/control are copied into ``where``, which nobody
    can read (the checkout may be in root's home); the script is run by the system's
    python3, as make runs it."""
    (where / "packaging" / "debian").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", where)
    shutil.copy(ROOT / "packaging" / "build_deps.py", where / "packaging")
    shutil.copy(ROOT / "packaging" / "debian" / "control", where / "packaging" / "debian")
    where.chmod(0o755)
    python = sys.executable
    wrap: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None or not os.access("/usr/bin/python3", os.X_OK):
            pytest.skip("as root this needs setpriv and /usr/bin/python3 to drop to nobody")
        python = "/usr/bin/python3"
        wrap = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if args[0] == "make":
        cmd = ["make", "-s", *args[1:], f"PYTHON={python}"]
    else:
        cmd = [python, str(where / "packaging" / "build_deps.py"), *args]
    # HOME: not root's, which nobody cannot read; PATH: without a venv or pyenv's shims
    full = {**os.environ, "HOME": str(where), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            **(env or {})}
    return subprocess.run([*wrap, *cmd], capture_output=True, text=True, timeout=120,
                          cwd=where, env=full)


def _dpkg(*args: str) -> str:
    return subprocess.run(["dpkg", *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_without_root_it_prints_the_apt_get_line_and_stops(short_tmp: Path) -> None:
    """A cross build for an architecture dpkg does not know here: the script finds what
    is missing with the real dpkg tools and, not being root, prints the lines instead
    of running them."""
    foreign = _dpkg("--print-foreign-architectures").split()
    arch = next(a for a in ("riscv64", "s390x", "ppc64el", "mips64el") if a not in foreign)
    out = _unprivileged(short_tmp, arch)
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr, out.stderr
    assert f"make deb ARCH={arch} needs packages this machine lacks; as root:" in out.stderr
    lines = out.stderr.splitlines()
    assert f"  sudo dpkg --add-architecture {arch}" in lines, out.stderr
    install = next(ln for ln in lines if ln.startswith("  sudo apt-get install "))
    packages = install.split()[4:]
    assert install.split()[:4] == ["sudo", "apt-get", "install", "--no-install-recommends"]
    assert {f"crossbuild-essential-{arch}", f"libzmq3-dev:{arch}",
            f"libjansson-dev:{arch}"} <= set(packages), install
    assert not {"python3-numpy", "dh-python"} & {p.split(":")[0] for p in packages
                                                 if p.endswith(f":{arch}")}, install


def test_what_it_finds_missing_is_what_dpkg_finds_missing(short_tmp: Path) -> None:
    """A native build: the script stops (and prints the line) exactly when
    dpkg-checkbuilddeps or dpkg-query finds something missing on this machine, and names
    every build dependency dpkg-checkbuilddeps calls unmet."""
    if shutil.which("dpkg-checkbuilddeps") is None:
        pytest.skip("dpkg-dev is not installed: nothing to compare with")
    arch = _dpkg("--print-architecture")
    out = _unprivileged(short_tmp, arch)
    check = subprocess.run(["dpkg-checkbuilddeps", str(ROOT / "packaging" / "debian" /
                                                       "control")],
                           capture_output=True, text=True)
    tools = [p for p in build_deps.TOOLS if not build_deps.installed(p)]
    assert "Traceback" not in out.stderr, out.stderr
    if check.returncode == 0 and not tools:
        assert (out.returncode, out.stderr) == (0, "")
        return
    assert out.returncode == 1, out
    install = next(ln for ln in out.stderr.splitlines()
                   if ln.startswith("  sudo apt-get install "))
    # "Unmet build dependencies: debhelper-compat (= 13) dh-python python3-all:native"
    unmet = re.sub(r"\(.*?\)", "", check.stderr.partition("Unmet build dependencies:")[2])
    listed = {p.split(":")[0] for p in install.split()[4:]}
    assert set(tools) <= listed, install
    assert {n.split(":")[0] for n in unmet.split()} <= listed, (check.stderr, install)


@pytest.mark.parametrize("relation, names", [
    ("debhelper-compat (= 13), dh-python", ["debhelper-compat", "dh-python"]),
    ("python3-numpy:native <!nocheck>, a | b [amd64]", ["python3-numpy:native", "a"]),
])
def test_relation_fields_give_package_names(relation, names):
    assert build_deps.names(relation) == names


def _fresh_dpkg(where: Path) -> dict[str, str]:
    """The environment of a machine on which dpkg has installed nothing and knows no
    foreign architecture: an empty dpkg database (dpkg and dpkg-query read
    DPKG_ADMINDIR)."""
    admin = where / "dpkg"
    for sub in ("info", "updates"):
        (admin / sub).mkdir(parents=True)
    (admin / "status").touch()
    return {"DPKG_ADMINDIR": str(admin)}


@pytest.mark.parametrize("test, foreign, wanted", [
    ("deb-test", None, ["lintian", "python3-zmq", "python3-seccomp"]),
    ("deb-test-systemd", None, ["mmdebstrap", "systemd-container", "gnupg", "apt-utils"]),
    ("deb-test-arm64", "arm64", ["mmdebstrap", "qemu-user-static", "binfmt-support",
                                 "libc6:arm64", "libstdc++6:arm64", "libgcc-s1:arm64"]),
])
def test_the_package_tests_print_their_apt_get_line_on_a_fresh_machine(
        short_tmp: Path, test: str, foreign: str | None, wanted: list[str]) -> None:
    """`make deb-test-systemd` stopped with "mmdebstrap: command not found" and a Python
    traceback on a fresh machine (issue 31 item 16): its first step is now what it needs,
    installed as root, or the lines printed. Here the make target itself, by a user who
    is not root, on an empty dpkg database."""
    out = _unprivileged(short_tmp, "make", test.replace("deb-test", "deb-test-deps"),
                        env=_fresh_dpkg(short_tmp))
    assert out.returncode != 0, out
    assert "Traceback" not in out.stderr and "command not found" not in out.stderr, out
    lines = out.stderr.splitlines()
    assert f"build_deps: make {test} needs packages this machine lacks; as root:" in lines
    assert (f"  sudo dpkg --add-architecture {foreign}" in lines) == bool(foreign), lines
    install = next(ln for ln in lines if ln.startswith("  sudo apt-get install "))
    assert install.split()[4:] == build_deps.TEST_PACKAGES[test][1], install
    assert set(wanted) <= set(install.split()), install


@pytest.mark.parametrize("test", sorted(build_deps.TEST_PACKAGES))
def test_the_package_tests_need_what_dpkg_says_is_missing(short_tmp: Path,
                                                          test: str) -> None:
    """On this machine, as it is: the script lists exactly the packages dpkg-query does
    not find installed (nothing, and exit status 0, when all are)."""
    out = _unprivileged(short_tmp, "--test", test)
    lacking = [p for p in build_deps.TEST_PACKAGES[test][1] if not build_deps.installed(p)]
    assert "Traceback" not in out.stderr, out.stderr
    if not lacking and "--add-architecture" not in out.stderr:
        assert (out.returncode, out.stderr) == (0, ""), out
        return
    assert out.returncode == 1, out
    install = next(ln for ln in out.stderr.splitlines()
                   if ln.startswith("  sudo apt-get install "))
    assert install.split()[4:] == lacking, install


def test_make_checks_what_the_package_tests_need_before_it_builds() -> None:
    """The check is the targets' first step: not after make deb's minutes."""
    for test in ("deb-test", "deb-test-systemd", "deb-test-arm64"):
        # -B: every step printed, even where packages built earlier in this checkout are
        # up to date (make -n would leave build-deb.sh out: the test failed after a deb-test)
        out = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), test],
                             capture_output=True, text=True, check=True).stdout
        check = out.index(f"build_deps.py --test {test}")
        assert check < out.index("build-deb.sh amd64"), out


def test_deb_test_brings_what_dpkg_i_of_inferd_needs() -> None:
    """make deb-test installs the inferd package with dpkg -i, which installs none of
    its Depends: the list holds every one of them (debian/control's inferd stanza)."""
    control = (ROOT / "packaging" / "debian" / "control").read_text()
    stanza = next(p for p in control.split("\n\n") if p.startswith("Package: inferd\n"))
    depends = re.search(r"^Depends:(.*(?:\n[ \t].*)*)", stanza, re.M)
    assert depends is not None
    wanted = [n for n in build_deps.names(depends.group(1).replace("\n", " "))
              if not n.startswith("${")]
    assert "python3-zmq" in wanted
    assert set(wanted) <= set(build_deps.TEST_PACKAGES["deb-test"][1]), wanted
