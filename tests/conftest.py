"""Shared fixtures: the demo model repository and a real daemon process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inferd.ipc import Client, RequestError
from inferd.ipc.libc import kept_signal_stack

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


@pytest.hookimpl(hookwrapper=True)  # old style: Debian's pytest (the .deb's build) too
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Iterator[None]:
    """Each test gives this process's main thread back its alternate signal stack. A
    test that loads an engine itself (not through load_planned, which keeps the stack)
    may leave the engine's there, to be unmapped later by another thread (OpenVINO's:
    ipc/libc.py); pytest-timeout's SIGALRM handler would then die of SIGSEGV."""
    with kept_signal_stack():
        yield


@pytest.fixture(scope="session")
def models_dir() -> Path:
    missing = [n for n in ("ocr-det", "ocr-rec", "ocr-cls", "vad")
               if not (MODELS / n / "1" / "model.onnx").exists()]
    if missing:
        pytest.fail(f"demo models {missing} missing in {MODELS}: run `make setup`")
    return MODELS


def _short_path() -> Path:
    return Path(tempfile.mkdtemp(prefix="inferd-t", dir="/tmp"))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: ipc socket paths are limited to ~107 bytes."""
    path = _short_path()
    yield path
    shutil.rmtree(path, ignore_errors=True)


PLACEMENT_FIRST = '[placement]\nmode = "first"\n'


def _placement_first(config: Path) -> None:
    """The tests' placement policy for a test's own config file: where neither the file
    nor a ``conf.d`` drop-in beside it has a ``[placement]`` table, the table
    ``mode = "first"`` is appended to the file (a test of measured placement says
    ``mode = "measured"``). Measured placement measures every model's candidates in
    worker processes of their own right after its load, and a preload's before READY:
    in a test that is CPU the test does not use (make test's time), and models that
    move to another backend while a test compares bits with onnxruntime. A file that is
    not TOML (a test of a bad config) is left as it is."""
    try:
        texts = [config.read_text()] + [p.read_text()
                                        for p in sorted((config.parent / "conf.d").glob("*.toml"))]
        tables = [tomllib.loads(text) for text in texts]
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return
    if not any("placement" in table for table in tables):
        with open(config, "a") as f:
            f.write("\n# tests/conftest.py: the tests' placement policy\n" + PLACEMENT_FIRST)


class Daemon:
    """A real ``inferd`` process on a private socket."""

    def __init__(self, workdir: Path, args: list[str],
                 env: dict[str, str | None] | None = None, wrap: list[str] | None = None):
        """``env`` adds to (a None value removes from) the environment; ``wrap`` is a
        command the daemon runs under (``prlimit --nofile=...``, ``setpriv ...``)."""
        self.workdir = workdir
        self.socket_path = workdir / "inferd.sock"
        self.endpoint = f"ipc://{self.socket_path}"
        self.log_path = workdir / "inferd.log"
        cmd = [*(wrap or []), sys.executable, "-m", "inferd.daemon.main", "--socket",
               self.endpoint, *args]
        self._log = open(self.log_path, "ab")
        # Keep the host's /etc/inferd/inferd.toml (an installed package) out of tests:
        # without --config the daemon reads a file of the test's own, which keeps each
        # model on the first backend of its plan (placement "first"): a test compares
        # bits with onnxruntime run in the test, and since measured placement measures
        # a preload before READY (ready_within_s) it would move models while the test
        # runs and make every start wait for it. Tests of measured placement pass their
        # own --config. Likewise the host's /usr/lib/inferd/backends: an empty backends
        # dir by default.
        isolated = workdir / "empty-inferd.toml"
        if not isolated.exists():
            isolated.write_text(PLACEMENT_FIRST)
        own = (args[args.index("--config") + 1] if "--config" in args[:-1]
               else (env or {}).get("INFERD_CONFIG"))
        if own:  # the test's own config, by --config or $INFERD_CONFIG
            _placement_first(Path(own))
        no_backends = workdir / "no-backends"
        no_backends.mkdir(exist_ok=True)
        env = {"INFERD_CONFIG": str(isolated), "INFERD_BACKENDS_PATH": str(no_backends),
               "INFERD_CUSTOMOPS_PATH": str(no_backends), **(env or {})}
        full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=workdir)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"inferd exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket_path.exists():
                try:
                    with Client(self.endpoint, timeout=1.0) as c:
                        if c.ping()["ready"]:
                            return
                except RequestError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"inferd not ready after {timeout} s:\n{self.log()}")

    def client(self, timeout: float = 30.0) -> Client:
        return Client(self.endpoint, timeout=timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"inferd did not stop on SIGTERM:\n{self.log()}")
        self._log.close()
        return self.proc.returncode


def _daemons(default_workdir: Path) -> Iterator:
    started: list[Daemon] = []

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True,
              workdir: Path | None = None, wrap: list[str] | None = None) -> Daemon:
        d = Daemon(workdir or default_workdir, list(args), env, wrap)
        started.append(d)
        if ready:
            d.wait_ready()
        return d

    start.workdir = default_workdir  # type: ignore[attr-defined]
    yield start
    for d in started:
        if d.proc.poll() is None:
            d.stop()


@pytest.fixture
def start_daemon(short_tmp: Path) -> Iterator:
    """Factory: ``start_daemon(*args, env=None, ready=True, wrap=None) -> Daemon``;
    stopped after."""
    yield from _daemons(short_tmp)


@pytest.fixture(scope="module")
def module_daemon() -> Iterator:
    """``start_daemon`` for a module's fixture that starts one daemon for several tests
    (in a directory of its own; stopped after the module's last test). Only for tests
    that leave the daemon as they found it: nothing loaded or unloaded that another
    test's result depends on, no state they count. ``module_daemon.workdir`` is that
    directory."""
    workdir = _short_path()
    yield from _daemons(workdir)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_inputs() -> dict[str, dict[str, np.ndarray]]:
    """Small valid inputs for each demo model, by model name."""
    return {
        "ocr-cls": {"x": np.zeros((1, 3, 48, 192), np.float32)},
        "ocr-det": {"x": np.zeros((1, 3, 64, 64), np.float32)},
        "ocr-rec": {"x": np.zeros((1, 3, 48, 64), np.float32)},
        "vad": {"input": np.zeros((1, 512), np.float32),
                "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000, np.int64)},
    }
