"""Which upstream engine the logging front sends a new request to, and how many each one still serves.

The front (decode.upstream) takes a lease on the engine served now for the whole life of a request, its stream
included, and gives it back when the request ends. A supervisor (train.engine_swap) moves the pointer to a new
engine with `point`: requests already running keep their lease, so they finish on the engine they started on,
and the old engine can be stopped once `in_flight(old)` reaches 0 (`wait_drained`). For a machine that cannot
hold two engines, `pause` holds new requests in line (at most `max_waiting`, past it QueueFull: a 429) until the
next `point`.

The pointer is moved from the supervisor's thread while leases are taken on the server's event loop, so the
state sits behind a threading lock and a waiting request polls it (every 20 ms) rather than awaiting an
asyncio primitive that belongs to one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

from specdistill.decode.admission import QueueFull

POLL_S = 0.02


@dataclass(frozen=True)
class Engine:
    """One OpenAI-compatible server: where it listens and which drafter version it speculates with."""
    name: str
    url: str                     # base URL without /v1, e.g. http://127.0.0.1:8101
    drafter_version: str = "none"


class NoEngine(Exception):
    """No engine came to serve a request that waited for one (a stop-start that did not come back)."""


def base_url(url: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` all name the same server."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream URL {url!r} must start with http:// or https://")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class UpstreamRouter:
    def __init__(self, engine: Engine | None, max_waiting: int = 64, max_wait_s: float = 900.0):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting, self.max_wait_s = max_waiting, max_wait_s
        self._lock = threading.Lock()
        self._engine = engine
        self._in_flight: dict[str, int] = {}
        self._waiting = 0

    # ---- the supervisor's side ------------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        with self._lock:
            return self._engine

    def point(self, engine: Engine) -> Engine | None:
        """Send new requests to `engine` from now on; returns the engine they went to before."""
        with self._lock:
            old, self._engine = self._engine, engine
            return old

    def pause(self) -> Engine | None:
        """Hold new requests in line until the next `point`; returns the engine served until now."""
        with self._lock:
            old, self._engine = self._engine, None
            return old

    def in_flight(self, engine: Engine | None = None) -> int:
        with self._lock:
            if engine is None:
                return sum(self._in_flight.values())
            return self._in_flight.get(engine.name, 0)

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._waiting

    def wait_drained(self, engine: Engine, timeout_s: float) -> bool:
        """Block until no request holds a lease on `engine` (True), or timeout_s passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight(engine):
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    # ---- the front's side -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self):
        """The engine served now, held until the block ends (acquire, then release)."""
        engine = await self.acquire()
        try:
            yield engine
        finally:
            self.release(engine)

    async def acquire(self) -> Engine:
        """The engine served now, counted in flight until `release`. Waits while paused (QueueFull past
        max_waiting, NoEngine after max_wait_s)."""
        return self._take() or await self._wait_for_engine()

    def release(self, engine: Engine) -> None:
        with self._lock:
            self._in_flight[engine.name] -= 1
            if not self._in_flight[engine.name]:
                del self._in_flight[engine.name]

    def _take(self) -> Engine | None:
        with self._lock:
            engine = self._engine
            if engine is not None:
                self._in_flight[engine.name] = self._in_flight.get(engine.name, 0) + 1
            return engine

    async def _wait_for_engine(self) -> Engine:
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise QueueFull(f"{self._waiting} requests are already waiting for an engine "
                                f"(--max-queue {self.max_waiting})")
            self._waiting += 1
        deadline = time.monotonic() + self.max_wait_s
        try:
            while (engine := self._take()) is None:
                if time.monotonic() >= deadline:
                    raise NoEngine(f"no upstream engine came back within {self.max_wait_s:.0f} s")
                await asyncio.sleep(POLL_S)
            return engine
        finally:
            with self._lock:
                self._waiting -= 1
