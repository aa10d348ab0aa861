"""What the HTTP server serves, without HTTP: the target, the hot-swappable drafter, generation, logging.

One request generates at a time, the others wait in a bounded first-come-first-served line
(decode.admission): on a CPU, or a single GPU at batch size 1, two concurrent generations only slow each
other. A request takes a snapshot of the drafter slot when it
arrives, so a version published while it waits or runs does not change what serves it; the next
request picks the new version up. Every version verifies against the same target, so every version
is lossless: greedy responses are the target's own.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from specdistill.decode.admission import Abandoned, AdmissionQueue, QueueFull, Ticket
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.decode.request_log import SCHEMA_VERSION, RequestLogWriter
from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.serve_metrics import ServerMetrics
from specdistill.models.drafter_store import current_version, is_store, version_path
from specdistill.models.drafters import load_drafter
from specdistill.models.target import Target

log = logging.getLogger("specdistill.serve")

DEFAULT_MAX_QUEUE = 64


@dataclass(frozen=True)
class Served:
    """One drafter version, ready to generate: a snapshot a request keeps until it is done."""
    version: str
    engine: SpeculativeEngine


class DrafterSlot:
    """The drafter currently served. For a store, a watcher thread reloads when `current` moves."""

    def __init__(self, target: Target, drafter: str | None, gamma: int = 5, adaptive: bool = True,
                 reload_interval_s: float = 1.0):
        self.target, self.spec, self.gamma, self.adaptive = target, drafter, gamma, adaptive
        self.reload_interval_s = reload_interval_s
        self.swaps = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._served = self._load(self._resolve_version())
        self._watcher: threading.Thread | None = None
        if self.is_store:
            self._watcher = threading.Thread(target=self._watch, name="drafter-watcher", daemon=True)
            self._watcher.start()

    @property
    def is_store(self) -> bool:
        return self.spec is not None and is_store(self.spec)

    def current(self) -> Served:
        with self._lock:
            return self._served

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def reload_if_changed(self) -> bool:
        """Load the store's current version if it is not the one served; True when it swapped."""
        version = self._resolve_version()
        if version == self.current().version:
            return False
        served = self._load(version)
        with self._lock:
            self._served = served
            self.swaps += 1
        log.info("hot-swapped to drafter version %s", version)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.reload_interval_s):
            try:
                self.reload_if_changed()
            except Exception:  # a bad version must not take the server down: keep serving the old one
                log.exception("could not load the new drafter version; still serving %s", self.current().version)

    def _resolve_version(self) -> str:
        if self.spec is None or self.spec == "none":
            return "none"
        return current_version(self.spec) if self.is_store else str(self.spec)

    def _load(self, version: str) -> Served:
        if version == "none":
            proposer = None
        else:
            source = version_path(self.spec, version) if self.is_store else self.spec
            drafter = load_drafter(str(source), self.target, device=str(self.target.device))
            proposer = build_proposer(drafter, self.target.model, gamma=self.gamma,
                                      eos_token_ids=self.target.eos_token_ids)
        engine = SpeculativeEngine(self.target.model, proposer, self.target.eos_token_ids, adaptive=self.adaptive)
        return Served(version, engine)


@dataclass
class Completion:
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length" | "cancelled" (the client went away)
    version: str
    stats: dict
    request_id: str
    prompt_tokens: int
    logged: bool = True  # False when the request log could not be written (the server is degraded)


@dataclass
class ServingLimits:
    max_prompt_tokens: int
    max_tokens: int  # the largest max_tokens a request may ask for


@dataclass
class LogHealth:
    """Whether the request log is being written; the reason and the count when it is not."""
    failures: int = 0
    reason: str | None = None  # set by a failed write, cleared by the next good one

    def status(self) -> dict:
        if self.reason is None:
            return {"status": "ok", "unlogged_requests": self.failures}
        return {"status": "degraded", "reason": f"request log: {self.reason}", "unlogged_requests": self.failures}


def append_or_degrade(writer: RequestLogWriter, health: LogHealth, record: dict) -> bool:
    """Append the record (True); on a write error (a full disk) mark `health` degraded with the reason and count
    the request as unlogged (False): the caller answers it all the same, a server that stops serving because its
    log is full would be worse than one that serves unlogged. The built-in server and the logging front share it."""
    try:
        writer.append(record)
    except OSError as e:
        health.failures += 1
        health.reason = f"{type(e).__name__}: {e}"
        log.error("could not write the request log (%s); request %s is answered but not logged "
                  "(%d unlogged so far)", e, record.get("id"), health.failures)
        return False
    health.reason = None
    return True


