"""The model cache in-process: a real ModelManager with the real onnxruntime backend and
the real demo models (hard-linked into a temporary repository), replies captured instead
of sent over a socket. Memory is really measured, so budgets are set from measurements.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.daemon.config import load_config
from inferd.daemon.models import ModelManager, State
from inferd.daemon.repository import Repository
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.ipc.protocol import Op, Reply, Request
from inferd.ipc.replies import ReplySink, Ticket
from inferd.libbackends.onnxruntime_cpu import OnnxRuntimeCpuBackend
from inferd.libbackends.registry import Registry
from tests.links import link_file



def make_repo(root: Path, models_dir: Path, layout: dict[str, dict[int, str]],
              settings: dict[str, str] | None = None) -> Path:
    """``layout``: name -> {version: demo model}; files are hard links to models/."""
    for name, versions in layout.items():
        for version, demo in versions.items():
            d = root / name / str(version)
            d.mkdir(parents=True)
            link_file(models_dir / demo / "1" / "model.onnx", d / "model.onnx")
        if settings and name in settings:
            (root / name / "model.toml").write_text(settings[name])
    return root


class Harness:
    """A ModelManager plus the replies it sent, by request id."""

    def __init__(self, repo: Path, inputs: dict[str, Any], **cache: Any) -> None:
        self.inputs = inputs
        overrides = {"models.repository": str(repo), "cache.idle_check_s": 0.02,
                     **{f"cache.{k}": v for k, v in cache.items() if k != "preload"}}
        if "preload" in cache:
            overrides["models.preload"] = cache["preload"]
        self.config = load_config(None, overrides)
        registry = Registry()
        registry.register(OnnxRuntimeCpuBackend())
        self.replies: dict[str, Reply] = {}
        self.hold: dict[str, threading.Event] = {}
        self.held: set[str] = set()  # held requests whose reply has come (see hold)
        self._cond = threading.Condition()
        self._seq = itertools.count(1)
        self.manager = ModelManager(Repository(repo.resolve()), registry, lambda: self.config,
                                    ReplySink(self._reply))

    def _reply(self, ticket: Ticket, reply: Reply) -> None:
        gate = self.hold.get(ticket.request_id)
        if gate is not None:  # keeps the request "running" until the test lets it go
            with self._cond:
                self.held.add(ticket.request_id)
                self._cond.notify_all()
            gate.wait(30)
        with self._cond:
            assert ticket.request_id not in self.replies, "second reply"
            self.replies[ticket.request_id] = reply
            self._cond.notify_all()

    def submit(self, model: str, rid: str | None = None, version: int | None = None,
               **params: Any) -> str:
        rid = rid or f"r{next(self._seq)}"
        request = Request(rid, Op.INFER, model, version, self.inputs[model], params=params)
        self.manager.submit(Ticket(next(self._seq), time.monotonic(), request))
        return rid

    def reload(self, config: Any) -> dict[str, list[str]]:
        """Put ``config`` in force (the harness holds it, as the runtime does) and
        reload the cache."""
        previous, self.config = self.config, config
        return self.manager.reload(previous)

    def reply(self, rid: str, timeout: float = 30) -> Reply:
        with self._cond:
            assert self._cond.wait_for(lambda: rid in self.replies, timeout), rid
            return self.replies[rid]

    def infer(self, model: str, **kw: Any) -> Reply:
        return self.reply(self.submit(model, **kw))

    def state(self, model: str, version: int | None = None) -> State:
        return self.manager.entry(model, version).state

    def row(self, model: str) -> dict[str, Any]:
        return next(m for m in self.manager.describe() if m["name"] == model
                    and m["default"])


def wait_for(cond: Callable[[], bool], timeout: float = 30, why: object = None) -> None:
    """Poll ``cond`` until it holds; on a timeout the assertion shows ``why`` (what the
    test kept that may explain it, e.g. the failures of its load)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not reached; {why!r}"
        time.sleep(0.01)


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        for gate in h.hold.values():
            gate.set()
        assert h.manager.stop(10)


@pytest.fixture
def harness(harnesses: list[Harness], demo_inputs: dict[str, Any]) -> Callable[..., Harness]:
    def make(repo: Path, **cache: Any) -> Harness:
        h = Harness(repo, demo_inputs, **cache)
        harnesses.append(h)
        return h
    return make


FOUR = {"ocr-cls": {1: "ocr-cls"}, "ocr-det": {1: "ocr-det"}, "ocr-rec": {1: "ocr-rec"},
        "vad": {1: "vad"}}


