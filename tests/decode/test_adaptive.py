"""The draft-length controller drafts deep for a good cheap drafter, not at all for a useless one."""

from specdistill.decode.adaptive import DraftLengthController


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
    depths = []
    for _ in range(300):
        depth = ctl.choose(100)
        depths.append(depth)
        ctl.observe(depth, 0, depth + 1, 0.015 * depth, 0.05 + 0.004 * depth)
    assert 1 in depths and set(depths) <= {0, 1}  # plain decoding, with an occasional probe
    assert depths.count(1) <= 300 / 32  # failed probes back off to one in 64 steps
    assert ctl.probe_interval == ctl.max_probe_every


def test_a_probe_that_makes_drafting_pay_resets_the_interval():
    ctl = trained(accept_prob=0.0, draft_s=0.015, verify_1=0.05, per_node=0.004)
    ctl.probe_interval, ctl.accept[0] = 64, 0.9  # the drafter started agreeing: this probe tips the balance
    ctl.probing = True
    ctl.observe(1, 1, 2, 0.015, 0.054)
    assert ctl.best_depth(ctl.max_depth) > 0 and ctl.probe_interval == ctl.probe_every


def test_accepted_probes_that_do_not_make_drafting_pay_back_off_when_most_are_rejected():
    """Right a third of the time, and a drafted token costs more than it brings (rows dear, drafting
    slow): an accepted probe halves the interval, a rejected one doubles it, so it drifts to the longest."""
    ctl = trained(accept_prob=0.0, draft_s=0.04, verify_1=0.05, per_node=0.03)
    depths = []
    for _ in range(600):
        depth = ctl.choose(100)
        depths.append(depth)
        n_acc = depth if depths.count(1) % 3 == 0 else 0  # every third probe accepted
        ctl.observe(depth, n_acc, depth + 1, 0.04 * depth, 0.05 + 0.03 * depth)
        if depth:
            assert ctl.best_depth(ctl.max_depth) == 0  # these probes never make drafting pay
    assert ctl.accept[0] > 0.2  # the accepted probes were learned
    assert ctl.probe_interval >= ctl.max_probe_every // 2 and depths[-300:].count(1) <= 300 / 24


def test_accepted_probes_halve_the_interval():
    ctl = trained(accept_prob=0.0, draft_s=0.015, verify_1=0.05, per_node=0.004)
    ctl.probe_interval, ctl.probing = 64, True
    ctl.observe(1, 1, 2, 0.015, 0.054)  # accepted, but one acceptance does not make drafting pay
    assert ctl.best_depth(ctl.max_depth) == 0 and ctl.probe_interval == 32


def test_limit_caps_depth():
    ctl = DraftLengthController(max_depth=5)
    assert ctl.choose(2) == 2 and ctl.choose(0) == 0


def test_a_wide_tree_is_priced_at_its_own_size():
    """Same acceptance and costs per node: a proposer that drafts 4 nodes per unit of depth pays
    4x the verification nodes, so it drafts less deep than a chain does."""
    def run(width: int) -> DraftLengthController:
        ctl = DraftLengthController(max_depth=5)
        for _ in range(200):
            depth = ctl.choose(100)
            n_acc = min(depth, 2)
            ctl.observe(depth, n_acc, 1 + width * depth, 0.002 * depth, 0.05 + 0.006 * width * depth)
        return ctl

    chain, wide = run(1), run(4)
    assert chain.width == 1.0 and abs(wide.width - 4.0) < 0.05
    assert wide.tree_nodes(3) == 13 and chain.tree_nodes(3) == 4
    for ctl in (chain, wide):
        ctl.accept = [0.7] * 5  # the same drafter quality; only the tree's size differs
    # by hand, from the costs above: a chain pays best at depth 3, the 4-wide tree at depth 1
    assert chain.choose(100) == 3 and wide.choose(100) == 1


def test_costs_and_sizes_are_measured_per_depth_and_interpolated_between():
    """A Medusa tree plus a prompt-lookup chain: drafting costs the same at any depth (the heads stop at
    their own depth, the lookup is free) and the tree is 4 nodes plus one per depth. Measured at depths
    1 and 6, depth 3 is priced between them, not at a per-token rate or a mean width."""
    ctl = DraftLengthController(max_depth=8)
    for depth in (1, 6) * 20:
        ctl.observe(depth, 1, 4 + depth, 0.003, 0.05 + 0.004 * (3 + depth))
    assert ctl.tree_nodes(1) == 5 and ctl.tree_nodes(6) == 10 and ctl.tree_nodes(3) == 7
    assert abs(ctl.predicted_draft_cost(3) - 0.003) < 1e-9 and abs(ctl.predicted_draft_cost(6) - 0.003) < 1e-9
    assert ctl.tree_nodes(0) == 1 and ctl.predicted_draft_cost(0) == 0.0
    assert ctl.tree_nodes(8) == 10 + round(2 * ctl.width)  # beyond the deepest: extrapolated by the width
    assert abs(ctl.predicted_draft_cost(8) - (0.003 + 2 * ctl.draft_cost)) < 1e-9


def test_a_depth_never_drafted_is_still_learned():
    """Estimates start wrong past depth 3 (as after a stretch where the lookup found nothing) while the
    drafter is in fact always right: drafting one deeper now and then finds that out, and the controller
    ends at full depth instead of staying at 3 forever."""
    ctl = DraftLengthController(max_depth=6)
    for depth in (6, 3):  # learn costs at two depths
        ctl.observe(depth, depth, 1 + depth, 0.001 * depth, 0.05 + 0.002 * depth)
    ctl.accept = [0.95, 0.95, 0.95, 0.02, 0.02, 0.02]
    assert ctl.choose(100) == 3
    depths = []
    for _ in range(300):
        depth = ctl.choose(100)
        depths.append(depth)
        ctl.observe(depth, depth, 1 + depth, 0.001 * depth, 0.05 + 0.002 * depth)  # every draft accepted
    assert depths[-1] == 6 and depths[-20:].count(6) >= 18


def test_the_next_step_bound_covers_every_choice_and_is_mostly_the_settled_depth():
    """An [LA]-like drafter: position 1 right a third of the time, position 2 never. The bound the
    engine reads before observing a step (how many [LA] rows to compute) covers the depth the next
    step chooses, so no choice is cut short; it is the settled depth 1 on most steps, and one more
    only when the controller's deeper probe is due."""
    import random
    rng = random.Random(0)
    ctl = DraftLengthController(max_depth=4)
    bounds, choices = [], []
    for _ in range(400):
        depth = ctl.choose(100)
        choices.append(depth)
        bounds.append(ctl.next_step_bound(100))
        n_acc = 1 if depth >= 1 and rng.random() < 0.35 else 0
        ctl.observe(depth, n_acc, depth + 1, 0.0005 * depth, 0.05 + 0.002 * depth)
    settled = list(zip(bounds[100:-1], choices[101:]))
    assert sum(nxt <= bound for bound, nxt in settled) >= 0.97 * len(settled)
    assert choices[100:].count(1) > 0.8 * 300  # settled at depth 1
    assert 0.8 * 300 < bounds[100:].count(1) < 300  # rows for depth 1 only, but not always:
    assert any(b == 2 for b in bounds[100:])  # the deeper probe gets the rows it needs


def test_the_next_step_bound_before_anything_is_measured_is_the_limit():
    ctl = DraftLengthController(max_depth=4)
    assert ctl.next_step_bound(100) == 4 and ctl.next_step_bound(2) == 2 and ctl.next_step_bound(0) == 0
