#!/usr/bin/env python3
"""`make deb-test-systemd`: the amd64 packages installed in a Debian 12 container with
systemd as PID 1, and the unit proven through systemd itself.

Needs root, systemd-nspawn (systemd-container) and mmdebstrap (the root is built once
and cached, tests/packaging/make_root.sh). Nothing on the host changes: the container's
root is an overlay on a tmpfs (tests/packaging/container.py). Steps, each printed with
what it measured:

1. boot; the distribution's systemd-sysusers and systemd-tmpfiles-setup units ran (or
   why not: the "Failed to set up credentials" question, see docs/install.md);
2. ``apt-get install inferd inferd-backend-...`` (every add-on built but
   onnxruntime-gpu, which replaces the CPU one) from a signed apt repository of the
   built packages (packaging/apt-repo.sh, a throwaway key; the board's inferd.sources
   with Signed-By, as docs/install.md shows): user and group inferd made by the
   package's sysusers.d file, the unit enabled and started;
3. with ocr-cls in /var/lib/inferd/models and preloaded (a conf.d drop-in),
   ``systemctl restart inferd`` returns once READY=1 came: ``active (running)``, the
   status line says the model is warm;
4. ``journalctl -u inferd MODEL=ocr-cls`` finds the load line with its fields;
5. a user in group inferd gets an inference from the installed inferctl; a user outside
   it is refused (client message and the kernel's EACCES); the member's input and output
   travel through a memfd registered over the ``.shm`` socket (SCM_RIGHTS) under the
   unit's sandbox;
6. ``systemctl reload inferd``: systemd's own log shows RELOADING=1, the unit in state
   reload, then READY=1 and running again;
7. the sandbox holds: in the service's mount namespace, as its user, every write outside
   /run/inferd and its private /tmp fails; the running process has NoNewPrivs, a
   seccomp filter and no capabilities; ``systemd-analyze security inferd`` inside equals
   ``--offline=yes`` on the unit file;
8. SIGSTOP of the daemon: the watchdog (WatchdogSec=30s) kills it and systemd restarts
   it within WatchdogSec x 2, measured from systemd's journal;
9. SIGKILL: Restart=on-failure brings it back (measured);
10. ``apt-get purge``: no file of the packages left, the unit gone;

then, in a second container, the upgrade cycle (inferd, the CPU add-on, libinferd0 and
libinferd-dev): installed from the repository at make deb's version; a newer version
built on the spot (build-deb.sh with INFERD_DEB_VERSION) joins the repository and
``apt-get upgrade`` installs it while a libinferd client (tests/packaging/serving_client.c,
built against the libinferd-dev package) keeps four calls in flight: the conffile edit,
the model repository and the user inferd are kept, the daemon restarts once and cleanly
(no failure, NRestarts unchanged, READY), every call is answered (OK, or UNAVAILABLE
around the restart, none lost), results unchanged; ``apt-get install --allow-downgrades``
back to the first version; ``apt-get purge`` and ``apt-get install`` again (a pristine
conffile, the same user); a last purge leaves nothing.

Usage: check_systemd.py BUILD_DIR MODELS_DIR (make deb-test-systemd passes build/deb/amd64
and models).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from container import Container, cached_root  # noqa: E402

# installed by every check; check_systemd installs every other add-on built too
PACKAGES = ("inferd", "inferd-backend-onnxruntime")
UNIT = "inferd.service"
SHARE = "/srv/inferd-test"
MEMBER, OUTSIDER = "inferd-t-member", "inferd-t-outsider"
DROPIN = "/etc/inferd/conf.d/50-deb-test.toml"
WATCHDOG_S = 30.0

figures: dict[str, str] = {}


def step(text: str) -> None:
    print(f"deb-test-systemd: {text}", flush=True)


# ---------------------------------------------------------------- shared with check_arm64


def make_share(build: Path, models: Path, model_names: list[str],
               packages: list[str]) -> Path:
    """A folder bound at /srv/inferd-test: the debs of PACKAGES, the models, the probe."""
    share = Path(tempfile.mkdtemp(prefix="inferd-share-"))
    share.chmod(0o755)
    (share / "debs").mkdir()
    for package in packages:
        debs = sorted(build.glob(f"{package}_*.deb"))
        assert debs, f"no {package}_*.deb in {build}: run make deb"
        shutil.copy2(debs[-1], share / "debs" / debs[-1].name)
    for name in model_names:
        shutil.copytree(models / name, share / "models" / name)
    shutil.copy2(Path(__file__).with_name("probe_results.py"), share / "probe_results.py")
    for path in share.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return share


def install(c: Container, models: list[str], preload: list[str],
            unit_dropin: str = "") -> float:
    """apt-get install the debs in the container (with UNIT_DROPIN as a drop-in of the
    unit, if given); models in place, preloaded; restarted. Returns the seconds
    `systemctl restart` took (it returns after READY=1)."""
    if unit_dropin:
        c.run("mkdir", "-p", f"/etc/systemd/system/{UNIT}.d")
        c.run("tee", f"/etc/systemd/system/{UNIT}.d/50-deb-test.conf", input=unit_dropin)
    debs = sorted(c.run("sh", "-c", f"ls {SHARE}/debs/*.deb").stdout.split())
    out = c.run("apt-get", "install", "-y", "--no-install-recommends", *debs, timeout=900)
    assert "Setting up inferd " in out.stdout, out.stdout
    return serve_models(c, models, preload)


def serve_models(c: Container, models: list[str], preload: list[str]) -> float:
    """MODELS copied into the installed repository, PRELOAD preloaded (a conf.d drop-in),
    the daemon restarted; the seconds `systemctl restart` took (until READY=1)."""
    for name in models:
        c.run("cp", "-r", f"{SHARE}/models/{name}", "/var/lib/inferd/models/")
    c.run("chmod", "-R", "a+rX", "/var/lib/inferd/models")
    toml = "[models]\npreload = [" + ", ".join(f'"{m}"' for m in preload) + "]\n"
    c.run("tee", DROPIN, input=toml)
    started = time.monotonic()
    c.run("systemctl", "restart", UNIT, timeout=900)
    return time.monotonic() - started


def add_users(c: Container) -> None:
    c.run("useradd", "--system", "--no-create-home", "--groups", "inferd", MEMBER)
    c.run("useradd", "--system", "--no-create-home", OUTSIDER)


def main_pid(c: Container) -> int:
    return int(c.show(UNIT, "MainPID")["MainPID"])


def journal_entries(c: Container, *args: str) -> list[dict[str, str]]:
    """Entries as dicts of strings (journalctl's JSON gives a field holding
    non-printable bytes as a list of byte values)."""
    text = c.journal("-o", "json", *args)
    entries = []
    for line in text.splitlines():
        if line.startswith("{"):
            e = json.loads(line)
            entries.append({k: bytes(v).decode(errors="replace") if isinstance(v, list) else
                            str(v) for k, v in e.items()})
    return entries


def exposure(text: str) -> float:
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", text)
    assert m, text
    return float(m.group(1))


# ---------------------------------------------------------------- the checks


def check_boot_units(c: Container) -> None:
    """The "Failed to set up credentials" question: how did the distribution's
    sysusers/tmpfiles units fare at boot?"""
    state = c.show("systemd-sysusers.service", "Result", "ExecMainStatus")
    tmpfiles = c.show("systemd-tmpfiles-setup.service", "Result", "ExecMainStatus")
    failed = c.run("systemctl", "--failed", "--no-legend", "--plain", check=False).stdout
    figures["boot units"] = (f"systemd-sysusers {state['Result']}/{state['ExecMainStatus']}, "
                             f"systemd-tmpfiles-setup {tmpfiles['Result']}/"
                             f"{tmpfiles['ExecMainStatus']}, failed: "
                             f"{failed.split() and failed.strip() or 'none'}")
    step(f"booted in {c.boot_s:.1f} s; {figures['boot units']}")
    if state["Result"] != "success" or tmpfiles["Result"] != "success":
        step("boot units failed (see the journal below); the package does not rely on "
             "them: its postinst runs systemd-sysusers and systemd-tmpfiles itself")
        print(c.journal("-b", "-u", "systemd-sysusers", "-u", "systemd-tmpfiles-setup"))


def check_installed(c: Container) -> None:
    c.run("getent", "passwd", "inferd")
    c.run("getent", "group", "render")
    # the snippets themselves, applied again as boot would: no change, no error
    out = c.run("systemd-sysusers", "/usr/lib/sysusers.d/inferd.conf")
    out2 = c.run("systemd-tmpfiles", "--create", "/usr/lib/tmpfiles.d/inferd.conf")
    assert not (out.stderr + out2.stderr).strip(), out.stderr + out2.stderr
    out = c.run("systemd-analyze", "verify", "--man=no", f"/lib/systemd/system/{UNIT}",
                check=False)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
    enabled = c.run("systemctl", "is-enabled", UNIT, check=False).stdout.strip()
    assert enabled == "enabled", enabled
    step("installed with apt-get: user inferd and group render from sysusers.d, "
         "tmpfiles and sysusers snippets re-apply cleanly, unit verifies and is enabled")


def check_running(c: Container, restart_s: float) -> None:
    props = c.show(UNIT, "ActiveState", "SubState", "StatusText", "Type", "NotifyAccess")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    assert "models warm: 1 (ocr-cls)" in props["StatusText"], props
    assert props["StatusText"].startswith("ready;"), props
    status = c.run("systemctl", "status", "--no-pager", UNIT, check=False).stdout
    assert "Active: active (running)" in status, status
    # systemd logs "Started" only once READY=1 came (Type=notify)
    entries = journal_entries(c, "-u", UNIT)
    ready = [e for e in entries if e.get("MESSAGE", "").startswith("Started ")]
    assert ready, "no 'Started inferd...' from systemd"
    figures["restart to READY with ocr-cls preloaded"] = f"{restart_s:.1f} s"
    step(f"systemctl restart returned after READY=1 in {restart_s:.1f} s: active (running), "
         f"Status: \"{props['StatusText']}\"")


def check_journal(c: Container) -> None:
    entries = journal_entries(c, "-u", UNIT, "MODEL=ocr-cls")
    loads = [e for e in entries if "load" in e.get("MESSAGE", "").lower() and e.get("BACKEND")]
    assert loads, f"journalctl -u inferd MODEL=ocr-cls: no load line with BACKEND: {entries}"
    e = loads[-1]
    fields = {k: e[k] for k in sorted(e) if not k.startswith("_") and k not in
              ("MESSAGE", "CODE_FILE", "CODE_LINE", "CODE_FUNC")}
    step(f"journalctl -u inferd MODEL=ocr-cls: \"{e['MESSAGE']}\" {fields}")


def check_clients(c: Container) -> None:
    sock = "ipc:///run/inferd/inferd.sock"
    out = c.run("inferctl", "--socket", sock, "infer", "ocr-cls", "-i",
                f"x={SHARE}/x.npy", user=MEMBER)
    assert "float32[1, 2]" in out.stdout, out.stdout
    out = c.run("inferctl", "--socket", sock, "ping", user=OUTSIDER, check=False)
    assert out.returncode != 0 and "permission denied" in out.stderr, out.stdout + out.stderr
    raw = c.run("python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
                "s.connect('/run/inferd/inferd.sock')", user=OUTSIDER, check=False)
    assert "PermissionError" in raw.stderr, raw.stderr
    step("member of group inferd: inference served; user outside the group: refused "
         "(client message and kernel EACCES)")


SHM_CLIENT = """
import numpy as np
from inferd.ipc import Client, Region
with Client("ipc:///run/inferd/inferd.sock", timeout=60) as c:
    region = c.register(Region(1 << 20))
    x = region.ndarray((1, 3, 48, 192), np.float32)
    x[...] = 0.5
    by_socket = c.infer("ocr-cls", {"x": np.full((1, 3, 48, 192), 0.5, np.float32)})
    out = c.infer("ocr-cls", {"x": x}, outputs_into=region)
    (name, y), = out.items()
    assert region.locate(y) is not None, "the output is not in the region"
    assert y.tobytes() == by_socket[name].tobytes(), (y, by_socket[name])
    print("shm ok", region.token[:3], list(y.shape))
