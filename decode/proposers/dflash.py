"""The DFlash proposer: a whole block drafted in ONE drafter forward from the target's features (models.dflash).

No extra target pass. The engine captures, in every target forward, the inputs of the drafter's target layers
(ModelRunner.feature_layers, as for EAGLE-3) and hands the accepted rows' features to `observe_prefill` /
`observe_verification`. Position p's features are the target's at p, so after a step the drafter's context
covers every position but the last emitted token's (the bonus token, which the target has not run yet): it is
the block's first row, and the block's other rows are mask rows whose heads draft positions +1 .. +B-1 at once.
`propose` first appends the pending features to every layer's context cache (one small forward over the
positions accepted since the last step, however many steps that spans: prompt-lookup-only steps skip the drafter
and are caught up here), then runs the block.

Greedy: a chain of each block row's most probable token, cut at an EOS and at the depth the engine asks (its
adaptive controller chooses the depth from measured costs and acceptance, decode.adaptive); with `topk` > 1, each
depth also offers its next most probable tokens as leaves beside the chain's node (the block's top alternatives per
position: the rows' distributions do not depend on the drafts before them, so an alternative is as good a guess
after the chain's prefix as anywhere). A candidate's path probability is the product of its row's probability and
those of the chain nodes above it; the tree is the `tree_nodes` most probable candidates at or above the floor
`min_prob`, and where the engine measures its costs (`price_verification`) the number of them that maximises the
step's expected tokens a second, as EAGLE-3's trees are priced (decode.tree.select_tree). The block is drafted
either way; the price decides how many of its rows the target verifies, step by step, from the block's confidence.

Sampling: a chain, token i drawn from block row i's distribution q_i (scattered into the target's vocabulary) and
proposed with it. q_i is a function of the context alone, a legitimate proposal for the multi-draft rule
(decode.sampling), so the output keeps the target's distribution exactly.
"""

from __future__ import annotations

import torch

from specdistill.decode.lean_dflash import lean_dflash
from specdistill.decode.proposers.base import (
    PricedTrees,
    Proposer,
    QueuedFeatures,
    manifest_decoding,
    pricing_options,
    register_proposer,
    stored_format,
)
from specdistill.decode.sampling import SamplingConfig, logits_to_probs, sample
from specdistill.decode.tree import TokenTree, select_tree
from specdistill.models.dflash import DFlashCache, DFlashDrafter  # importing it registers the kind "dflash"
from specdistill.models.kernel_linear import int8_for_inference, int8_unsupported
from specdistill.models.packed_linear import drafting_weights, packed_for_inference

__all__ = ["DFlashProposer", "build_dflash_proposer", "dflash_drafting_weights"]


class DFlashProposer(PricedTrees, QueuedFeatures, Proposer):
    name = "dflash"
    self_drafting = True

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Module, depth: int | None = None, topk: int = 1,
                 tree_nodes: int | None = None, eos_token_ids: set[int] = frozenset(), weights: str = "float32",
                 min_prob: float | None = None, priced: bool = True):
        """depth: the deepest draft (default and at most block_size - 1); topk: tokens offered per depth (1: a
        chain); tree_nodes: the most nodes besides the root (default depth x topk); weights: the format of the
        drafter's linear weights on the CPU (`dflash_drafting_weights`: float32, float16 where FBGEMM runs it, int8
        where the kernel library's int8 kernel does). min_prob: the path-probability floor of greedy trees, in
        [0, 1); 0 = none, None = DEFAULT_MIN_PROB for the device. priced: greedy trees keep the number of
        candidates that maximises the step's expected tokens a second under the engine's measured verification
        costs; False: always `tree_nodes` (above the floor)."""
        limit = drafter.block_size - 1
        self.max_depth = depth or limit
        if not 1 <= self.max_depth <= limit:
            raise ValueError(f"dflash.depth: 1..{limit} (block_size - 1), got {depth}")
        if topk < 1:
            raise ValueError(f"dflash.topk: must be >= 1, got {topk}")
        self.topk = topk
        self.tree_nodes = tree_nodes or self.max_depth * topk
        if self.tree_nodes < 1:
            raise ValueError(f"dflash.tree_nodes: must be >= 1, got {tree_nodes}")
        self.init_pricing("dflash", drafter.fc.weight.device, min_prob, priced)
        self.drafter, self.embed = drafter, embed
        # the same weights, packed (oneDNN fp32, FBGEMM fp16) or rounded to Q8_0 on the int8 kernel: the lean forward
        # (decode.lean_dflash) where it runs, else the drafter's own modules over those copies
        lean = lean_dflash(drafter, weights)
        self.net = lean if lean is not None else (
            int8_for_inference(drafter) if weights == "int8" else packed_for_inference(drafter, weights))
        self.weights = stored_format(weights, drafter)
        self.feature_layers = drafter.target_layers
        self.device, self.dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.vocab_map = drafter.vocab_map.to(self.device)  # [M] target id of each draft index
        self.target_vocab = drafter.config["vocab_size"]
        self.eos_token_ids = set(eos_token_ids)
        self.cache: DFlashCache | None = None
        self.pending: list[torch.Tensor] = []  # [k, K x D] features of positions not yet in the context

    def weight_format(self) -> str:
        return self.weights

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        rows = capacity + self.drafter.block_size + 1
        if self.cache is None or self.cache.keys.shape[2] < rows:
            self.cache = DFlashCache(self.drafter, rows, self.device, self.dtype)
        self.cache.length = 0
        self.pending = []

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator) -> TokenTree:
        self.start_step()
        logits = self.draft_block(seq, slice(1, min(max_depth, self.max_depth) + 1))  # [d, M]: rows 1..d
        if sampling.greedy:
            return self.greedy_tree(seq[-1], logits)
        return self.sampled_chain(seq[-1], logits, sampling, generator)

    def draft_block(self, seq: list[int], rows: slice = slice(None)) -> torch.Tensor:
        """Feed the pending features as context, then the block after seq: the logits [r, M] of its `rows` (the
        head runs on those rows only; the layers on the whole block, whose rows attend to each other)."""
        if self.cache is None:
            raise RuntimeError("DFlashProposer.propose before begin(): the engine must start the request")
        if self.pending:
            self.net.add_context(torch.cat(self.pending).to(self.device), self.cache)
            self.pending = []
        first = self.embed(torch.tensor([seq[-1]], device=self.device))[0].to(self.dtype)  # [D]
        return self.net.logits(self.net.block(first, len(seq) - 1, self.cache)[rows]).float()  # [r, M]

    def greedy_tree(self, root: int, logits: torch.Tensor) -> TokenTree:
        """logits [d, M] of block rows 1..d -> the tree of the most probable candidates (`tree_candidates`), at
        most tree_nodes, none below the floor, priced where the engine measures its costs."""
        k = min(self.topk, logits.shape[-1])
        values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)  # [d, k] each, best first
        tokens, parents, scores, depths = tree_candidates(values.tolist(), self.vocab_map[indices].tolist(),
                                                          self.eos_token_ids)
        return select_tree(root, tokens, parents, scores, depths, self.tree_nodes, self.min_score,
                           self.step_seconds())

    def sampled_chain(self, root: int, logits: torch.Tensor, sampling: SamplingConfig, generator) -> TokenTree:
        """Token i drawn from row i's q (over the target's vocabulary) and proposed with it; cut after an EOS."""
        drafts, probs = [], []
        for row in logits.cpu():
            q_draft = logits_to_probs(row, sampling)  # [M]
            q = q_draft.new_zeros(self.target_vocab).scatter_(0, self.vocab_map.cpu(), q_draft)  # [V]
            token = sample(q, generator)
            drafts.append(token)
            probs.append(q)
            if token in self.eos_token_ids:
                break
        return TokenTree.chain(root, drafts, probs)


