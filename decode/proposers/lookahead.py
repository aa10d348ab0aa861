"""The [LA] lookahead proposer (PaSS): the target's own forward drafts the next tokens.

Every target forward carries, besides its token rows, chains of k [LA] rows (decode.runner.ExtraRows):
the k learned embeddings LA_1..LA_k, fed by embedding, not by token id. The engine asks for them
(`prefill_rows`, `verification_rows`) and hands back their logits (`observe_rows`): the target's head
runs on the token rows and the [LA] rows in one call, a few more rows of a GEMM that reads the head's
weights once, where a separate call for the [LA] rows would read them again (on a 2-core CPU the
49k x 576 head costs 2.7 ms for one row, 0.3 ms more for two rows added to a call).

Offsets. A chain hangs under a token row a at position P_a (P = absolute position). LA_j sits at
position P_a + j, attends to the committed prefix, to a and a's ancestors, and to LA_1..LA_j of its
own chain; its output (the target's head on its hidden state) predicts the token at P_a + 1 + j. The
target's own output at a predicts P_a + 1: that is the bonus token the engine emits, which becomes
the next tree's root. So LA_1 proposes the root's child (depth 1 of the next tree), LA_j depth j; none
of them sees the root token itself. At prefill the chain hangs under the last prompt token.

Where chains go. A verification forward over a chain of drafts (root at depth 0, drafts 1..d) gets an
[LA] chain under its `chains` shallowest nodes: (min(chains, d+1)) x k' extra rows, where k' =
min(K, b) and b is how deep the next step can draft: under the adaptive depth the controller's present
choice, one more when its deeper probe is due (DraftLengthController.next_step_bound), else d + 1.
The trained LA_j beyond the first are rarely right (measured on MT-bench: 0.29 acceptance at LA_1, 0.04
at LA_2), so the controller settles at depth 1 and rows the next step would not use are not computed;
where it settles at depth 0 (drafting does not pay on the machine at hand) no [LA] rows are computed at
all but before its probes, and those forwards are plain ones.
The shallow nodes are the likely last accepted ones (P(stop at depth i) = a^i (1 - a) for acceptance
a < 1). After verification the next proposals come from the chain under the last accepted node a; if a
has none, from the chain under a's deepest ancestor o that has one, shifted: LA_j of o predicts position
P_o + 1 + j, and the next tree needs P_a + 2 onwards, so LA_{s+1}..LA_k with s = P_a - P_o. They are
predictions from less context, still a deterministic function of it. If s >= k nothing is proposed
and the next step is a plain decode step (with a chain under its root).

Branches. LA_1's top-1 is the target's token only 30% of the time on MT-bench, but one of its top 2
41%, top 3 48% (the shipped 1-token drafter; docs/journal.md, stop 23). With `branches` b the tree also
holds LA_1's next b - 1 tokens as siblings of the first draft: one verification row each, placed after
the chain so that the chain's nodes stay the shallowest and get the [LA] chains (a sibling gets one only
when `chains` reaches it; otherwise, when it is accepted, the next drafts come from the root's chain
shifted by one, as above, if it has LA_2).

Losslessness. [LA] rows are written after the token rows and no token row attends to them (the mask
gives token rows their ancestors only), so the verified logits are those of the plain tree forward;
their KV lies past the tree nodes, and the engine commits only the accepted path, so it is never
part of the cache (the next forward overwrites it). Drafts are the top-1 of each [LA] row (the siblings:
LA_1's next b - 1), a deterministic function of the context: each is proposed with q = one-hot
(proposal None), and the engine's multi-draft rule (decode.sampling) then emits exactly the target's
distribution.
"""

from __future__ import annotations

import torch

import specdistill.models.lookahead  # noqa: F401  (registers the drafter kind "lookahead" with models.drafters)
from specdistill.decode.proposers.base import Proposer, register_proposer
from specdistill.decode.runner import ExtraRows
from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.tree import TokenTree

__all__ = ["LookaheadProposer", "decoding_options", "lookahead_rows"]


def decoding_options(manifest: dict) -> dict:
    """The LookaheadProposer keywords a lookahead drafter's manifest stores (older drafters: defaults)."""
    extra = manifest.get("extra") or {}
    return {"chains": int(extra.get("chains", 2)), "branches": int(extra.get("branches", 1))}