"""


def check_shm(c: Container) -> None:
    """Shared-memory tensors under the real unit (PrivateTmp=, ProtectProc=invisible):
    the group member's memfd, passed over /run/inferd/inferd.sock.shm, carries an
    ocr-cls input in and its output out, the same bits as by the socket."""
    out = c.run("python3", "-c", SHM_CLIENT, user=MEMBER)
    assert out.stdout.startswith("shm ok r"), out.stdout + out.stderr
    step("member of group inferd: an input and its output through a registered memfd "
         "(SCM_RIGHTS) under the unit's sandbox, same bits as by the socket")


def check_reload(c: Container) -> None:
    c.run("systemd-analyze", "log-level", "debug")
    cursor = c.run("journalctl", "-n", "0", "--show-cursor", "--no-pager",
                   check=False).stdout.strip().rsplit("cursor: ", 1)[-1]
    try:
        c.run("systemctl", "reload", UNIT)
        deadline = time.monotonic() + 120
        want = ["RELOADING=1", "Changed running -> reload", "READY=1",
                "Changed reload -> running"]
        while True:
            text = "\n".join(e.get("MESSAGE", "") for e in journal_entries(
                c, f"--after-cursor={cursor}", "_PID=1") if "inferd" in e.get("MESSAGE", ""))
            at = [text.find(w) for w in want]
            if all(i >= 0 for i in at):
                break
            assert time.monotonic() < deadline, f"systemd did not see {want}:\n{text}"
            time.sleep(0.5)
        reload_lines = [line for line in text.splitlines() if "RELOADING=1" in line]
        assert at[0] < at[2] and at[1] < at[3], f"out of order:\n{text}"
    finally:
        c.run("systemd-analyze", "log-level", "info")
    props = c.show(UNIT, "ActiveState", "SubState")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    step(f"systemctl reload: systemd logged \"{reload_lines[0].strip()}\", running -> "
         "reload, then READY=1 and reload -> running")


SANDBOX_PROBE = r"""
import errno, os, sys
wrote, refused = [], []
for d in ["/", "/etc", "/etc/inferd", "/usr/lib/inferd", "/var/lib/inferd",
          "/var/lib/inferd/models", "/var/tmp", "/var/log", "/root", "/home", "/srv", "/opt",
          "/run", "/dev/shm", "/run/inferd", "/tmp", "/var/lib/inferd/state"]:
    path = os.path.join(d, ".inferd-sandbox-probe")
    try:
        with open(path, "w") as f:
            f.write("x")
        os.unlink(path)
        wrote.append(d)
    except OSError as e:
        refused.append(f"{d}:{errno.errorcode[e.errno]}")
