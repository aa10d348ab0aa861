"""Self-drafting proposers: Medusa heads read the target's own hidden states.

No extra target forward per step. The engine's verification forward returns the hidden state of
every tree node; after verification it calls `observe_verification(hidden [N, D], verdict)` (and
after prefill `observe_prefill(hidden [n, D])`, the prompt's) on a proposer whose `self_drafting` is True.
Heads with a prefix layer (models.medusa, Hydra++) run it over the accepted rows in sequence order,
with its own KV cache, and read its output at the last one.

Offsets. Let t be the last accepted node. The target's head on h_t gives the bonus token (t + 1),
which the engine emits and which becomes the next tree's root. Medusa head k on h_t predicts token
t + k + 1, i.e. the token at depth k below that root. So head 1 proposes the root's children, head 2
their children, and so on; none of them sees the root token itself (Medusa's design).

The tree is sparse: a list of rank paths (r_1, ..., r_d), a node meaning "head 1's r_1-th choice,
then head 2's r_2-th choice, ...", chosen offline by `choose_tree` from per-head top-k accuracies
measured on calibration data (greedy expansion maximising expected accepted length under a node
budget, as in Medusa's tree search) and stored in the drafter's manifest.

Sequential heads (models.medusa, `sequential`) read the tokens above them too, so the tree cannot be
filled from one top-k per head: `propose` runs head d on the states and tokens of the depth-(d-1)
nodes that have children in the tree (one batched call per depth, cut at the step's depth), and a
node's children are its own head-d choices. The same rank paths describe the tree.

Sampling. Every draft is a deterministic function of the context (top-k of the heads on the
target's hidden state), so each node is proposed with q = one-hot (proposal None): the existing
multi-draft rule (decode.sampling.verify_sampling) then emits exactly the target's distribution.
Proposing the top-k tokens with q = the head's softmax would be biased: they are not samples of q.
"""

from __future__ import annotations

import heapq

import torch

from specdistill.decode.proposers.base import Proposer, register_proposer, stored_format, vocab_size
from specdistill.decode.sampling import SamplingConfig, Verdict
from specdistill.decode.tree import TokenTree
from specdistill.models.medusa import (  # importing models.medusa registers the drafter kind "medusa"
    PrefixCache,
    check_heads_vocab,
    projection_rows,
)
from specdistill.models.packed_linear import (
    check_weight_format,
    drafting_weights,
    packed_class,
    packed_for_inference,
    packing_supported,
)

__all__ = ["MedusaProposer", "choose_tree", "check_tree", "tree_from_ranks"]

RankPath = tuple[int, ...]


