#!/usr/bin/env python3
"""`make deb-test`: the built Debian packages, installed and run on this machine.

Needs root; changes the system (installs the packages, creates users), and undoes
what it did at the end, also after a failure, so it can be run again. Steps:

1. lintian on the built packages (errors and warnings fail);
2. ``systemd-analyze security --offline=yes --threshold=20`` on the built unit, and its
   exposure <= 2.0;
3. ``dpkg -i`` both packages; ``systemd-analyze verify`` on the installed unit prints
   nothing;
4. the installed daemon runs as the unit would run it (its User, Group,
   SupplementaryGroups, RuntimeDirectory, UMask, NoNewPrivileges, no capabilities, its
   SystemCallFilter= and RestrictAddressFamilies= as a seccomp filter, ExecStart; no
   systemd as PID 1 here; the mount and namespace sandboxing is not emulated),
   with a notify socket bound by this test: EXTEND_TIMEOUT_USEC while preloading,
   READY=1 with STATUS=, WATCHDOG=1 pings;
5. a user in group inferd gets an inference through /run/inferd/inferd.sock with the
   installed inferctl; a bfloat16 tensor is refused UNSUPPORTED naming ml_dtypes (no
   Debian 12 package of it); a user outside the group is refused by the kernel;
6. SIGHUP gives RELOADING=1 then READY=1, and a reloaded [access] allow-list refuses
   the group member with PERMISSION_DENIED;
7. SIGTERM gives STOPPING=1 and exit status 0;
8. ``dpkg --purge`` leaves no file of either package behind (libinferd0 and
   libinferd-dev too: installed, the example they ship built with pkg-config and served
   by the installed daemon, purged);
9. the onnxruntime-gpu add-on (built where PyPI has its wheel): its fields replace
   inferd-backend-onnxruntime, it installs in its place, its GPU plugin's probe gives
   the no-GPU reason and its CPU plugin runs the model on the GPU build; then purged.

The OpenVINO add-on is installed with the others: a model pinned to it is served. So is
the ncnn add-on: a model placed on gpu, its ncnn files converted ahead of time with this
tree's `inferd-convert ncnn` (the board workflow: no pnnx on the device), is served by
ncnn on the Vulkan device, Mesa's lavapipe here (a drop-in allows a software device).

Usage: check_debs.py BUILD_DIR MODELS_DIR (make deb-test passes build/deb and models).
"""

from __future__ import annotations

import grp
import json
import os
import threading
import pwd
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inferd.daemon.logs import decode_journal

PACKAGES = ("inferd", "inferd-backend-onnxruntime", "inferd-backend-rknn",
            "inferd-backend-openvino", "inferd-backend-ncnn")
# replaces inferd-backend-onnxruntime (one `onnxruntime` module per process): checked
# after the others are purged (check_gpu_package); no NVIDIA GPU here to run it on
GPU_PACKAGE = "inferd-backend-onnxruntime-gpu"
UNIT = Path("/lib/systemd/system/inferd.service")
RUN_DIR = Path("/run/inferd")
SOCKET = RUN_DIR / "inferd.sock"
MODELS = Path("/var/lib/inferd/models")
DROPIN = Path("/etc/inferd/conf.d/50-deb-test.toml")
MEMBER, OUTSIDER = "inferd-t-member", "inferd-t-outsider"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

notes: list[str] = []


def step(text: str) -> None:
    print(f"deb-test: {text}", flush=True)


def run(*cmd: str, check: bool = True, user: str | None = None,
        **kw: object) -> subprocess.CompletedProcess[str]:
    if user:
        cmd = ("runuser", "-u", user, "--", *cmd)
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} exited {out.returncode}:\n"
                             f"{out.stdout}{out.stderr}")
    return out


def installed(package: str) -> bool:
    out = run("dpkg-query", "-W", "-f=${db:Status-Abbrev}", package, check=False)
    return out.returncode == 0 and out.stdout.startswith("ii")


def user_exists(name: str) -> bool:
    return name in {p.pw_name for p in pwd.getpwall()}


def group_exists(name: str) -> bool:
    return name in {g.gr_name for g in grp.getgrall()}


# ---------------------------------------------------------------- notify socket


