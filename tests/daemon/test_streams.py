"""The [stream] table and the stream table of a cache entry (daemon/streams.py), without
a daemon: what model.toml may say, how a table binds to a model, and a stream's turns,
loss, ending and idleness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.daemon.model_settings import check_settings
from inferd.daemon.streams import (
    Admission, StreamModel, StreamTable, parse_stream, stream_loss,
)
from inferd.daemon.model_threads import Queued
from inferd.ipc.errors import ErrorCode, InferdError, ModelError
from inferd.ipc.protocol import Op, Reply, Request, StreamRef
from inferd.ipc.replies import LocalTicket
from inferd.libbackends.contract import TensorSpec

VAD = {"state": {"state": {"from": "stateN", "axis": 1}}, "constant": {"sr": [16000]},
       "context": {"input": {"axis": 1, "size": 64}}, "chunk": {"input": [1, 512]}}
INPUTS = (TensorSpec("input", "float32", (None, None)),
          TensorSpec("state", "float32", (2, None, 128)), TensorSpec("sr", "int64", ()))
OUTPUTS = (TensorSpec("output", "float32", (None, 1)),
           TensorSpec("stateN", "float32", (None, None, None)))


def test_a_vad_table_parses_and_binds(tmp_path: Path) -> None:
    spec = parse_stream(VAD)
    assert spec.max_streams == 64 and spec.idle_timeout_s == 60.0
    bound = StreamModel.prepare("vad version 1", spec, INPUTS, OUTPUTS, tmp_path)
    assert bound.init["state"].shape == (2, 1, 128) and bound.state_bytes() == 1024
    assert bound.chunk_inputs == ["input"]


@pytest.mark.parametrize("table, why", [
    ({}, "state must be a table"),
    ({**VAD, "states": {}}, "unknown keys ['states']"),
    ({**VAD, "state": {"state": {"from": "stateN", "axis": -1}}},
     "state.state.axis must be an integer >= 0, got -1"),
    ({**VAD, "state": {"state": {"from": "stateN", "init": "../x.npy"}}},
     "state.state.init must be \"zeros\" or the name of a .npy file"),
    ({**VAD, "constant": "sr"}, "constant must be a list of input names"),
    ({**VAD, "context": {"input": {"axis": 1}}}, "context.input must be { axis = n, size = n }"),
    ({**VAD, "context": {"sr": {"axis": 0, "size": 1}}},
     "context.sr: a state or constant input has no context"),
    ({**VAD, "idle_timeout_s": 0}, "idle_timeout_s must be a positive number, got 0"),
    ({**VAD, "max_streams": 0}, "max_streams must be an integer >= 1, got 0"),
])
def test_a_wrong_table_names_the_key(table, why) -> None:
    with pytest.raises(ModelError) as e:
        check_settings("vad", {"stream": table}, "vad/model.toml")
    assert e.value.code is ErrorCode.INTERNAL
    assert e.value.message.startswith("model vad: vad/model.toml: stream = ")
    assert why in e.value.message


@pytest.mark.parametrize("table, why", [
    ({"state": {"h": {"from": "stateN", "axis": 1}}},
     "state.h names 'h', which is not an input of the model; its inputs: "
     "['input', 'state', 'sr']"),
    ({"state": {"state": {"from": "hN", "axis": 1}}},
     "state.state.from names 'hN', which is not an output of the model; its outputs: "
     "['output', 'stateN']"),
    ({"state": {"state": {"from": "stateN", "axis": 3}}},
     "state.state.axis = 3, but input 'state' has rank 3"),
    ({"state": {"state": {"from": "stateN", "axis": 0}}},
     "state.state: the model leaves axis 1 of 'state' free ([2, None, 128]), so zeros "
     "have no shape; give init = \"file.npy\""),
    ({"state": {"state": {"from": "stateN", "axis": 1, "init": "s.npy"}}}, "cannot read"),
])
def test_a_table_that_does_not_fit_the_model_fails_its_load(tmp_path, table, why) -> None:
    with pytest.raises(ModelError) as e:
        StreamModel.prepare("vad version 1", parse_stream(table), INPUTS, OUTPUTS, tmp_path)
    assert e.value.message.startswith("model vad version 1: model.toml [stream]: ")
    assert why in e.value.message


def test_an_initial_state_from_a_file(tmp_path) -> None:
    np.save(tmp_path / "s.npy", np.full((2, 1, 128), 0.5, np.float32))
    spec = parse_stream({"state": {"state": {"from": "stateN", "axis": 1, "init": "s.npy"}}})
    bound = StreamModel.prepare("vad version 1", spec, INPUTS, OUTPUTS, tmp_path)
    assert float(bound.init["state"][0, 0, 0]) == 0.5


def test_loss_reasons() -> None:
    assert stream_loss("evicted to make room for ocr-det version 1 within ...") == "evicted"
    assert stream_loss("unload requested") == "model unloaded"
    assert stream_loss("its files changed on disk") == ("model reloaded: its files "
                                                        "changed on disk")


# ----------------------------------------------------------------- the table's turns

def item(sid: str, start: bool = False, end: bool = False, peer: bytes = b"p",
         x: float | None = 1.0) -> Queued:
    inputs = {} if x is None else {"input": np.full((1, 512), x, np.float32)}
    if start:
        inputs["sr"] = np.array(16000, np.int64)
    req = Request(id=f"{sid}-{x}", op=Op.INFER, model="vad", inputs=inputs,
                  stream=StreamRef(sid, start, end))
    return Queued(LocalTicket(req, lambda r: None, peer=peer))


@pytest.fixture
def table(tmp_path) -> StreamTable:
    t = StreamTable("vad")
    t.bound = StreamModel.prepare("vad version 1", parse_stream(VAD), INPUTS, OUTPUTS,
                                  tmp_path)
    return t


def run(t: StreamTable, it: Queued, ok: bool = True, reason: str | None = None) -> list:
    """What the workers do with a chunk: bind, run (a fake: stateN = state + 1), commit,
    answer; returns what finished hands on."""
    values = t.bind(it, it.request.inputs)
    it.chunk.ran = True
    if ok:
        t.commit(it, values, {"output": np.zeros((1, 1), np.float32),
                              "stateN": values["state"] + 1})
    else:
        it.chunk.reason = reason
    return t.finished(it, ok)


def admit(t: StreamTable, it: Queued, spec=parse_stream(VAD), per_client: int = 16):
    held = []
    verdict = t.admit(it, spec, per_client, lambda: held.append(it))
    return verdict


def test_a_stream_takes_turns_and_carries_its_state(table) -> None:
    a = item("s", start=True, x=1.0)
    assert admit(table, a) is Admission.RUN
    b, c = item("s", x=2.0), item("s", x=3.0)
    assert admit(table, b) is Admission.HELD and admit(table, c) is Admission.HELD
    assert run(table, a) == [(b, None)]  # b's turn: queued
    values = table.bind(b, b.request.inputs)
    assert float(values["state"][0, 0, 0]) == 1.0  # a's stateN
    assert values["input"].shape == (1, 576)
    np.testing.assert_array_equal(values["input"][:, :64], np.full((1, 64), 1.0))  # context
    np.testing.assert_array_equal(values["sr"], np.array(16000))  # kept from the start
    assert run(table, b) == [(c, None)]
    assert run(table, c) == []
    assert table.open() == 1 and table.nbytes() == 1024 + 256


def test_a_failed_chunk_loses_the_stream_and_its_held_chunks_are_told(table) -> None:
    a, b, c = item("s", start=True), item("s", x=2.0), item("s", start=True, x=3.0)
    admit(table, a)
    run(table, a)
    x = item("s", x=4.0)
    assert admit(table, x) is Admission.RUN
    assert admit(table, b) is Admission.HELD and admit(table, c) is Admission.HELD
    handed = run(table, x, ok=False, reason="worker died while running chunk 2")
    # b is told why; c (a start) begins the stream again and runs
    assert handed[0][0] is b and handed[0][1].error.code is ErrorCode.FAILED_PRECONDITION
    assert handed[0][1].error.message == ("stream s of vad: state lost (worker died while "
                                          "running chunk 2); start the stream again")
    assert handed[1] == (c, None)
    assert float(table.bind(c, c.request.inputs)["state"].max()) == 0.0  # from zeros
    run(table, c)
    assert table.open() == 1 and table.lost_count == 1


def test_a_refused_chunk_loses_nothing_and_a_refused_start_begins_nothing(table) -> None:
    a = item("s", start=True)
    admit(table, a)
    del a.request.inputs["sr"]
    with pytest.raises(InferdError) as e:
        table.bind(a, a.request.inputs)
    assert e.value.code is ErrorCode.INVALID_ARGUMENT
    assert table.finished(a, False) == [] and table.open() == 0
    with pytest.raises(InferdError) as e:
        admit(table, item("s"))
    assert e.value.message == "stream s of vad: not started; send start=true first"


def test_end_frees_ids_are_per_client_and_limits(table) -> None:
    admit(table, a := item("s", start=True))
    run(table, a)
    with pytest.raises(InferdError) as e:  # another client's "s" is not this one
        admit(table, item("s", peer=b"q"))
    assert e.value.code is ErrorCode.FAILED_PRECONDITION
    end = item("s", end=True, x=None)
    reply = admit(table, end)
    assert isinstance(reply, Reply) and reply.ok and not reply.outputs
    assert table.open() == 0
    spec = parse_stream({**VAD, "max_streams": 2})
    for sid in ("a", "b"):
        admit(table, it := item(sid, start=True), spec)
        run(table, it)
    with pytest.raises(InferdError) as e:
        admit(table, item("c", start=True), spec)
    assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED
    with pytest.raises(InferdError) as e:
        admit(table, item("c", start=True, peer=b"q"), parse_stream(VAD), per_client=0)
    assert "limit per client" in e.value.message


def test_idleness_and_unload_lose_streams_with_their_reason(table) -> None:
    admit(table, a := item("a", start=True))
    run(table, a)
    assert table.expire(a.chunk.stream.used_at + 59, 60) == []
    assert table.expire(a.chunk.stream.used_at + 61, 60) == ["stream a of vad"]
    with pytest.raises(InferdError) as e:
        admit(table, item("a"))
    assert e.value.message == ("stream a of vad: state lost (idle for 60 s); start the "
                               "stream again")
    admit(table, b := item("b", start=True))
    run(table, b)
    assert table.lose_all("model reloaded: its files changed on disk") == 1
    with pytest.raises(InferdError) as e:
        admit(table, item("b"))
    assert "state lost (model reloaded: its files changed on disk)" in e.value.message
    assert table.expired == 1 and table.open() == 0


def test_chunks_of_streams_merge_and_split_on_their_axes(table) -> None:
    from inferd.daemon import streams

    bound = table.bound
    parts = []
    for i in range(3):
        admit(table, it := item(f"s{i}", start=True, x=float(i)))
        parts.append(table.bind(it, it.request.inputs))
    assert len({streams.signature(bound, p) for p in parts}) == 1
    merged = streams.merge(bound, parts)
    assert merged["input"].shape == (3, 576) and merged["state"].shape == (2, 3, 128)
    assert merged["sr"].shape == ()
    out = {"output": np.arange(3, dtype=np.float32)[:, None],
           "stateN": np.arange(3, dtype=np.float32)[None, :, None] * np.ones((2, 3, 128))}
    each = streams.split(bound, out, [1, 1, 1])
    assert [float(e["output"][0, 0]) for e in each] == [0, 1, 2]
    assert [float(e["stateN"][1, 0, 5]) for e in each] == [0, 1, 2]
    assert each[1]["stateN"].shape == (2, 1, 128)
    with pytest.raises(ModelError) as e:
        streams.split(bound, {"output": out["output"], "stateN": out["stateN"][:, :2]},
                      [1, 1, 1])
    assert e.value.message == ("model vad version 1: output 'stateN' is [2, 2, 128], not 3 "
                               "rows on axis 1")
    # another constant never shares a batch
    other = dict(parts[0], sr=np.array(8000, np.int64))
    assert streams.signature(bound, other) != streams.signature(bound, parts[0])


def test_batches_sized_ahead_are_those_of_first_chunks_merged(table) -> None:
    """streams.batch_inputs (ModelThreads.warm_up sizes each batch's working memory at
    the load): the inputs that so many streams' first chunks merge into; none where a
    chunk's shape or a constant's value is not known."""
    from inferd.daemon import streams

    bound = table.bound
    batches = streams.batch_inputs(bound, INPUTS, [1, 2, 4, 16])
    assert list(batches) == [1, 2, 4, 16]
    four = batches[4]
    assert four["input"].shape == (4, 576) and four["input"].dtype == np.float32
    assert four["state"].shape == (2, 4, 128) and not four["state"].any()
    assert four["sr"].dtype == np.int64 and int(four["sr"]) == 16000
    parts = []
    for i in range(4):
        admit(table, it := item(f"s{i}", start=True, x=0.0))
        parts.append(table.bind(it, it.request.inputs))
    real = streams.merge(bound, parts)
    assert streams.signature(bound, four) == streams.signature(bound, real)
    assert {k: v.shape for k, v in four.items()} == {k: v.shape for k, v in real.items()}

    def bound_as(table):
        return StreamModel.prepare("vad version 1", parse_stream(table), INPUTS, OUTPUTS,
                                   Path("."))
    no_chunk = {k: v for k, v in VAD.items() if k != "chunk"}
    assert streams.batch_inputs(bound_as(no_chunk), INPUTS, [1, 2]) == {}
    any_rate = {**VAD, "constant": ["sr"]}  # an integer constant of any value
    assert streams.batch_inputs(bound_as(any_rate), INPUTS, [1, 2]) == {}
    two_rows = {**VAD, "chunk": {"input": [2, 512]}}  # sizes of whole chunks only
    assert list(streams.batch_inputs(bound_as(two_rows), INPUTS, [1, 2, 4, 5])) == [2, 4]
    no_rows = {**VAD, "chunk": {"input": [0, 512]}}
    assert streams.batch_inputs(bound_as(no_rows), INPUTS, [1, 2]) == {}


def test_many_streams_pipelined_on_two_threads_keep_their_order(tmp_path, models_dir,
                                                              monkeypatch) -> None:
    """A real cache (in the daemon process, two inference threads, batches of up to 4)
    and the real vad: 6 streams of 4 clients, every chunk submitted before any reply,
    from 6 threads at once; each stream's outputs equal its own loop's, and nothing is
    left in flight or open."""
    import threading
    import time

    import onnxruntime as ort

    from inferd.daemon.config import load_config
    from inferd.daemon.models import ModelManager
    from inferd.daemon.repository import Repository
    from inferd.ipc.replies import ReplySink, Ticket
    from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
    from inferd.libbackends.registry import Registry
    from tests.links import link_file

    onnx_path = models_dir / "vad" / "1" / "model.onnx"
    link_file(onnx_path, tmp_path / "vad" / "1" / "model.onnx")
    toml = (Path(__file__).resolve().parents[2] / "examples" / "models" / "vad" / "model.toml")
    (tmp_path / "vad" / "model.toml").write_text(
        "instances = 2\n" + toml.read_text().replace("max_batch = 16", "max_batch = 4")
        .replace("max_delay_ms = 0", "max_delay_ms = 1")
        .replace('batching = "adaptive"', 'batching = "fixed"'))
    config = load_config(None, {"models.repository": str(tmp_path),
                                "workers.isolation": "in-process"})
    registry = Registry()
    registry.register(OnnxRuntimeCpuBackend())
    replies: dict[str, Reply] = {}
    cond = threading.Condition()

    def send(ticket: Ticket, reply: Reply) -> None:
        if ticket.answer(reply):
            with cond:
                replies[ticket.request_id] = reply
                cond.notify_all()
    manager = ModelManager(Repository(tmp_path), registry, lambda: config, ReplySink(send))
    rng = np.random.default_rng(5)
    streams, steps = 6, 30
    audio = rng.standard_normal((streams, steps, 1, 512)).astype(np.float32) * 0.3
    seq = iter(range(10**6))
    lock = threading.Lock()

    def client(i: int) -> None:
        peer = f"client{i % 4}".encode()
        for t in range(steps):
            inputs = {"input": audio[i, t]}
            if t == 0:
                inputs["sr"] = np.array(16000, np.int64)
            rid = f"s{i}-{t}"
            with lock:
                n = next(seq)
            manager.submit(Ticket(n, time.monotonic(), Request(
                rid, Op.INFER, "vad", None, inputs,
                stream=StreamRef(f"s{i}", start=t == 0, end=t == steps - 1)),
                peer=peer, uid=1000))
    # the graph is read for each batch size at the load (ModelThreads.warm_up), never
    # while chunks wait
    from inferd.daemon.activations import Activations
    reads: list[int] = []
    peak = Activations.peak

    def counted(self, shapes, values=None):
        reads.append(shapes["input"][0])
        return peak(self, shapes, values)
    monkeypatch.setattr(Activations, "peak", counted)
    try:
        manager.load("vad")
        assert sorted(reads) == [1, 2, 4]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        with cond:
            done = cond.wait_for(lambda: len(replies) == streams * steps, 30)
        entry = manager.entry("vad")
        left = [(s.name, s.busy, len(s.held)) for s in entry.streams._streams.values()]
        assert done, f"{streams * steps - len(replies)} unanswered; (stream, busy, held): {left}"
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(onnx_path), opts)
        for i in range(streams):
            state = np.zeros((2, 1, 128), np.float32)
            context = np.zeros((1, 64), np.float32)
            for t in range(steps):
                x = np.concatenate([context, audio[i, t]], axis=1)
                want, state = session.run(None, {"input": x, "state": state,
                                                 "sr": np.array(16000, np.int64)})
                context = x[:, -64:]
                got = replies[f"s{i}-{t}"]
                assert got.ok, got.error
                np.testing.assert_array_equal(got.outputs["output"], want)
        assert entry.in_flight == 0 and entry.streams.open() == 0
        assert entry.threads is not None and entry.threads.batches > 0  # some shared a run
        assert sorted(reads) == [1, 2, 4]
    finally:
        assert manager.stop(30)
