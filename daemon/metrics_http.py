"""The optional HTTP endpoint of the metrics (``[metrics] listen``): ``GET /metrics`` on
localhost or on a unix socket, nothing else. The address is checked when the config is
read (:func:`parse_listen`): the daemon never exposes its metrics to the network.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socketserver
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from inferd.ipc.runfiles import check_directory

log = logging.getLogger(__name__)

LOCAL_NAMES = ("localhost", "ip6-localhost")


@dataclass(frozen=True)
class Listen:
    """Where the endpoint listens: a unix socket path, or a loopback host and port."""

    unix: str | None = None
    host: str = ""
    port: int = 0

    def describe(self) -> str:
        return f"unix:{self.unix}" if self.unix else f"http://{self.host}:{self.port}/metrics"


def parse_listen(value: Any) -> Listen | None:
    """``""`` (off), ``"unix:/run/inferd/metrics.sock"``, ``"localhost:9464"``,
    ``"127.0.0.1:9464"`` or ``"[::1]:9464"``. Raises ValueError for anything else: an
    address that is not loopback is refused."""
    if not isinstance(value, str):
        raise ValueError
    if value == "":
        return None
    if value.startswith("unix:"):
        path = value.removeprefix("unix:")
        if not path.startswith("/"):
            raise ValueError
        return Listen(unix=path)
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host not in LOCAL_NAMES:
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError
        except ValueError:
            raise ValueError from None
    return Listen(host="127.0.0.1" if host == "localhost" else
                  "::1" if host == "ip6-localhost" else host, port=int(port))


class _Handler(BaseHTTPRequestHandler):
    text: Any = None  # set per server: () -> str

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is here")
            return
        body = type(self).text().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return str(self.client_address or "unix")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics endpoint: " + format, *args)


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def server_bind(self) -> None:
        socketserver.UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "localhost", 0


class _IPv6HTTPServer(ThreadingHTTPServer):
    import socket as _socket
    address_family = _socket.AF_INET6


class MetricsEndpoint:
    """Serves ``text()`` at ``listen`` on the ``inferd-metrics-http`` thread."""

    def __init__(self, listen: Listen, text: Any) -> None:
        handler = type("MetricsHandler", (_Handler,), {"text": staticmethod(text)})
        self.listen = listen
        self._server: socketserver.BaseServer
        if listen.unix:
            path = Path(listen.unix)
            check_directory(path)  # no socket where others could plant links
            if path.is_socket():
                path.unlink()
            self._server = _UnixHTTPServer(listen.unix, handler)
            os.chmod(listen.unix, 0o660)
        else:
            cls = _IPv6HTTPServer if ":" in listen.host else ThreadingHTTPServer
            self._server = cls((listen.host, listen.port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="inferd-metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics served at %s", self.listen.describe())

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        if self.listen.unix:
            Path(self.listen.unix).unlink(missing_ok=True)
