"""Soak (issue 12): 8 client processes send over 100,000 requests to ocr-cls and vad
while other clients are killed with SIGKILL mid-flight and the models are unloaded,
loaded and the daemon reloaded under load. Every request of the 8 clients gets its
reply, every result equals onnxruntime's own, and the daemon stays up. `make test` runs
it with 12,800 requests, `make soak` with the 100,000 (``soak`` mark)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferd.ipc import RequestError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 8
PER_CLIENT = int(os.environ.get("SOAK_PER_CLIENT", "12800"))  # 102,400 requests in all
SHORT_PER_CLIENT = 1600  # 12,800 requests: `make test`'s run (~15 s on 2 cores)


def _client(endpoint: str, models: Path, count: int, seed: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.soak_kit", endpoint,
                             str(models), str(count), str(seed)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(ROOT), os.environ.get("PYTHONPATH", "")])})


def test_soak_8_clients_12k_requests_kills_unloads_reloads(start_daemon, models_dir):
    """The soak below at an eighth of the requests: the same kills, unloads and reloads
    under load (the first three turns are a kill, an unload and a reload whatever the
    count; then one at random every 0.3-1 s while the clients run), the same checks of
    every reply. The 100,000 requests run in `make soak`."""
    _soak(start_daemon, models_dir, SHORT_PER_CLIENT)


@pytest.mark.soak
def test_soak_8_clients_100k_requests_kills_unloads_reloads(start_daemon, models_dir):
    """The issue's 100,000 requests (SOAK_PER_CLIENT per client), in `make soak`."""
    _soak(start_daemon, models_dir, PER_CLIENT)


def _soak(start_daemon, models_dir: Path, per_client: int) -> None:
    d = start_daemon("--models", str(models_dir), "--preload", "ocr-cls", "--preload", "vad")
    clients = [_client(d.endpoint, models_dir, per_client, seed) for seed in range(CLIENTS)]
    rng = random.Random(0)
    killed = unloads = reloads = turn = 0
    victims: list[subprocess.Popen[str]] = []
    with d.client(timeout=120) as c:
        while any(p.poll() is None for p in clients):
            time.sleep(rng.uniform(0.3, 1.0))
            # a kill, an unload and a reload first, whatever the count, then at random
            action = turn if turn < 3 else rng.randrange(4)
            turn += 1
            if action == 0:  # a client dies with requests in flight
                victims.append(_client(d.endpoint, models_dir, 10**6, 100 + killed))
                killed += 1
            elif action == 1:
                model = rng.choice(["ocr-cls", "vad"])
                c.unload(model)
                unloads += 1
                if rng.random() < 0.5:
                    c.load(model)
            elif action == 2:
                c.call("reload")
                reloads += 1
            for v in victims:
                if v.poll() is None and rng.random() < 0.7:
                    v.send_signal(signal.SIGKILL)
            victims = [v for v in victims if v.poll() is None]
        for v in victims:
            v.kill()
            v.wait()
        results = []
        for p in clients:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        try:
            assert c.ping()["pong"] is True
        except RequestError as e:
            raise AssertionError(f"daemon not answering: {e}\n{d.log()[-3000:]}") from e
    total = {k: sum(r[k] for r in results) for k in ("sent", "ok", "wrong", "lost")}
    errors = [e for r in results for e in r["examples"]]
    print(f"soak: {total}, {killed} clients killed, {unloads} unloads, {reloads} reloads")
    assert total["sent"] >= CLIENTS * per_client
    assert total["wrong"] == 0 and total["lost"] == 0, (total, errors)
    assert total["ok"] == total["sent"], (total, errors)
    assert killed > 0 and unloads > 0 and reloads > 0
    assert d.proc.poll() is None
    assert d.stop() == 0