class NotifySocket:
    """Stands in for systemd's notify socket; writable by the daemon's user.

    A thread drains it all the time, as systemd does: with nobody reading, the daemon's
    watchdog pings (one a second here) fill the datagram queue (net.unix.max_dgram_qlen,
    10 by default) within seconds, and its next sd_notify() blocks."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "notify"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        os.chmod(self.path, 0o666)
        self.sock.settimeout(0.5)
        self.seen: list[dict[str, str]] = []
        self.sender: subprocess.Popen[bytes] | None = None  # fail fast when it exits
        self._messages: queue.SimpleQueue[dict[str, str]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._drain, name="deb-test-notify",
                                        daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(65536).decode()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self._messages.put(dict(line.split("=", 1) for line in data.splitlines()
                                    if "=" in line))

    def wait_for(self, key: str, timeout: float = 120.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self._messages.get(timeout=0.5)
            except queue.Empty:
                if self.sender is not None and self.sender.poll() is not None:
                    raise AssertionError(f"inferd exited with {self.sender.returncode} "
                                         f"while the test waited for {key}=") from None
                continue
            self.seen.append(msg)
            if key in msg:
                return msg
        raise AssertionError(f"no {key}= from the daemon within {timeout} s; got {self.seen}")

    def close(self) -> None:
        self._closed.set()
        self._reader.join(timeout=5)
        self.sock.close()


class FakeJournald:
    """Binds journald's socket (this machine runs no journald) and keeps each entry
    sent to it, so the installed daemon's journal path (systemd-python's sendv) is
    checked end to end."""

    PATH = Path("/run/systemd/journal/socket")

    def __init__(self) -> None:
        self.made_dirs = [d for d in (self.PATH.parent.parent, self.PATH.parent)
                          if not d.exists()]
        self.PATH.parent.mkdir(parents=True, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.PATH))
        os.chmod(self.PATH, 0o666)
        self.sock.settimeout(0.2)
        self.entries: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    @classmethod
    def available(cls) -> bool:
        return not cls.PATH.exists()

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            self.entries.append(decode_journal(data))

    def text(self) -> str:
        return "\n".join(e.get("MESSAGE", "") for e in list(self.entries))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.PATH.unlink(missing_ok=True)
        for d in reversed(self.made_dirs):
            d.rmdir()


# ---------------------------------------------------------------- the unit, emulated

SECCOMP_EXEC = """\
# Loads the unit's SystemCallFilter= (allowed minus denied system calls, the rest
# failing with EPERM) and RestrictAddressFamilies= (socket() of another family fails
# with EAFNOSUPPORT) as systemd would, then execs the daemon.
import errno, json, os, socket, sys
import seccomp
allowed = json.loads(os.environ.pop("INFERD_TEST_SYSCALLS"))
families = json.loads(os.environ.pop("INFERD_TEST_FAMILIES"))
f = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
for name in allowed:
    if name == "socket" and families:
        continue
    try:
        f.add_rule(seccomp.ALLOW, name)
    except (RuntimeError, ValueError):
        pass  # not a system call of this architecture
if families:
    numbers = [int(getattr(socket, name)) for name in families]
    for n in numbers:
        f.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.EQ, n))
    if len(numbers) == 1:
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket",
                   seccomp.Arg(0, seccomp.NE, numbers[0]))
f.load()
os.execv(sys.argv[1], sys.argv[1:])
"""


def syscall_set(spec: str, _seen: set[str] | None = None) -> set[str]:
    """System call names of a systemd filter group, nested groups expanded."""
    seen = _seen if _seen is not None else set()
    if spec in seen:
        return set()
    seen.add(spec)
    out = run("systemd-analyze", "syscall-filter", spec).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        names |= syscall_set(item, seen) if item.startswith("@") else {item}
    return names


def unit_syscalls(unit: dict[str, list[str]]) -> list[str]:
    """The allow-list that the unit's SystemCallFilter= lines make."""
    allowed: set[str] = set()
    for value in unit["SystemCallFilter"]:
        deny = value.startswith("~")
        for spec in value.lstrip("~").split():
            names = syscall_set(spec) if spec.startswith("@") else {spec}
            allowed = allowed - names if deny else allowed | names
    return sorted(allowed)


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