@pytest.fixture
def four(models_dir: Path, short_tmp: Path, harness: Callable[..., Harness]) -> Harness:
    """The four demo models, ocr-cls pinned, no budget yet."""
    return harness(make_repo(short_tmp / "repo", models_dir, FOUR), max_memory="unlimited",
                   preload=["ocr-cls"])


@pytest.mark.slow
def test_budget_evicts_least_recently_used_idle_model_and_keeps_pinned(four: Harness) -> None:
    h = four
    m = h.manager
    assert m.load_pinned() == [] and m.loaded() == ["ocr-cls"]
    def idle_after(name: str) -> bool:  # a reply goes out just before its run counts done
        assert h.infer(name).ok
        wait_for(lambda: h.row(name)["in_flight"] == 0)
        return True

    # Measure each model's cost once (unlimited budget), then unload the unpinned ones.
    # The cost counts the working memory of a run (measured once per input shape class,
    # kept across loads), so each model runs here first.
    for name in ("ocr-cls", "ocr-det", "ocr-rec", "vad"):
        m.load(name)
        assert idle_after(name)
        assert h.row(name)["memory_bytes"] > 0, name
    for name in ("ocr-det", "ocr-rec", "vad"):
        m.unload(name)

    def room_for_all_but(name: str) -> int:
        """A budget 1 MiB short of what is loaded plus ``name``'s figure from its last
        load: the cache decides on these figures, so an idle model must go first, and
        the one evicted leaves a whole model's room for ``name``'s new measurement (an
        RSS delta of this process: two loads of ocr-rec measured 22 and 29 MiB here)."""
        return m.used() + m.entry(name).memory.total() - 2**20

    assert idle_after("ocr-det")
    assert idle_after("ocr-rec")
    assert idle_after("ocr-det")          # ocr-rec is now the least recently used
    m.config.cache.max_memory = room_for_all_but("vad")
    assert h.infer("vad").ok              # does not fit beside both: evicts ocr-rec
    assert h.state("ocr-rec") is State.UNLOADED
    assert h.state("ocr-det") is State.READY
    assert h.state("vad") is State.READY
    assert h.state("ocr-cls") is State.READY  # pinned: never evicted
    assert m.cache_status()["used_bytes"] <= m.config.cache.max_memory
    m.config.cache.max_memory = room_for_all_but("ocr-rec")
    assert h.infer("ocr-rec").ok          # evicts ocr-det now (LRU), not the pinned one
    assert h.state("ocr-det") is State.UNLOADED
    assert h.state("vad") is State.READY
    assert h.state("ocr-cls") is State.READY
    assert m.cache_status()["used_bytes"] <= m.config.cache.max_memory


@pytest.mark.slow
def test_busy_model_is_not_evicted_and_no_room_says_what_is_needed_and_pinned(
        four: Harness) -> None:
    h = four
    m = h.manager
    m.load_pinned()
    rec = m.budget.cost(m.load("ocr-rec"))
    m.unload("ocr-rec")
    det = m.budget.cost(m.load("ocr-det"))
    assert rec and det
    # The pinned model and the larger of the two others, and the smaller less 1 MiB:
    # not both (the cache decides on these figures), and once one is evicted a whole
    # model's room for the other's new measurement (an RSS delta of this process, which
    # varies by several MiB from one load to the next).
    m.config.cache.max_memory = sum(m.budget.engines().values()) \
        + h.row("ocr-cls")["memory_bytes"] + max(det, rec) + min(det, rec) - 2**20
    h.hold["busy"] = threading.Event()
    h.submit("ocr-det", rid="busy")  # runs, then its reply blocks: ocr-det stays busy
    # its run over (not only taken from the queue: a run's working memory is admitted
    # when it starts, and ocr-rec's load beside it would leave no room for it)
    wait_for(lambda: "busy" in h.held)

    reply = h.infer("ocr-rec")
    assert reply.error is not None
    code, message = reply.error
    assert code is ErrorCode.RESOURCE_EXHAUSTED
    assert "model ocr-rec version 1 needs" in message and "MiB" in message
    assert "pinned: ocr-cls version 1" in message
    assert "busy, loading or being replaced: ocr-det version 1" in message
    assert h.state("ocr-det") is State.READY  # never pulled from under its request

    h.hold["busy"].set()
    assert h.reply("busy").ok
    wait_for(lambda: m.entry("ocr-det").in_flight == 0)
    with pytest.raises(InferdError):  # the failure is remembered for a while ...
        h.submit("ocr-rec")
    m.load("ocr-rec")                 # ... but an explicit load retries: ocr-det idles now
    assert h.state("ocr-det") is State.UNLOADED
    assert h.state("ocr-rec") is State.READY


