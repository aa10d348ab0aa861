"""Several drafters, one token tree: every member drafts a chain, the chains merge with shared
prefixes once, and the target verifies the whole tree in one forward.

Why the multi-draft rule keeps the target's distribution (SpecInfer, Miao et al. 2023, multi-step
speculative sampling; `decode.sampling.verify_sampling` implements it). At a node v with target
distribution p, the members whose chains pass through v propose x_1, ..., x_n (in source order),
each x_i drawn independently from its own q_i. Try them in order: accept x_i with probability
min(1, r_i(x_i) / q_i(x_i)), where r_1 = p and, on rejection, r_{i+1} = norm(max(r_i - q_i, 0));
if all are rejected, emit a token drawn from r_{n+1}. Induction from the last draft back:
  * one draft against r: P(emit y) = min(r, q)(y) + (1 - sum_z min(r, q)(z)) * r'(y) = r(y), with
    r' = norm(max(r - q, 0)) and sum_z max(r - q, 0)(z) = 1 - sum_z min(r, q)(z) (Leviathan et al.);
  * so if drafts i+1..n emit exactly r_{i+1} after a rejection of x_i, drafts i..n emit exactly r_i,
    and all n emit r_1 = p.
The emitted token is therefore distributed as p, and the next node starts the same argument afresh:
a member's next draft was sampled after its earlier drafts and nothing before it looked at it, so
given the accepted path it is still a fresh draw from the member's q.

Why the source order must not depend on the sampled tokens: the induction needs, when x_i is tried,
x_i ~ q_i independently of everything that decided that x_i is the i-th draft tried. Ordering by
token (say, the most probable draft first) selects drafts by their values: the first one tried is
then not a sample of its q, the acceptance min(1, p/q) no longer cancels q, and the output is
biased (tests/decode/test_ensemble.py shows a chi-square test rejecting exactly that). Members
therefore keep their index as the source; the verifier sorts by source only.

The same requirement shapes the node cap (`cap_chains`): whether a member's draft at depth d stays
in the tree may depend on what was decided before it in verification order (shallower drafts of
every member, and the depth-d drafts of earlier members), never on that draft itself or on deeper
ones. So drafts are admitted breadth-first, depth by depth and, within a depth, member by member,
and each admission needs room for one new node even when the draft will turn out to coincide with
an existing node (it may still share it; it just cannot be admitted *because* it shares). When the
cap binds, the deepest drafts of the later members are the ones dropped, and the result is always
a valid tree (a member keeps a prefix of its chain). Greedy decoding is lossless whatever the tree
(the accepted path is the target's argmax path), so it uses the same rule.
"""

from __future__ import annotations

import torch

from specdistill.decode.proposers.base import (
    Alternate,
    Proposer,
    build_proposer,
    register_proposer,
    use_gemv_friendly_head,
)
from specdistill.decode.proposers.draft_model import DraftModelProposer
from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.tree import TokenTree

__all__ = ["EnsembleProposer", "cap_chains", "merge_chains", "build_ensemble_proposer"]

Chain = tuple[list[int], list[torch.Tensor | None]]  # drafted tokens and the q each was sampled from


