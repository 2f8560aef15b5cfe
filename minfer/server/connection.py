"""uvicorn's settings for the server: its httptools protocol, with a read timeout and a header
limit uvicorn does not have there.

Why httptools and not h11: both parse HTTP for uvicorn, but h11 is pure Python on every request
and every streamed chunk, and the api server's one event loop writes every stream (~43,000 SSE
chunks a second at 256 streams on an H200). On a 2-core machine `GET /v1/models` over 32
connections took 267 us per request through h11 and 188-207 us through httptools
(scripts/api_request_cost.py, docs/BENCHMARKS.md twelfth session); on an H200 host, where the
api process no longer bounds `bench serve`, the two serve alike (thirteenth session).

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but waits forever for the
headers of a connection's first request and for a request body that stops halfway: 1,500
half-sent connections stayed open indefinitely. `ReadTimeoutProtocol` closes a connection whose
request (headers and body) is not complete `request_read_timeout` seconds after the request
began (or after the connection opened). A request being answered, or streamed, is not affected:
the timer stops once the request has been read. The request line and headers together are
limited to MAX_HEADER_BYTES (httptools itself has no limit); a larger request is answered 400.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from minfer.config import ServerConfig

KEEP_ALIVE_S = 5  # uvicorn's default: idle time between requests of a keep-alive connection
MAX_HEADER_BYTES = 32 * 1024  # the request line and headers together (h11's default limit)


class HeadersTooLarge(Exception):
    """Raised inside the parser's callbacks; httptools turns it into a parser error (400)."""


class ReadTimeoutProtocol(HttpToolsProtocol):
    read_timeout_s = 30.0  # set per server by uvicorn_options

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._arm_read_timer()  # the first request must arrive, too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    # -- parser callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm_read_timer()  # a request started arriving on a kept-alive connection

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        super().on_header(name, value)

    def on_message_complete(self) -> None:
        self._stop_read_timer()
        super().on_message_complete()

    # -- the limits ---------------------------------------------------------------------------
    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            raise HeadersTooLarge(f"request line and headers over {MAX_HEADER_BYTES} bytes")

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.logger.info(
                "closing a connection that sent no complete request in %.0f s", self.read_timeout_s
            )
            self.transport.close()


def uvicorn_options(cfg: ServerConfig) -> dict:
    """Keyword arguments of uvicorn.Config for this server's limits."""
    protocol = type(
        "ReadTimeoutHttpTools", (ReadTimeoutProtocol,), {"read_timeout_s": cfg.request_read_timeout}
    )
    return {"http": protocol, "timeout_keep_alive": KEEP_ALIVE_S}