print(" ".join(wrote))
print(" ".join(refused))
"""


def check_sandbox(c: Container, offline: float) -> None:
    pid = main_pid(c)
    status = c.run("cat", f"/proc/{pid}/status").stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["NoNewPrivs"].strip() == "1", fields["NoNewPrivs"]
    assert fields["Seccomp"].strip() == "2", fields["Seccomp"]
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0, status
    uid = c.run("id", "-u", "inferd").stdout.strip()
    assert fields["Uid"].split()[0] == uid, fields["Uid"]
    # a probe in the service's own mount namespace, as its user and groups
    out = c.run("nsenter", "-t", str(pid), "-m", "--", "setpriv", "--reuid=inferd",
                "--regid=inferd", "--init-groups", "--no-new-privs", "/usr/bin/python3",
                "-c", SANDBOX_PROBE)
    wrote, refused = (out.stdout.splitlines() + ["", ""])[:2]
    # /tmp and /var/tmp are the unit's own (PrivateTmp=yes); /dev/shm stays the system's
    # (PrivateDevices= is off for the GPU/NPU nodes) and RemoveIPC=yes empties it on stop
    assert set(wrote.split()) <= {"/run/inferd", "/tmp", "/var/tmp", "/dev/shm",
                                  "/var/lib/inferd/state"}, (wrote, refused)
    assert {"/run/inferd", "/var/lib/inferd/state"} <= set(wrote.split()), \
        (wrote, refused)
    # a file in the unit's /tmp or /var/tmp is not in the system's
    for tmp in ("/tmp", "/var/tmp"):
        c.run("nsenter", "-t", str(pid), "-m", "--", "setpriv", "--reuid=inferd",
              "--regid=inferd", "--init-groups", "touch", f"{tmp}/.inferd-private")
        assert c.run("test", "-e", f"{tmp}/.inferd-private", check=False).returncode != 0
    online = c.run("systemd-analyze", "security", "--no-pager", UNIT, check=False).stdout
    offline_in = c.run("systemd-analyze", "security", "--no-pager", "--offline=yes",
                       f"/lib/systemd/system/{UNIT}", check=False).stdout
    figures["exposure"] = (f"running unit {exposure(online)}, --offline=yes inside "
                           f"{exposure(offline_in)}, offline on the build host {offline}")
    diff = sorted(set(online.splitlines()) ^ set(offline_in.splitlines()))
    assert exposure(online) == exposure(offline_in) == offline, (figures["exposure"], diff)
    step(f"sandbox: writes succeed only in {wrote.split()}; refused: {refused}; NoNewPrivs=1, "
         f"Seccomp=2, CapEff=0; exposure {figures['exposure']}")


def wait_restarted(c: Container, old_pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        props = c.show(UNIT, "MainPID", "ActiveState", "SubState")
        if (int(props["MainPID"]) not in (0, old_pid) and props["ActiveState"] == "active"
                and props["SubState"] == "running"):
            return
        assert time.monotonic() < deadline, f"not restarted within {timeout} s: {props}"
        time.sleep(0.2)


def unit_events(c: Container, cursor: str, *needles: str) -> dict[str, float]:
    """CLOCK_MONOTONIC seconds of the first systemd (PID 1) message about inferd holding
    each needle, after CURSOR."""
    found: dict[str, float] = {}
    for e in journal_entries(c, f"--after-cursor={cursor}", "_PID=1"):
        msg = e.get("MESSAGE", "")
        for needle in needles:
            if needle not in found and needle in msg and "inferd" in msg:
                found[needle] = int(e["__MONOTONIC_TIMESTAMP"]) / 1e6
    return found


def cursor_now(c: Container) -> str:
    out = c.run("journalctl", "-n", "0", "--show-cursor", "--no-pager", check=False).stdout
    return out.strip().rsplit("cursor: ", 1)[-1]


def check_watchdog(c: Container) -> None:
    pid = main_pid(c)
    cursor = cursor_now(c)
    stopped = time.monotonic()  # the same CLOCK_MONOTONIC as the journal's
    c.run("kill", "-STOP", str(pid))
    wait_restarted(c, pid, WATCHDOG_S * 2 + 30)
    ev = unit_events(c, cursor, "Watchdog timeout", "Started ")
    assert "Watchdog timeout" in ev, "systemd logged no watchdog timeout"
    fired, ready = ev["Watchdog timeout"] - stopped, ev["Started "] - stopped
    figures["watchdog"] = (f"SIGSTOP -> watchdog fired {fired:.1f} s, -> READY again "
                           f"{ready:.1f} s (WatchdogSec=30s)")
    assert ready <= WATCHDOG_S * 2, figures["watchdog"]
    step(f"frozen daemon (SIGSTOP): {figures['watchdog']}, within WatchdogSec x 2")


def check_sigkill(c: Container) -> None:
    pid = main_pid(c)
    cursor = cursor_now(c)
    killed = time.monotonic()
    c.run("kill", "-KILL", str(pid))
    wait_restarted(c, pid, 120)
    ev = unit_events(c, cursor, "Main process exited", "Scheduled restart job", "Started ")
    assert "Scheduled restart job" in ev, ev
    restarts = c.show(UNIT, "NRestarts")["NRestarts"]
    figures["SIGKILL"] = (f"SIGKILL -> restart scheduled {ev['Scheduled restart job'] - killed:.1f}"
                          f" s, -> READY again {ev['Started '] - killed:.1f} s (RestartSec=2s), "
                          f"NRestarts={restarts}")
    step(f"Restart=on-failure: {figures['SIGKILL']}")


# replaces inferd-backend-onnxruntime (Conflicts: one `onnxruntime` module per process),
# so it cannot be installed beside it; make deb-test installs it in its place
REPLACES_CPU_ADDON = "inferd-backend-onnxruntime-gpu"


def built_packages(build: Path) -> list[str]:
    """inferd and every add-on built into BUILD (inferd-backend-*_ARCH.deb) that can be
    installed together (not the GPU add-on, which replaces the CPU one)."""
    names = sorted({deb.name.split("_")[0] for deb in build.glob("inferd*.deb")}
                   - {REPLACES_CPU_ADDON})
    assert set(PACKAGES) <= set(names), f"{build} lacks {set(PACKAGES) - set(names)}"
    return names


def check_purge(c: Container, packages: list[str]) -> None:
    files = {p: [f for f in c.run("dpkg-query", "-L", p).stdout.splitlines() if f not in ("", "/.")]
             for p in packages}
    c.run("rm", "-rf", DROPIN, "/var/lib/inferd/models/ocr-cls")
    c.run("apt-get", "purge", "-y", *packages, timeout=600)
    left = []
    for paths in files.values():
        for path in paths:
            exists = c.run("test", "-e", path, check=False).returncode == 0
            if exists and c.run("dpkg-query", "-S", path, check=False).returncode != 0:
                left.append(path)
    for path in ("/etc/inferd", "/var/lib/inferd", "/usr/lib/inferd", "/run/inferd",
                 "/usr/lib/python3/dist-packages/inferd", f"/lib/systemd/system/{UNIT}",
                 f"/etc/systemd/system/multi-user.target.wants/{UNIT}"):
        if c.run("test", "-e", path, check=False).returncode == 0:
            left.append(path)
    assert not left, f"apt-get purge left: {left}"
    load = c.show(UNIT, "LoadState")["LoadState"]
    assert load == "not-found", load
    step(f"apt-get purge {' '.join(packages)}: no file of theirs left, unit not-found "
         "(the system user inferd stays, as Debian keeps system users)")


def offline_exposure(build: Path) -> float:
    tmp = Path(tempfile.mkdtemp(prefix="inferd-unit-"))
    try:
        deb = sorted(build.glob("inferd_*_all.deb"))[-1]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
        out = subprocess.run(["systemd-analyze", "security", "--offline=yes",
                              str(tmp / "lib/systemd/system" / UNIT)],
                             capture_output=True, text=True)
        return exposure(out.stdout + out.stderr)
    finally:
        shutil.rmtree(tmp)


def main(argv: list[str]) -> int:
    from apt_cycle import Repository, build_serving_client, check_upgrade_cycle, install_from_repo

    if os.geteuid() != 0:
        print("deb-test-systemd: needs root (systemd-nspawn)", file=sys.stderr)
        return 2
    build, models = Path(argv[1]).resolve(), Path(argv[2]).resolve()
    started = time.monotonic()
    offline = offline_exposure(build)
    root = cached_root("amd64")
    packages = built_packages(build)
    share = make_share(build, models, ["ocr-cls"], packages)
    np.save(share / "x.npy", np.zeros((1, 3, 48, 192), np.float32))
    (share / "x.npy").chmod(0o644)
    repo = Repository(share)
    try:
        repo.add(build)
        build_serving_client(build, share)
        with Container(root, share) as c:
            try:
                check_boot_units(c)
                restart_s = install_from_repo(c, packages, ["ocr-cls"], ["ocr-cls"])
                check_installed(c)
                check_running(c, restart_s)
                check_journal(c)
                add_users(c)
                check_clients(c)
                check_shm(c)
                check_reload(c)
                check_sandbox(c, offline)
                check_watchdog(c)
                check_sigkill(c)
                check_purge(c, packages)
            except BaseException:
                print("--- journal of inferd ---\n" + c.journal("-u", UNIT, "-n", "80"),
                      file=sys.stderr)
                raise
        check_upgrade_cycle(root, share, repo, build)
    finally:
        repo.close()
        shutil.rmtree(share, ignore_errors=True)
    for key, value in figures.items():
        step(f"FIGURE {key}: {value}")
    step(f"PASS in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    # run as the module `check_systemd`, the one apt_cycle.py and check_arm64.py import,
    # so that there is one `figures` for all of them
    import check_systemd

    sys.exit(check_systemd.main(sys.argv))
