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
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
        self.requests = Counter("inferd_requests", "Requests answered, by model (or graph) "
                                "and result code", ["model", "code"], registry=r)
        self.request_seconds = Histogram(
            "inferd_request_seconds", "Time from receipt to reply, by model or graph",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "inferd_queue_wait_seconds", "Time from receipt until the model starts running "
            "the request (queue and pre-processing)", ["model"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.run_seconds = Histogram(
            "inferd_run_seconds", "Time of one model run (one batch)", ["model"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "inferd_batch_size", "Requests per model run", ["model"], buckets=BATCH_BUCKETS,
            registry=r)
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
        self.requests.labels(name, ticket.code or OK).inc()
        self.request_seconds.labels(name).observe(ticket.answered - ticket.received)

    def for_model(self, name: str) -> Callable[[list[Any], float, float], None]:
        """The workers' run hook for ``name``: (tickets, started, seconds)."""
        wait, run, batch = (self.queue_wait.labels(name), self.run_seconds.labels(name),
                            self.batch_size.labels(name))

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


class _StateCollector(Collector):
    """Gauges read from the runtime at collection time."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._proc = psutil.Process()

    def collect(self) -> Iterator[Metric]:
        rt = self.runtime
        models = rt.models.describe() + rt.graphs.describe()
        families = {
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
