"""Stateful streams through a real daemon (docs/streams.md), on the real Silero VAD
model with the model.toml the demo ships (examples/models/vad/model.toml): per-chunk
outputs equal, bit for bit, a loop that carries the state and context itself on the same
engine; chunks of many streams batched; ownership, limits, idleness, loss (a worker
killed, a reload), bad input."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferd.ipc import ErrorCode, RequestError
from inferd.ipc.protocol import StreamRef

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VAD_TOML = ROOT / "examples" / "models" / "vad" / "model.toml"
SR = np.array(16000, np.int64)


def audio(seed: int, chunks: int) -> np.ndarray:
    """Noise with louder bursts: chunks of [1, 512] float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(chunks * 512).astype(np.float32) * 0.05
    t = np.arange(chunks * 512) / 16000
    x += (0.5 * np.sin(2 * np.pi * 220 * t) * (np.sin(2 * np.pi * 1.5 * t) > 0)).astype(
        np.float32)
    return x.reshape(chunks, 1, 512)


def reference(onnx_path: Path, chunks: np.ndarray) -> list[np.ndarray]:
    """silero-vad's OnnxWrapper loop in numpy: context in front, state carried."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    s = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros((1, 64), np.float32)
    out = []
    for chunk in chunks:
        x = np.concatenate([context, chunk], axis=1)
        prob, state = s.run(None, {"input": x, "state": state, "sr": SR})
        context = x[..., -64:]
        out.append(prob)
    return out


def vad_repo(root: Path, models_dir: Path, toml: str | None = None) -> Path:
    repo = root / "repo"
    (repo / "vad" / "1").mkdir(parents=True)
    os.symlink(models_dir / "vad" / "1" / "model.onnx", repo / "vad" / "1" / "model.onnx")
    if toml is None:
        shutil.copyfile(VAD_TOML, repo / "vad" / "model.toml")
    else:
        (repo / "vad" / "model.toml").write_text(toml)
    return repo


def start(start_daemon, short_tmp: Path, repo: Path, extra: str = "",
          isolation: str = "backend"):
    conf = short_tmp / "inferd.toml"
    conf.write_text(f'[workers]\nisolation = "{isolation}"\n[models]\n'
                    f'allow_external_links = true\n[metrics]\ntextfile = ""\n{extra}')
    return start_daemon("--config", str(conf), "--models", str(repo))


@pytest.mark.parametrize("isolation", ["backend", "in-process"])
def test_a_stream_equals_the_reference_loop_bit_for_bit(start_daemon, short_tmp, models_dir,
                                                        isolation):
    repo = vad_repo(short_tmp, models_dir)
    d = start(start_daemon, short_tmp, repo, isolation=isolation)
    chunks = audio(1, 40)
    want = reference(models_dir / "vad" / "1" / "model.onnx", chunks)
    with d.client() as c:
        with c.stream("vad", sr=16000) as s:
            got = [s.infer({"input": ch}) for ch in chunks]
        for g, w in zip(got, want):
            assert list(g) == ["output"]  # the state stays in the daemon
            np.testing.assert_array_equal(g["output"], w)
        # the state and context matter: each chunk alone from zeros gives other values
        alone = [reference(models_dir / "vad" / "1" / "model.onnx", ch[None])[0]
                 for ch in chunks[1:6]]
        assert any(not np.array_equal(a, w) for a, w in zip(alone, want[1:6]))
        # the end freed it
        with pytest.raises(RequestError) as e:
            c.infer("vad", {"input": chunks[0]}, stream=StreamRef(s.id))
        assert e.value.code is ErrorCode.FAILED_PRECONDITION
        assert e.value.message == (f"stream {s.id} of vad: not started; send start=true "
                                   f"first")
        assert c.models()[0]["streams"] == 0


@pytest.fixture(scope="module")
def vad_daemon(module_daemon, models_dir):
    """One daemon (workers) with the demo vad model and its model.toml, for the tests
    that leave no stream open behind them."""
    root = Path(module_daemon.workdir)
    repo = vad_repo(root, models_dir)
    # the same model with batches that wait for company (batching across streams)
    (repo / "vad-batch" / "1").mkdir(parents=True)
    os.symlink(models_dir / "vad" / "1" / "model.onnx",
               repo / "vad-batch" / "1" / "model.onnx")
    (repo / "vad-batch" / "model.toml").write_text(
        VAD_TOML.read_text().replace("max_batch = 16", "max_batch = 8")
        .replace("max_delay_ms = 0", "max_delay_ms = 100")
        .replace('batching = "adaptive"', 'batching = "fixed"'))
    conf = root / "inferd.toml"
    conf.write_text('[models]\nallow_external_links = true\n[metrics]\ntextfile = ""\n'
                    '[streams]\nmax_per_client = 3\n')
    return module_daemon("--config", str(conf), "--models", str(repo))


def fails(call, code: ErrorCode) -> str:
    with pytest.raises(RequestError) as e:
        call()
    assert e.value.code is code, e.value.message
    return e.value.message


def test_a_stream_is_its_clients_own(vad_daemon):
    chunks = audio(2, 4)
    with vad_daemon.client() as a, vad_daemon.client() as b:
        sa = a.stream("vad", id="shared", sr=16000)
        first = sa.infer({"input": chunks[0]})
        # the other connection's "shared" is its own: not started, and a start of it
        # makes a new stream that starts from zeros, not from a's state
        assert fails(lambda: b.infer("vad", {"input": chunks[1]}, stream=StreamRef("shared")),
                     ErrorCode.FAILED_PRECONDITION) == (
            "stream shared of vad: not started; send start=true first")
        with b.stream("vad", id="shared", sr=16000) as sb:
            np.testing.assert_array_equal(sb.infer({"input": chunks[0]})["output"],
                                          first["output"])
            assert [m["streams"] for m in a.models() if m["name"] == "vad"] == [2]
        want = reference(vad_daemon_model(vad_daemon), chunks[:2])[1]
        np.testing.assert_array_equal(sa.infer({"input": chunks[1]})["output"], want)
        sa.close()
        assert [m["streams"] for m in a.models() if m["name"] == "vad"] == [0]


def test_chunks_sent_at_once_run_in_order_and_limits_per_client(vad_daemon):
    chunks = audio(4, 24)
    want = reference(vad_daemon_model(vad_daemon), chunks)
    with vad_daemon.client() as c:
        # every chunk sent before the first is answered: each waits for the one before
        pending = [c.submit("infer", "vad", {"input": ch, **({"sr": SR} if i == 0 else {})},
                            stream={"id": "fast", "start": i == 0, "end": i == len(chunks) - 1})
                   for i, ch in enumerate(chunks)]
        for p, w in zip(pending, want):
            np.testing.assert_array_equal(p.result()["output"], w)
        # the last one ended it: its stream settles just after its reply is sent (what
        # the client got decides how), so the listing may show it for a moment more
        from tests.e2e.test_cache_reload import poll
        poll(lambda: row(c, "vad")["streams"] == 0, 10)
        # a plain request to a model with a [stream] table carries its state as before
        out = c.infer("vad", {"input": np.concatenate([np.zeros((1, 64), np.float32),
                                                       chunks[0]], axis=1),
                              "state": np.zeros((2, 1, 128), np.float32), "sr": SR})
        np.testing.assert_array_equal(out["output"], want[0])
        # [streams] max_per_client = 3 (the model's own max_streams is 64)
        open3 = [c.stream("vad", id=f"m{i}", sr=16000) for i in range(3)]
        for s in open3:
            s.infer({"input": chunks[0]})
        assert fails(lambda: c.stream("vad", id="m3", sr=16000).infer({"input": chunks[0]}),
                     ErrorCode.RESOURCE_EXHAUSTED) == (
            "model vad: this client has 3 streams open, the limit per client ([streams] "
            "max_per_client = 3 in inferd.toml)")
        with vad_daemon.client() as other:  # another client has its own
            with other.stream("vad", id="m3", sr=16000) as s:
                s.infer({"input": chunks[0]})
        for s in open3:
            s.close()
        assert row(c, "vad")["streams"] == 0


def test_eight_streams_batched_give_what_each_gives_alone(vad_daemon):
    import threading

    steps, n = 12, 8
    chunks = [audio(10 + i, steps) for i in range(n)]
    want = [reference(vad_daemon_model(vad_daemon), ch) for ch in chunks]
    got: list[list] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        try:
            with vad_daemon.client() as c, c.stream("vad-batch", sr=16000) as s:
                for t in range(steps):
                    barrier.wait(30)  # the eight chunks of a step arrive together
                    got[i].append(s.infer({"input": chunks[i][t]})["output"])
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(n):
        for g, w in zip(got[i], want[i]):
            np.testing.assert_array_equal(g, w)  # bitwise: onnxruntime's batch of 8 gives
            # each row what a batch of 1 gives (checked on this engine)
    with vad_daemon.client() as c:
        samples = c.call("metrics")["samples"]
    runs = next(v for name, lab, v in samples
                if name == "inferd_batch_size_count" and lab.get("model") == "vad-batch")
    chunks_run = next(v for name, lab, v in samples
                      if name == "inferd_batch_size_sum" and lab.get("model") == "vad-batch")
    assert chunks_run == n * steps and runs < chunks_run / 2, (runs, chunks_run)
    print(f"{int(chunks_run)} chunks of {n} streams in {int(runs)} runs")


def test_an_async_clients_stream_gives_what_the_sync_ones_gives(vad_daemon):
    import asyncio

    from inferd.ipc import AsyncClient

    chunks = [audio(20, 16), audio(21, 16)]
    with vad_daemon.client() as c:
        sync = []
        for ch in chunks:
            with c.stream("vad", sr=16000) as s:
                sync.append([s.infer({"input": x})["output"] for x in ch])

    async def run() -> tuple[list, list, str, int]:
        async with AsyncClient(vad_daemon.endpoint) as ac:
            async def one(ch) -> list:
                async with ac.stream("vad", sr=16000) as s:
                    return [(await s.infer({"input": x}))["output"] for x in ch]
            got = await asyncio.gather(*(one(ch) for ch in chunks))  # two streams at once
            # a refused start begins nothing; the next chunk starts the stream again
            s = ac.stream("vad", id="async-b", sr=8000)
            try:
                await s.infer({"input": chunks[0][0]})
                refused = "not refused"
            except RequestError as e:
                refused = f"{e.code.name}: {e.message}"
            s.constants["sr"] = SR
            again = [(await s.infer({"input": x}))["output"] for x in chunks[0][:2]]
            open_now = [m["streams"] for m in await ac.models() if m["name"] == "vad"][0]
            await s.close()
            left = [m["streams"] for m in await ac.models() if m["name"] == "vad"][0]
            return got, again, refused, open_now * 10 + left
    got, again, refused, counts = asyncio.run(run())
    for g, w in zip(got, sync):
        assert len(g) == len(w) == 16
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)  # bit for bit
    assert refused == ("INVALID_ARGUMENT: stream async-b of vad: constant 'sr' = 8000; "
                       "this model's streams take [16000]")
    for a, b in zip(again, sync[0][:2]):
        np.testing.assert_array_equal(a, b)
    assert counts == 10  # one open before its close, none after (the gathered ones ended)


CLIENT_LEAVES = """
import os, sys
import numpy as np
from inferd.ipc import Client