class MedusaProposer(Proposer):
    name = "medusa"
    self_drafting = True

    def __init__(self, heads: torch.nn.Module, tree: list[list[int]] | None = None,
                 vocab_map: torch.Tensor | None = None, embed: torch.nn.Module | None = None,
                 weights: str = "float32"):
        """vocab_map: [M] target ids the heads may propose (models.medusa: the teacher data's most
        frequent tokens); the projections then cover those M rows only, which cuts the proposer's
        cost by V / M. None keeps the full vocabulary. Either way the target verifies every draft.
        embed: the target's input embedding, which sequential heads read the tree's tokens through.
        weights: the format of the heads' packed projections on the CPU (models.packed_linear)."""
        self.heads = heads
        self.sequential = bool(getattr(heads, "sequential", False))
        if self.sequential and embed is None:
            raise ValueError("sequential Medusa heads need the target's input embedding (embed=)")
        self.embed = embed
        self.tree = check_tree(tree if tree is not None else default_chain(heads.num_heads), heads.num_heads)
        self.max_depth = max(len(path) for path in self.tree)
        self.max_rank = max(max(path) for path in self.tree) + 1
        self.topk: torch.Tensor | None = None  # [K, max_rank] the heads' choices after the last accepted node
        self.hidden: torch.Tensor | None = None  # [D] the last accepted node's state (sequential heads)
        self.vocab_map = None if vocab_map is None else vocab_map.long().cpu()  # [M] head row -> target id
        self.projections = head_projections(heads, self.vocab_map, weights)  # K x ([N, D] -> [N, M])
        self.weights = stored_format(weights if packing_supported(heads) else "float32", heads)  # packed only there
        prefix = getattr(heads, "prefix", None)  # decoding runs a few rows through it per step: packed too
        self.prefix = None if prefix is None else packed_for_inference(prefix)
        self.prefix_cache: PrefixCache | None = None

    def weight_format(self) -> str:
        return self.weights

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.topk = self.hidden = None
        if self.prefix is not None:
            weight = self.prefix.attn_norm.weight  # shared with the unpacked layer: its device and dtype
            self.prefix_cache = PrefixCache(self.prefix, capacity, weight.device, weight.dtype)

    def observe_prefill(self, hidden: torch.Tensor) -> None:
        """hidden [n, D]: the target's states at the prompt's positions."""
        self.observe_accepted(hidden)

    def observe_verification(self, hidden: torch.Tensor, verdict: Verdict) -> None:
        # the accepted nodes' states, root first; without a prefix layer only the last one is read, as a
        # view (a list index copies, 0.15 ms a step on a 2-core CPU, paid by steps that draft nothing)
        last = verdict.path[-1]
        self.observe_accepted(hidden[verdict.path] if self.prefix is not None else hidden[last:last + 1])

    @torch.no_grad()
    def observe_accepted(self, rows: torch.Tensor) -> None:
        """rows [n, D]: the target's states at the next n positions of the sequence, all accepted."""
        if self.prefix is not None:
            if self.prefix_cache is None:
                raise RuntimeError("MedusaProposer: begin() must come before the prefix layer's first rows")
            rows = self.prefix.extend(rows.to(self.prefix_cache.keys.dtype), self.prefix_cache)
        self.observe_state(rows[-1])

    def observe_state(self, hidden: torch.Tensor) -> None:
        if self.sequential:  # the heads' choices depend on the tree's tokens: drafted in propose
            self.hidden = hidden.to(self.heads.heads[0].proj.weight.dtype)
        else:
            self.topk = self.head_choices(hidden)

    @torch.no_grad()
    def head_choices(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.heads.heads[0].proj.weight.dtype)  # [D]
        blocks = torch.stack([head.blocks(hidden) for head in self.heads.heads])  # [K, D]
        logits = torch.cat([project(blocks[k:k + 1]) for k, project in enumerate(self.projections)])  # [K, M]
        return self.target_ids(logits.topk(self.max_rank, dim=-1).indices.cpu())  # [K, max_rank]

    def target_ids(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.vocab_map is None else self.vocab_map[rows]

    def propose(self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator) -> TokenTree:
        if (self.hidden if self.sequential else self.topk) is None:
            raise RuntimeError("MedusaProposer.propose before observe_prefill: the engine must feed it hidden states")
        if self.sequential:
            return self.sequential_tree(seq[-1], max_depth)
        return tree_from_ranks(seq[-1], self.tree, self.topk, max_depth)

    @torch.no_grad()
    def sequential_tree(self, root: int, max_depth: int) -> TokenTree:
        """The rank-path tree drafted depth by depth: head d runs once, batched, on the depth-(d-1)
        nodes that have children (their states and tokens); each node's children are its own choices."""
        tree = TokenTree.root(root)
        node_of: dict[RankPath, int] = {(): 0}
        state_of: dict[RankPath, torch.Tensor] = {(): self.hidden}  # [D] the state each node's children read
        for depth in range(1, min(max_depth, self.max_depth) + 1):
            paths = [tuple(p) for p in self.tree if len(p) == depth]
            parents = list(dict.fromkeys(p[:-1] for p in paths))  # in tree order, each once
            ranks = max(p[-1] for p in paths) + 1
            head = self.heads.heads[depth - 1]
            tokens = torch.tensor([tree.tokens[node_of[p]] for p in parents], device=self.hidden.device)  # [P]
            states = head.state(torch.stack([state_of[p] for p in parents]), self.embed(tokens))  # [P, D]
            choices = self.target_ids(self.projections[depth - 1](states).topk(ranks, dim=-1).indices.cpu()).tolist()
            row_of = {p: i for i, p in enumerate(parents)}
            for path in paths:  # siblings are distinct ranks of one head: no dedupe needed
                row = row_of[path[:-1]]
                node_of[path] = tree.add(choices[row][path[-1]], node_of[path[:-1]], None, dedupe=False)
                state_of[path] = states[row]
        return tree


def head_projections(heads: torch.nn.Module, vocab_map: torch.Tensor | None, weights: str = "float32") -> list:
    """Per head, states [N, D] -> logits [N, M]: its output projection restricted to vocab_map's rows.

    A decode step runs every head on one or a few states: GEMVs over [M, D] weights that dominate the
    proposer's cost. On CPU in fp32 each head gets a packed copy of its rows in `weights` format
    (models.packed_linear: oneDNN fp32, or FBGEMM fp16); elsewhere a column-major copy, which the BLAS runs
    as a faster GEMV (see decode.proposers.base.use_gemv_friendly_head). Inference only: the proposer never
    trains the heads, and they keep their weights."""
    check_weight_format(weights)
    rows = projection_rows(heads, vocab_map)  # K x [M, D] (K x [V, D] without a vocab_map)
    if packing_supported(heads):
        return [packed_class(weights)(as_linear(w)) for w in rows]  # built once per proposer: no cache needed
    columns = [w.t().contiguous() for w in rows]  # K x [D, M]
    return [lambda states, w=w: states @ w for w in columns]


def as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free Linear holding `weight` [M, D] (shared, not copied)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def tree_from_ranks(root: int, paths: list[list[int]], topk: torch.Tensor, max_depth: int) -> TokenTree:
    """The token tree of rank paths (sorted by depth, every prefix present), cut at max_depth."""
    tree = TokenTree.root(root)
    node_of: dict[RankPath, int] = {(): 0}
    choices = topk.tolist()
    for path in paths:
        if len(path) > max_depth:
            continue
        depth = len(path)
        token = choices[depth - 1][path[-1]]
        # no dedupe: sibling ranks are distinct tokens of one head, so children never coincide
        node_of[tuple(path)] = tree.add(token, node_of[tuple(path[:-1])], None, dedupe=False)
    return tree


def default_chain(num_heads: int) -> list[list[int]]:
    """Each head's top choice: a chain of num_heads drafts (used when no calibrated tree is stored)."""
    return [[0] * d for d in range(1, num_heads + 1)]


def check_tree(paths, num_heads: int) -> list[list[int]]:
    """Rank paths, sorted by depth; every prefix present, no deeper than the number of heads."""
    paths = [list(map(int, p)) for p in paths]
    if not paths:
        raise ValueError("a Medusa tree needs at least one node besides the root")
    seen = {()}
    for path in sorted(paths, key=len):
        if not path or len(path) > num_heads or min(path) < 0:
            raise ValueError(f"tree path {path}: needs depth 1..{num_heads} (heads) and ranks >= 0")
        if tuple(path[:-1]) not in seen:
            raise ValueError(f"tree path {path}: its parent {path[:-1]} is not in the tree")
        if tuple(path) in seen:
            raise ValueError(f"tree path {path} appears twice")
        seen.add(tuple(path))
    return sorted(paths, key=len)


def choose_tree(accuracy: list[list[float]], budget: int) -> list[list[int]]:
    """The `budget` nodes (root excluded) that maximise the expected accepted length.

    accuracy[k][r] = P(head k+1's r-th choice is the target's token), measured teacher-forced. A node's
    acceptance probability is the product of its path's accuracies (heads treated as independent),
    and the expected accepted length is the sum over nodes. Expanding greedily the frontier node of
    highest probability is optimal for this objective: a child is never more likely than its parent,
    nor rank r + 1 more than rank r when accuracies decrease with rank."""
    heads, ranks = len(accuracy), len(accuracy[0])
    frontier = [(-path_probability((0,), accuracy), (0,))]
    chosen: list[list[int]] = []
    while frontier and len(chosen) < budget:
        _, path = heapq.heappop(frontier)
        chosen.append(list(path))
        # each node enters the frontier once: from its previous sibling, or (rank 0) from its parent
        successors = [path[:-1] + (path[-1] + 1,)] if path[-1] + 1 < ranks else []
        if len(path) < heads:
            successors.append(path + (0,))
        for nxt in successors:
            heapq.heappush(frontier, (-path_probability(nxt, accuracy), nxt))
    return chosen


def path_probability(path, accuracy: list[list[float]]) -> float:
    p = 1.0
    for depth, rank in enumerate(path):
        p *= accuracy[depth][rank]
    return p


def expected_accept_length(paths: list[list[int]], accuracy: list[list[float]]) -> float:
    return sum(path_probability(path, accuracy) for path in paths)


def build_medusa_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                          **kw) -> MedusaProposer:
    """A loaded medusa drafter's proposer, with the tree its manifest stores (else one chain)."""
    check_medusa_vocab(drafter.model, target_model, drafter.vocab_map)
    return MedusaProposer(drafter.model, tree=(drafter.manifest.get("extra") or {}).get("tree"),
                          vocab_map=drafter.vocab_map, embed=target_model.get_input_embeddings(),
                          weights=drafting_weights(drafter.model, kw.get("drafter_weights")))


def check_medusa_vocab(heads, target_model, vocab_map: torch.Tensor | None = None) -> None:
    """Full heads predict the target's vocabulary; reduced ones (models.medusa) their vocab_map's ids."""
    check_heads_vocab(heads, vocab_map, vocab_size(target_model), "Medusa heads")


register_proposer("medusa", build_medusa_proposer)