@dataclass
class Server:
    target: Target
    slot: DrafterSlot
    log_writer: RequestLogWriter
    limits: ServingLimits
    model_name: str
    admission: AdmissionQueue = field(default_factory=lambda: AdmissionQueue(DEFAULT_MAX_QUEUE))
    metrics: ServerMetrics | None = None
    log_health: LogHealth = field(default_factory=LogHealth)

    def __post_init__(self):
        self.metrics = self.metrics or ServerMetrics(self.model_name)

    def reserve(self) -> Ticket:
        """A place in the waiting line (QueueFull past --max-queue): taken before a response starts, so that
        a full queue is a 429, never a stream that fails."""
        try:
            ticket = self.admission.reserve()
        except QueueFull:
            self.metrics.rejected.labels(self.model_name).inc()
            raise
        self._update_queue_metrics()
        return ticket

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingConfig, stop: list[str],
                 request_fields: dict, on_text=None, ticket: Ticket | None = None,
                 cancelled: threading.Event | None = None) -> Completion | None:
        """Wait for the engine (first come, first served), generate with the drafter version served at
        arrival, call on_text(delta) as text is produced, and log the request before returning it: a client
        is answered only once its line is written. `cancelled` set (the client went away) stops generation at
        the next step; the request is logged as cancelled with the tokens the target emitted. Returns None when
        it was cancelled before it started (nothing generated, nothing logged)."""
        arrived = time.time()
        served = self.slot.current()  # the version at arrival serves it, even if another is published meanwhile
        ticket = ticket or self.reserve()
        try:
            self.admission.wait_turn(ticket, cancelled)
        except Abandoned:
            self.metrics.cancelled.labels(self.model_name, "queued").inc()
            self._update_queue_metrics()
            return None
        try:
            return self._generate_now(served, prompt_ids, max_tokens, sampling, stop,
                                      {**request_fields, "ticket": ticket.number}, on_text, cancelled, arrived)
        finally:
            self.admission.release(ticket)
            self._update_queue_metrics()

    def _generate_now(self, served: Served, prompt_ids, max_tokens, sampling, stop, request_fields, on_text,
                      cancelled, arrived: float) -> Completion:
        self._update_queue_metrics()
        started = time.time()
        request_id = new_request_id()
        text_stream = TextStream(self.target.tokenizer, stop, on_text)
        first_token: list[float] = []

        def on_emit(new_ids: list[int]) -> bool:
            if new_ids and not first_token:
                first_token.append(time.time())
            return text_stream.push(new_ids) or (cancelled is not None and cancelled.is_set())

        gen = served.engine.generate(prompt_ids, max_tokens, sampling, on_emit=on_emit)
        text_stream.finish()
        hit_eos = bool(gen.tokens) and gen.tokens[-1] in self.target.eos_token_ids
        if hit_eos or text_stream.stopped:
            finish = "stop"
        elif cancelled is not None and cancelled.is_set() and len(gen.tokens) < max_tokens:
            finish = "cancelled"
        else:
            finish = "length"
        stats = gen.stats.to_dict()
        completion = Completion(gen.tokens, text_stream.text, finish, served.version, stats, request_id,
                                len(prompt_ids))
        completion.logged = self.log_request(self.log_record(completion, prompt_ids, max_tokens, sampling, stop,
                                                             request_fields, started, arrived))
        if finish == "cancelled":
            self.metrics.cancelled.labels(self.model_name, "generating").inc()
        self.metrics.observe_request(stats, len(prompt_ids), finish, started - arrived,
                                     first_token[0] - arrived if first_token else None, time.time() - arrived)
        return completion

    def log_request(self, record: dict) -> bool:
        """Append the record; on failure the server stays up, degraded, and counts what it could not log."""
        logged = append_or_degrade(self.log_writer, self.log_health, record)
        if not logged:
            self.metrics.log_failures.labels(self.model_name).inc()
        return logged

    def _update_queue_metrics(self) -> None:
        self.metrics.set_queue(self.admission.running, self.admission.waiting)

    def log_record(self, c: Completion, prompt_ids: list[int], max_tokens: int, sampling: SamplingConfig,
                   stop: list[str], request_fields: dict, started: float, arrived: float | None = None) -> dict:
        arrived = started if arrived is None else arrived
        return {
            "schema": SCHEMA_VERSION,
            "id": c.request_id,
            "time": started,
            "latency_s": time.time() - started,
            "queued_s": started - arrived,
            **request_fields,  # endpoint, model, and the prompt or the messages as the client sent them
            "prompt_ids": prompt_ids,
            "output_ids": c.output_ids,
            "finish_reason": c.finish_reason,
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                         "seed": sampling.seed, "max_tokens": max_tokens, "stop": stop},
            "stats": c.stats,
            "drafter_version": c.version,
            "target_fingerprint": self.target.fingerprint,
            "tokenizer_fingerprint": self.target.tokenizer_fingerprint,
        }


class TextStream:
    """Detokenizes incrementally: emits text deltas, holds back an incomplete UTF-8 character, and
    stops at the first stop string (which is not part of the text)."""

    def __init__(self, tokenizer, stop: list[str], on_text=None):
        self.tokenizer, self.stop, self.on_text = tokenizer, [s for s in stop if s], on_text
        self.ids: list[int] = []
        self.text = ""       # the final text so far (cut at a stop string)
        self.sent = 0        # characters of self.text handed to on_text
        self.stopped = False

    def push(self, new_ids: list[int]) -> bool:
        if self.stopped:
            return True
        self.ids += new_ids
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for s in self.stop if (i := full.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = full[:cut], True
        else:
            self.text = full
        ready = len(self.text) if self.stopped else len(self.text.rstrip("\ufffd"))
        ready = self._hold_back_stop_prefix(ready)
        self._send(ready)
        return self.stopped

    def finish(self) -> None:
        self._send(len(self.text))

    def _hold_back_stop_prefix(self, ready: int) -> int:
        """Do not stream the start of what may become a stop string."""
        if self.stopped:
            return ready
        for s in self.stop:
            for n in range(min(len(s) - 1, ready), 0, -1):
                if self.text[:ready].endswith(s[:n]):
                    return min(ready, ready - n)
        return ready

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            delta, self.sent = self.text[self.sent:upto], upto
            if self.on_text is not None:
                self.on_text(delta)


def new_request_id() -> str:
    return uuid.uuid4().hex
