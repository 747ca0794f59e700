"""Closing connections that hold the server without sending their request: the two timeouts
uvicorn lacks.

uvicorn (0.55) has only its keep-alive timeout, armed once a response is sent and cancelled
by any byte received: a client that connects and sends nothing, or trickles its request's
head or body a byte at a time, keeps its connection (a socket and a slot of the server) for
ever. TimedH11Protocol is uvicorn's h11 protocol with one more timer, following h11's view
of what the client owes:
* the head (request line and headers) must be whole within header_timeout_s of the
  connection being ready for it (opened, or its last response sent);
* a body must keep coming: each body_timeout_s while it arrives must bring at least
  MIN_BODY_BYTES_S bytes a second. A stalled or trickled body is cut, a slow but steady
  upload is not; a window in which the server itself had stopped reading (flow control: the
  app not reading yet) is not held against the client. This holds after a response too
  (the app answered without reading the body, which the client goes on sending).
Either closes the connection: there is no request to answer. The app sees a disconnect.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
MIN_BODY_BYTES_S = 1024   # 30 KiB each 30 s; mod_reqtimeout's default minimum rate is 500 B/s


class TimedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None   # "head", "body", or None (the app's turn, or closed)
        self._body_bytes = 0                # received in the body's current window

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        if self._awaiting == "body":
            self._body_bytes += len(data)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._awaiting = None
        self._cancel()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arm the timer of what h11 now awaits from the client, if that changed."""
        state = self.conn.their_state
        awaiting = None if self.transport.is_closing() else (
            "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)
        if awaiting == self._awaiting:
            return
        self._cancel()
        self._awaiting = awaiting
        if awaiting == "head":
            self._timer = self.loop.call_later(self.header_timeout_s, self._close, "its request head was not "
                                               f"complete within {self.header_timeout_s:g} s")
        elif awaiting == "body":
            self._body_bytes = 0
            self._timer = self.loop.call_later(self.body_timeout_s, self._body_window_ended)

    def _body_window_ended(self) -> None:
        if self.flow.read_paused or self._body_bytes >= MIN_BODY_BYTES_S * self.body_timeout_s:
            self._body_bytes = 0   # the server was not reading, or enough came: another window
            self._timer = self.loop.call_later(self.body_timeout_s, self._body_window_ended)
            return
        self._close(f"its request body brought {self._body_bytes} bytes in {self.body_timeout_s:g} s "
                    f"(at least {MIN_BODY_BYTES_S} a second are needed)")

    def _close(self, why: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            client = "%s:%d" % self.client if self.client else "a client"
            self.logger.info("closed the connection of %s: %s", client, why)
            self.transport.close()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def timed_h11(header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S):
    """The protocol class for uvicorn's `http=` with these timeouts."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
