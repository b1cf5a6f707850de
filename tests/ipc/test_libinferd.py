"""libinferd, the C client library (ipc/c/), against a real daemon: C test programs
built with gcc by ipc/c/Makefile, each run as built and under AddressSanitizer +
UndefinedBehaviorSanitizer. Results are compared with the Python client's bit for bit.
The reply parser's fuzz, against a fake ROUTER, is tests/ipc/test_libinferd_fuzz.py."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.ipc import Client, RequestError
from inferd.ipc.dtypes import WIRE_DTYPES, dtype_name
from inferd.ipc.protocol import encode_tensors
from tests.conftest import Daemon
from tests.ipc import libinferd_kit as kit

pytestmark = pytest.mark.slow

KINDS = ["plain", "sanitize"]


@pytest.fixture(scope="module")
def programs() -> dict[str, Path]:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required (apt-get install gcc libzmq3-dev libjansson-dev)")
    return {kind: kit.build(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def daemon(models_dir: Path) -> Iterator[Daemon]:
    work = Path(tempfile.mkdtemp(prefix="inferd-c", dir="/tmp"))
    repo = kit.make_repository(work / "repo", models_dir)
    # One engine for the whole module: the C client's and the Python client's replies are
    # compared bit for bit, and measured placement may move ocr-cls to OpenVINO between
    # the two (seen once in CI's set: the cls output differed in its last bits).
    config = work / "inferd.toml"
    # An inline limit of its own, whatever this machine's memory makes of "auto"
    # (test_shm: a call over it in frames is refused, staged it runs).
    config.write_text('[placement]\nmode = "first"\n[server]\nmax_message_bytes = "512KiB"\n')
    d = Daemon(work, ["--config", str(config), "--models", str(repo), "--preload", "ocr-cls",
                      "--preload", "slow"])
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(programs: dict[str, Path], kind: str, name: str, *args: str,
        timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(programs[kind] / name), *args], capture_output=True, text=True,
                         timeout=timeout, env=kit.program_env(kind), input=input)
    assert out.returncode == 0, f"{name} ({kind}) exited {out.returncode}:\n{out.stdout}" \
                                f"\n{out.stderr}"
    return out


def wire_bytes(value: np.ndarray) -> bytes:
    """The frame the protocol carries for VALUE (what ipc/protocol.py sends)."""
    return bytes(encode_tensors({"v": value})[1][0])


class Spec:
    """A spec file for infer_files, and what the Python client got for each call."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lines: list[str] = []
        self.calls: dict[str, tuple[str, dict[str, np.ndarray]]] = {}

    def call(self, tag: str, model: str, inputs: dict[str, np.ndarray]) -> None:
        self.lines.append(f"call {tag} {model}")
        self.calls[tag] = (model, inputs)
        for k, (name, value) in enumerate(inputs.items()):
            path = self.folder / f"{tag}.{name}.in"
            path.write_bytes(wire_bytes(value))
            dtype = dtype_name(value)
            mode = "owned" if (len(self.lines) + k) % 2 else "borrowed"
            self.lines.append(f"in {name} {dtype} {value.ndim} "
                              f"{' '.join(map(str, value.shape))} {path} {mode}")

    def write(self) -> Path:
        path = self.folder / "spec.txt"
        path.write_text("\n".join(self.lines) + "\n")
        return path


def read_reply(folder: Path, tag: str) -> tuple[str, str, dict[str, Any]]:
    lines = (folder / f"{tag}.txt").read_text().splitlines()
    code, _, message = lines[0].partition(" ")
    outputs = {}
    for k, line in enumerate(lines[1:]):
        words = line.split()
        assert words[0] == "output"
        name, dtype, rank = words[1], words[2], int(words[3])
        shape = tuple(int(w) for w in words[4:4 + rank])
        size, aligned = int(words[4 + rank]), words[5 + rank] == "1"
        data = (folder / f"{tag}.{k}.bin").read_bytes()
        assert len(data) == size
        strings = (folder / f"{tag}.{k}.strings").read_bytes() if dtype == "string" else None
        outputs[name] = {"dtype": dtype, "shape": shape, "data": data, "aligned": aligned,
                         "strings": strings}
    return code, message, outputs