@pytest.mark.slow
def test_single_flight_many_concurrent_first_requests_one_load(
        models_dir: Path, short_tmp: Path, harness: Callable[..., Harness]) -> None:
    h = harness(make_repo(short_tmp / "repo", models_dir, {"ocr-cls": {1: "ocr-cls"}}))
    rids = [h.submit("ocr-cls") for _ in range(50)]
    assert all(h.reply(r).ok for r in rids)
    row = h.row("ocr-cls")
    assert row["loads"] == 1
    assert row["requests"] == 50


def test_failed_load_is_remembered_with_its_reason_then_retried(
        short_tmp: Path, harness: Callable[..., Harness]) -> None:
    repo = short_tmp / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    h = harness(repo, failed_load_hold_s=0.3)
    first = h.reply(_submit_x(h, "first"))
    assert first.error is not None and "cannot load" in first.error.message
    assert h.manager.entry("broken").loads == 1
    # A storm meanwhile gets the reason at once, without a new load.
    for _ in range(20):
        with pytest.raises(InferdError) as e:
            _submit_x(h, None)
        assert "failed to load" in e.value.message and "cannot load" in e.value.message
    assert h.manager.entry("broken").loads == 1
    assert h.row("broken")["state"] == "failed"
    # Once the hold has passed, the next request tries again.
    wait_for(lambda: time.monotonic() - h.manager.entry("broken").failed_at > 0.3)
    again = h.reply(_submit_x(h, "again"))
    assert again.error is not None
    assert h.manager.entry("broken").loads == 2


def _submit_x(h: Harness, rid: str | None) -> str:
    rid = rid or f"x{next(h._seq)}"
    request = Request(rid, Op.INFER, "broken", None, {"x": np.zeros(1, np.float32)})
    h.manager.submit(Ticket(next(h._seq), time.monotonic(), request))
    return rid


@pytest.mark.slow
def test_idle_models_unload_after_keep_alive_unless_pinned_or_extended(
        models_dir: Path, short_tmp: Path, harness: Callable[..., Harness]) -> None:
    repo = make_repo(short_tmp / "repo", models_dir, FOUR, settings={
        "ocr-det": "keep_alive = 0.05\n", "vad": "keep_alive = 0.05\n",
        "ocr-cls": "pin = true\nkeep_alive = 0\n"})
    h = harness(repo, keep_alive="forever")
    h.manager.start()
    assert h.manager.load_pinned() == [] and h.manager.loaded() == ["ocr-cls"]  # pin = true
    assert h.infer("ocr-rec").ok                   # config default: forever
    assert h.infer("vad", keep_alive="1h").ok      # the request extends its keep-alive
    assert h.infer("ocr-det").ok
    wait_for(lambda: h.state("ocr-det") is State.UNLOADED)
    assert h.state("vad") is State.READY
    assert h.state("ocr-rec") is State.READY
    assert h.state("ocr-cls") is State.READY
    assert h.row("ocr-rec")["keep_alive_s"] is None  # forever
    with pytest.raises(InferdError) as e:
        h.submit("vad", keep_alive="soon")
    assert e.value.code is ErrorCode.INVALID_ARGUMENT


def test_versions_highest_by_default_pinned_kept_and_named(
        models_dir: Path, short_tmp: Path, harness: Callable[..., Harness]) -> None:
    cls3 = {1: "ocr-cls", 2: "ocr-cls", 3: "ocr-cls"}
    repo = make_repo(short_tmp / "repo", models_dir,
                     {"a": cls3, "b": cls3, "c": cls3},
                     settings={"b": "version = 2\n", "c": "keep_versions = 2\n"})
    specs = Repository(repo).scan()
    assert (specs["a"].default, specs["a"].versions) == (3, (1, 2, 3))
    assert (specs["b"].default, specs["b"].versions) == (2, (1, 2, 3))
    assert (specs["c"].default, specs["c"].versions) == (3, (2, 3))
    h = harness(repo)
    assert h.manager.entry("a").version == 3
    assert h.manager.entry("b").version == 2
    r = h.reply(_submit_named(h, "c", 2))
    assert r.ok
    assert h.manager.entry("c", 2).state is State.READY
    assert h.manager.entry("c").state is State.UNLOADED  # version 3 untouched
    with pytest.raises(InferdError) as e:
        _submit_named(h, "c", 1)  # not kept
    assert e.value.code is ErrorCode.NOT_FOUND and "available: 2, 3" in e.value.message


