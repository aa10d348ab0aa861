"""The online daemon's durable state: read position, replay buffer and journals, committed atomically.

    WORK/state.json          the commit: log position, counters, live chunks, evicted ids, journal sizes
    WORK/chunks/c00000012.pt one file per ingested batch: its entries with the target's top-k
    WORK/used.jsonl          one line per request taken into the buffer (the exactly-once ledger)
    WORK/dead_letter.jsonl   one line per unusable log line, with the reason
    WORK/metrics.jsonl       acceptance over time

A commit writes the new chunk first (temp file, rename), appends to the journals, and only then
replaces state.json (temp file, fsync, rename). state.json records each journal's size at the commit.
Opening the state deletes chunks it does not list and cuts every journal back to its committed size,
so whatever a crash interrupted is undone and the lines after the committed position are read again:
each request lands in the buffer exactly once, each bad line in the dead letters exactly once.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdistill.decode.request_log import LogPosition
from specdistill.distill.replay import Entry, ReplayBuffer

STATE = "state.json"
CHUNKS = "chunks"
USED = "used.jsonl"
DEAD = "dead_letter.jsonl"
METRICS = "metrics.jsonl"
JOURNALS = (USED, DEAD, METRICS)


@dataclass
class Counters:
    ingested: int = 0          # requests taken into the buffer (train + held out)
    dead_letters: int = 0
    since_update: int = 0      # requests ingested since the last update
    updates: int = 0
    published: int = 0
    rollbacks: int = 0
    last_update_time: float = 0.0
    general_reference: float | None = None  # the general guard's alpha with the first served version
    engine_events: int = 0     # lines of the swap supervisor's journal copied into the metrics


@dataclass
class Committed:
    position: dict = field(default_factory=lambda: LogPosition().to_dict())
    counters: Counters = field(default_factory=Counters)
    chunks: dict[str, list[str]] = field(default_factory=dict)   # chunk name -> ids it holds
    evicted: list[str] = field(default_factory=list)             # ids gone from the buffer, chunk still live
    priorities: dict[str, float] = field(default_factory=dict)
    journal_sizes: dict[str, int] = field(default_factory=lambda: {j: 0 for j in JOURNALS})
    next_chunk: int = 0


class OnlineState:
    def __init__(self, work_dir: str | Path, buffer: ReplayBuffer):
        self.dir = Path(work_dir)
        (self.dir / CHUNKS).mkdir(parents=True, exist_ok=True)
        self.committed = self._read_state()
        self._undo_uncommitted()
        self.buffer = buffer
        self.seen: set[str] = set()
        self._load_buffer()

    # ---- reading back ------------------------------------------------------------------------------

    @property
    def position(self) -> LogPosition:
        return LogPosition.from_dict(self.committed.position)

    @property
    def counters(self) -> Counters:
        return self.committed.counters

    def _read_state(self) -> Committed:
        path = self.dir / STATE
        if not path.exists():
            return Committed()
        data = json.loads(path.read_text())
        data["counters"] = Counters(**data["counters"])
        return Committed(**data)

    def _undo_uncommitted(self) -> None:
        """Cut journals to their committed sizes; delete chunks no commit refers to."""
        for name in JOURNALS:
            path = self.dir / name
            size = self.committed.journal_sizes.get(name, 0)
            if path.exists() and path.stat().st_size > size:
                with open(path, "r+b") as f:
                    f.truncate(size)
        for chunk in (self.dir / CHUNKS).iterdir():
            if chunk.suffix != ".pt" or chunk.stem not in self.committed.chunks:
                chunk.unlink()

    def _load_buffer(self) -> None:
        evicted = set(self.committed.evicted)
        used = self.dir / USED
        held_out_ids = set()
        if used.exists():
            for line in used.read_text().splitlines():
                rec = json.loads(line)
                self.seen.add(rec["id"])
                if rec["split"] == "holdout":
                    held_out_ids.add(rec["id"])
        for name in sorted(self.committed.chunks):
            for raw in torch.load(self.dir / CHUNKS / f"{name}.pt", weights_only=True)["entries"]:
                if raw["id"] in evicted:
                    continue
                entry = Entry(**raw, priority=self.committed.priorities.get(raw["id"], 1.0))
                self.buffer.add(entry, held_out=raw["id"] in held_out_ids)

    # ---- committing -----------------------------------------------------------------------------------

    def journal(self, name: str, record: dict) -> None:
        with open(self.dir / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def ingest(self, entries: list[tuple[Entry, bool]], dead: list[dict], position: LogPosition) -> None:
        """Commit one read batch: its usable entries (entry, held_out), its dead letters, the new position."""
        c = self.committed
        if entries:
            name = f"c{c.next_chunk:08d}"
            c.next_chunk += 1
            write_chunk(self.dir / CHUNKS / f"{name}.pt", [e for e, _ in entries])
            c.chunks[name] = [e.id for e, _ in entries]
            for entry, held_out in entries:
                self.journal(USED, {"id": entry.id, "split": "holdout" if held_out else "train", "chunk": name})
                c.evicted += self.buffer.add(entry, held_out)
                c.priorities[entry.id] = entry.priority
                self.seen.add(entry.id)
            c.counters.ingested += len(entries)
            c.counters.since_update += len(entries)
        for letter in dead:
            self.journal(DEAD, letter)
        c.counters.dead_letters += len(dead)
        c.position = position.to_dict()
        self.commit()

    def commit(self) -> None:
        c = self.committed
        self._drop_dead_chunks()
        live = self.buffer.ids()
        c.priorities = {i: p for i, p in c.priorities.items() if i in live}
        for name in JOURNALS:
            path = self.dir / name
            c.journal_sizes[name] = path.stat().st_size if path.exists() else 0
        data = asdict(c)
        tmp = self.dir / f".{STATE}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / STATE)

    def _drop_dead_chunks(self) -> None:
        """Forget chunks whose entries have all been evicted (the file goes at the next open)."""
        c = self.committed
        evicted = set(c.evicted)
        for name, ids in list(c.chunks.items()):
            if all(i in evicted for i in ids):
                del c.chunks[name]
                evicted -= set(ids)
        c.evicted = [i for i in c.evicted if i in evicted]

    def set_priorities(self, priorities: dict[str, float]) -> None:
        self.committed.priorities.update(priorities)


def write_chunk(path: Path, entries: list[Entry]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"entries": [{k: v for k, v in asdict(e).items() if k != "priority"} for e in entries]}, tmp)
    os.replace(tmp, path)