c = Client(sys.argv[1])
x = np.zeros((1, 512), np.float32)
for i in range(3):
    c.stream("vad", id=f"gone{i}", sr=16000).infer({"input": x})
print(sum(m["streams"] for m in c.models() if m["name"] == "vad"), flush=True)
os._exit(0)  # no end sent, no close: the connection just goes
"""


def test_a_disconnected_clients_streams_are_freed_at_once(vad_daemon):
    import subprocess
    import sys

    from tests.e2e.test_cache_reload import poll

    def open_streams(c) -> tuple[int, float]:
        samples = c.call("metrics")["samples"]
        gauge = next(v for n, lab, v in samples
                     if n == "inferd_streams" and lab.get("model") == "vad")
        return row(c, "vad")["streams"], gauge

    with vad_daemon.client() as c:
        with c.stream("vad", id="stays", sr=16000) as s:  # another client's: kept
            s.infer({"input": audio(5, 1)[0]})
            done = subprocess.run([sys.executable, "-c", CLIENT_LEAVES, vad_daemon.endpoint],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert done.stdout.split() == ["4"]  # its 3 and ours, before it went
            # freed when the connection closes, not at idle_timeout_s (60 s)
            poll(lambda: open_streams(c) == (1, 1), 10)
            assert row(c, "vad")["streams_bytes"] == 1024 + 256
            assert vad_daemon.log().count(
                "model vad: 3 streams of a client that disconnected freed (3840 bytes)") == 1
            s.infer({"input": audio(5, 1)[0]})
        poll(lambda: open_streams(c) == (0, 0), 10)  # the metrics are cached briefly


def test_a_stream_start_without_room_in_the_budget_is_refused(start_daemon, short_tmp,
                                                              models_dir):
    import re

    d = start(start_daemon, short_tmp, vad_repo(short_tmp, models_dir))
    chunks = audio(6, 3)
    want = reference(models_dir / "vad" / "1" / "model.onnx", chunks)
    with d.client() as c:
        a = c.stream("vad", id="a", sr=16000)
        a.infer({"input": chunks[0]})  # loaded, its cost measured, a's state counted
        # a budget with room for what is in use and less than one more stream's state
        # (1,024 bytes for Silero: state [2, 1, 128] float32)
        budget = c.status()["cache"]["used_bytes"] + 1000
        conf = short_tmp / "inferd.toml"
        conf.write_text(conf.read_text() + f"[cache]\nmax_memory = {budget}\n")
        c.call("reload")
        assert c.status()["cache"]["max_memory_bytes"] == budget
        message = fails(lambda: c.stream("vad", id="b", sr=16000).infer({"input": chunks[0]}),
                        ErrorCode.RESOURCE_EXHAUSTED)
        got = re.fullmatch(
            rf"model vad: no room for a new stream's state \(1024 bytes\) in the cache "
            rf"budget \(\[cache\] max_memory = {budget} bytes, (\d+) in use\); end "
            rf"streams, unload models or raise the budget", message)
        assert got and int(got.group(1)) + 1024 > budget, message
        assert row(c, "vad")["streams"] == 1  # the refused start began nothing
        # a's state is untouched; ending it makes room for b
        np.testing.assert_array_equal(a.infer({"input": chunks[1]})["output"], want[1])
        a.close()
        with c.stream("vad", id="b", sr=16000) as b:
            np.testing.assert_array_equal(b.infer({"input": chunks[0]})["output"], want[0])


def vad_daemon_model(d) -> Path:
    return Path(d.workdir) / "repo" / "vad" / "1" / "model.onnx"


def test_bad_chunks_are_refused_and_lose_nothing(vad_daemon):
    chunks = audio(3, 3)
    want = reference(vad_daemon_model(vad_daemon), chunks)
    with vad_daemon.client() as c:
        # a start without its constant, with a wrong one, with the state sent
        assert fails(lambda: c.infer("vad", {"input": chunks[0]},
                                     stream=StreamRef("b", start=True)),
                     ErrorCode.INVALID_ARGUMENT) == (
            "stream b of vad: constant input 'sr' missing at its start (constants: ['sr'])")
        assert fails(lambda: c.infer("vad", {"input": chunks[0], "sr": np.array(8000)},
                                     stream=StreamRef("b", start=True)),
                     ErrorCode.INVALID_ARGUMENT) == (
            "stream b of vad: constant 'sr' = 8000; this model's streams take [16000]")
        assert fails(lambda: c.infer("vad", {"input": chunks[0], "sr": SR,
                                             "state": np.zeros((2, 1, 128), np.float32)},
                                     stream=StreamRef("b", start=True)),
                     ErrorCode.INVALID_ARGUMENT) == (
            "stream b of vad: input 'state' is the stream's state, which the daemon keeps; "
            "do not send it")
        # a refused start began nothing
        fails(lambda: c.infer("vad", {"input": chunks[0]}, stream=StreamRef("b")),
              ErrorCode.FAILED_PRECONDITION)
        with c.stream("vad", id="b", sr=16000) as s:
            np.testing.assert_array_equal(s.infer({"input": chunks[0]})["output"], want[0])
            assert fails(lambda: s.infer({"input": chunks[1][:, :500]}),
                         ErrorCode.INVALID_ARGUMENT) == (
                "stream b of vad: chunk input 'input' is float32[1, 500]; this stream's "
                "chunks are float32[1, 512] (set in its model.toml [stream] chunk)")
            assert fails(lambda: s.infer({"input": chunks[1].astype(np.float64)}),
                         ErrorCode.INVALID_ARGUMENT) == (
                "model vad: input 'input' is float64, expected float32")
            assert fails(lambda: s.infer({"input": chunks[1], "sr": np.array(16001)}),
                         ErrorCode.INVALID_ARGUMENT) == (
                "stream b of vad: constant 'sr' = 16001; this model's streams take [16000]")
            assert fails(lambda: s.infer({"inputs": chunks[1]}),
                         ErrorCode.INVALID_ARGUMENT) == (
                "stream b of vad: unknown input 'inputs'; a chunk takes ['input']")
            # the same constant again is fine; nothing was lost by the refusals
            out = c.infer("vad", {"input": chunks[1], "sr": SR}, stream=StreamRef("b"))
            np.testing.assert_array_equal(out["output"], want[1])
            np.testing.assert_array_equal(s.infer({"input": chunks[2]})["output"], want[2])


def test_a_model_without_a_stream_table_refuses_a_stream(start_daemon, short_tmp,
                                                         models_dir):
    repo = short_tmp / "repo"
    (repo / "vad" / "1").mkdir(parents=True)
    os.symlink(models_dir / "vad" / "1" / "model.onnx", repo / "vad" / "1" / "model.onnx")
    (repo / "ocr").mkdir()
    shutil.copyfile(models_dir / "ocr" / "graph.toml", repo / "ocr" / "graph.toml")
    d = start(start_daemon, short_tmp, repo)
    with d.client() as c:
        assert fails(lambda: c.stream("vad", sr=16000).infer({"input": audio(0, 1)[0]}),
                     ErrorCode.INVALID_ARGUMENT) == (
            "model vad has no [stream] table in its model.toml")
        assert fails(lambda: c.stream("ocr").infer({"image": np.zeros((8, 8, 3), np.uint8)}),
                     ErrorCode.INVALID_ARGUMENT) == (
            "graph ocr cannot run as a stream: only a model with a [stream] table in its "
            "model.toml can")
        # a plain request carries its state itself, as before
        out = c.infer("vad", {"input": np.zeros((1, 576), np.float32), "sr": SR,
                              "state": np.zeros((2, 1, 128), np.float32)})
        assert set(out) == {"output", "stateN"}


# ----------------------------------------------------------------- a toy stream model

SLOW_OP = '''
import os
import time
from pathlib import Path


class CstSlow:
    """Identity; a first element of 9 marks a file and sleeps (a run to kill)."""

    op_type = "cstSlow"

    def shape_infer(self, node, in_shapes, in_dtypes):
        return [in_shapes[0]], [in_dtypes[0]]

    def compute(self, node, inputs):
        x = inputs[0]
        if x.size and float(x.reshape(-1)[0]) == 9.0:
            Path(os.environ["SLOW_MARK"]).touch()
            time.sleep(60)
        return [x.copy()]
'''

TOY_TOML = '''[stream]
state = {{ state = {{ from = "stateN", axis = 0 }} }}
max_streams = 2
idle_timeout_s = {idle}
'''


def toy_model(repo: Path, name: str, idle: float = 60) -> None:
    """x [N, 4], state [N, 4] -> y = stateN = state + slow(x): a running sum."""
    import onnx
    from onnx import TensorProto, helper

    from tests.libbackends.customops import kit

    nodes = [helper.make_node("cstSlow", ["x"], ["s"], name="slow", domain=kit.DOMAIN),
             helper.make_node("Add", ["state", "s"], ["stateN"]),
             helper.make_node("Identity", ["stateN"], ["y"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "toy", [helper.make_tensor_value_info("x", f, ["N", 4]),
                       helper.make_tensor_value_info("state", f, ["N", 4])],
        [helper.make_tensor_value_info("y", f, ["N", 4]),
         helper.make_tensor_value_info("stateN", f, ["N", 4])])
    model = helper.make_model(graph, opset_imports=kit.OPSETS)
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "customops").mkdir()
    (repo / name / "customops" / "slow.py").write_text(SLOW_OP)
    (repo / name / "model.toml").write_text(TOY_TOML.format(idle=idle))


def worker_pid(log: str, model: str) -> int:
    import re

    pids = re.findall(rf"worker {model} version 1@onnxruntime started: pid (\d+)", log)
    assert pids, log[-3000:]
    return int(pids[-1])


@pytest.fixture
def toy_daemon(start_daemon, short_tmp):
    repo = short_tmp / "repo"
    repo.mkdir()
    toy_model(repo, "toy")
    toy_model(repo, "toy-idle", idle=0.3)
    conf = short_tmp / "inferd.toml"
    conf.write_text('[workers]\nisolation = "backend"\nrestart_backoff_s = 0.1\n'
                    '[cache]\nidle_check_s = 0.1\n[metrics]\ntextfile = ""\n')
    mark = short_tmp / "running"
    d = start_daemon("--config", str(conf), "--models", str(repo),
                     env={"SLOW_MARK": str(mark)})
    d.mark = mark
    return d


def row(c, name: str) -> dict:
    return next(m for m in c.models() if m["name"] == name)


def ones(v: float) -> np.ndarray:
    return np.full((1, 4), v, np.float32)


def test_a_worker_killed_mid_chunk_loses_the_stream_and_between_chunks_nothing(toy_daemon):
    import signal
    import threading

    from tests.e2e.test_cache_reload import poll

    d = toy_daemon
    with d.client(timeout=60) as c:
        s = c.stream("toy", id="k")
        np.testing.assert_array_equal(s.infer({"x": ones(1)})["y"], ones(1))
        # killed between two chunks: the state is the daemon's, nothing is lost
        os.kill(worker_pid(d.log(), "toy"), signal.SIGKILL)
        poll(lambda: "died of SIGKILL" in d.log(), 10)
        np.testing.assert_array_equal(s.infer({"x": ones(2)})["y"], ones(3))
        # killed while the stream's third chunk runs: that chunk is UNAVAILABLE, the
        # next one is told the state is lost, a start makes it whole again
        pid = worker_pid(d.log(), "toy")
        killer = threading.Thread(target=lambda: (poll(d.mark.exists, 30),
                                                  os.kill(pid, signal.SIGKILL)))
        killer.start()
        assert "died of SIGKILL while running" in fails(lambda: s.infer({"x": ones(9)}),
                                                        ErrorCode.UNAVAILABLE)
        killer.join()
        assert fails(lambda: s.infer({"x": ones(1)}), ErrorCode.FAILED_PRECONDITION) == (
            "stream k of toy: state lost (worker died while running chunk 3); start the "
            "stream again")
        # told again until started
        assert "state lost (worker died while running chunk 3)" in fails(
            lambda: c.infer("toy", {"x": ones(1)}, stream=StreamRef("k")),
            ErrorCode.FAILED_PRECONDITION)
        s.reset()
        np.testing.assert_array_equal(s.infer({"x": ones(5)})["y"], ones(5))
        np.testing.assert_array_equal(s.infer({"x": ones(1)})["y"], ones(6))
        assert row(c, "toy")["streams_lost"] == 1
        s.close()


def test_limits_idleness_and_a_reload(toy_daemon):
    from tests.e2e.test_cache_reload import poll

    d = toy_daemon
    with d.client() as c, d.client() as other:
        a, b = c.stream("toy", id="a"), other.stream("toy", id="b")
        a.infer({"x": ones(1)})
        b.infer({"x": ones(1)})
        assert fails(lambda: c.stream("toy", id="c").infer({"x": ones(1)}),
                     ErrorCode.RESOURCE_EXHAUSTED) == (
            "model toy: 2 streams are open, its limit (max_streams = 2 in its model.toml "
            "[stream])")
        assert row(c, "toy")["streams"] == 2
        assert row(c, "toy")["streams_bytes"] == 2 * 16
        b.close()
        with c.stream("toy", id="c") as s3:  # room again
            s3.infer({"x": ones(1)})
        # an idle stream is freed (idle_timeout_s = 0.3), logged once, counted
        i = c.stream("toy-idle", id="i")
        i.infer({"x": ones(1)})
        poll(lambda: row(c, "toy-idle")["streams"] == 0, 10)
        assert fails(lambda: i.infer({"x": ones(1)}), ErrorCode.FAILED_PRECONDITION) == (
            "stream i of toy-idle: state lost (idle for 0.3 s); start the stream again")
        assert d.log().count("stream i of toy-idle freed: idle for") == 1
        samples = c.call("metrics")["samples"]
        got = {(n, lab.get("model")): v for n, lab, v in samples
               if n.startswith("inferd_streams")}
        assert got[("inferd_streams_expired_total", "toy-idle")] == 1
        assert got[("inferd_streams", "toy")] == 1
        # a reload that replaces the model's files loses its open streams
        model = Path(d.workdir) / "repo" / "toy" / "1" / "model.onnx"
        import onnx

        m = onnx.load(model)
        m.doc_string = "changed"
        onnx.save(m, model)
        c.call("reload")
        poll(lambda: row(c, "toy")["streams"] == 0, 10)
        assert fails(lambda: a.infer({"x": ones(1)}), ErrorCode.FAILED_PRECONDITION) == (
            "stream a of toy: state lost (model reloaded: its files changed on disk); "
            "start the stream again")
        a.reset()
        np.testing.assert_array_equal(a.infer({"x": ones(4)})["y"], ones(4))


def test_a_retired_versions_chunks_are_told_their_state_went_with_it(start_daemon, short_tmp):
    """A reload that makes version 2 the default retires version 1 (commit dfefc0f):
    a chunk of a stream still queued on it, and the one its stream held behind that,
    are answered FAILED_PRECONDITION naming the loss, and so is every stream's next
    chunk (it goes to version 2): never a silent start from zeros on the new version."""
    from tests.e2e.test_cache_reload import poll

    repo = short_tmp / "repo"
    repo.mkdir()
    toy_model(repo, "toy")
    toml = repo / "toy" / "model.toml"
    # only the latest version is offered: the reload retires version 1 (keep_versions)
    toml.write_text("keep_versions = 1\n" + toml.read_text().replace("max_streams = 2",
                                                                     "max_streams = 4"))
    conf = short_tmp / "inferd.toml"
    # one thread, nothing run on the I/O thread: a chunk waits behind a slow one; the
    # drain gives the slow one up after 0.5 s (what it held is then rerouted)
    conf.write_text('[workers]\nisolation = "backend"\n[models]\ninstances = 1\n'
                    'io_run_max_us = 0\nstuck_after_s = 0.5\n[metrics]\ntextfile = ""\n'
                    '[placement]\nmode = "first"\n')
    mark = short_tmp / "running"
    d = start_daemon("--config", str(conf), "--models", str(repo),
                     env={"SLOW_MARK": str(mark)})
    lost = ("stream {} of toy: state lost (model reloaded: replaced by version 2); start "
            "the stream again")
    with d.client(timeout=60) as c, d.client(timeout=60) as c2:
        a, idle = c.stream("toy", id="a"), c.stream("toy", id="idle")
        np.testing.assert_array_equal(a.infer({"x": ones(1)})["y"], ones(1))
        idle.infer({"x": ones(1)})  # nothing in flight at the reload
        slow = c2.submit("infer", "toy", {"x": ones(9)}, stream={"id": "b", "start": True})
        poll(mark.exists, 30)
        stuck = worker_pid(d.log(), "toy")
        # behind b's run; naming its version (else it could run on the next one's)
        queued = c.submit("infer", "toy", {"x": ones(2)}, stream={"id": "a"}, version=1)
        held = c.submit("infer", "toy", {"x": ones(3)}, stream={"id": "a"})  # behind queued
        poll(lambda: row(c, "toy")["queued"] >= 1, 10)
        (repo / "toy" / "2").mkdir()
        shutil.copyfile(repo / "toy" / "1" / "model.onnx", repo / "toy" / "2" / "model.onnx")
        # the reload says its drain gave up b's run (issue 20); version 2 serves
        assert "model toy: unloaded, but a stage did not end" in fails(
            lambda: c.call("reload"), ErrorCode.UNAVAILABLE)
        for p in (queued, held):
            reply = p.reply()
            assert reply.error is not None and reply.error.code is ErrorCode.FAILED_PRECONDITION
            assert reply.error.message == lost.format("a")
        assert slow.reply().error.code is ErrorCode.UNAVAILABLE  # its stage given up
        import signal

        os.kill(stuck, signal.SIGKILL)  # its 60 s sleep need not hold up what follows
        assert fails(lambda: a.infer({"x": ones(4)}), ErrorCode.FAILED_PRECONDITION) == (
            lost.format("a"))
        assert fails(lambda: idle.infer({"x": ones(4)}), ErrorCode.FAILED_PRECONDITION) == (
            lost.format("idle"))
        # started again, on version 2, from its initial state
        np.testing.assert_array_equal(a.infer({"x": ones(4)})["y"], ones(4))
        assert [(m["version"], m["streams"]) for m in c.models() if m["name"] == "toy"
                and m["state"] == "ready"] == [(2, 1)]
        a.close()
