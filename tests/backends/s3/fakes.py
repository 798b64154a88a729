"""A scriptable fake S3 endpoint: each test says how it answers, and sees what it received."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["FakeStore", "Received", "fake_store"]


@dataclass
class Received:
    """One request as the fake store saw it."""

    method: str
    path: str
    at: float
    headers: dict[str, str]
    body: bytes = b""


Handler = Callable[[http.server.BaseHTTPRequestHandler, Received], None]


@dataclass
class FakeStore:
    """The running fake: its URL, the requests it received, and a flag set when answers end."""

    url: str
    received: list[Received] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def requests(self, method: str | None = None) -> list[Received]:
        with self.lock:
            return [r for r in self.received if method is None or r.method == method]


@contextmanager
def fake_store(answer: Handler, *, read_body: bool = True) -> Iterator[FakeStore]:
    """Serve ``answer(handler, request)`` for every request on 127.0.0.1; stop on exit.

    With ``read_body`` the request body is read (by ``Content-Length``) before ``answer`` runs;
    otherwise ``answer`` reads it (or not) itself.
    """
    store: FakeStore

    class _Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            request = Received(
                method=self.command, path=self.path, at=time.monotonic(), headers=dict(self.headers)
            )
            if read_body:
                length = int(self.headers.get("Content-Length") or 0)
                request.body = self.rfile.read(length) if length else b""
            with store.lock:
                store.received.append(request)
            try:
                answer(self, request)
            except OSError:  # the client gave up and closed the connection
                self.close_connection = True

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _serve

        def log_message(self, format: str, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    store = FakeStore(url=f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield store
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def error_response(
    handler: http.server.BaseHTTPRequestHandler,
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer with an S3 XML error."""
    body = (
        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
        f"<Message>{message}</Message></Error>"
    ).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)
    handler.wfile.flush()
