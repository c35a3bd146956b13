"""Real HTTP receivers for the notify tests: a threaded http.server on 127.0.0.1 that answers from a script and
records every request it gets (method, path, headers, raw body, arrival time); and the channels and events the
delivery tests send."""
from __future__ import annotations

import dataclasses
import http.server
import itertools
import threading
import time

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
_counter = itertools.count(1)


@dataclasses.dataclass
class Received:
    method: str
    path: str
    headers: dict  # lower-case names
    body: bytes
    at: float  # time.monotonic() when the request was read
    status: int  # what the receiver answered


@dataclasses.dataclass
class Reply:
    status: int = 200
    headers: dict = dataclasses.field(default_factory=dict)
    body: bytes = b"ok"
    delay: float = 0.0  # seconds to wait before answering (read timeouts)


class Receiver:
    """``Receiver([Reply(500)] * 5)`` fails five times, then answers ``default`` (200) for ever."""

    def __init__(self, script: list[Reply] | None = None, default: Reply | None = None,
                 protocol: str = "HTTP/1.1"):
        self.script = list(script or [])
        self.default = default or Reply()
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = protocol  # "HTTP/1.0": one request per connection, closed after the answer

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with receiver._lock:
                    reply = receiver.script.pop(0) if receiver.script else receiver.default
                    receiver.requests.append(Received(self.command, self.path,
                                                      {k.lower(): v for k, v in self.headers.items()}, body,
                                                      time.monotonic(), reply.status))
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:
                    pass  # the client gave up (timeout test)

            do_POST = do_GET = do_PUT = _handle

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def bodies(self) -> list[bytes]:
        with self._lock:
            return [r.body for r in self.requests]

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def make_channel(project, url, name="hook", kind="webhook", **fields):
    from notify.models import Channel

    fields.setdefault("secrets", [SECRET] if kind in ("webhook", "alertmanager") else [])
    return Channel.objects.create(project=project, name=name, kind=kind, url=url, **fields)


def event(status="firing", fingerprint=None, **labels) -> dict:
    """A neutral alert event as the alerts app hands it to notify.enqueue, unique per call."""
    n = next(_counter)
    return {"event_id": f"evt-{n}", "fingerprint": fingerprint or f"fp-{n}", "status": status, "severity": "page",
            "kind": "slo_burn", "project": "alpha", "title": f"alert {n}", "summary": "burning", "description": "",
            "labels": {"alertname": "SLOBurn", "severity": "page", **labels}, "annotations": {},
            "starts_at": "2026-11-20T10:00:00Z", "ends_at": None, "url": None, "slo": None, "diagnosis": None}
