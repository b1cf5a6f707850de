"""inferctl(1) documents every command and option inferctl has; `inferctl --version`;
`models -v` shows whether dynamic batching is on and the worker process a model runs in;
the configuration files are logged at start and a failed `inferctl reload` is logged
like a failed SIGHUP."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from inferd.ipc.inferctl import build_parser
from tests.links import link_file

MAN = Path(__file__).resolve().parents[2] / "packaging" / "man" / "inferctl.1"


def _words(parser: argparse.ArgumentParser) -> set[str]:
    """Every subcommand and option string of ``parser`` and its subparsers."""
    out = set()
    for action in parser._actions:
        out |= {o for o in action.option_strings if o not in ("-h",)}
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.add(name)
                out |= _words(sub)
    return out


def test_the_man_page_names_every_command_and_option() -> None:
    man = MAN.read_text().replace("\\-", "-")
    missing = sorted(w for w in _words(build_parser()) if w not in man)
    assert missing == []


@pytest.mark.slow
def test_version() -> None:
    r = subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("inferctl ")


def _inferctl(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferd.ipc.inferctl", "--socket", endpoint,
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_models_verbose_shows_batching_and_the_log_names_the_config(
        start_daemon, short_tmp: Path, models_dir: Path) -> None:
    repo = short_tmp / "repo"
    for name, toml in (("batched", "max_batch = 8\nmax_delay_ms = 2\n"), ("single", "")):
        link_file(models_dir / "ocr-cls" / "1" / "model.onnx", repo / name / "1" / "model.onnx")
        (repo / name / "model.toml").write_text(toml)
    config = short_tmp / "inferd.toml"
    config.write_text(f'[models]\nrepository = "{repo}"\npreload = ["batched", "single"]\n')
    d = start_daemon("--config", str(config))
    out = _inferctl(d.endpoint, "models", "-v").stdout
    blocks = {b.split("\n", 1)[0]: b for b in out.split("\n\n")}
    assert "batching: on (max_batch 8, max_delay_ms 2)" in blocks["batched"], out
    assert "batching: off" in blocks["single"], out
    # the worker process each runs in: a process of the daemon's (under its zygote)
    pids = {int(re.search(r"\n  worker: onnxruntime, pid (\d+)\n", blocks[name])[1])
            for name in ("batched", "single")}
    family = {p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)}
    assert len(pids) == 1 and pids <= family, (pids, family, out)
    assert f"configuration: {config}\n" in d.log() or f"configuration: {config} [" in d.log()
    # A configuration that does not validate: inferctl says why, the log says the same.
    config.write_text('[models]\nqueue_size = "many"\n')
    r = _inferctl(d.endpoint, "reload")
    assert r.returncode == 1 and "queue_size = 'many'" in r.stderr
    deadline = time.monotonic() + 30
    while "reload failed, keeping the running configuration: " not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