def _submit_named(h: Harness, model: str, version: int | None) -> str:
    rid = f"n{next(h._seq)}"
    request = Request(rid, Op.INFER, model, version, h.inputs["ocr-cls"])
    h.manager.submit(Ticket(next(h._seq), time.monotonic(), request))
    return rid


def test_bad_version_policy_is_reported_not_fatal(models_dir: Path, short_tmp: Path,
                                                  harness: Callable[..., Harness]) -> None:
    repo = make_repo(short_tmp / "repo", models_dir,
                     {"good": {1: "ocr-cls"}, "bad": {1: "ocr-cls"}},
                     settings={"bad": "version = 7\n"})
    h = harness(repo)
    rows = {m["name"]: m for m in h.manager.describe()}
    assert rows["bad"]["state"] == "failed"
    assert "pins version 7" in rows["bad"]["error"]
    assert rows["good"]["state"] == "unloaded"


@pytest.mark.slow
def test_warmup_runs_zeros_or_files_and_a_failing_warmup_fails_the_load(
        models_dir: Path, short_tmp: Path, harness: Callable[..., Harness]) -> None:
    repo = make_repo(short_tmp / "repo", models_dir,
                     {"ocr-det": {1: "ocr-det"}, "vad": {1: "vad"}, "bad": {1: "ocr-rec"}},
                     settings={"ocr-det": "warmup = true\n", "vad": "warmup = true\n",
                               "bad": "warmup = true\nwarmup_shapes = {x = [1, 3, 48]}\n"})
    h = harness(repo)
    warm = repo / "vad" / "1" / "warmup"
    warm.mkdir()
    for name, value in h.inputs["vad"].items():
        np.save(warm / f"{name}.npy", value)
    assert h.manager.load("ocr-det").state is State.READY
    assert h.manager.load("vad").state is State.READY
    with pytest.raises(InferdError) as e:
        h.manager.load("bad")
    assert "warm-up failed" in e.value.message
    assert h.row("bad")["state"] == "failed"


def test_unknown_model_lists_what_exists(models_dir: Path, short_tmp: Path,
                                         harness: Callable[..., Harness]) -> None:
    h = harness(make_repo(short_tmp / "repo", models_dir, {"ocr-cls": {1: "ocr-cls"}}))
    with pytest.raises(InferdError) as e:
        h.submit("ocr-cls", version=4)
    assert e.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(InferdError) as e:
        h.manager.entry("nope")
    assert e.value.code is ErrorCode.NOT_FOUND and "available: ocr-cls" in e.value.message


def test_full_queue_refuses_with_resource_exhausted(models_dir: Path, short_tmp: Path,
                                                    harness: Callable[..., Harness]) -> None:
    repo = make_repo(short_tmp / "repo", models_dir, {"ocr-cls": {1: "ocr-cls"}},
                     settings={"ocr-cls": "queue_size = 2\n"})
    h = harness(repo)
    h.hold["first"] = threading.Event()
    h.submit("ocr-cls", rid="first")  # runs; its reply blocks the only worker
    wait_for(lambda: h.manager.entry("ocr-cls").queue.empty()
             and h.state("ocr-cls") is State.READY)
    queued = [h.submit("ocr-cls") for _ in range(2)]
    with pytest.raises(InferdError) as e:
        h.submit("ocr-cls")
    assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED and "queue is full" in e.value.message
    h.hold["first"].set()
    assert all(h.reply(r).ok for r in ["first", *queued])
    wait_for(lambda: h.manager.entry("ocr-cls").in_flight == 0)


class Load(threading.Thread):
    """Requests to one model back to back through the harness; every failure kept."""

    def __init__(self, h: Harness, model: str) -> None:
        super().__init__(daemon=True)
        self.h, self.model = h, model
        self.ok, self.failures = 0, []  # type: ignore[var-annotated]
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                reply = self.h.infer(self.model)
            except InferdError as e:
                self.failures.append(e.message)
                continue
            if reply.ok:
                self.ok += 1
            else:
                self.failures.append(reply.error)


