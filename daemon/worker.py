"""Per-model worker threads: take requests from the model's bounded queue, run them on
the loaded model, and hand each reply back to the I/O thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.ipc.errors import ErrorCode, InferdError
from inferd.ipc.protocol import Reply, Request
from inferd.ipc.server import Ticket
from inferd.libbackends.contract import LoadedModel, check_inputs, check_outputs

log = logging.getLogger(__name__)

STOP = None
"""Queue sentinel: one per worker thread ends it after everything queued before it."""


@dataclass
class WorkItem:
    request: Request
    ticket: Ticket


ReplyFn = Callable[[Ticket, Reply], None]


def error_for(item: WorkItem, code: ErrorCode, message: str) -> Reply:
    return Reply(id=item.request.id, error=(code, message))


class Workers:
    """The inference threads of one loaded model.

    Args:
        name: model name, used in thread names (``inferd-<model>-infer-<i>``) and logs.
        model: the loaded model.
        work: the model's bounded request queue (shared with the model entry).
        reply: sends a reply for a ticket (any thread).
        release: called by each thread on exit (closes its reply socket).
        instances: number of threads.
        on_done: called after each request with whether it succeeded.
    """

    def __init__(self, name: str, model: LoadedModel, work: queue.Queue[WorkItem | None],
                 reply: ReplyFn, release: Callable[[], None], instances: int = 1,
                 on_done: Callable[[bool], None] | None = None) -> None:
        self.name = name
        self.model = model
        self._work = work
        self._reply = reply
        self._release = release
        self._on_done = on_done
        self.threads = [threading.Thread(target=self._loop, name=f"inferd-{name}-infer-{i}",
                                         daemon=True)
                        for i in range(instances)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Queue one sentinel per thread and join; True if all threads ended in time."""
        for _ in self.threads:
            self._work.put(STOP)
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def _loop(self) -> None:
        try:
            while True:
                item = self._work.get()
                if item is STOP:
                    return
                reply = self.run_one(item)
                self._reply(item.ticket, reply)
                if self._on_done:
                    self._on_done(reply.ok)
        finally:
            self._release()

    def run_one(self, item: WorkItem) -> Reply:
        """Run one request; every failure becomes that request's error reply."""
        req = item.request
        if item.ticket.expired():
            return error_for(item, ErrorCode.DEADLINE_EXCEEDED,
                             f"model {self.name}: deadline of {req.timeout_ms} ms passed "
                             f"while the request was queued")
        try:
            check_inputs(self.name, self.model.inputs, req.inputs)
            check_outputs(self.name, self.model.outputs, req.outputs)
            outputs = self.model.run(req.inputs, req.outputs)
        except InferdError as e:
            return error_for(item, e.code, e.message)
        except Exception as e:  # a backend bug must not kill the worker
            log.exception("model %s: request %s failed", self.name, req.id,
                          extra={"MODEL": self.name, "REQUEST_ID": req.id})
            return error_for(item, ErrorCode.INTERNAL,
                             f"model {self.name}: {type(e).__name__}: {e}")
        return Reply(id=req.id, outputs=outputs)
