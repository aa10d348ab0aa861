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
depth also keeps its next most probable tokens as leaves beside the chain's node (the block's top alternatives per
position: the rows' distributions do not depend on the drafts before them, so an alternative is as good a guess
after the chain's prefix as anywhere), at most `tree_nodes` nodes.

Sampling: a chain, token i drawn from block row i's distribution q_i (scattered into the target's vocabulary) and
proposed with it. q_i is a function of the context alone, a legitimate proposal for the multi-draft rule
(decode.sampling), so the output keeps the target's distribution exactly.
"""

from __future__ import annotations

import torch

from specdistill.decode.lean_dflash import lean_dflash
from specdistill.decode.proposers.base import Proposer, QueuedFeatures, register_proposer, stored_format
from specdistill.decode.sampling import SamplingConfig, logits_to_probs, sample
from specdistill.decode.tree import TokenTree
from specdistill.models.dflash import DFlashCache, DFlashDrafter  # importing it registers the kind "dflash"
from specdistill.models.kernel_linear import int8_for_inference, int8_unsupported
from specdistill.models.packed_linear import drafting_weights, packed_for_inference

__all__ = ["DFlashProposer", "build_dflash_proposer", "dflash_drafting_weights"]


class DFlashProposer(QueuedFeatures, Proposer):
    name = "dflash"
    self_drafting = True

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Module, depth: int | None = None, topk: int = 1,
                 tree_nodes: int | None = None, eos_token_ids: set[int] = frozenset(), weights: str = "float32"):
        """depth: the deepest draft (default and at most block_size - 1); topk: tokens kept per depth (1: a chain);
        tree_nodes: the most nodes besides the root (default depth x topk); weights: the format of the drafter's
        linear weights on the CPU (`dflash_drafting_weights`: float32, float16 where FBGEMM runs it, int8 where the
        kernel library's int8 kernel does)."""
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
        """The chain of each row's best token (cut after an EOS), with each depth's next topk - 1 tokens as
        leaves beside it, chain first, at most tree_nodes nodes."""
        k = min(self.topk, logits.shape[-1])
        ranked = self.vocab_map[logits.topk(k, dim=-1).indices].tolist()  # [d][k] target ids, best first
        tree, parent = TokenTree.root(root), 0
        chain_nodes = []
        for tokens in ranked:
            if len(tree) > self.tree_nodes:
                break
            parent = tree.add(tokens[0], parent, None, dedupe=False)
            chain_nodes.append(parent)
            if tokens[0] in self.eos_token_ids:
                break
        for depth, node in enumerate(chain_nodes):
            for token in ranked[depth][1:]:
                if len(tree) > self.tree_nodes:
                    return tree
                tree.add(token, tree.parents[node], None, dedupe=False)
        return tree

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
    """A loaded dflash drafter's proposer: depth, topk and tree_nodes from kw (dflash_depth, dflash_topk,
    dflash_tree_nodes), else from its manifest's extra.decoding, else the whole block as a chain; its weights in the
    format `drafter_weights` chooses (`dflash_drafting_weights`: auto, int8, float32, float16)."""
    options = (drafter.manifest.get("extra") or {}).get("decoding") or {}
    return DFlashProposer(drafter.model, target_model.get_input_embeddings(),
                          depth=kw.get("dflash_depth") or options.get("depth"),
                          topk=kw.get("dflash_topk") or options.get("topk") or 1,
                          tree_nodes=kw.get("dflash_tree_nodes") or options.get("tree_nodes"),
                          eos_token_ids=eos_token_ids,
                          weights=dflash_drafting_weights(drafter.model, kw.get("drafter_weights")))


register_proposer("dflash", build_dflash_proposer)
