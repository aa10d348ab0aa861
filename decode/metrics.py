"""Per-request statistics of a generation, and their aggregate.

tau   = tokens emitted per target forward, the bonus token included (Spec-Bench's "mean accepted
        tokens"; plain decoding = 1.00). The prefill forward, which emits the first token, counts.
alpha = accepted draft tokens / drafted tokens (None when nothing was drafted). For a tree, a
        drafted token is a draft position on the deepest path that could have been accepted:
        we count one drafted token per tree depth, so alpha compares across chains and trees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def record_step(self, draft_depth: int, n_accepted: int) -> None:
        """One verification: a tree of depth `draft_depth` of which `n_accepted` drafts were kept."""
        grow = draft_depth - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for pos in range(draft_depth):
            self.drafted_per_position[pos] += 1
            self.accepted_per_position[pos] += int(pos < n_accepted)
        self.drafted += draft_depth
        self.accepted += n_accepted
        self.target_forwards += 1

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(tau=self.tau, alpha=self.alpha, tokens_per_s=self.tokens_per_s,
                   acceptance_per_position=acceptance_rates(self.accepted_per_position, self.drafted_per_position))
        return out


def acceptance_rates(accepted: list[int], drafted: list[int]) -> list[float]:
    """P(draft at position k accepted | drafted) for each position."""
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def aggregate_stats(stats: list[RequestStats]) -> dict:
    """Sum the counts of many requests and derive tau, alpha and tokens/s from the sums."""
    total = RequestStats()
    for s in stats:
        n = max(len(total.drafted_per_position), len(s.drafted_per_position))
        total.drafted_per_position = _pad_add(total.drafted_per_position, s.drafted_per_position, n)
        total.accepted_per_position = _pad_add(total.accepted_per_position, s.accepted_per_position, n)
        for name in ("new_tokens", "target_forwards", "drafted", "accepted",
                     "draft_time_s", "verify_time_s", "total_time_s"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
    out = total.to_dict()
    out["requests"] = len(stats)
    return out


def _pad_add(a: list[int], b: list[int], n: int) -> list[int]:
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