@pytest.mark.parametrize("kind", KINDS)
def test_every_dtype_and_the_demo_models_equal_the_python_client(programs, daemon, kind,
                                                                 short_tmp):
    spec = Spec(short_tmp)
    for i, dtype in enumerate(WIRE_DTYPES):
        spec.call(f"id-{dtype}", f"id-{dtype}", {"x": kit.sample(dtype, (3, 5), i)})
        spec.call(f"empty-{dtype}", f"id-{dtype}", {"x": kit.sample(dtype, (0, 4), i)})
    rng = np.random.default_rng(7)
    spec.call("cls", "ocr-cls", {"x": rng.random((2, 3, 48, 192), dtype=np.float32)})
    spec.call("labels", "labels", {"x": rng.random((1, 3, 48, 192), dtype=np.float32)})
    spec.call("vad", "vad", {"input": rng.random((1, 512), dtype=np.float32) - 0.5,
                             "state": np.zeros((2, 1, 128), np.float32),
                             "sr": np.array(16000, np.int64)})
    spec.call("wrong-dtype", "ocr-cls", {"x": np.zeros((1, 3, 48, 192), np.float64)})
    spec.call("unknown", "no-such-model", {"x": np.zeros(2, np.float32)})
    out = short_tmp / "out"
    out.mkdir()
    done = run(programs, kind, "infer_files", daemon.endpoint, str(spec.write()), str(out))
    assert sorted(done.stdout.split()[1::2]) == sorted(spec.calls)
    compared = 0
    with Client(daemon.endpoint) as c:
        for tag, (model, inputs) in spec.calls.items():
            code, message, outputs = read_reply(out, tag)
            try:
                ref = c.infer(model, inputs)
            except RequestError as e:
                assert (code, message) == (str(e.code), e.message), tag
                continue
            assert code == "OK", (tag, code, message)
            assert list(outputs) == list(ref), tag
            for name, value in ref.items():
                got = outputs[name]
                dtype = dtype_name(value)
                assert (got["dtype"], got["shape"]) == (dtype, value.shape), (tag, name)
                assert got["data"] == wire_bytes(value), (tag, name)  # bit for bit
                if got["strings"] is not None:
                    assert got["strings"] == wire_bytes(value)
                compared += 1
    assert compared >= 2 * len(WIRE_DTYPES) + 6


@pytest.mark.parametrize("kind", KINDS)
def test_every_op_errors_and_deadlines(programs, daemon, kind):
    out = run(programs, kind, "test_ops", daemon.endpoint).stdout
    assert out.rstrip().endswith("ok"), out
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()
             if " " in line}
    with Client(daemon.endpoint) as c:
        status = c.status()
        assert lines["status"] == f"pid {status['pid']} version {status['version']}"
        with pytest.raises(RequestError) as e:
            c.load("no-such-model")
        assert lines["not-found"] == e.value.message
        models = {line.split()[1]: line.split()[2] for line in out.splitlines()
                  if line.startswith("model ")}
        assert set(models) == {m["name"] for m in c.models()}
    assert "DEADLINE_EXCEEDED" not in lines["deadline"] and lines["deadline"]