class EnsembleProposer(Proposer):
    """Members draft one after another (each from its own q when sampling: independent draws, as
    the multi-draft rule needs); their chains merge into one tree of at most `max_tree_nodes` nodes
    (root included), source = member index. With `branches` b > 1, in greedy mode each member also
    offers its next b - 1 most likely tokens at every depth of its chain as one-node branches; the
    tree takes the ones with the highest path probability (by their member's own q) while there
    is room (SpecInfer's top-b expansion, ranked as EAGLE-2 ranks its dynamic tree)."""

    name = "ensemble"

    def __init__(self, members: list[DraftModelProposer], max_tree_nodes: int, branches: int = 1):
        if not members:
            raise ValueError("an ensemble needs at least one member proposer")
        if max_tree_nodes < 2:
            raise ValueError(f"max_tree_nodes must be >= 2 (the root and one draft), got {max_tree_nodes}")
        if branches < 1:
            raise ValueError(f"branches must be >= 1 (1: chains only), got {branches}")
        self.members = list(members)
        self.max_tree_nodes = max_tree_nodes
        self.branches = branches
        self.max_depth = max(m.max_depth for m in self.members)

    def weight_format(self) -> str:
        """The members' format, or their distinct formats in member order, comma-separated."""
        return ", ".join(dict.fromkeys(member.weight_format() for member in self.members))

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        for member in self.members:
            member.begin(prompt_ids, capacity)

    def last_catch_up_s(self) -> float:
        return sum(member.last_catch_up_s() for member in self.members)

    def propose(self, seq: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> TokenTree:
        chains, alternates = [], []
        for member in self.members:
            tokens, probs, others = member.draft_chain(seq, max_depth, sampling, generator, self.branches - 1)
            chains.append((tokens, probs))
            alternates.append(others)
        return merge_chains(seq[-1], chains, self.max_tree_nodes, alternates)


def merge_chains(root: int, chains: list[Chain], max_nodes: int,
                 alternates: list[list[Alternate]] | None = None) -> TokenTree:
    """One tree from the members' chains (source = index in `chains`), shared prefixes once, at
    most `max_nodes` nodes. Nodes are laid out member by member (member 0's chain first and
    contiguous, so that its accepted path commits without moving KV entries). Then, while there is
    room, the members' greedy alternates (`alternates[i]`: member i's (depth, token, log path
    probability), see DraftModelProposer.draft_chain) as leaves beside their chain's token at that
    depth, highest path probability first over all members; an alternate whose chain was cut above
    its depth has no parent and is skipped. Only greedy decoding drafts alternates, and its
    losslessness does not depend on the tree's shape, so they need not follow the cap's rule."""
    keep = cap_chains([tokens for tokens, _ in chains], max_nodes)
    tree = TokenTree.root(root)
    parents = []  # parents[i][d]: the node member i's depth-d draft hangs from
    for source, ((tokens, probs), n) in enumerate(zip(chains, keep)):
        parents.append([0] + tree.add_chain(tokens[:n], probs[:n], source=source))
    ranked = sorted(((score, source, depth, token) for source, others in enumerate(alternates or [])
                     for depth, token, score in others), key=lambda a: -a[0])  # stable: member, depth
    for _, source, depth, token in ranked:
        if depth > keep[source]:
            continue  # its chain was cut above it
        parent = parents[source][depth]
        shared = any(tree.tokens[c] == token for c in tree.children(parent))
        if len(tree) >= max_nodes and not shared:
            continue
        tree.add(token, parent, None, source=source)  # shares the node when the token is there already
    return tree


def cap_chains(chains: list[list[int]], max_nodes: int) -> list[int]:
    """How many leading drafts of each chain the tree keeps, so that the merged tree has at most
    `max_nodes` nodes (root included). Admission runs breadth-first (depth, then member) and a
    draft is admitted only while there is room for one more node, whether or not it would be
    shared; a member whose draft is refused drafts no deeper. See the module docstring for why."""
    keep = [0] * len(chains)
    nodes = {()}  # the distinct prefixes in the tree, () being the root
    for depth in range(max((len(c) for c in chains), default=0)):
        for source, chain in enumerate(chains):
            if keep[source] != depth or depth >= len(chain):
                continue  # refused (or ended) at a shallower depth
            if len(nodes) >= max_nodes:
                continue
            nodes.add(tuple(chain[: depth + 1]))
            keep[source] = depth + 1
    return keep


def build_ensemble_proposer(member_drafters: list, target_model: torch.nn.Module, gamma: int = 5,
                            eos_token_ids: set[int] = frozenset(), max_tree_nodes: int = 16,
                            branches: int = 1) -> EnsembleProposer:
    """The proposer of an ensemble whose members are loaded drafters (models.drafters.Drafter of
    kind draft_model), each checked against the target's vocabulary."""
    members = []
    for i, drafter in enumerate(member_drafters):
        if drafter.kind != "draft_model":
            raise ValueError(f"ensemble member {i} is of kind {drafter.kind!r}; members must be draft_model drafters")
        members.append(build_proposer(drafter, target_model, gamma=gamma, eos_token_ids=eos_token_ids))
    return EnsembleProposer(members, max_tree_nodes, branches)


def build_ensemble_kind_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                                 **kw) -> EnsembleProposer:
    """A loaded ensemble drafter's proposer, its tree's size and branching as its manifest stores them."""
    for member in drafter.members:
        use_gemv_friendly_head(member.model)
    return build_ensemble_proposer(drafter.members, target_model, gamma, eos_token_ids,
                                   drafter.manifest.get("max_tree_nodes", 16),
                                   drafter.manifest.get("branches", 1))


register_proposer("ensemble", build_ensemble_kind_proposer)
