"""The packaging files in the source tree: the hardened unit, the sysusers and tmpfiles
snippets, and the package's dependencies against pyproject.toml. (The built and
installed packages are tested by `make deb-test`, tests/packaging/check_debs.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
UNIT = PACKAGING / "inferd.service"


def settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_exposure_is_at_most_2():
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=20",
                          str(UNIT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    level = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout).group(1))
    assert level <= 2.0


def test_unit_keeps_devices_reachable_and_psutil_working():
    s = settings()
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # systemd 252: no notify-reload
    assert "char-drm rw" in s["DeviceAllow"]
    assert {"/dev/rknpu rw", "/dev/mali0 rw"} <= set(s["DeviceAllow"])
    assert s["SupplementaryGroups"] == ["render video"]
    assert s["RuntimeDirectory"] == ["inferd"] and s["RuntimeDirectoryMode"] == ["0750"]
    # the daemon's state ($STATE_DIRECTORY: converted models, placement decisions); not
    # StateDirectory=inferd, which would hand /var/lib/inferd/models to the daemon's user
    assert s["StateDirectory"] == ["inferd/state"] and s["StateDirectoryMode"] == ["0750"]
    assert s["User"] == ["inferd"] and s["CapabilityBoundingSet"] == [""]
    assert "PrivateDevices" not in s  # would hide /dev/dri, /dev/rknpu
    assert "ProcSubset" not in s  # ProcSubset=pid breaks psutil
    assert s["ProtectSystem"] == ["strict"] and s["NoNewPrivileges"] == ["yes"]


def test_sysusers_and_tmpfiles_agree_with_the_unit():
    users = (PACKAGING / "sysusers.d" / "inferd.conf").read_text()
    assert re.search(r"^u inferd ", users, re.M)
    # every SupplementaryGroups= group must exist or systemd refuses to start the unit
    assert re.search(r"^g render ", users, re.M)  # video comes with base-passwd
    tmpfiles = (PACKAGING / "tmpfiles.d" / "inferd.conf").read_text()
    assert re.search(r"^d /run/inferd 0750 inferd inferd -$", tmpfiles, re.M)


def test_package_depends_on_debian_packages_for_every_pyproject_dependency():
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower() for d in deps}
    debian = {"pyzmq": "python3-zmq", "numpy": "python3-numpy", "onnx": "python3-onnx",
              "psutil": "python3-psutil", "prometheus-client": "python3-prometheus-client"}
    control = (PACKAGING / "debian" / "control").read_text()
    core = control.split("Package: inferd\n", 1)[1].split("\nPackage:", 1)[0]
    assert names - {"onnxruntime"} <= set(debian), f"map the new dependency: {names}"
    for name in names - {"onnxruntime"}:
        assert debian[name] in core, f"{debian[name]} missing from inferd's Depends"
    assert "python3-systemd" in core
    assert "Recommends: inferd-backend-onnxruntime" in core
    # onnxruntime comes from the add-on, never as a Depends guessed by dh_python3
    overrides = (PACKAGING / "debian" / "py3dist-overrides").read_text().split()
    assert overrides == ["onnxruntime"]


def test_packaged_config_differs_from_the_defaults_only_in_the_socket_group():
    rules = (PACKAGING / "debian" / "rules").read_text()
    assert "s/^socket_group = \"\"$$/socket_group = \"inferd\"/" in rules
    assert re.search(r'^socket_group = ""$', (ROOT / "config" / "inferd.toml").read_text(),
                     re.M)


def test_every_program_the_unit_runs_comes_with_a_dependency():
    """ExecReload=/bin/kill is procps, which is not Essential (a minbase Debian 12 root
    has no /bin/kill, and `systemctl reload inferd` failed there)."""
    control = (PACKAGING / "debian" / "control").read_text()
    core = control.split("Package: inferd\n", 1)[1].split("\nPackage:", 1)[0]
    s = settings()
    assert s["ExecReload"][0].startswith("/bin/kill ")
    assert re.search(r"^Depends:.*\bprocps,", core, re.M | re.S)


def test_addons_keep_vendored_library_names():
    rules = (PACKAGING / "debian" / "rules").read_text()
    addon_line = [line for line in rules.splitlines() if "dh_python3 -p inferd-backend-" in line]
    assert addon_line and "--no-ext-rename" in addon_line[0]


def test_unit_lets_the_daemon_hold_its_connections():
    """Issue 18, defect 1: under systemd's soft default of 1024 descriptors libzmq aborts
    the daemon at the 1,0xxth connection."""
    (value,) = settings()["LimitNOFILE"]
    assert int(value) >= 16384
