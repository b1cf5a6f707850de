"""The operator's view: Prometheus metrics of one runtime (docs/metrics.md).

Counters and histograms are fed by small hooks: every answered request for a model or
a graph (:meth:`Metrics.count`, reading the request's ticket: the server calls it where
every wire reply passes, the reply sink for the in-process calls of graph nodes), every
model run (:meth:`Metrics.for_model`, called by the workers),
every load and unload (:meth:`Metrics.loaded`, :meth:`Metrics.unloaded`). Gauges (queue
depth, memory, states, backends, process) are read from the runtime when the metrics are
collected. They are exposed three ways: a textfile for node_exporter's textfile collector
rewritten atomically by the ``inferd-metrics`` thread, the ``metrics`` protocol op, and
optionally an HTTP endpoint on localhost or a unix socket (daemon/metrics_http.py).
"""

from __future__ import annotations

import logging
import bisect
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from inferd.ipc.replies import OK, AnyTicket
from inferd.ipc.runfiles import UnsafePath, check_directory, replace_file

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

if hasattr(prometheus_client, "disable_created_metrics"):  # 0.17+ (Debian 12 has 0.16)
    prometheus_client.disable_created_metrics()  # *_created series: noise in a textfile


class Metrics:
    """Every metric of one runtime, in its own registry.

    Args:
        runtime: the :class:`~inferd.daemon.runtime.Runtime` whose state the gauges read
            (its ``models``, ``graphs``, ``registry``, ``config`` and ``started``).
    """

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        # Per request and per run: plain tallies (a bisect and a few additions under one
        # lock), read when the metrics are collected; prometheus_client's own Counter
        # and Histogram cost several microseconds per update on the request path.
        self.requests = _Counts("inferd_requests", "Requests answered, by model (or graph) "
                                "and result code", ("model", "code"))
        self.request_seconds = _Histograms(
            "inferd_request_seconds", "Time from receipt to reply, by model or graph",
            LATENCY_BUCKETS)
        self.queue_wait = _Histograms(
            "inferd_queue_wait_seconds", "Time from receipt until the model starts running "
            "the request (queue and pre-processing)", LATENCY_BUCKETS)
        self.run_seconds = _Histograms(
            "inferd_run_seconds", "Time of one model run (one batch)", LATENCY_BUCKETS)
        self.batch_size = _Histograms(
            "inferd_batch_size", "Requests per model run", BATCH_BUCKETS)
        r.register(_Tallies([self.requests, self.request_seconds, self.queue_wait,
                             self.run_seconds, self.batch_size]))
        self.loads = Counter("inferd_model_loads", "Model loads, by result", ["model", "result"],
                             registry=r)
        self.load_seconds = Histogram("inferd_model_load_seconds", "Time to load and warm up "
                                      "a model", ["model"], buckets=LOAD_BUCKETS, registry=r)
        self.unloads = Counter("inferd_model_unloads", "Model unloads (idle, requested, "
                               "evicted, replaced)", ["model"], registry=r)
        self.evictions = Counter("inferd_model_evictions", "Unloads to make room in the "
                                 "cache budget", ["model"], registry=r)
        r.register(_StateCollector(runtime))

    # ----------------------------------------------------------------- hooks

    def count(self, ticket: AnyTicket) -> None:
        """Count an answered request (any thread) as its ticket says: under the model
        or graph an ``infer`` named, by its outcome, with its time from receipt to
        reply. Tickets of other ops (``model`` None) are not counted."""
        name = ticket.model
        if name is None or ticket.answered is None:
            return
        self.requests.inc((name, ticket.code or OK))
        self.request_seconds.observe(name, ticket.answered - ticket.received)

    def answered(self, name: str) -> tuple[int, int]:
        """The infer requests for the model or graph ``name`` answered since the daemon
        started, as :meth:`count` counted them: (OK, any other code)."""
        codes = self.requests.of(name)
        ok = codes.pop(OK, 0)
        return ok, sum(codes.values())

    def for_model(self, name: str) -> Callable[[list[Any], float, float], None]:
        """The workers' run hook for ``name``: (tickets, started, seconds)."""
        wait, run, batch = (self.queue_wait.child(name), self.run_seconds.child(name),
                            self.batch_size.child(name))

        def observe(tickets: list[Any], started: float, seconds: float) -> None:
            run.observe(seconds)
            batch.observe(len(tickets))
            for t in tickets:
                wait.observe(max(0.0, started - t.received))
        return observe

    def loaded(self, name: str, seconds: float, ok: bool) -> None:
        self.loads.labels(name, "ok" if ok else "failed").inc()
        if ok:
            self.load_seconds.labels(name).observe(seconds)

    def unloaded(self, name: str, evicted: bool) -> None:
        self.unloads.labels(name).inc()
        if evicted:
            self.evictions.labels(name).inc()

    # ----------------------------------------------------------------- output

    def text(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()

    def samples(self) -> list[list[Any]]:
        """Every sample as ``[name, labels, value]`` (the ``metrics`` op)."""
        return [[s.name, s.labels, s.value] for family in self.registry.collect()
                for s in family.samples]


class _Histogram:
    """One histogram's tallies: a count per bucket (the last one past every bound) and
    the sum, cumulated only when collected."""

    __slots__ = ("bounds", "counts", "sum", "_lock")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value (le)
        with self._lock:
            self.counts[i] += 1
            self.sum += value

    def read(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self.counts), self.sum


class _Histograms:
    """A histogram family with one label, ``model``."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._children: dict[str, _Histogram] = {}
        self._lock = threading.Lock()

    def child(self, model: str) -> _Histogram:
        child = self._children.get(model)
        if child is None:
            with self._lock:
                child = self._children.setdefault(model, _Histogram(self.bounds))
        return child

    def observe(self, model: str, value: float) -> None:
        self.child(model).observe(value)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        for model, child in list(self._children.items()):
            counts, total = child.read()
            cumulative, running = [], 0
            for le, n in zip(self._les, counts):
                running += n
                cumulative.append((le, float(running)))
            family.add_metric([model], cumulative, total)
        return family


class _Counts:
    """A counter family by label values."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self._values: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def inc(self, key: tuple[str, ...]) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0) + 1

    def of(self, first: str) -> dict[str, int]:
        """The counts whose first label value is ``first``, by the second's value."""
        with self._lock:
            return {key[1]: n for key, n in self._values.items() if key[0] == first}

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        with self._lock:
            values = list(self._values.items())
        for key, n in values:
            family.add_metric(list(key), float(n))
        return family


class _Tallies(Collector):
    """The per-request families, in their order."""

    def __init__(self, families: list[_Counts | _Histograms]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            yield f.family()


class _StateCollector(Collector):
    """Gauges read from the runtime at collection time."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._proc = psutil.Process()

    def collect(self) -> Iterator[Metric]:
        rt = self.runtime
        models = rt.models.describe() + rt.graphs.describe()
        families: dict[str, Any] = {
            "queue": GaugeMetricFamily("inferd_model_queue_depth", "Requests waiting in "
                                       "the model's queue", labels=["model", "version"]),
            "in_flight": GaugeMetricFamily("inferd_model_in_flight", "Requests queued or "
                                           "running", labels=["model", "version"]),
            "memory": GaugeMetricFamily("inferd_model_memory_bytes", "What the model counts "
                                        "against the cache budget (load cost plus working "
                                        "memory)", labels=["model", "version"]),
            "working": GaugeMetricFamily("inferd_model_working_memory_bytes", "Largest "
                                         "working memory measured while the model ran",
                                         labels=["model", "version"]),
            "state": GaugeMetricFamily("inferd_model_state", "1 for the model's current "
                                       "state", labels=["model", "version", "state"]),
            "streams": GaugeMetricFamily("inferd_streams", "Stateful streams open on the "
                                         "model (docs/streams.md)",
                                         labels=["model", "version"]),
            "streams_expired": CounterMetricFamily("inferd_streams_expired", "Streams freed "
                                                   "after idle_timeout_s",
                                                   labels=["model", "version"]),
            "streams_lost": CounterMetricFamily("inferd_streams_lost", "Streams whose state "
                                                "was lost (a failed chunk, an unload)",
                                                labels=["model", "version"]),
            "batch": GaugeMetricFamily("inferd_model_batch_limit", "Rows a batch of the "
                                       "loaded model may hold now (adaptive batching's "
                                       "choice, at most max_batch)",
                                       labels=["model", "version"]),
        }
        for m in models:
            labels = [m["name"], str(m.get("version") or "-")]
            if m.get("kind") == "graph":
                families["state"].add_metric(labels + [m["state"]], 1)
                continue
            families["queue"].add_metric(labels, m.get("queued") or 0)
            families["in_flight"].add_metric(labels, m.get("in_flight") or 0)
            families["memory"].add_metric(labels, m.get("memory_bytes") or 0)
            families["working"].add_metric(labels, m.get("memory_working_bytes") or 0)
            families["state"].add_metric(labels + [m["state"]], 1)
            families["streams"].add_metric(labels, m.get("streams") or 0)
            families["streams_expired"].add_metric(labels, m.get("streams_expired") or 0)
            families["streams_lost"].add_metric(labels, m.get("streams_lost") or 0)
            batching = m.get("batching") or {}
            if "limit" in batching:  # loaded
                families["batch"].add_metric(labels, batching["limit"])
        yield from families.values()
        stuck = GaugeMetricFamily("inferd_stuck_stages", "Stage threads inside one call "
                                  "for longer than models.stuck_after_s", labels=["model"])
        for owner, stages in rt.watch.stuck().items():
            stuck.add_metric([owner], len(stages))
        yield stuck
        backends = GaugeMetricFamily("inferd_backend_up", "1 if the backend is registered "
                                     "and usable, else 0", labels=["backend", "kind",
                                                                   "status"])
        for b in rt.registry.describe():
            backends.add_metric([b["id"], str(b["kind"]), b["status"]],
                                1 if b["status"] == "registered" else 0)
        yield backends
        cache = rt.models.cache_status()
        yield GaugeMetricFamily("inferd_cache_used_bytes", "Memory the loaded models count "
                                "against the budget", value=cache["used_bytes"])
        yield GaugeMetricFamily("inferd_cache_budget_bytes", "The cache budget "
                                "(cache.max_memory); 0: unlimited",
                                value=cache["max_memory_bytes"] or 0)
        yield GaugeMetricFamily("inferd_process_resident_memory_bytes", "Resident memory "
                                "of the daemon process", value=self._proc.memory_info().rss)
        if rt.workers is not None:
            restarts = CounterMetricFamily("inferd_worker_restarts", "Worker processes that "
                                           "died (signal, exit) or were killed, by backend "
                                           "and reason", labels=["backend", "reason"])
            for (backend, reason), n in sorted(rt.workers.restarts.items()):
                restarts.add_metric([backend, reason], n)
            yield restarts
            workers = GaugeMetricFamily("inferd_workers", "Worker processes running")
            workers.add_metric([], len(rt.workers.pids()))
            yield workers
        yield GaugeMetricFamily("inferd_open_peers", "Client connections open on the "
                                "daemon's ipc socket", value=open_peers(rt.config.server.socket))
        yield GaugeMetricFamily("inferd_uptime_seconds", "Seconds since the daemon started",
                                value=time.time() - rt.started)


def open_peers(endpoint: str) -> int:
    """Connected sockets on the ipc endpoint's path (/proc/net/unix: accepted
    connections carry the listening socket's path; state 03 is connected)."""
    if not endpoint.startswith("ipc://"):
        return 0
    path = endpoint.removeprefix("ipc://")
    count = 0
    try:
        with open("/proc/net/unix", "rb") as f:
            next(f, None)
            target = os.fsencode(path)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7] == target and fields[5] == b"03":
                    count += 1
    except OSError:
        return 0
    return count


def textfile_wanted(path: Path, under_systemd: bool) -> bool:
    """Whether to write the metrics textfile at ``path``, decided once at start.

    Under systemd always: the unit makes its directory (``RuntimeDirectory=``), so a
    failure to write there is worth the writer's warning. Elsewhere (the source tree's
    ``make run`` with the shipped config, a test) only where its directory exists and
    this process may write into it; if not, one INFO line says so and there is no
    textfile (the ``metrics`` op, ``inferctl top`` and ``[metrics] listen`` still serve
    the metrics).
    """
    if under_systemd:
        return True
    directory = path.parent
    if os.access(directory, os.W_OK | os.X_OK):
        return True
    why = "does not exist" if not directory.is_dir() else "is not writable by this user"
    log.info("metrics textfile %s off: its directory %s %s and inferd was not started by "
             "systemd (set [metrics] textfile to a writable path, or \"\" to say none)",
             path, directory, why)
    return False


class TextfileWriter:
    """Rewrites the metrics textfile atomically every ``interval`` seconds on the
    ``inferd-metrics`` thread (and once more at stop).

    Args:
        metrics: what to write.
        path: the file (node_exporter's textfile collector reads ``*.prom``).
        interval: seconds between writes.
    """

    def __init__(self, metrics: Metrics, path: Path, interval: float) -> None:
        self.metrics = metrics
        self.path = path
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        self.write()
        self._thread = threading.Thread(target=self._loop, name="inferd-metrics",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def write(self) -> None:
        """Write the file once: to a new temporary file beside it, then rename over it
        (:func:`~inferd.ipc.runfiles.replace_file`: never through a planted link; a
        directory every user may write into, without a sticky bit, is refused)."""
        try:
            check_directory(self.path)
            replace_file(self.path, self.metrics.text())
        except UnsafePath as e:
            if not self._failing:
                log.error("%s (metrics.textfile)", e.message)
            self._failing = True
            return
        except OSError as e:
            if not self._failing:  # once, not every few seconds
                log.warning("cannot write the metrics textfile %s (metrics.textfile): %s",
                            self.path, e.strerror)
            self._failing = True
            return
        except Exception:  # a collector failing must not end the thread
            log.exception("writing the metrics textfile %s failed", self.path)
            return
        if self._failing:
            log.info("metrics textfile %s written again", self.path)
        self._failing = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.write()


def sample_value(samples: Iterable[list[Any]], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == x for k, x in labels.items()))