class InstalledDaemon:
    """/usr/bin/inferd started the way inferd.service starts it, minus systemd."""

    def __init__(self, unit: dict[str, list[str]], notify: NotifySocket, log: Path,
                 journal: FakeJournald | None) -> None:
        user, group = unit["User"][-1], unit["Group"][-1]
        groups = [group] + [g for g in " ".join(unit["SupplementaryGroups"]).split()
                            if group_exists(g)]
        missing = set(" ".join(unit["SupplementaryGroups"]).split()) - set(groups)
        if missing:  # systemd would refuse to start; on a real device udev makes them
            notes.append(f"supplementary groups {sorted(missing)} do not exist here")
        mode = int(unit["RuntimeDirectoryMode"][-1], 8)
        umask = int(unit["UMask"][-1], 8)
        # RuntimeDirectory=: made by systemd before ExecStart, owned by User/Group
        assert unit["RuntimeDirectory"] == ["inferd"], unit["RuntimeDirectory"]
        RUN_DIR.mkdir(exist_ok=True)
        os.chown(RUN_DIR, pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid)
        os.chmod(RUN_DIR, mode)
        exec_start = shlex.split(unit["ExecStart"][-1])
        # NoNewPrivileges=, an empty capability set, then SystemCallFilter= via seccomp
        launcher = log.parent / "seccomp_exec.py"
        launcher.write_text(SECCOMP_EXEC)
        os.chmod(launcher, 0o644)
        self.prefix = ["setpriv", f"--reuid={user}", f"--regid={group}",
                       f"--groups={','.join(groups)}", "--inh-caps=-all",
                       "--bounding-set=-all", "--no-new-privs", "--", "/usr/bin/python3",
                       str(launcher)]
        env = {**ENV, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000",
               "INVOCATION_ID": "deb-test",
               "INFERD_TEST_SYSCALLS": json.dumps(unit_syscalls(unit)),
               "INFERD_TEST_FAMILIES": json.dumps(
                   " ".join(unit.get("RestrictAddressFamilies", [])).split())}
        self.env = dict(env)
        self.check_sandbox()
        self.log_path = log
        self._log = open(log, "wb")
        self.journal = journal
        if journal is not None:  # stderr "is" the journal, as under StandardError=journal
            st = os.fstat(self._log.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        self.proc = subprocess.Popen([*self.prefix, *exec_start], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd="/",
                                     preexec_fn=lambda: os.umask(umask))

    def check_sandbox(self) -> None:
        """The emulation bites: what the unit forbids fails the same way here."""
        code = ("import errno, os, socket\n"
                "try:\n socket.socket(socket.AF_INET)\nexcept OSError as e:\n"
                " assert e.errno == errno.EAFNOSUPPORT, e\nelse:\n raise SystemExit('AF_INET')\n"
                "socket.socket(socket.AF_UNIX).close()\n"
                "try:\n os.chown('/run/inferd', -1, os.getgid())\nexcept OSError as e:\n"
                " assert e.errno == errno.EPERM, e\nelse:\n raise SystemExit('chown')\n")
        out = subprocess.run([*self.prefix, "/usr/bin/python3", "-c", code],
                             capture_output=True, text=True, env=self.env)
        assert out.returncode == 0, f"sandbox emulation is not in force: {out.stderr}"
        step("sandbox emulated: as user inferd, AF_INET sockets and chown are refused")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text + (self.journal.text() if self.journal is not None else "")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ---------------------------------------------------------------- checks


def check_lintian(build: Path) -> None:
    changes = sorted(build.glob("inferd_*.changes"))
    assert changes, f"no .changes file in {build}: run make deb"
    out = run("lintian", "--fail-on", "error,warning", str(changes[-1]), check=False)
    assert out.returncode == 0, f"lintian:\n{out.stdout}{out.stderr}"
    step(f"lintian clean: {changes[-1].name}")


def check_unit_security(build: Path, tmp: Path) -> None:
    deb = sorted(build.glob("inferd_*_all.deb"))[-1]
    run("dpkg-deb", "-x", str(deb), str(tmp / "x"))
    unit = tmp / "x" / UNIT.relative_to("/")
    out = run("systemd-analyze", "security", "--offline=yes", "--threshold=20", str(unit),
              check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"unit exposure over the threshold:\n{text}"
    level = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", text).group(1))
    assert level <= 2.0, f"exposure {level} > 2.0"
    step(f"unit exposure {level} (<= 2.0)")


def check_installed_files() -> None:
    out = run("systemd-analyze", "verify", "--man=no", str(UNIT), check=False)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), \
        f"systemd-analyze verify:\n{out.stdout}{out.stderr}"
    conffiles = run("dpkg-query", "-W", "-f=${Conffiles}", "inferd").stdout
    assert "/etc/inferd/inferd.toml" in conffiles, conffiles
    assert 'socket_group = "inferd"' in Path("/etc/inferd/inferd.toml").read_text()
    for path in ("/usr/bin/inferd", "/usr/bin/inferctl", "/etc/inferd/conf.d",
                 "/usr/lib/inferd/backends/onnxruntime/__init__.py", str(MODELS),
                 "/usr/lib/inferd/backends/openvino/__init__.py",
                 "/usr/lib/inferd/backends/ncnn/__init__.py", "/var/lib/inferd/state",
                 "/usr/share/man/man8/inferd.8.gz", "/usr/share/man/man1/inferctl.1.gz",
                 "/usr/share/man/man5/inferd.toml.5.gz", "/usr/lib/sysusers.d/inferd.conf"):
        assert Path(path).exists(), f"{path} missing after dpkg -i"
    assert user_exists("inferd") and group_exists("inferd"), "sysusers made no inferd user"
    assert group_exists("render"), "sysusers made no render group"
    step("installed: unit verifies cleanly, conffile, user inferd, files in place")


def check_plugin_directly(model: Path) -> None:
    """The add-on's plugin, imported as the loader would, runs the model as inferd."""
    code = ("import importlib.util, numpy as np; "
            "spec = importlib.util.spec_from_file_location('ortplugin', "
            "'/usr/lib/inferd/backends/onnxruntime/__init__.py', submodule_search_locations="
            "['/usr/lib/inferd/backends/onnxruntime']); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "from pathlib import Path; from inferd.libbackends.contract import LoadOptions; "
            "b = m.create_backend(); p = b.probe(); assert p.available, p.reason; "
            f"lm = b.load(Path({str(model)!r}), LoadOptions(1, 1)); "
            "out = lm.run({'x': np.zeros((1, 3, 48, 192), np.float32)}); "
            "print(b.id, b.version, {k: v.shape for k, v in out.items()})")
    out = run("/usr/bin/python3", "-c", code, user="inferd")
    step(f"plugin create_backend() as user inferd: {out.stdout.strip()}")


def main() -> int:
    if os.geteuid() != 0:
        print("deb-test: needs root (it installs packages and creates users)", file=sys.stderr)
        return 2
    build, models = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    debs = [sorted(build.glob(f"{p}_*.deb"))[-1] for p in PACKAGES]
    demo = models / "ocr-cls" / "1" / "model.onnx"
    assert demo.exists(), f"{demo} missing: run make setup"
    tmp = Path(tempfile.mkdtemp(prefix="inferd-deb-test-"))
    os.chmod(tmp, 0o755)
    inferd_user_existed = user_exists("inferd")
    render_existed = group_exists("render")
    made_users: list[str] = []
    daemon: InstalledDaemon | None = None
    notify: NotifySocket | None = None
    journal: FakeJournald | None = None
    purged = False
    try:
        cleanup_leftovers()
        check_lintian(build)
        check_unit_security(build, tmp)

        run("dpkg", "-i", *map(str, debs))
        check_installed_files()
        file_lists = {p: [f for f in run("dpkg-query", "-L", p).stdout.splitlines()
                             if f not in ("", "/.")] for p in PACKAGES}

        (MODELS / "ocr-cls" / "1").mkdir(parents=True)
        shutil.copyfile(demo, MODELS / "ocr-cls" / "1" / "model.onnx")
        # the same model pinned to the OpenVINO add-on
        (MODELS / "ocr-cls-ov" / "1").mkdir(parents=True)
        shutil.copyfile(demo, MODELS / "ocr-cls-ov" / "1" / "model.onnx")
        (MODELS / "ocr-cls-ov" / "model.toml").write_text('backends = ["openvino"]\n')
        # and to the ncnn add-on's Vulkan device, converted ahead of time
        convert_for_ncnn(demo, MODELS / "ocr-cls-vk")
        DROPIN.write_text('[models]\npreload = ["ocr-cls"]\n'
                          '[logging]\nmodules = { "inferd.ipc.server" = "debug" }\n'
                          '[ncnn]\nallow_software_vulkan = true\n')
        for name, groups in ((MEMBER, ["inferd"]), (OUTSIDER, [])):
            run("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                *(["--groups", ",".join(groups)] if groups else []), name)
            made_users.append(name)

        notify = NotifySocket(tmp)
        if FakeJournald.available():
            journal = FakeJournald()
        else:
            notes.append(f"{FakeJournald.PATH} exists: the journal path was not checked")
        daemon = InstalledDaemon(unit_settings(UNIT), notify, tmp / "inferd.log", journal)
        notify.sender = daemon.proc
        extend = notify.wait_for("EXTEND_TIMEOUT_USEC")
        assert extend.get("STATUS") == "preloading model ocr-cls (1/1)", extend
        ready = notify.wait_for("READY")
        status = ready.get("STATUS", "")
        # the add-ons' plugins replace the built-ins (no onnxruntime or openvino in
        # Debian's python); the rknn add-on is there, unavailable without an NPU
        # (check_rknn_unavailable)
        assert status == ("ready; backends: 3 loaded (ncnn, onnxruntime, openvino), 1 "
                          "failed (rknn); models warm: 1 (ocr-cls)"), ready
        step(f"READY=1, STATUS={status}")
        for _ in range(2):
            notify.wait_for("WATCHDOG", timeout=30)
        step("watchdog pings arrive (WATCHDOG_USEC=2000000)")

        st = SOCKET.stat()
        assert oct(st.st_mode & 0o777) == "0o660", oct(st.st_mode)
        assert st.st_gid == grp.getgrnam("inferd").gr_gid
        assert oct(RUN_DIR.stat().st_mode & 0o777) == "0o750"
        check_clients(daemon, tmp, status)
        check_rknn_unavailable()
        check_openvino(tmp)
        check_ncnn(tmp)
        check_libinferd_dev(build, tmp)
        if journal is not None:
            check_journal(journal)

        daemon.signal(signal.SIGHUP)
        notify.seen.clear()
        reloading = notify.wait_for("RELOADING")
        assert int(reloading["MONOTONIC_USEC"]) > 0, reloading
        notify.wait_for("READY")
        step("SIGHUP: RELOADING=1 with MONOTONIC_USEC, then READY=1")
        check_allow_list(daemon, notify)

        daemon.signal(signal.SIGTERM)
        notify.wait_for("STOPPING")
        code = daemon.stop()
        assert code == 0, f"inferd exited {code}:\n{daemon.log()}"
        daemon = None
        shutil.rmtree(RUN_DIR, ignore_errors=True)  # RuntimeDirectory= goes on stop
        step("SIGTERM: STOPPING=1, exit status 0")

        DROPIN.unlink()
        shutil.rmtree(MODELS / "ocr-cls")
        shutil.rmtree(MODELS / "ocr-cls-ov")
        shutil.rmtree(MODELS / "ocr-cls-vk")
        run("dpkg", "--purge", *reversed(PACKAGES))
        purged = True
        check_purged(file_lists)
        check_gpu_package(build, demo)
    except BaseException:
        if daemon is not None:
            print(f"--- installed daemon's log ---\n{daemon.log()}", file=sys.stderr)
        raise
    finally:
        if daemon is not None:
            daemon.stop()
        if notify is not None:
            notify.close()
        if journal is not None:
            journal.close()
        for name in made_users:
            run("userdel", name, check=False)
        if not purged:
            cleanup_leftovers()
        if not inferd_user_existed:  # Debian keeps system users on purge; we made it
            run("userdel", "inferd", check=False)
            run("groupdel", "inferd", check=False)
        if not render_existed and group_exists("render"):  # made by our sysusers file
            run("groupdel", "render", check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    for note in notes:
        step(f"NOTE: {note}")
    step("PASS")
    return 0


def check_clients(daemon: InstalledDaemon, tmp: Path, status: str) -> None:
    import numpy as np  # the test driver's own numpy, only to write the input file

    x = tmp / "x.npy"
    np.save(x, np.zeros((1, 3, 48, 192), np.float32))
    os.chmod(x, 0o644)
    sock = f"ipc://{SOCKET}"
    backends = run("inferctl", "--socket", sock, "--json", "backends", user=MEMBER).stdout
    plugin_loaded = "/usr/lib/inferd/backends" in backends and "models warm: 1" in status
    infer = run("inferctl", "--socket", sock, "infer", "ocr-cls", "-i", f"x={x}",
                user=MEMBER, check=False)
    if plugin_loaded:
        assert infer.returncode == 0, f"inference failed:\n{infer.stdout}{infer.stderr}"
        assert "float32[1, 2]" in infer.stdout, infer.stdout
        step(f"member of group inferd: inference via {SOCKET}: {infer.stdout.split()[0:2]}")
    else:
        # Without the plugin loader (issue 3) the daemon cannot see the add-on: the
        # request still travels the installed socket and gets a coded reply.
        assert "UNAVAILABLE" in infer.stderr and "no backend can run it" in infer.stderr, \
            infer.stdout + infer.stderr
        check_plugin_directly(MODELS / "ocr-cls" / "1" / "model.onnx")
        notes.append("the installed daemon has no backend plugin loader yet (issue 3): "
                     "the group member's inference got UNAVAILABLE through the socket, and "
                     "the add-on plugin was checked by calling create_backend() directly")
    check_ml_dtypes_refused(sock)
    uid = pwd.getpwnam(MEMBER).pw_uid
    deadline = time.monotonic() + 30
    while f"new client: uid {uid} " not in daemon.log():
        assert time.monotonic() < deadline, f"client uid {uid} not logged:\n{daemon.log()}"
        time.sleep(0.1)
    out = run("inferctl", "--socket", sock, "ping", user=OUTSIDER, check=False)
    assert out.returncode != 0 and "permission denied" in out.stderr, out.stdout + out.stderr
    # not only the client's own check: the kernel refuses the connection
    raw = run("python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
              f"s.connect({str(SOCKET)!r})", user=OUTSIDER, check=False)
    assert "PermissionError" in raw.stderr, raw.stderr
    step("user outside group inferd: refused (client message and kernel EACCES)")


LIB_PACKAGES = ("libinferd0", "libinferd-dev")


def check_libinferd_dev(build: Path, tmp: Path) -> None:
    """libinferd0 and libinferd-dev installed: the example they ship builds with
    `pkg-config --cflags --libs inferd` alone and is served by the installed daemon;
    then both purged, nothing of theirs left (issue 23)."""
    debs = [str(sorted(build.glob(f"{p}_*.deb"))[-1]) for p in LIB_PACKAGES]
    run("dpkg", "-i", *debs)
    files = [f for p in LIB_PACKAGES for f in run("dpkg-query", "-L", p).stdout.splitlines()
             if f not in ("", "/.")]
    try:
        flags = run("pkg-config", "--cflags", "--libs", "inferd").stdout.split()
        assert flags == ["-linferd"], flags  # /usr/include and the multiarch libdir
        example = tmp / "c-client"
        shutil.copytree("/usr/share/doc/libinferd-dev/examples", example)
        os.chmod(example, 0o755)
        run("make", "-C", str(example))
        out = run(str(example / "build" / "inferd_client"), f"ipc://{SOCKET}", user=MEMBER)
        assert "scores:" in out.stdout and out.stdout.count("reply ") == 4, out.stdout
    finally:
        run("dpkg", "--purge", *reversed(LIB_PACKAGES))
    left = [f for f in files if os.path.lexists(f) and
            run("dpkg-query", "-S", f, check=False).returncode != 0]
    assert not left, f"dpkg --purge libinferd0 libinferd-dev left {left}"
    step(f"libinferd-dev: its example built with pkg-config ({' '.join(flags)}) and served "
         f"by the installed daemon ({out.stdout.split('scores:')[1].split(chr(10))[0].strip()}); "
         "purged clean")


def check_ml_dtypes_refused(sock: str) -> None:
    """Debian 12 has no python3-ml-dtypes: the installed daemon refuses a bfloat16
    tensor with UNSUPPORTED naming the package (issue 19), and so does the installed
    client before sending one."""
    header = ('{"id":"bf","op":"infer","model":"ocr-cls","inputs":'
              '[{"name":"x","dtype":"bfloat16","shape":[2]}]}')
    code = ("import zmq\n"
            "from inferd.ipc.protocol import decode_reply\n"
            "s = zmq.Context().socket(zmq.DEALER)\n"
            "s.setsockopt(zmq.RCVTIMEO, 30000)\n"
            f"s.connect({sock!r})\n"
            f"s.send_multipart([b'INFERD/1', {header!r}.encode(), bytes(4)])\n"
            "r = decode_reply(s.recv_multipart())\n"
            "print(r.error.code, r.error.message)\n")
    out = run("python3", "-c", code, user=MEMBER).stdout
    assert out.startswith("UNSUPPORTED") and "needs the Python package ml_dtypes" in out, out
    client = run("python3", "-c", "import numpy as np\n"
                 "from inferd.ipc.protocol import Op, Request, decode_request, encode_request\n"
                 "from inferd.ipc.errors import ProtocolError\n"
                 "f = encode_request(Request('r', Op.PING))\n"
                 f"h = {header!r}.encode()\n"
                 "try:\n"
                 "    decode_request([b'INFERD/1', h, bytes(4)])\n"
                 "except ProtocolError as e:\n"
                 "    print(e.code, e.message)\n", user=MEMBER).stdout
    assert client.startswith("UNSUPPORTED") and "ml_dtypes" in client, client
    step(f"bfloat16 without python3-ml-dtypes: refused, {out.split(':')[0].strip()}")


def check_openvino(tmp: Path) -> None:
    """A model pinned to the OpenVINO add-on runs through the installed daemon."""
    sock = f"ipc://{SOCKET}"
    x = tmp / "x.npy"
    infer = run("inferctl", "--socket", sock, "infer", "ocr-cls-ov", "-i", f"x={x}",
                user=MEMBER)
    assert "float32[1, 2]" in infer.stdout, infer.stdout
    models = run("inferctl", "--socket", sock, "models", user=MEMBER).stdout
    assert any(line.split()[:5] == ["ocr-cls-ov", "ready", "1", "openvino", "CPU"]
               for line in models.splitlines()), models
    step("a model pinned to openvino runs through the installed daemon (device CPU)")


def convert_for_ncnn(demo: Path, folder: Path) -> None:
    """``folder``/1 with ``demo`` and its ncnn files, written by this tree's
    ``inferd-convert ncnn`` (pnnx is in the developer's venv, not on the device)."""
    (folder / "1").mkdir(parents=True)
    shutil.copyfile(demo, folder / "1" / "model.onnx")
    out = subprocess.run([sys.executable, "-m", "inferd.libbackends.rknn_convert", "ncnn",
                          str(folder / "1"), "--input-shape", "x=1,3,48,192"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"inferd-convert ncnn failed:\n{out.stdout}{out.stderr}"
    for path in folder.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    (folder / "model.toml").write_text('backends = ["gpu"]\n')


def check_ncnn(tmp: Path) -> None:
    """A model placed on gpu is served by the ncnn add-on on lavapipe (Vulkan)."""
    sock = f"ipc://{SOCKET}"
    x = tmp / "x.npy"
    # lavapipe compiles the model's shaders at its first run (6 s on a quiet machine; the
    # daemon's user has no Mesa shader cache), far longer on a busy one
    infer = run("inferctl", "--socket", sock, "--timeout", "300", "infer", "ocr-cls-vk",
                "-i", f"x={x}", user=MEMBER)
    assert "float32[1, 2]" in infer.stdout, infer.stdout
    models = json.loads(run("inferctl", "--socket", sock, "--json", "models", "-v",
                            user=MEMBER).stdout)
    vk = next(m for m in models if m["name"] == "ocr-cls-vk")
    assert (vk["backend"], vk["device_kind"]) == ("ncnn", "gpu"), vk
    assert vk["device"].startswith("vulkan:0 ") and "software" in vk["device"], vk
    step(f"a model placed on gpu runs on the ncnn add-on, device {vk['device']}")


def check_gpu_package(build: Path, model: Path) -> None:
    """The GPU add-on replaces the CPU one (one ``onnxruntime`` module per process):
    installed in its place, its GPU plugin's probe gives the no-GPU reason, its CPU
    plugin runs the model on the GPU build's CPU provider; then purged clean."""
    debs = sorted(build.glob(f"{GPU_PACKAGE}_*.deb"))
    if not debs:
        notes.append(f"{GPU_PACKAGE} not built for this architecture (see make deb's "
                     "stage_backends lines)")
        return
    deb = debs[-1]
    fields = {f: run("dpkg-deb", "-f", str(deb), f).stdout.strip()
              for f in ("Provides", "Conflicts", "Replaces")}
    assert all(v == "inferd-backend-onnxruntime" for v in fields.values()), fields
    inferd_deb = sorted(build.glob("inferd_*.deb"))[-1]
    run("dpkg", "-i", str(inferd_deb), str(deb))
    try:
        lists = {GPU_PACKAGE: [f for f in run("dpkg-query", "-L", GPU_PACKAGE).stdout
                               .splitlines() if f not in ("", "/.")]}
        base = "/usr/lib/inferd/backends/"
        for path in ("onnxruntime/__init__.py", "onnxruntime_gpu/__init__.py",
                     "onnxruntime/vendor/onnxruntime/capi/libonnxruntime_providers_cuda.so",
                     "onnxruntime/vendor/onnxruntime/capi/"
                     "libonnxruntime_providers_shared.so"):
            assert base + path in lists[GPU_PACKAGE], f"{path} not in {deb.name}"
        code = ("import importlib.util, numpy as np\n"
                "from pathlib import Path\n"
                "from inferd.libbackends.contract import LoadOptions\n"
                "def plugin(name):\n"
                f"    d = {base!r} + name\n"
                "    spec = importlib.util.spec_from_file_location(name, d + '/__init__.py',"
                " submodule_search_locations=[d])\n"
                "    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
                "    return m.create_backend()\n"
                "gpu = plugin('onnxruntime_gpu'); p = gpu.probe()\n"
                "assert not p.available and p.reason, p\n"
                "print('gpu:', gpu.id, gpu.version, p.reason)\n"
                "cpu = plugin('onnxruntime'); p = cpu.probe(); assert p.available, p.reason\n"
                f"lm = cpu.load(Path({str(model)!r}), LoadOptions(1, 1))\n"
                "out = lm.run({'x': np.zeros((1, 3, 48, 192), np.float32)})\n"
                "print('cpu:', cpu.id, cpu.version, {k: v.shape for k, v in out.items()})\n")
        out = run("/usr/bin/python3", "-c", code, user="inferd").stdout.strip()
        step(f"{deb.name}: replaces inferd-backend-onnxruntime, installed; {out}")
    finally:
        run("dpkg", "--purge", GPU_PACKAGE, "inferd")
    check_purged(lists)


def check_rknn_unavailable() -> None:
    """The rknn add-on cannot run here (no NPU): its probe, run in a real backend host
    process under the unit's sandbox, says why, and the daemon serves on."""
    out = run("inferctl", "--socket", f"ipc://{SOCKET}", "--json", "backends",
              user=MEMBER).stdout
    [rknn] = [b for b in json.loads(out)["backends"] if b["id"] == "rknn"]
    assert rknn["status"] == "unavailable", rknn
    machine = os.uname().machine
    expected = ("/usr/lib/librknnrt.so not found" if machine == "aarch64"
                else f"runs on aarch64 boards only, not {machine}")
    assert expected in rknn["reason"], rknn
    step(f"rknn add-on: unavailable, reason: {rknn['reason']}")


def check_journal(journal: FakeJournald) -> None:
    entries = list(journal.entries)
    assert entries, "nothing reached the journal although JOURNAL_STREAM matched stderr"
    bad = {k for e in entries for k in e if not re.fullmatch(r"[A-Z0-9_]+", k)}
    assert not bad, f"field names journald would reject: {bad}"
    loaded = [e for e in entries if e.get("MODEL") == "ocr-cls" and e.get("BACKEND")]
    assert loaded, f"no entry with MODEL=ocr-cls and BACKEND: {entries}"
    assert any(e.get("PRIORITY") == "7" and e.get("MESSAGE", "").startswith("new client")
               for e in entries), "the debug entry for the new client is missing"
    assert all(e.get("SYSLOG_IDENTIFIER") == "inferd" for e in entries)
    step(f"journal: {len(entries)} entries via systemd-python, e.g. MODEL=ocr-cls "
         f"BACKEND={loaded[0]['BACKEND']} PRIORITY={loaded[0]['PRIORITY']}")


def check_allow_list(daemon: InstalledDaemon, notify: NotifySocket) -> None:
    DROPIN.write_text(DROPIN.read_text() + "[access]\nuids = [0]\n")
    daemon.signal(signal.SIGHUP)
    notify.wait_for("RELOADING")
    notify.wait_for("READY")
    out = run("inferctl", "--socket", f"ipc://{SOCKET}", "ping", user=MEMBER, check=False)
    assert out.returncode == 1 and "PERMISSION_DENIED" in out.stderr, out.stdout + out.stderr
    out = run("inferctl", "--socket", f"ipc://{SOCKET}", "ping")
    assert "pong" in out.stdout
    step("reloaded [access] uids = [0]: group member gets PERMISSION_DENIED, root served")


def check_purged(file_lists: dict[str, list[str]]) -> None:
    left = []
    for package, paths in file_lists.items():
        for path in paths:
            if not os.path.lexists(path):
                continue
            owner = run("dpkg-query", "-S", path, check=False)
            if owner.returncode != 0:  # a shared directory stays only for other packages
                left.append(path)
    for path in ("/etc/inferd", "/var/lib/inferd", "/usr/lib/inferd",
                 "/usr/lib/python3/dist-packages/inferd"):
        if os.path.lexists(path):
            left.append(path)
    assert not left, f"dpkg --purge left files behind: {left}"
    step("dpkg --purge: nothing of either package is left")


def cleanup_leftovers() -> None:
    """Remove what an interrupted earlier run may have left."""
    for name in (MEMBER, OUTSIDER):
        if user_exists(name):
            run("userdel", name, check=False)
    if DROPIN.exists():
        DROPIN.unlink()
    shutil.rmtree(MODELS / "ocr-cls", ignore_errors=True)
    shutil.rmtree(MODELS / "ocr-cls-ov", ignore_errors=True)
    shutil.rmtree(MODELS / "ocr-cls-vk", ignore_errors=True)
    if any(installed(p) for p in (*PACKAGES, GPU_PACKAGE)) or Path("/etc/inferd").exists():
        run("dpkg", "--purge", GPU_PACKAGE, *reversed(PACKAGES), check=False)
    shutil.rmtree(RUN_DIR, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
