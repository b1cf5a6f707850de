"""``inferd``: the daemon's entry point. Parses the command line, reads the config,
sets up logging and signals, and runs a :class:`Runtime` in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

from inferd.daemon.config import find_config_file, load_config
from inferd.daemon import logs
from inferd.daemon.logs import setup_logging
from inferd.daemon.runtime import VERSION, Runtime
from inferd.ipc import defs
from inferd.ipc.errors import InferdError

log = logging.getLogger("inferd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferd", description="inferd inference daemon "
                                "(runs in the foreground)")
    p.add_argument("--config", help="TOML config file (default: $INFERD_CONFIG, then "
                   f"{defs.CONFIG_FILE}, then built-in defaults)")
    p.add_argument("--socket", help=f"endpoint to serve (default {defs.SOCKET})")
    p.add_argument("--models", help="model repository directory")
    p.add_argument("--backends-dir", action="append", default=None, metavar="DIR",
                   help="directory searched for backend plugins (repeatable)")
    p.add_argument("--customops-dir", action="append", default=None, metavar="DIR",
                   help="directory searched for custom operators (repeatable)")
    p.add_argument("--preload", action="append", default=None, metavar="MODEL",
                   help="model to load before reporting ready (repeatable)")
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument("--version", action="version", version=f"inferd {VERSION}")
    return p.parse_args(argv)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {"server.socket": args.socket, "models.repository": args.models,
             "backends.paths": args.backends_dir, "customops.paths": args.customops_dir,
             "models.preload": args.preload,
             "logging.level": args.log_level}
    return {k: v for k, v in pairs.items() if v is not None}


def raise_fd_limit() -> int:
    """Raise the soft limit of open files to the hard one (systemd gives a service 1024
    unless the unit sets ``LimitNOFILE``): each client connection holds a descriptor.
    Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # no soft limit may be that: the kernel's cap
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as e:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
        return soft
    log.info("open-files limit raised from %d to %d", soft, target)
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path, overrides = find_config_file(args.config), _overrides(args)
    try:
        config = load_config(path, overrides)
    except InferdError as e:
        print(f"inferd: invalid configuration: {e.message}", file=sys.stderr)
        return 2
    handler = setup_logging(config.logging.level, config.logging.modules)
    log.debug("logging to %s", type(handler).__name__)
    raise_fd_limit()
    log.info("configuration: %s%s", path or "built-in defaults",
             f", then drop-ins {', '.join(str(p) for p in config.dropins)}"
             if config.dropins else "")
    # A blocked signal is inherited across exec: a parent that leaves SIGTERM or SIGHUP
    # blocked (systemd does not, a script's supervisor may) would leave the daemon deaf
    # to stop and reload. Start from an empty mask.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    runtime = Runtime(config, overrides)

    def on_signal(signum: int, _frame: Any) -> None:
        # Signal context: only flag and wake the I/O loop; the work happens elsewhere.
        runtime.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The handler only queues the reload: it runs on the control thread, never here.
    signal.signal(signal.SIGHUP, lambda _signum, _frame: runtime.request_reload())
    try:
        runtime.start()
    except InferdError as e:
        log.error("cannot start: %s", e.message, extra={"CODE": str(e.code)})
        return 1
    # A signal may land on any thread; the wakeup fd makes the I/O loop notice it.
    signal.set_wakeup_fd(runtime.server.wakeup_fd, warn_on_full_buffer=False)
    runtime.serve()
    if not runtime.workers_done:
        # A worker still inside a backend's native code (an onnxruntime run) when the
        # interpreter finalises makes the C++ runtime abort ("terminate called without
        # an active exception", SIGABRT). Every request is answered and the socket is
        # gone by now: end the process without running native destructors.
        log.warning("inferd exited cleanly; model threads still running after the grace "
                    "period are ended with the process")
        _exit_now(0)
    log.info("inferd exited cleanly")
    return 0


def _exit_now(status: int) -> None:
    """Flush the logs and standard streams, then ``os._exit``."""
    logs.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: nothing left to flush into
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
