"""The draft-length controller drafts deep for a good cheap drafter, not at all for a useless one."""

from decode.adaptive import DraftLengthController


def trained(accept_prob: float, draft_s: float, verify_1: float, per_node: float, steps: int = 200):
    ctl = DraftLengthController(max_depth=5)
    for _ in range(steps):
        depth = ctl.choose(100)
        n_acc = 0
        while n_acc < depth and (n_acc + 1) / (depth + 1) <= accept_prob:  # deterministic acceptance pattern
            n_acc += 1
        ctl.observe(depth, n_acc, depth + 1, draft_s * depth, verify_1 + per_node * depth)
    return ctl


def test_good_cheap_drafter_drafts_full_depth():
    ctl = trained(accept_prob=1.0, draft_s=0.005, verify_1=0.05, per_node=0.004)
    assert ctl.choose(100) == 5


def test_useless_drafter_mostly_does_not_draft_but_probes():
    ctl = trained(accept_prob=0.0, draft_s=0.015, verify_1=0.05, per_node=0.004)
    depths = [ctl.choose(100) for _ in range(16)]
    assert depths.count(0) >= 14 and 1 in depths  # plain decoding, with an occasional probe


def test_limit_caps_depth():
    ctl = DraftLengthController(max_depth=5)
    assert ctl.choose(2) == 2 and ctl.choose(0) == 0