@pytest.mark.slow
@pytest.mark.parametrize("fits_both", [True, False])
def test_reload_swaps_a_new_version_in_under_load(
        models_dir: Path, short_tmp: Path, harness: Callable[..., Harness],
        fits_both: bool, caplog: pytest.LogCaptureFixture) -> None:
    # Version 1 is the text recognizer, version 2 the smaller direction classifier: both
    # take a (1, 3, 48, 192) image. Two versions of one size made the outcome hang on
    # the noise of in-process measurements (an RSS delta of this whole process: ocr-det
    # measured 15.5 to 21.8 MiB over six loads here, and a margin of half a model failed
    # in CI); with these the budget's margins are a whole model wide.
    repo = make_repo(short_tmp / "repo", models_dir,
                     {"text": {1: "ocr-rec"}, "vad": {1: "vad"}})
    h = harness(repo, max_memory="unlimited", preload=["vad"])
    h.inputs["text"] = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    m = h.manager
    m.load("text")
    m.load("vad")
    load = Load(h, "text")
    load.start()
    wait_for(lambda: load.ok >= 3, why=load.failures)
    # What the cache counts once version 1 ran: the engines imported, vad, version 1's
    # load and the working memory its runs measured.
    used = m.used()
    v1 = m.budget.cost(m.entry("text"))
    assert v1 and used > v1
    (repo / "text" / "2").mkdir()
    link_file(models_dir / "ocr-cls" / "1" / "model.onnx", repo / "text" / "2" / "model.onnx")
    # Either room for version 2 beside version 1 (twice version 1's cost), or none at all:
    # not even for version 2's file (the least its load reserves before it is measured),
    # so the swap drains version 1 first, and version 2 then has version 1's room.
    size = (repo / "text" / "2" / "model.onnx").stat().st_size
    budget = used + (2 * v1 if fits_both else size // 2)
    config = load_config(None, {"models.repository": str(repo), "models.preload": ["vad"],
                                "cache.max_memory": budget})
    caplog.set_level(logging.INFO, "inferd.daemon.reload")
    assert h.reload(config)["changed"] == ["text: version 1 -> 2"]
    before = load.ok  # from here every request goes to version 2 (the old one served
    wait_for(lambda: load.ok >= before + 3,  # those that came during the reload)
             why=load.failures)
    load.halt.set()
    load.join(30)
    assert load.failures == []
    assert h.row("text")["version"] == 2 and h.row("text")["requests"] > 0
    assert h.state("text", 2) is State.READY
    assert [r["version"] for r in m.describe() if r["name"] == "text"] == [2]
    assert h.state("vad") is State.READY  # pinned
    replaced = "versions 1 and 2 do not fit together" in caplog.text
    assert replaced is not fits_both


def test_room_for_a_new_input_size_is_made_off_the_worker_thread(
        models_dir: Path, short_tmp: Path, harness: Callable[..., Harness],
        caplog: pytest.LogCaptureFixture) -> None:
    repo = make_repo(short_tmp / "repo", models_dir,
                     {"ocr-det": {1: "ocr-det"}, "ocr-cls": {1: "ocr-cls"}})
    h = harness(repo, max_memory="unlimited")
    m = h.manager
    assert h.infer("ocr-det").ok and h.infer("ocr-cls").ok
    wait_for(lambda: h.row("ocr-det")["in_flight"] == 0 == h.row("ocr-cls")["in_flight"])
    det, cls = h.row("ocr-det")["memory_bytes"], h.row("ocr-cls")["memory_bytes"]
    # A larger detector input: its graph's estimate (~18 MiB) fits beside the detector,
    # not beside both models, so the idle classifier must go first.
    h.inputs["ocr-det"] = {"x": np.zeros((1, 3, 320, 320), np.float32)}
    need = m.entry("ocr-det").memory.working.estimate(h.inputs["ocr-det"]).bytes
    m.config.cache.max_memory = sum(m.budget.engines().values()) + det + need + cls // 2
    caplog.set_level(logging.INFO, "inferd.daemon.models")
    assert h.infer("ocr-det").ok
    assert h.state("ocr-cls") is State.UNLOADED
    [evicted] = [r for r in caplog.records if "ocr-cls version 1 unloaded: evicted" in
                 r.getMessage()]
    assert evicted.threadName.startswith("inferd-cache-evict"), evicted.threadName
    assert m.cache_status()["used_bytes"] <= m.config.cache.max_memory
