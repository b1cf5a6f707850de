"""A Debian 12 container with systemd as PID 1, for the packaging checks
(tests/packaging/check_systemd.py, check_arm64.py).

The root comes from tests/packaging/make_root.sh (cached under /var/cache/inferd-ci/)
and is booted with ``systemd-nspawn --volatile=overlay --boot``: the cached root is the
read-only lower layer of an overlay whose upper layer is a tmpfs, so nothing a test
does (installing packages, adding users) reaches the cache. ``--register=no
--keep-unit`` because the host need not run systemd (CI machines and this one run
without it as PID 1). Commands run inside with ``nsenter`` into all of the container's
namespaces, with a clean environment.

An arm64 root runs under qemu-user through binfmt_misc (tests/packaging/binfmt.sh);
for it ``fake_cpu_sysfs=True`` mounts a tmpfs holding only ``possible`` and ``present``
over /sys/devices/system/cpu, since onnxruntime's CPU detection segfaults under qemu
when it reads the host's x86 cache topology there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "TERM": "dumb"}


def say(text: str) -> None:
    print(f"container: {text}", flush=True)


def cached_root(arch: str) -> Path:
    """The cached root for ARCH (built on first use; minutes)."""
    if arch != "amd64":
        subprocess.run([str(HERE / "binfmt.sh")], check=True)
    out = subprocess.run([str(HERE / "make_root.sh"), arch], check=True,
                         stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class Container:
    """One booted container; ``with Container(...) as c: c.run("systemctl", ...)``."""

    def __init__(self, root: Path, share: Path, *, fake_cpu_sysfs: bool = False,
                 boot_timeout: float = 120.0) -> None:
        self.root = root
        self.share = share  # bound read-write at /srv/inferd-test
        self.fake_cpu_sysfs = fake_cpu_sysfs
        self.boot_timeout = boot_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.boot_s = 0.0
        self._tmp = Path(tempfile.mkdtemp(prefix="inferd-nspawn-"))
        self.console = self._tmp / "console.log"

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> Container:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cmd = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit",
               "--console=pipe", "--volatile=overlay", "-D", str(self.root),
               f"--bind={self.share}:/srv/inferd-test", "--boot"]
        if self.fake_cpu_sysfs:
            cpu = self._tmp / "cpu"
            cpu.mkdir()
            n = min(os.cpu_count() or 1, 8)
            for name in ("possible", "present", "online"):
                (cpu / name).write_text(f"0-{n - 1}\n" if n > 1 else "0\n")
            cmd.insert(-1, f"--bind-ro={cpu}:/sys/devices/system/cpu")
        started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=open(self.console, "wb"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = started + self.boot_timeout
        while not self.leader:
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}:\n"
                                     f"{self.console.read_text(errors='replace')}")
            self.leader = self._find_leader()
            if time.monotonic() > deadline:
                raise AssertionError("the container's PID 1 did not appear")
            time.sleep(0.05)
        state = ""
        while time.monotonic() < deadline:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the container did not finish booting: {state}\n"
                                 f"{self.console.read_text(errors='replace')}")
        self.boot_s = time.monotonic() - started
        say(f"booted {self.root.name} in {self.boot_s:.1f} s (system {state})")

    def _find_leader(self) -> int:
        assert self.proc is not None
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in children:
                try:
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                        return int(child)
                except OSError:
                    continue
        return 0

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn: orderly poweroff of PID 1
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                if self.leader:
                    os.kill(self.leader, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        for path in sorted(self._tmp.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        self._tmp.rmdir()

    # ------------------------------------------------------------ commands

    def run(self, *cmd: str, user: str | None = None, check: bool = True,
            timeout: float = 300.0, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run CMD inside the container (as USER with runuser if given)."""
        assert self.leader, "the container is not running"
        inner = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
        full = ["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i",
                *(f"{k}={v}" for k, v in ENV.items()), *inner]
        out = subprocess.run(full, capture_output=True, text=True, timeout=timeout,
                             input=input)
        if check and out.returncode != 0:
            raise AssertionError(f"in the container: {' '.join(cmd)} exited "
                                 f"{out.returncode}:\n{out.stdout}{out.stderr}")
        return out

    def popen(self, *cmd: str, user: str | None = None) -> subprocess.Popen[str]:
        """Start CMD inside the container (as USER) without waiting: its stdin and stdout
        are pipes, its stderr goes to the test's."""
        assert self.leader, "the container is not running"
        inner = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
        full = ["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i",
                *(f"{k}={v}" for k, v in ENV.items()), *inner]
        return subprocess.Popen(full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> str:
        return self.run("journalctl", "--no-pager", *args, check=False).stdout
