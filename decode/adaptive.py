"""Cost-aware draft length: draft as deep as pays for itself, measured online.

Drafting k tokens emits on average E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j tokens per target
forward, where a_j is the acceptance rate of draft position j given that position j-1 was
accepted; it costs k drafter steps plus a target forward over k + 1 nodes. The controller
estimates a_j, the drafting cost and the target's cost per tree size from the steps it has seen,
and picks the k in [0, max_depth] that maximises E(k) / cost(k). A tree proposer (an ensemble,
Medusa) verifies more than k + 1 nodes at depth k, and not every proposer's drafting cost grows
with k (Medusa's stops at its last head, a prompt-lookup chain costs nothing): the controller
learns the tree size and the drafting time at each depth it has drafted, and prices a depth it
has not by interpolating between measured ones, or beyond them by the tree's width (nodes per unit
of depth) and the drafting time per token. k = 0 is plain decoding:
a drafter that is almost never right should not slow the target down. While k = 0 wins it still
drafts one token every `probe_every` steps, so that a drafter that starts agreeing is noticed; each
probe that is rejected doubles the interval (up to `max_probe_every`), one after which drafting pays
resets it, and one accepted without making drafting pay halves it (down to `probe_every`): the interval
drifts up where fewer than half the probes are accepted, down where more are. A useless drafter costs
about 1% of the steps instead of one in eight, and so does one right less than half the time whose
drafts cost more than they bring (an [LA] drafter on a CPU where each verified row is dear), which
resetting on every accepted probe kept probing every 8-16 steps. Likewise, the estimate a_j only
moves when a step drafts j deep, so a controller settled at depth k would never learn that position
k + 1 got better (a prompt-lookup chain that starts matching): every `deeper_every` steps at a depth
k > 0 below the limit it drafts k + 1 once.

The drafting time it learns from leaves out a draft model's catch-up after such plain-decoding steps
(the tokens emitted meanwhile, fed in a forward of their own: decode.proposers.CATCH_UP_SPLIT): that is
paid once when drafting resumes, and charged to the probe it kept a drafter that pays when drafting
steadily from ever starting.

This only changes how much is drafted, never what is emitted: the output stays lossless.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class DraftLengthController:
    max_depth: int
    probe_every: int = 8
    max_probe_every: int = 64
    decay: float = 0.9  # EMA weight of the past; recent steps count most
    accept: list[float] = field(default_factory=list)  # a_j estimates, prior 0.5
    draft_cost: float | None = None  # seconds per drafted token
    verify_cost: dict[int, float] = field(default_factory=dict)  # tree size -> seconds
    width: float = 1.0  # drafted nodes per unit of depth (1 for a chain), EMA
    nodes_at: dict[int, float] = field(default_factory=dict)  # drafted depth -> tree size (root included), EMA
    draft_at: dict[int, float] = field(default_factory=dict)  # drafted depth -> drafting seconds, EMA
    steps_without_draft: int = 0
    probe_interval: int = 0  # current interval between probes (starts at probe_every)
    probing: bool = False
    deeper_every: int = 16  # a step one deeper than the choice this often, while 0 < choice < limit
    steps_since_deeper: int = 0

    def __post_init__(self):
        self.accept = [0.5] * self.max_depth
        self.probe_interval = self.probe_every

    def choose(self, limit: int) -> int:
        """The draft depth for the next step, at most `limit` (tokens left before max_new_tokens)."""
        limit = min(limit, self.max_depth)
        if limit <= 0:
            return 0
        if self.draft_cost is None or not self.verify_cost:
            return limit  # nothing measured yet: draft fully once to learn the costs
        best = self.best_depth(limit)
        self.probing = False
        if best == 0:
            self.steps_without_draft += 1
            if self.steps_without_draft >= self.probe_interval:
                self.steps_without_draft = 0
                self.probing = True
                return 1
        elif best < limit:
            self.steps_since_deeper += 1
            if self.steps_since_deeper >= self.deeper_every:
                self.steps_since_deeper = 0
                return best + 1
        return best

    def best_depth(self, limit: int) -> int:
        """The depth in [0, limit] of highest expected throughput under the present estimates."""
        return max(range(limit + 1), key=self.throughput)

    def next_step_bound(self, limit: int) -> int:
        """The depth the next step would draft as things stand (its probes included): choose() on a
        copy, so that no counter moves. For a proposer whose next drafts come out of this step's target
        forward ([LA] rows): rows past this bound would be computed for nothing. The step after may
        choose deeper once its estimates moved; it drafts what this bound let through, and the bound
        follows one step later."""
        return copy.copy(self).choose(limit)  # choose() only rebinds scalar fields: a shallow copy is enough

    def throughput(self, k: int) -> float:
        """Expected tokens per second when drafting k tokens."""
        expected, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.accept[j]
            expected += reach
        return expected / (self.predicted_draft_cost(k) + self.predicted_verify_cost(self.tree_nodes(k)))

    def tree_nodes(self, k: int) -> int:
        """The expected size of a tree drafted at depth k, root included."""
        return round(per_depth(self.nodes_at, k, 1.0, self.width))

    def predicted_draft_cost(self, k: int) -> float:
        """Seconds of drafting at depth k."""
        return per_depth(self.draft_at, k, 0.0, self.draft_cost or 0.0)

    def predicted_verify_cost(self, nodes: int) -> float:
        """Measured cost for this tree size, else interpolated between measured sizes, else scaled
        from the nearest measured size by a prior of +10% of a one-token forward per extra node."""
        if nodes in self.verify_cost:
            return self.verify_cost[nodes]
        known = sorted(self.verify_cost)
        below = [n for n in known if n < nodes]
        above = [n for n in known if n > nodes]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (nodes - lo) / (hi - lo)
            return (1 - w) * self.verify_cost[lo] + w * self.verify_cost[hi]
        nearest = below[-1] if below else above[0]
        return self.verify_cost[nearest] * _prior(nodes) / _prior(nearest)

    def observe(self, depth: int, n_accepted: int, tree_nodes: int, draft_s: float, verify_s: float) -> None:
        """Learn from one verification step."""
        for j in range(min(depth, n_accepted + 1)):  # positions that were reached
            self.accept[j] = self._ema(self.accept[j], float(j < n_accepted))
        if depth > 0:
            per_token = draft_s / depth
            self.draft_cost = per_token if self.draft_cost is None else self._ema(self.draft_cost, per_token)
            self.width = self._ema(self.width, (tree_nodes - 1) / depth)
            old_nodes, old_draft = self.nodes_at.get(depth), self.draft_at.get(depth)
            self.nodes_at[depth] = tree_nodes if old_nodes is None else self._ema(old_nodes, tree_nodes)
            self.draft_at[depth] = draft_s if old_draft is None else self._ema(old_draft, draft_s)
        old = self.verify_cost.get(tree_nodes)
        self.verify_cost[tree_nodes] = verify_s if old is None else self._ema(old, verify_s)
        if self.probing:
            self.probe_interval = self.next_probe_interval(n_accepted)

    def next_probe_interval(self, n_accepted: int) -> int:
        """After a probe (its evidence already in the estimates): start over if drafting now pays, else
        twice as far apart if it was rejected, half as far if it was accepted."""
        if self.best_depth(self.max_depth) > 0:
            return self.probe_every
        if n_accepted == 0:
            return min(2 * self.probe_interval, self.max_probe_every)
        return max(self.probe_interval // 2, self.probe_every)

    def _ema(self, old: float, new: float) -> float:
        return self.decay * old + (1 - self.decay) * new


def per_depth(measured: dict[int, float], k: int, at_zero: float, slope: float) -> float:
    """A quantity at depth k: measured there, else interpolated between the nearest measured depths
    (depth 0 is `at_zero`), else extrapolated from the deepest measured one by `slope` per depth."""
    if k in measured:
        return measured[k]
    below = max((d for d in measured if d < k), default=0)
    low = measured.get(below, at_zero)
    above = min((d for d in measured if d > k), default=None)
    if above is None:
        return low + slope * (k - below)
    return low + (measured[above] - low) * (k - below) / (above - below)


def _prior(nodes: int) -> float:
    """Relative cost of a target forward over `nodes` tokens before anything is measured."""
    return 1.0 + 0.1 * (nodes - 1)