class LookaheadProposer(Proposer):
    name = "lookahead"
    adds_rows = True  # its [LA] rows ride in the target's forwards (max_extra_rows is set per instance)

    def __init__(self, tokens: torch.nn.Module, target_model: torch.nn.Module, chains: int = 2, branches: int = 1):
        """tokens: a module whose forward() gives the [K, D] lookahead embeddings (models.lookahead);
        branches: the first draft's b most likely tokens go into the tree as siblings (1: a chain)."""
        head = target_model.get_output_embeddings()
        embeds = tokens().detach()  # [K, D]
        width = target_model.get_input_embeddings().weight.shape[1]
        if embeds.dim() != 2 or embeds.shape[1] != width:
            raise ValueError(f"lookahead embeddings of shape {tuple(embeds.shape)} do not fit a target of hidden "
                             f"size {width}")
        if chains < 1:
            raise ValueError(f"chains must be >= 1 (the root always gets an [LA] chain), got {chains}")
        if branches < 1:
            raise ValueError(f"branches must be >= 1 (1: a chain of top-1 drafts), got {branches}")
        self.embeds = embeds.to(device=head.weight.device, dtype=head.weight.dtype)
        self.k = self.max_depth = embeds.shape[0]
        self.active = self.k  # [LA] rows per chain in the last forward (LA_1..LA_active)
        self.chains, self.branches = chains, branches
        self.max_extra_rows = self.chains * self.k
        self.drafts: list[int] = []  # the next tree's drafts, depth 1, 2, ...
        self.alternates: list[int] = []  # the first draft row's next most likely tokens (branches - 1)
        self.owner_row: dict[int, int] = {}  # token row -> index of its [LA] chain in the last forward
        self.parents: list[int] = []  # the last forward's tree (prefill: just the owner, as a root)
        self.depths: list[int] = []

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.drafts, self.alternates, self.owner_row = [], [], {}

    def prefill_rows(self, prompt_len: int) -> ExtraRows:
        """One chain under the last prompt token (row prompt_len - 1), which sees the whole prompt."""
        self.owner_row, self.active = {prompt_len - 1: 0}, self.k
        self.parents, self.depths = [-1] * prompt_len, [0] * prompt_len  # only the owner is ever looked up
        sees = torch.ones(1, prompt_len, dtype=torch.bool)  # [1, T]
        return lookahead_rows(self.embeds, [prompt_len - 1], sees)

    def verification_rows(self, tree: TokenTree, depth: int | None = None) -> ExtraRows | None:
        """[LA] chains under the tree's `chains` shallowest nodes, each LA_1..LA_d with d = min(depth, K):
        the engine passes how deep the next step can draft, so rows it would not use are not computed.
        LA_j attends only to LA_1..LA_j of its chain, so a shorter chain's rows are exactly the first rows
        of a full one. depth 0 (the adaptive depth will decode the next step plainly): no rows at all,
        and nothing to propose next; the forward is a plain one (the engine's greedy head, no logits)."""
        if depth == 0:
            self.drafts, self.alternates, self.owner_row = [], [], {}
            return None
        self.active = self.k if depth is None else min(depth, self.k)
        owners = sorted(range(len(tree)), key=lambda i: (tree.depths[i], i))[: self.chains]
        self.owner_row = {node: i for i, node in enumerate(owners)}
        self.parents, self.depths = tree.parents, tree.depths
        sees = tree.ancestor_mask()[owners]  # [m, N]: each owner's ancestors, itself included
        return lookahead_rows(self.embeds[:self.active], [tree.depths[i] for i in owners], sees)

    @torch.no_grad()
    def observe_rows(self, logits: torch.Tensor, last_node: int) -> None:
        """logits [L, V]: the target's head on the [LA] rows of the last forward; last_node: the last
        accepted token row."""
        owner, shift = self.nearest_owner(last_node)
        if owner is None or shift >= self.active:
            self.drafts, self.alternates = [], []
            return
        chain, k = self.owner_row[owner], self.active
        rows = logits[chain * k + shift:(chain + 1) * k]  # [k - shift, V]: LA_{shift+1}..LA_k
        self.drafts = rows.argmax(-1).tolist()
        self.alternates = rows[0].topk(self.branches).indices[1:].tolist() if self.branches > 1 else []

    def nearest_owner(self, node: int) -> tuple[int | None, int]:
        """The deepest node on the path to `node` with an [LA] chain, and the depth between them."""
        walk = node
        while walk != -1 and walk not in self.owner_row:
            walk = self.parents[walk]
        if walk == -1:
            return None, 0
        return walk, self.depths[node] - self.depths[walk]

    def propose(self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator) -> TokenTree:
        """The chain of top-1 drafts; with branches b > 1, the first draft's next b - 1 tokens as its
        siblings (after the chain, so the chain's nodes are the shallowest that get [LA] chains)."""
        tree = TokenTree.chain(seq[-1], self.drafts[:max_depth])  # proposals None: deterministic drafts
        if max_depth >= 1 and self.drafts:
            for token in self.alternates:
                tree.add(token, 0)  # dedupe: a tie can make topk's runner-up the argmax
        return tree


def lookahead_rows(embeds: torch.Tensor, owner_depths: list[int], sees: torch.Tensor) -> ExtraRows:
    """[LA] chains under m token rows. embeds [K, D]; owner_depths [m]; sees [m, N] bool: the token
    rows each owner attends to (itself included). Row c*K + j is LA_{j+1} under owner c, at depth
    owner_depth + j + 1, seeing what its owner sees plus LA_1..LA_{j+1} of its own chain."""
    k, m = embeds.shape[0], len(owner_depths)
    own_chain = torch.block_diag(*[torch.ones(k, k, dtype=torch.bool).tril()] * m)  # [mK, mK]
    mask = torch.cat([sees.cpu().repeat_interleave(k, dim=0), own_chain], dim=1)  # [mK, N + mK]
    depths = [d + j for d in owner_depths for j in range(1, k + 1)]
    return ExtraRows(embeds.repeat(m, 1), depths, mask)  # embeds [mK, D]


def build_lookahead_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                             **kw) -> LookaheadProposer:
    """A loaded lookahead drafter's proposer, with the decoding options its manifest stores."""
    return LookaheadProposer(drafter.model, target_model, **decoding_options(drafter.manifest))


register_proposer("lookahead", build_lookahead_proposer)
