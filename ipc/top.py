"""``inferctl top``: a live table of the daemon's models from its ``metrics`` op,
refreshed each second (``--once``: one table, for scripts and tests).

Rates (requests/s) come from the difference between two refreshes; the first table,
and ``--once``, show totals only. Latencies are means over the daemon's lifetime (the
histograms' sum over count), and over the last interval once there is one.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from typing import Any

from inferd.ipc.client import Client

Samples = list[list[Any]]


def _by_model(samples: Samples, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for n, labels, value in samples:
        if n == name and "model" in labels:
            out[labels["model"]] += value
    return out


def _one(samples: Samples, name: str) -> float | None:
    return next((v for n, _, v in samples if n == name), None)


def summarize(samples: Samples, before: Samples | None = None,
              elapsed: float | None = None) -> dict[str, Any]:
    """Per model: state, requests, errors, req/s, queue, in flight, mean queue wait and
    run time (ms), mean batch size, memory; and the process figures."""
    requests = _by_model(samples, "inferd_requests_total")
    ok = _by_model([s for s in samples if s[1].get("code") == "OK"], "inferd_requests_total")
    prev = _by_model(before, "inferd_requests_total") if before else {}
    sums = {k: _by_model(samples, f"inferd_{k}_sum") for k in
            ("queue_wait_seconds", "run_seconds", "batch_size")}
    counts = {k: _by_model(samples, f"inferd_{k}_count") for k in
              ("queue_wait_seconds", "run_seconds", "batch_size")}
    queue = _by_model(samples, "inferd_model_queue_depth")
    in_flight = _by_model(samples, "inferd_model_in_flight")
    memory = _by_model(samples, "inferd_model_memory_bytes")
    working = _by_model(samples, "inferd_model_working_memory_bytes")
    states: dict[str, str] = {}
    for n, labels, value in samples:
        if n == "inferd_model_state" and value:
            if states.get(labels["model"]) != "ready":  # any ready version wins
                states[labels["model"]] = labels["state"]

    def mean(kind: str, model: str, scale: float = 1.0) -> float | None:
        c = counts[kind].get(model, 0)
        return sums[kind][model] / c * scale if c else None

    models = {}
    for m in sorted(set(states) | set(requests)):
        rate = None
        if before is not None and elapsed:
            rate = (requests.get(m, 0) - prev.get(m, 0)) / elapsed
        models[m] = {
            "state": states.get(m, "-"),
            "requests": int(requests.get(m, 0)),
            "errors": int(requests.get(m, 0) - ok.get(m, 0)), "rate": rate,
            "queued": int(queue.get(m, 0)), "in_flight": int(in_flight.get(m, 0)),
            "wait_ms": mean("queue_wait_seconds", m, 1000),
            "run_ms": mean("run_seconds", m, 1000),
            "batch": mean("batch_size", m),
            "memory_bytes": int(memory.get(m, 0)), "working_bytes": int(working.get(m, 0)),
        }
    return {"models": models,
            "process": {"rss_bytes": _one(samples, "inferd_process_resident_memory_bytes"),
                        "open_peers": _one(samples, "inferd_open_peers"),
                        "uptime_s": _one(samples, "inferd_uptime_seconds"),
                        "cache_used_bytes": _one(samples, "inferd_cache_used_bytes"),
                        "cache_budget_bytes": _one(samples, "inferd_cache_budget_bytes")}}


def _mib(n: Any) -> str:
    return f"{n / 2**20:.1f}M" if isinstance(n, int | float) and n else "-"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, int | float) else "-"


def render(summary: dict[str, Any]) -> str:
    """The table ``inferctl top`` shows."""
    p = summary["process"]
    budget = p["cache_budget_bytes"]
    head = (f"inferd  up {_num(p['uptime_s'], '.0f')} s  rss {_mib(p['rss_bytes'])}  "
            f"peers {_num(p['open_peers'], '.0f')}  cache {_mib(p['cache_used_bytes'])}"
            f" of {_mib(budget) if budget else 'unlimited'}")
    header = ["MODEL", "STATE", "REQ/S", "REQUESTS", "ERRORS", "QUEUE", "INFLIGHT",
              "WAIT ms", "RUN ms", "BATCH", "MEMORY", "WORKING"]
    rows = [header]
    for name, m in summary["models"].items():
        rows.append([name, m["state"], _num(m["rate"], ".1f"), str(m["requests"]),
                     str(m["errors"]), str(m["queued"]), str(m["in_flight"]),
                     _num(m["wait_ms"], ".2f"), _num(m["run_ms"], ".2f"),
                     _num(m["batch"], ".1f"), _mib(m["memory_bytes"]),
                     _mib(m["working_bytes"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, ""] + lines)


def run_top(client: Client, once: bool = False, interval: float = 1.0,
            as_json: bool = False) -> int:
    """Show the table (once, or refreshed every ``interval`` s until Ctrl-C)."""
    before: Samples | None = None
    taken = 0.0
    try:
        while True:
            samples = client.call("metrics")["samples"]
            now = time.monotonic()
            summary = summarize(samples, before, now - taken if before else None)
            if as_json:
                print(json.dumps(summary), flush=True)
            else:
                if not once:
                    sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: like top
                print(render(summary), flush=True)
            if once:
                return 0
            before, taken = samples, now
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
