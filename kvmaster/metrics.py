"""HTTP endpoint for operators: ``/metrics`` (Prometheus text), ``/health``, ``/ready``.

Placeholder serving ``/health`` only; the full exporter replaces it.
"""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MetricsServer:
    """Runs an HTTP server thread; reads master state only through ``master.snapshot()``
    scheduled on the master's event loop."""

    def __init__(self, master: Any, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        self.master = master
        self.loop = loop
        self.host = host
        self.port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                ok = self.path == "/health" and outer.master.state.value == "running"
                self.send_response(200 if ok else 404)
                self.end_headers()
                self.wfile.write(b"ok\n" if ok else b"not found\n")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="kvmaster-metrics")
        self._thread.start()
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