def tree_candidates(logq: list[list[float]], tokens: list[list[int]], eos_token_ids: set[int]
                    ) -> tuple[list[int], list[int], list[int], list[float]]:
    """A block's candidates from each drafted row's top-k (log-probabilities and target ids [d][k], best first):
    at depth i the chain's token (column 0) and its alternatives, all children of the chain's node at depth i - 1,
    scored by their log path probability (the chain's log-probabilities above them plus their own); nothing
    below an EOS on the chain. Returns (tokens, parents, scores, depths), parents as candidate indices (-1: the
    root). A child never outscores its parent, so the most probable candidates are closed under ancestors."""
    out_tokens, parents, scores, depths = [], [], [], []
    parent, above = -1, 0.0
    for depth, (row_logq, row_tokens) in enumerate(zip(logq, tokens), start=1):
        chain = len(out_tokens)
        for lq, token in zip(row_logq, row_tokens):
            out_tokens.append(int(token))
            parents.append(parent)
            scores.append(above + lq)
            depths.append(depth)
        parent, above = chain, above + row_logq[0]
        if row_tokens[0] in eos_token_ids:
            break
    return out_tokens, parents, scores, depths


def dflash_drafting_weights(drafter: DFlashDrafter, choice: str | None = "auto") -> str:
    """The format a DFlash drafter drafts in. "int8": every matrix on the kernel library's int8 kernel (Q8_0
    weights, each row of x rounded to int8 per group of 32: what EAGLE-3 drafts in), an error saying why where it
    cannot run; "auto" picks it wherever it runs, else models.packed_linear.drafting_weights' choice (float16 where
    FBGEMM runs, else float32). Measured on a 2-core Zen 3 (AVX2), the default target's two-layer drafter, a block
    of 8 after 300 positions: 3.0 ms in int8 against 4.0 in float16 on the lean forward (`python -m
    benchmarks.dflash_drafting`), the same greedy drafts. "float32" / "float16" as drafting_weights; "q8_0" is
    EAGLE-3's only. Only which tokens are proposed can change: the target verifies every draft in its own
    precision."""
    choice = choice or "auto"
    if choice in ("auto", "int8"):
        why = int8_unsupported(drafter)
        if why is None:
            return "int8"
        if choice == "int8":
            raise ValueError(f"drafter weights int8: {why}")
    elif choice == "q8_0":
        raise ValueError("drafter weights q8_0: a DFlash drafter drafts in auto, int8, float16 or float32")
    return drafting_weights(drafter, choice)


def build_dflash_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                          **kw) -> DFlashProposer:
    """A loaded dflash drafter's proposer: depth, topk, tree_nodes, min_prob and priced from kw (dflash_depth,
    dflash_topk, dflash_tree_nodes, dflash_min_prob, dflash_priced), else from its manifest's extra.decoding, else
    the whole block as a chain, floored at DEFAULT_MIN_PROB and priced; its weights in the format
    `drafter_weights` chooses (`dflash_drafting_weights`: auto, int8, float32, float16)."""
    options = manifest_decoding(drafter)
    return DFlashProposer(drafter.model, target_model.get_input_embeddings(),
                          depth=kw.get("dflash_depth") or options.get("depth"),
                          topk=kw.get("dflash_topk") or options.get("topk") or 1,
                          tree_nodes=kw.get("dflash_tree_nodes") or options.get("tree_nodes"),
                          eos_token_ids=eos_token_ids,
                          weights=dflash_drafting_weights(drafter.model, kw.get("drafter_weights")),
                          **pricing_options("dflash", kw, options))


register_proposer("dflash", build_dflash_proposer)
