"""The online loop with vLLM serving: where each drafter version's vLLM export lives, what the swap supervisor
journals, and the live acceptance read from an engine's /metrics.

    STORE/versions/v000003/          the drafter (models.drafter_store)
    STORE/vllm/v000003/              the same version as vLLM loads it (models.export --format vllm)
    STORE/engine_events.jsonl        the swap supervisor's journal (train.engine_swap): swaps, rollbacks and why

The daemon writes the export right after it publishes a version (the supervisor waits for it before starting an
engine) and copies the supervisor's rollbacks into its metrics. Live acceptance: vLLM counts drafted and accepted
tokens since its engine started (`vllm:spec_decode_num_draft_tokens_total`, `..._num_accepted_tokens_total`,
`..._num_drafts_total`, `..._num_accepted_tokens_per_pos_total{position}`); the live alpha of a window is the
ratio of their increases between two reads. A new engine starts its counters at 0: a counter that went down was
reset, and its increase is its new value (Prometheus' rule for counter resets). That rule misses a new engine whose
counters already passed the old one's last reads (two reads far apart across a swap), so the counters' creation
time (the `..._created` samples vLLM 0.32 exposes beside each `..._total`) names the engine too: when it changes,
every counter counts from 0.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("specdistill.online")

VLLM_EXPORTS = "vllm"
ENGINE_EVENTS = "engine_events.jsonl"
SPEC_COUNTERS = {  # vLLM's metric family (without _total) -> our name
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_export_path(store: str | Path, version: str) -> Path:
    return Path(store).absolute() / VLLM_EXPORTS / version


def engine_events_path(store: str | Path) -> Path:
    return Path(store).absolute() / ENGINE_EVENTS


def export_version_for_vllm(store: str | Path, version: str, target, num_speculative_tokens: int) -> Path:
    """STORE/vllm/VERSION from STORE/versions/VERSION, unless it is there already (exports are immutable, as
    versions are: written to a temporary sibling and renamed into place by models.export)."""
    from specdistill.models.drafter_store import version_path
    from specdistill.models.export import export_for_vllm

    out = vllm_export_path(store, version)
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    path, method = export_for_vllm(version_path(store, version), out, target,
                                   num_speculative_tokens=num_speculative_tokens)
    log.info("exported %s for vLLM (method %s) to %s", version, method, path)
    return path


def read_engine_events(store: str | Path, after_line: int = 0) -> list[dict]:
    """The supervisor's journal from line `after_line` on (complete lines only: a line being written waits)."""
    path = engine_events_path(store)
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")[:-1]  # the part after the last newline is not complete yet
    return [json.loads(x) for x in lines[after_line:] if x.strip()]


# ---- live acceptance from /metrics --------------------------------------------------------------------

@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters at one read, summed over its label sets (one engine serves one model)."""
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    per_position: tuple[float, ...] = ()
    created: float | None = None  # when the engine created these counters (None: not exposed)


def parse_spec_counters(text: str) -> SpecCounters:
    """The spec-decode counters of a Prometheus exposition (vLLM's /metrics, or the built-in server's, which uses
    vLLM's names); absent counters read 0 (an engine without speculation)."""
    from prometheus_client.parser import text_string_to_metric_families  # the `serve` extra, as the server's

    totals = {name: 0.0 for name in SPEC_COUNTERS.values()}
    positions: dict[int, float] = {}
    created: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created") and sample.name[:-len("_created")] in SPEC_COUNTERS:
                created = max(created or 0.0, sample.value)
                continue
            if not sample.name.endswith("_total"):
                continue
            base = sample.name[:-len("_total")]
            if base in SPEC_COUNTERS:
                totals[SPEC_COUNTERS[base]] += sample.value
            elif base == PER_POSITION:
                pos = int(sample.labels.get("position", 0))
                positions[pos] = positions.get(pos, 0.0) + sample.value
    per_position = tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()
    return SpecCounters(totals["drafts"], totals["draft_tokens"], totals["accepted_tokens"], per_position, created)


def increase(now: float, before: float) -> float:
    """A counter's increase between two reads; a counter that went down was reset (a new engine) to 0."""
    return now - before if now >= before else now


def new_engine(before: SpecCounters, now: SpecCounters) -> bool:
    """Whether `now` was read from another engine than `before` (its counters were created at another time)."""
    return before.created is not None and now.created is not None and now.created != before.created


@dataclass
class LiveAcceptance:
    """Successive reads of an engine's counters; each `window` is what happened since the previous read."""
    last: SpecCounters | None = None
    history: list[dict] = field(default_factory=list)

    def window(self, now: SpecCounters) -> dict:
        before = self.last if self.last is not None and not new_engine(self.last, now) else SpecCounters()
        self.last = now
        drafted = increase(now.draft_tokens, before.draft_tokens)
        accepted = increase(now.accepted_tokens, before.accepted_tokens)
        drafts = increase(now.drafts, before.drafts)
        per_pos = [increase(n, before.per_position[i] if i < len(before.per_position) else 0.0)
                   for i, n in enumerate(now.per_position)]
        return {"engine_live_alpha": accepted / drafted if drafted else None,
                "engine_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "engine_drafted": drafted, "engine_accepted": accepted, "engine_drafts": drafts,
                "engine_acceptance_per_position": [a / drafts for a in per_pos] if drafts else None,
                "engine_accepted_total": now.accepted_tokens, "engine_draft_tokens_total": now.draft_tokens}


def scrape(url: str, timeout_s: float = 5.0) -> SpecCounters | None:
    """The counters at `url` (an engine's or the front's /metrics), or None when it cannot be read right now
    (an engine being swapped): the daemon goes on without the engine's view for that window."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout_s)
        response.raise_for_status()
        return parse_spec_counters(response.text)
    except (httpx.HTTPError, ValueError) as e:
        log.warning("could not read the engine's metrics at %s: %s", url, e)
        return None
