"""The job's phases with their wall time and memory: what loading the target, writing the teacher data, reading the
target's states and training each cost, so that a run states peak RSS per phase (issue #62) and a job that nears the
machine's memory shows which phase to look at.

    with phase("teacher data"):
        ...
    finished_phases() -> [{"name", "seconds", "peak_rss_gib", "peak_anon_gib", "end_rss_gib", "job_peak_rss_gib"}, ...]

Besides the resident set, each phase records the largest anonymous part of it sampled (RssAnon: the heap, tensors,
what must fit in memory). The rest is pages of mapped files: a named real target's fp32 weights are a mapped
safetensors file (6.6 GiB of the 1.5B's), resident once read and counted in VmRSS, which the kernel drops and reads
again under memory pressure rather than failing, so a job's RSS can sit near the machine's memory without being at
risk; the anonymous peak is the figure to hold against it.

A phase's own peak is the largest resident set sampled while it ran (every `SAMPLE_SECONDS` by a daemon thread, and
at its start and end), so a spike shorter than the interval can be missed; the job's peak so far is the kernel's
high-water mark (VmHWM; or an earlier phase's sample where that is larger, the kernel summing its per-CPU counters
approximately). The high-water mark is never reset (writing /proc/self/clear_refs would, but it would also lower
what getrusage and /usr/bin/time report for the whole job). Linux only: elsewhere a phase records its time and no
memory (None), and its log line says so.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from specdistill.distill.prompts import write_json_atomically

log = logging.getLogger("specdistill.phases")

SAMPLE_SECONDS = 0.25
_STATUS = Path("/proc/self/status")
_finished: list[dict] = []
_highest: int | None = None  # KiB: the largest VmHWM or sample any phase has seen


def status_kib(field: str) -> int | None:
    """A `VmRSS`/`VmHWM`-style line of /proc/self/status in KiB; None where the file or field is missing."""
    return statuses_kib(field)[0]


def statuses_kib(*fields: str) -> list[int | None]:
    """Several such lines from one read of /proc/self/status, in the order asked."""
    found: dict[str, int] = {}
    try:
        for line in _STATUS.read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                found[name] = int(value.split()[0])
    except OSError:
        pass
    return [found.get(field) for field in fields]


def gib(kib: int | None) -> float | None:  # KiB -> GiB (2**30 bytes), as /usr/bin/time reports KiB
    return None if kib is None else round(kib / 2**20, 2)


class PeakSampler:
    """The largest VmRSS and the largest RssAnon seen between start() and stop(), sampled by a daemon thread."""

    def __init__(self, interval: float = SAMPLE_SECONDS):
        self.interval = interval
        self.peak, self.peak_anon = statuses_kib("VmRSS", "RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.observe()

    def observe(self) -> None:
        rss, anon = statuses_kib("VmRSS", "RssAnon")  # one read of the file a sample
        if rss is not None and (self.peak is None or rss > self.peak):
            self.peak = rss
        if anon is not None and (self.peak_anon is None or anon > self.peak_anon):
            self.peak_anon = anon

    def start(self) -> PeakSampler:
        if self.peak is not None:  # nothing to sample where /proc is not there
            self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.observe()
        return self.peak


@contextmanager
def phase(name: str):
    """Time the block and sample its resident set; log and keep the phase's record when it ends (also when it
    raises: the record says how far the job got)."""
    sampler = PeakSampler().start()
    started = time.monotonic()
    try:
        yield
    finally:
        peak = sampler.stop()
        job_peak = highest_seen(status_kib("VmHWM"), peak)
        record = {"name": name, "seconds": round(time.monotonic() - started, 1), "peak_rss_gib": gib(peak),
                  "peak_anon_gib": gib(sampler.peak_anon), "end_rss_gib": gib(status_kib("VmRSS")),
                  "job_peak_rss_gib": gib(job_peak)}
        _finished.append(record)
        log.info("phase %s: %s", name, describe(record))


def highest_seen(*kib: int | None) -> int | None:
    """The largest of these and of every earlier phase's, in KiB (None where nothing was measured)."""
    global _highest
    _highest = max((k for k in (*kib, _highest) if k is not None), default=None)
    return _highest


def describe(record: dict) -> str:
    """'12:34, peak RSS 9.1 GiB, 5.2 GiB of it anonymous (at its end 8.0 GiB, the job's so far 9.3 GiB)' or the
    time alone."""
    minutes, seconds = divmod(int(record["seconds"]), 60)
    if record["peak_rss_gib"] is None:
        return f"{minutes}:{seconds:02d} (no /proc/self/status here: memory not measured)"
    anon = "" if record.get("peak_anon_gib") is None else f", {record['peak_anon_gib']:.1f} GiB of it anonymous"
    return (f"{minutes}:{seconds:02d}, peak RSS {record['peak_rss_gib']:.1f} GiB{anon} (at its end "
            f"{record['end_rss_gib']:.1f} GiB, the job's so far {record['job_peak_rss_gib']:.1f} GiB)")


def finished_phases() -> list[dict]:
    """The records of the phases that ended in this process, in order."""
    return [dict(record) for record in _finished]


def write_phases(path: Path) -> None:
    """The finished phases as JSON at `path`, written whole."""
    write_json_atomically(path, finished_phases())