def vad_audio(n_chunks: int) -> np.ndarray:
    """N_CHUNKS chunks of 512 samples at 16 kHz: bursts of a modulated tone in noise,
    on which Silero's probabilities vary (0.01 to 0.44)."""
    rng = np.random.default_rng(11)
    t = np.arange(n_chunks * 512) / 16000
    envelope = (np.sin(2 * np.pi * 0.7 * t) > 0.3).astype(np.float32)
    voice = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 5 * t))
    return (envelope * voice + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_equals_the_python_clients_stream(programs, daemon, kind, short_tmp):
    """inferd_stream_open / _infer / _close: each chunk's probability equals the Python
    client's stream's bit for bit; the refusals, a loss and a reset (test_stream.c)."""
    audio = vad_audio(40)
    (short_tmp / "audio.f32").write_bytes(audio.tobytes())
    out = run(programs, kind, "test_stream", daemon.endpoint, str(short_tmp / "audio.f32"),
              str(short_tmp / "probs.f32")).stdout
    assert out.rstrip().endswith("ok"), out
    got = np.fromfile(short_tmp / "probs.f32", np.float32)
    with Client(daemon.endpoint) as c, c.stream("vad", sr=16000) as s:
        ref = np.array([s.infer({"input": chunk[None]})["output"].item()
                        for chunk in audio.reshape(-1, 512)], np.float32)
    assert got.tobytes() == ref.tobytes()
    assert float(ref.max() - ref.min()) > 0.2, ref  # the state carried: they vary
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert "input" in lines["short chunk"] and "never-started" in lines["not held"]
    assert "state lost (model unloaded)" in lines["lost"], lines["lost"]
    assert "stream" in lines["no [stream]"]


@pytest.fixture
def limited(models_dir: Path, short_tmp: Path, start_daemon) -> Daemon:
    """A daemon of its own: two requests in flight per client at most."""
    repo = kit.make_repository(short_tmp / "repo", models_dir)
    config = short_tmp / "limited.toml"
    config.write_text("[server]\nmax_requests_per_client = 2\n[placement]\nmode = \"first\"\n")
    return start_daemon("--config", str(config), "--models", str(repo), "--preload", "slow",
                        "--preload", "ocr-cls")


@pytest.mark.parametrize("kind", KINDS)
def test_per_client_limit_and_the_retry_of_exhausted_calls(programs, limited, kind):
    out = run(programs, kind, "test_limits", limited.endpoint).stdout
    assert out.rstrip().endswith("ok"), out


@pytest.mark.parametrize("kind", KINDS)
def test_a_daemon_restart_under_a_connected_client(programs, limited, kind, short_tmp):
    proc = subprocess.Popen([str(programs[kind] / "test_restart"), limited.endpoint],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=kit.program_env(kind))
    assert proc.stdin and proc.stdout
    try:
        assert proc.stdout.readline().strip() == "stop-daemon"
        assert limited.stop() == 0
        proc.stdin.write("stopped\n")
        proc.stdin.flush()
        slow = proc.stdout.readline().split(" ", 2)
        assert proc.stdout.readline().strip() == "start-daemon"
        again = Daemon(short_tmp, limited.proc.args[5:])  # same socket, same arguments
        try:
            again.wait_ready()
            proc.stdin.write("started\n")
            proc.stdin.flush()
            rest = proc.stdout.read()
            assert proc.wait(120) == 0, rest
        finally:
            again.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the call in flight: the daemon's answer at shutdown, or the lost connection
    assert slow[0] == "slow" and slow[1] in ("OK", "UNAVAILABLE"), slow
    print(f"the call in flight at the restart: {' '.join(slow).strip()}")
    assert rest.splitlines()[0].startswith("queued OK"), rest
    assert "region registered again" in rest, rest
    assert rest.rstrip().endswith("ok"), rest


@pytest.mark.parametrize("kind", KINDS)
def test_the_cxx_header(programs, daemon, kind):
    out = run(programs, kind, "test_cxx", daemon.endpoint).stdout
    assert out.rstrip().endswith("ok"), out
    got = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    x = np.full((1, 3, 48, 192), 0.25, np.float32)
    with Client(daemon.endpoint) as c:
        ref = next(iter(c.infer("ocr-cls", {"x": x}).values()))
        labels = c.infer("labels", {"x": x}, outputs=["topk_labels"])["topk_labels"]
    assert [np.float32(v) for v in got["scores"].split()] == list(ref[0])  # bit for bit
    assert got["labels"] == " ".join(f"[{s}]" for s in labels.reshape(-1))
    v = (np.arange(512, dtype=np.int64) * 7919 % 200).astype(np.float32)
    chunk = (np.float32(0.3) * v / np.float32(200) - np.float32(0.15)).reshape(1, 512)
    with Client(daemon.endpoint) as c, c.stream("vad", sr=16000) as s:
        first = s.infer({"input": chunk})["output"].item()
    assert np.float32(got["stream"]) == np.float32(first)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_memory_tensors(programs, daemon, kind):
    out = run(programs, kind, "test_shm", daemon.endpoint).stdout
    assert out.rstrip().endswith("ok"), out
    got = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    x = (np.arange(1 * 3 * 48 * 192, dtype=np.int64) * 7919 % 1000).astype(np.float32) / 1000
    with Client(daemon.endpoint) as c:
        ref = next(iter(c.infer("ocr-cls", {"x": x.reshape(1, 3, 48, 192)}).values()))
    for way in ("framed", "shared", "into", "staged"):  # bit for bit, every way
        assert got[way] == ref.tobytes().hex(), way
    assert "over the limit of 524288 bytes (server.max_message_bytes)" in got["refused"]
    assert "big staged ok" in out and "many staged ok" in out
    assert "the outputs need more" in got["small"]
    assert got["regions"].startswith("63 more, then at most 64 regions per connection")
