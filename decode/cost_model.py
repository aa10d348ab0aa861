"""What a drafter has to achieve to pay on a given machine: the speculative step's cost model.

A step drafts d tokens and verifies them, with the root, in one target forward of d + 1 rows (a tree
of n nodes: n rows). Let P_k be the probability that the step's first k drafts are all accepted
(the evaluation report's `acceptance_per_position`: accepted / drafted at depth k). Then a step emits

    E(d) = 1 + P_1 + ... + P_d  tokens                       (the bonus token, then each accepted draft)

and costs, in units of a one-row target forward,

    C(d) = d * c + v(d + 1)                                    (drafting, then verification)

where c is the drafter's cost per drafted token and v(r) the cost of an r-row forward (v(1) = 1).
Plain decoding emits one token per one-row forward, so the step's speedup is E(d) / C(d); the
adaptive depth (decode.adaptive) looks for the best d. With a conditional acceptance a at every
depth, P_k = a^k.

Everything here is arithmetic on measured figures: `specdistill speedup-model` measures v on the
machine and reads P and c from an evaluation report. It answers "would this drafter pay here if it
drafted deeper?" and "what acceptance would it need for a given speedup?"; the engine does not use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["expected_tokens", "step_cost", "speedup", "best_depth", "acceptance_needed",
           "interpolate", "report_costs"]


def expected_tokens(cumulative: Sequence[float], depth: int) -> float:
    """E(d) = 1 + P_1 + ... + P_d; `cumulative[k - 1]` = P_k, non-increasing in k, each in [0, 1]."""
    check_cumulative(cumulative, depth)
    return 1.0 + sum(cumulative[:depth])


def step_cost(depth: int, draft_cost: float, verify_cost: Sequence[float]) -> float:
    """C(d) = d * c + v(d + 1); `verify_cost[r - 1]` = v(r), relative to a one-row forward."""
    if depth < 0 or draft_cost < 0:
        raise ValueError(f"depth and draft cost must be >= 0, got {depth}, {draft_cost}")
    if len(verify_cost) < depth + 1:
        raise ValueError(f"verification cost known for up to {len(verify_cost)} rows, depth {depth} needs {depth + 1}")
    return depth * draft_cost + verify_cost[depth]


def speedup(cumulative: Sequence[float], depth: int, draft_cost: float, verify_cost: Sequence[float]) -> float:
    """E(d) / C(d): tokens per step over the step's cost in one-row forwards."""
    return expected_tokens(cumulative, depth) / step_cost(depth, draft_cost, verify_cost)


def best_depth(cumulative: Sequence[float], draft_cost: float, verify_cost: Sequence[float]) -> tuple[int, float]:
    """(d, speedup) at the depth d in 0..len(cumulative) (capped by the known row costs) that pays most;
    d = 0 is plain decoding (speedup 1 when v(1) = 1)."""
    deepest = min(len(cumulative), len(verify_cost) - 1)
    options = [(speedup(cumulative, d, draft_cost, verify_cost), -d) for d in range(deepest + 1)]
    value, neg_depth = max(options)
    return -neg_depth, value


def acceptance_needed(goal: float, draft_cost: float, verify_cost: Sequence[float], max_depth: int,
                      tol: float = 1e-4) -> float | None:
    """The least conditional acceptance a (P_k = a^k) whose best depth up to `max_depth` reaches
    `goal`; None when even a = 1 does not (the drafting and verification costs alone forbid it)."""
    def reaches(a: float) -> bool:
        cumulative = [a ** k for k in range(1, max_depth + 1)]
        return best_depth(cumulative, draft_cost, verify_cost)[1] >= goal

    if not reaches(1.0):
        return None
    lo, hi = 0.0, 1.0  # best speedup grows with a: every E(d) does and no C(d) depends on it
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


def interpolate(measured: Mapping[int, float], rows: int) -> list[float]:
    """v(1..rows) from costs measured at some row counts (v(1) among them): linear between measured
    counts, and past the largest along the line through the two largest."""
    points = sorted(measured.items())
    if not points or points[0][0] != 1:
        raise ValueError("the verification cost must be measured at 1 row (the unit)")
    out = []
    for r in range(1, rows + 1):
        lower = [p for p in points if p[0] <= r][-1]
        upper = next((p for p in points if p[0] >= r), None)
        if upper is None and len(points) == 1:  # only v(1) known: flat
            out.append(points[0][1])
        elif upper is None:  # extrapolate along the two largest
            (r0, v0), (r1, v1) = points[-2:]
            out.append(v1 + (v1 - v0) / (r1 - r0) * (r - r1))
        elif upper[0] == lower[0]:
            out.append(lower[1])
        else:
            (r0, v0), (r1, v1) = lower, upper
            out.append(v0 + (v1 - v0) * (r - r0) / (r1 - r0))
    return out


def report_costs(method: Mapping, baseline: Mapping) -> dict:
    """From an evaluation report's entries (decode.report): the method's cumulative acceptance P_k,
    its drafting cost per drafted token c (in one-row forwards: the baseline's seconds per forward),
    drafted tokens per step, and the measured speedup and tau. With the adaptive depth, deeper
    positions are measured on fewer, more confident steps and P_k can exceed P_(k-1); the running
    minimum keeps P a probability of nested events (a conservative reading of the report)."""
    forward_s = baseline["wall_s"] / baseline["target_forwards"]  # one row, with the step's overheads
    accepted = (method["tau"] - 1.0) * method["target_forwards"]
    drafted = accepted / method["alpha"] if method.get("alpha") else 0.0
    cost = method["draft_time_s"] / drafted / forward_s if drafted else float("nan")
    cumulative, previous = [], 1.0
    for p in method.get("acceptance_per_position") or []:
        previous = min(previous, float(p))
        cumulative.append(previous)
    return {"cumulative": cumulative, "draft_cost": cost,
            "drafted_per_step": drafted / method["target_forwards"], "speedup": method["speedup"],
            "tau": method["tau"], "forward_s": forward_s}


def check_cumulative(cumulative: Sequence[float], depth: int) -> None:
    if depth < 0 or depth > len(cumulative):
        raise ValueError(f"depth {depth} outside 0..{len(cumulative)} (the positions with a known acceptance)")
    previous = 1.0
    for k, p in enumerate(cumulative, 1):
        if not 0.0 <= p <= previous + 1e-9:
            raise ValueError(f"P_{k} = {p}: cumulative acceptance must lie in [0, P_{k - 1}] (P_0 = 1)")
        previous = p
