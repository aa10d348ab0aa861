"""First come, first served admission to the one engine, with a bounded waiting line.

The engine decodes one request at a time. A request first `reserve`s a place (refused with QueueFull when
`max_waiting` requests already wait behind a running one), then waits for its turn; places are served
strictly in the order they were reserved. A request whose client went away while it waited gives its place
up (`abandon`), and the line moves on without it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


class QueueFull(Exception):
    """No place left in the waiting line."""


class Abandoned(Exception):
    """The request was cancelled while it waited for its turn."""


@dataclass(frozen=True)
class Ticket:
    number: int


class AdmissionQueue:
    def __init__(self, max_waiting: int):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._line: deque[Ticket] = deque()  # reserved, not yet running, in arrival order
        self._running: Ticket | None = None
        self._issued = 0

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._line)

    @property
    def running(self) -> int:
        with self._cond:
            return int(self._running is not None)

    def reserve(self) -> Ticket:
        """A place in line; QueueFull when the line is at its bound (a free engine takes anyone)."""
        with self._cond:
            busy = self._running is not None or bool(self._line)
            if busy and len(self._line) >= self.max_waiting:
                raise QueueFull(f"{len(self._line)} requests are already waiting (--max-queue {self.max_waiting})")
            ticket = Ticket(self._issued)
            self._issued += 1
            self._line.append(ticket)
            return ticket

    def wait_turn(self, ticket: Ticket, cancelled: threading.Event | None = None, poll_s: float = 0.05) -> None:
        """Block until `ticket` is first in line and the engine is free; it then runs until `release`.
        Raises Abandoned (and gives the place up) if `cancelled` is set first."""
        with self._cond:
            while not (self._running is None and self._line and self._line[0] == ticket):
                if cancelled is not None and cancelled.is_set():
                    self._line.remove(ticket)
                    self._cond.notify_all()
                    raise Abandoned()
                self._cond.wait(timeout=poll_s if cancelled is not None else None)
            self._line.popleft()
            self._running = ticket

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            if self._running != ticket:
                raise RuntimeError(f"ticket {ticket.number} is not the one running")
            self._running = None
            self._cond.notify_all()

    def abandon(self, ticket: Ticket) -> None:
        """Give up a reserved place that never waited (e.g. the request failed before generating)."""
        with self._cond:
            if ticket in self._line:
                self._line.remove(ticket)
                self._cond.notify_all()
