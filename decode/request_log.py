"""The server's request log: JSON lines in size-rotated, numbered segments, and a reader that tails them.

    LOGS/requests.000000.jsonl
    LOGS/requests.000001.jsonl     <- the writer appends here; a new segment starts past max_bytes

Segments are never renamed or rewritten: rotation starts the next number, and a restarted server
starts a fresh segment (the last one may end in a line cut by a crash). So a reader's position is
just (segment, byte offset), valid forever, and "rotation mid-read" is the reader finishing one file
and moving to the next. A line is complete only once its newline is written; the reader never
consumes a partial line of the newest segment (the writer may be mid-write), and reports a partial
line at the end of an older segment as truncated (it will never be finished).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
SEGMENT_RE = re.compile(r"^requests\.(\d{6})\.jsonl$")
DEFAULT_MAX_BYTES = 16 * 2**20

# what every record must carry, with its JSON type; the daemon sends a record without them to its dead letters
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "schema": int,
    "id": str,
    "time": (int, float),
    "prompt_ids": list,
    "output_ids": list,
    "sampling": dict,
    "stats": dict,
    "drafter_version": str,
    "tokenizer_fingerprint": str,
}


def segment_name(number: int) -> str:
    return f"requests.{number:06d}.jsonl"


def list_segments(log_dir: str | Path) -> list[int]:
    d = Path(log_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := SEGMENT_RE.match(p.name)))


class RequestLogWriter:
    """Appends one JSON line per request; thread-safe; rotates to a new segment past `max_bytes`.

    The log holds users' prompts: the directory is created 0700 and segments 0600 (owner only). A failed
    write (a full disk, a read-only directory) raises OSError after undoing what it can: the segment is cut
    back to its last whole line where the file still allows it, and the next append starts a new segment, so
    a torn line is never followed by another record in the same file."""

    def __init__(self, log_dir: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, fsync: bool = False):
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, got {max_bytes}")
        self.dir = Path(log_dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.lock = threading.Lock()
        existing = list_segments(self.dir)
        self.segment = (existing[-1] + 1) if existing else 0  # never append after a possibly cut line
        self.fd: int | None = None  # the open segment, written with os.write: no user-space buffer to flush later

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self.lock:
            size = self._size()
            if self.fd is not None and size + len(line) > self.max_bytes and size > 0:
                self._close()
                self.segment += 1
            if self.fd is None:
                self.fd = open_private(self.dir / segment_name(self.segment))
                size = self._size()
            try:
                write_all(self.fd, line)  # a reader sees whole lines or a cut last line
                if self.fsync:
                    os.fsync(self.fd)
            except OSError:
                self._abandon_segment(size)
                raise

    def _size(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_END) if self.fd is not None else 0

    def _abandon_segment(self, whole_lines_end: int) -> None:
        """After a failed write: cut the torn tail where the file allows it, close, go on to a new segment."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, whole_lines_end)
        self._close()
        self.segment += 1

    def _close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        with self.lock:
            self._close()


def open_private(path: Path) -> int:
    """A descriptor appending to `path`, which is created readable and writable by its owner only."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass(frozen=True)
class LogPosition:
    segment: int = 0
    offset: int = 0  # bytes into the segment, always at a line start

    def to_dict(self) -> dict:
        return {"segment": self.segment, "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict) -> "LogPosition":
        return cls(int(d["segment"]), int(d["offset"]))


@dataclass
class LogLine:
    raw: bytes            # without the newline
    segment: int
    offset: int           # where the line starts
    end: LogPosition      # the position after it
    truncated: bool = False  # a partial last line of a closed segment


def read_lines(log_dir: str | Path, start: LogPosition, max_lines: int = 1000,
               chunk_bytes: int = 1 << 20) -> list[LogLine]:
    """Complete lines from `start` on, across segments, at most `max_lines`. Moving to the next segment
    happens only when one exists (then the current one is closed: nothing more will be appended)."""
    out: list[LogLine] = []
    segments = list_segments(log_dir)
    pos = start
    for number in [s for s in segments if s >= pos.segment]:
        if number > pos.segment:
            pos = LogPosition(number, 0)
        closed = number != segments[-1]
        pos = _read_segment(Path(log_dir) / segment_name(number), pos, closed, max_lines - len(out), chunk_bytes, out)
        if len(out) >= max_lines or not closed or pos.offset < _size(Path(log_dir) / segment_name(number)):
            break
    return out


def _read_segment(path: Path, pos: LogPosition, closed: bool, budget: int, chunk_bytes: int,
                  out: list[LogLine]) -> LogPosition:
    with open(path, "rb") as f:
        f.seek(pos.offset)
        offset, pending = pos.offset, b""
        while budget > 0:
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            pending += chunk
            while budget > 0 and (nl := pending.find(b"\n")) >= 0:
                raw, pending = pending[:nl], pending[nl + 1:]
                end = LogPosition(pos.segment, offset + nl + 1)
                out.append(LogLine(raw, pos.segment, offset, end))
                offset, budget = end.offset, budget - 1
            if budget <= 0:
                break
        if closed and budget > 0 and pending and not f.read(1):
            end = LogPosition(pos.segment, offset + len(pending))
            out.append(LogLine(pending, pos.segment, offset, end, truncated=True))
            offset = end.offset
    return LogPosition(pos.segment, offset)


def _size(path: Path) -> int:
    return path.stat().st_size


def position_after(lines: list[LogLine], start: LogPosition) -> LogPosition:
    return lines[-1].end if lines else start


class BadRecord(ValueError):
    """A log line the daemon cannot use; the message is the dead-letter reason."""


def parse_record(line: LogLine, tokenizer_fingerprint: str, vocab_size: int, max_line_bytes: int) -> dict:
    """A validated record, or BadRecord naming what is wrong with the line."""
    if line.truncated:
        raise BadRecord("truncated: the segment ends in a partial line (the writer stopped mid-line)")
    if len(line.raw) > max_line_bytes:
        raise BadRecord(f"oversized: {len(line.raw)} bytes > max_line_bytes={max_line_bytes}")
    try:
        record = json.loads(line.raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRecord(f"not JSON: {e}") from None
    if not isinstance(record, dict):
        raise BadRecord(f"not a JSON object: {type(record).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in record]
    if missing:
        raise BadRecord(f"missing fields: {', '.join(missing)}")
    wrong = [k for k, t in REQUIRED_FIELDS.items() if not isinstance(record[k], t) or isinstance(record[k], bool)]
    if wrong:
        raise BadRecord(f"wrong types: {', '.join(f'{k} is {type(record[k]).__name__}' for k in wrong)}")
    if record["schema"] != SCHEMA_VERSION:
        raise BadRecord(f"unknown schema {record['schema']} (this reader knows {SCHEMA_VERSION})")
    if record["tokenizer_fingerprint"] != tokenizer_fingerprint:
        raise BadRecord(f"foreign: tokenizer fingerprint {record['tokenizer_fingerprint'][:12]} is not the "
                        f"target's {tokenizer_fingerprint[:12]}")
    for key in ("prompt_ids", "output_ids"):
        ids = record[key]
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise BadRecord(f"{key}: token ids must be integers in [0, {vocab_size})")
    if not record["prompt_ids"]:
        raise BadRecord("prompt_ids is empty")
    return record
