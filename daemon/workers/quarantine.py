"""Who keeps killing a worker: a death is charged to the clients (uids) whose requests
the worker was running. A client charged with ``[workers] refuse_client_after`` deaths
of one model's workers within a minute is refused for that model for
``refuse_client_s``; a model whose runs killed its worker for ``set_aside_after``
different clients within a minute is set aside until it is reloaded or its files change.
One client cannot keep knocking out its neighbours, nor get a model set aside for
everyone on its own.

Pure bookkeeping, under one lock: the model threads charge deaths, the I/O thread asks
before queueing a request (a dict look-up).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

from inferd.ipc.errors import ErrorCode, InferdError

log = logging.getLogger(__name__)

WINDOW_S = 60.0


class Quarantine:
    """Deaths by model and client, refusals and set-aside models.

    Args:
        refuse_after: deaths charged to one client within a minute that refuse it.
        refuse_s: how long a refused client stays refused.
        set_aside_after: distinct clients whose runs killed the model's worker within a
            minute that set the model aside.
    """

    def __init__(self, refuse_after: int = 5, refuse_s: float = 60.0,
                 set_aside_after: int = 3) -> None:
        self.refuse_after = refuse_after
        self.refuse_s = refuse_s
        self.set_aside_after = set_aside_after
        self._lock = threading.Lock()
        self._deaths: dict[tuple[str, object], deque[float]] = {}
        self._killers: dict[str, dict[object, float]] = {}  # model -> client -> last death
        self._refused: dict[tuple[str, object], float] = {}  # -> refused until
        self.set_aside: dict[str, str] = {}  # model -> reason

    def death(self, model: str, clients: Iterable[object], how: str) -> None:
        """A worker running ``model`` for ``clients`` (uids; None for the daemon's own
        callers: warm-up, placement's measuring runs; a graph's node runs as the graph's
        client) ended (``how``: the error's message)."""
        now = time.monotonic()
        with self._lock:
            for client in set(clients):
                if client is None:
                    continue
                times = self._deaths.setdefault((model, client), deque())
                times.append(now)
                while times and now - times[0] > WINDOW_S:
                    times.popleft()
                killers = self._killers.setdefault(model, {})
                killers[client] = now
                if len(times) >= self.refuse_after and (model, client) not in self._refused:
                    self._refused[(model, client)] = now + self.refuse_s
                    log.warning("model %s: uid %s refused for %g s: its requests were "
                                "running at %d worker deaths within %g s "
                                "(workers.refuse_client_after)", model, client,
                                self.refuse_s, len(times), WINDOW_S,
                                extra={"MODEL": model, "UID": client})
            killers = self._killers.get(model, {})
            for client, at in list(killers.items()):
                if now - at > WINDOW_S:
                    del killers[client]
            if len(killers) >= self.set_aside_after and model not in self.set_aside:
                uids = ", ".join(str(c) for c in sorted(killers, key=str))
                reason = (f"set aside: its runs killed its worker for {len(killers)} clients "
                          f"within {WINDOW_S:g} s (uids {uids}; last: {how}); reload the "
                          f"daemon or change its files to serve it again")
                self.set_aside[model] = reason
                log.error("model %s %s", model, reason, extra={"MODEL": model})

    def check(self, model: str, client: object) -> None:
        """Raise the refusal of ``client``'s request for ``model``, if any."""
        if not self._refused and not self.set_aside:
            return  # the common case: nothing to look up
        with self._lock:
            reason = self.set_aside.get(model)
            if reason is not None:
                raise InferdError(f"model {model} is {reason}", ErrorCode.UNAVAILABLE)
            until = self._refused.get((model, client))
            if until is None:
                return
            left = until - time.monotonic()
            if left <= 0:
                del self._refused[(model, client)]
                self._deaths.pop((model, client), None)
                return
        raise InferdError(f"model {model}: uid {client} is refused for {left:.0f} s more: "
                          f"its requests were running at {self.refuse_after} deaths of the "
                          f"model's worker within {WINDOW_S:g} s "
                          f"(workers.refuse_client_after)", ErrorCode.UNAVAILABLE)

    def lift(self, model: str | None = None) -> None:
        """Forget ``model``'s deaths, refusals and set-aside (all models: None): a reload,
        or its files changed."""
        with self._lock:
            if model is None:
                self._deaths.clear()
                self._killers.clear()
                self._refused.clear()
                lifted = list(self.set_aside)
                self.set_aside.clear()
            else:
                for key in [k for k in self._deaths if k[0] == model]:
                    del self._deaths[key]
                for key in [k for k in self._refused if k[0] == model]:
                    del self._refused[key]
                self._killers.pop(model, None)
                lifted = [model] if self.set_aside.pop(model, None) else []
        for name in lifted:
            log.info("model %s is served again (set aside until now)", name,
                     extra={"MODEL": name})
