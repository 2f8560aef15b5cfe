"""uvicorn's settings for the server, with a read timeout uvicorn does not have.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but waits forever for the
headers of a connection's first request and for a request body that stops halfway: 1,500
half-sent connections stayed open indefinitely. `ReadTimeoutH11Protocol` closes a connection
whose request (headers and body) is not complete `request_read_timeout` seconds after its first
byte (or after the connection opened). A request being answered, or streamed, is not affected:
the timer stops once the request has been read.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minfer.config import ServerConfig

KEEP_ALIVE_S = 5  # uvicorn's default: idle time between requests of a keep-alive connection
MAX_HEADER_BYTES = 32 * 1024  # h11's limit on the request line and headers together


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout_s = 30.0  # set per server by uvicorn_options

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading():
            self._arm_read_timer()  # a request started arriving on a kept-alive connection
        elif self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        super().connection_lost(exc)

    def _reading(self) -> bool:
        """Whether the client is still sending a request (its headers or its body)."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        # IDLE with nothing buffered after a finished response is uvicorn's keep-alive wait.
        idle_between_requests = (
            self.conn.their_state is h11.IDLE and self.cycle is not None and not self.conn.trailing_data[0]
        )
        if self._reading() and not idle_between_requests and not self.transport.is_closing():
            self.logger.info(
                "closing a connection that sent no complete request in %.0f s", self.read_timeout_s
            )
            self.transport.close()


def uvicorn_options(cfg: ServerConfig) -> dict:
    """Keyword arguments of uvicorn.Config for this server's limits."""
    protocol = type("ReadTimeoutH11", (ReadTimeoutH11Protocol,), {"read_timeout_s": cfg.request_read_timeout})
    return {
        "http": protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
    }
