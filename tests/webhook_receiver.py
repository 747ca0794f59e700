"""A real webhook receiver for the tests: an HTTP server in a thread that verifies every
delivery with the openai package's own verifier (client.webhooks.unwrap), as a user's
receiver would, and can be made to answer 503 or to refuse connections for a while.

    with Receiver() as r:
        url = r.url("team-a")          # a path of its own, verified with its own secret
        r.secrets["team-a"] = secret   # until then a delivery there gets 503 (and is retried)
        ...
        r.accepted()                   # the events it answered 2xx, unwrapped by openai
"""
from __future__ import annotations

import dataclasses
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openai import OpenAI


@dataclasses.dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int            # what the receiver answered
    event: object = None   # openai's event type, when verified
    error: str = ""


class Receiver:
    def __init__(self):
        self.secrets: dict[str, str] = {}
        self.received: list[Delivery] = []
        self.answer = 204       # what a verified delivery gets; set 503 for a receiver that is down
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{name}"

    # up and down
    def start(self) -> "Receiver":
        """Listen (again, on the same port when restarted)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                status = receiver._receive(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="webhook-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the socket: connections are refused until start()."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "Receiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # what came
    def _receive(self, path: str, headers: dict[str, str], body: bytes) -> int:
        name = path.rsplit("/", 1)[-1]
        delivery = Delivery(path, headers, body, 503)
        secret = self.secrets.get(name)
        if secret is None:
            delivery.error = "no secret yet"
        else:
            try:
                delivery.event = OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(body, headers)
                delivery.status = self.answer
            except Exception as e:   # a bad signature, an old timestamp, a body openai cannot read
                delivery.status, delivery.error = 400, f"{type(e).__name__}: {e}"
        with self._lock:
            self.received.append(delivery)
        return delivery.status

    def all(self) -> list[Delivery]:
        with self._lock:
            return list(self.received)

    def accepted(self, name: str | None = None) -> list:
        """The events answered 2xx (to name's path only, if given), in order."""
        return [d.event for d in self.all() if 200 <= d.status < 300 and (name is None or d.path.endswith(f"/{name}"))]

    def refused_signatures(self) -> list[Delivery]:
        return [d for d in self.all() if d.status == 400]
