"""The EAGLE-3 proposer: feature-level drafting from the target's own hidden states (models.eagle3).

No extra target pass. The engine captures, in every target forward, the inputs of the drafter's three
target layers (ModelRunner.feature_layers) and hands the accepted rows' features to
`observe_prefill` / `observe_verification`. Position p's feature pairs with the token at p + 1, which is
known once the step's tokens are emitted, so `propose` first feeds the pending features with the last
tokens of the sequence as the drafter's context rows (kept in its own KV cache: rollback of the tree
rows is a length move), then drafts from the last one.

Greedy: a dynamic tree as EAGLE-2 builds it. Depth 1 is the top-K tokens after the root; at each further
depth the K candidates of highest path probability (product of the drafter's probabilities along the
path) are expanded, in one drafter forward over K rows, each row attending to the committed context and
to its own ancestors' rows; finally the `tree_nodes` candidates of highest path probability over all
depths make the tree (a child is never more probable than its parent, so the set is closed under
ancestors). The engine's adaptive controller chooses the depth per step from measured costs; the tree
size follows from it (at most K per depth, at most `tree_nodes`).

Greedy trees are priced: where the engine measures its costs (decode.adaptive; `price_verification`), a tree keeps
the k most probable candidates for the k that maximises the step's expected tokens a second, (1 + the sum of their
path probabilities) / (the drafting done + the measured verification of k + 1 rows): `priced_size`. So a machine
whose verification rows are dear (a 2-core CPU without matrix units: 8 rows cost 2x one row) verifies small trees
and one whose rows are nearly free (AMX, a GPU) the whole `tree_nodes`, from the same drafter and code, and the
size follows the drafter's confidence step by step.

Greedy trees also have a floor: a node whose path probability is below `min_prob` is neither kept nor
expanded, so drafting stops at the first depth whose frontier has no node at or above it (a root-only
tree is a plain decoding step). A trained drafter's path probability is close to the chance that the
target accepts the node (stop 39, the GPU-trained drafter on MT-bench: nodes of mean path probability
0.03 / 0.14 / 0.24 / 0.45 / 0.65 / 0.96 were accepted 0.03 / 0.12 / 0.24 / 0.43 / 0.61 / 0.97 of the
time; docs/journal.md, stop 39), so a node below the floor is a verification row that costs more
than the tokens it is expected to earn: on the 2-core CPU a tree of 14 rows verifies in 1.5x one row's
time while 4 rows cost no more than one. The floor lets the tree run deep where the drafter is sure and
stop at one or two nodes where it is not; docs/journal.md "A probability floor for EAGLE-3 trees".

Sampling: a chain, each token drawn from the drafter's distribution q (scattered into the target's
vocabulary) and proposed with q, so the multi-draft rule (decode.sampling) keeps the target's
distribution exactly. A top-K tree would not be a draw from q.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from specdistill.decode.draft_steps import ContextStep, DraftTreeStep, candidate_depths, draft_graphs_supported
from specdistill.decode.lean_eagle3 import DISABLE_ENV as LEAN_DISABLE_ENV
from specdistill.decode.lean_eagle3 import LeanEagle3, lean_eagle3, lean_eagle3_runs
from specdistill.decode.proposers.base import (
    CATCH_UP_SPLIT,
    PricedTrees,
    Proposer,
    QueuedFeatures,
    manifest_decoding,
    pricing_options,
    register_proposer,
    stored_format,
)
from specdistill.decode.runner import synchronized_clock
from specdistill.decode.sampling import SamplingConfig, logits_to_probs, sample
from specdistill.decode.tree import DEFAULT_MIN_PROB, TokenTree, select_tree
from specdistill.models.eagle3 import (  # importing models.eagle3 registers the drafter kind "eagle3"
    DraftCache,
    Eagle3Drafter,
)
from specdistill.models.kernel_linear import int8_shapes_supported
from specdistill.models.kernels import int8_unavailable
from specdistill.models.kernels import unavailable as kernel_unavailable
from specdistill.models.packed_linear import drafting_weights, packed_for_inference, packing_supported
from specdistill.models.quant_formats import shape_supported

__all__ = ["DEFAULT_MIN_PROB", "DEFAULT_TREE", "Eagle3Proposer", "select_tree"]

# (depth, top-K per expansion, tree nodes): measured on the 2-core CPU, where verifying 8 rows costs about
# 1.1x one row and 16 rows 1.4x (docs/journal.md). Stop 32's weaker drafter paid most with top-2 and 10 nodes; the
# stop-35 drafter (first-position acceptance 0.43) pays more with top-3 and 14: against (8, 2, 10) side by side,
# alone 1.41x / 1.34x, with prompt lookup 2.01x / 1.97x (MT-bench, 2 per category), 2.48x / 2.32x (held-out
# Arena v2.0), 2.13x / 2.01x (held-out HumanEval + GSM8K) (docs/journal.md, "Four unrolled steps instead of seven").
# A GPU verifies 32-64 nodes for about one forward.
DEFAULT_TREE = {"cpu": (8, 3, 14), "cuda": (8, 8, 48)}


@dataclass
class Candidate:
    token: int  # target id
    parent: int  # index of the parent candidate, -1 for the root
    depth: int
    score: float  # log path probability under the drafter
    row: int = -1  # the drafter cache row that expanded it (its children's logits), -1 if not expanded


class Eagle3Proposer(PricedTrees, QueuedFeatures, Proposer):
    name = "eagle3"
    self_drafting = True

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Module, depth: int | None = None,
                 topk: int | None = None, tree_nodes: int | None = None,
                 eos_token_ids: set[int] = frozenset(), weights: str = "float32", fixed_steps: bool | None = None,
                 min_prob: float | None = None, priced: bool = True):
        """weights: the format of the drafter's packed linear weights on the CPU (`eagle3_drafting_weights`:
        int8 wherever the kernel library's int8 kernels run, else q8_0 wherever the library runs, else float16
        wherever FBGEMM runs it). fixed_steps: a tree's depths as fixed-shape steps (decode.draft_steps), replayed as
        CUDA graphs where they are supported; None = on CUDA only.
        min_prob: the path-probability floor of greedy trees (module docstring), in [0, 1); 0 = none,
        None = DEFAULT_MIN_PROB for the device.
        priced: greedy trees keep the number of nodes that maximises the step's expected tokens per second under
        the engine's measured verification costs (`price_verification`; module docstring); False: always
        `tree_nodes` (above the floor)."""
        device = drafter.fc.weight.device
        device_kind = "cuda" if device.type == "cuda" else "cpu"
        default = DEFAULT_TREE[device_kind]
        self.max_depth = depth or default[0]
        self.topk = topk or default[1]
        self.tree_nodes = tree_nodes or default[2]
        if min(self.max_depth, self.topk, self.tree_nodes) < 1:
            raise ValueError(f"eagle3: depth, topk and tree_nodes must be >= 1, got "
                             f"{self.max_depth}, {self.topk}, {self.tree_nodes}")
        self.init_pricing("eagle3", device, min_prob, priced)
        self.drafter = drafter
        self.embed = embed
        self.feature_layers = drafter.target_layers
        self.vocab_map = drafter.vocab_map.to(device)  # [M] target id of each draft index
        self.target_vocab = drafter.config["vocab_size"]
        self.eos_token_ids = set(eos_token_ids)
        self.device, self.dtype = device, drafter.fc.weight.dtype
        self.cache: DraftCache | None = None
        self.graphed = draft_graphs_supported(device)
        self.fixed_steps = self.graphed if fixed_steps is None else fixed_steps
        # the same weights, packed on CPU (oneDNN fp32, or FBGEMM fp16 copies under float16-weights): the lean
        # rows (decode.lean_eagle3) depth by depth, the drafter's own modules in fixed-shape steps
        weights = weights if packing_supported(drafter) else "float32"
        lean = None if self.fixed_steps else lean_eagle3(drafter, weights)
        if lean is None and weights in ("q8_0", "int8"):
            raise ValueError(f"eagle3: drafter weights {weights} run on the lean drafting rows only (fp32 on the CPU, "
                             f"not fixed-shape steps, ${LEAN_DISABLE_ENV} unset)")
        self.net = lean if lean is not None else packed_for_inference(drafter, weights)
        self.weights = stored_format(weights, drafter)  # resolved: what self.net's matrices hold (weight_format)
        self.step: DraftTreeStep | None = None  # kept across requests while the cache is (its graphs too)
        self.context_step: ContextStep | None = None
        self.pool = torch.cuda.graph_pool_handle() if self.fixed_steps and self.graphed else None
        self.pending: list[torch.Tensor] = []  # [k, 3D] features of positions not yet fed
        self.position = 0  # the position of the next context row
        self.catch_up_s = 0.0

    def weight_format(self) -> str:
        return self.weights

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        rows = capacity + self.topk * (self.max_depth + 1) + 2
        if self.cache is None or self.cache.keys.shape[1] < rows:  # else reused: a fixed step keeps its graph
            self.cache = DraftCache(self.drafter, rows, self.device, self.dtype)
            self.step = None
        self.cache.length = self.cache.used = 0
        if self.fixed_steps and self.step is None:
            eos = torch.tensor([int(t) in self.eos_token_ids for t in self.vocab_map.tolist()], dtype=torch.bool)
            self.step = DraftTreeStep(self.net, self.embed, self.cache, self.vocab_map, eos, self.topk,
                                      self.max_depth, graphed=self.graphed, pool=self.pool)
            self.context_step = ContextStep(self.net, self.embed, self.cache, self.drafter.fc.in_features,
                                            graphed=self.graphed, pool=self.pool)
        self.pending, self.position = [], 0

    def last_catch_up_s(self) -> float:
        return self.catch_up_s

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator) -> TokenTree:
        if self.cache is None:
            raise RuntimeError("Eagle3Proposer.propose before begin(): the engine must start the request")
        self.start_step()
        out = self.feed_context(seq)  # [D]: the last context row's output, whose head drafts depth 1
        depth = min(max_depth, self.max_depth)
        if sampling.greedy:
            return self.draft_tree(seq[-1], out, depth)
        return self.draft_chain(seq[-1], out, depth, sampling, generator)

    def feed_context(self, seq: list[int]) -> torch.Tensor:
        """Feed the pending features, each with the token after its position, as committed context rows."""
        if not self.pending:
            raise RuntimeError("Eagle3Proposer.propose before observe_prefill: the engine must feed it features")
        self.cache.drop_uncommitted()  # the previous tree's rows
        features = torch.cat(self.pending)  # [k, 3D]
        self.pending = []
        tokens = seq[len(seq) - features.shape[0]:]
        self.catch_up_s = 0.0
        if len(tokens) > CATCH_UP_SPLIT:  # resuming after plain-decoding steps: a one-off, timed apart
            start = synchronized_clock(self.device)
            self.context_rows(tokens[:-1], features[:-1])
            self.catch_up_s = synchronized_clock(self.device) - start
            tokens, features = tokens[-1:], features[-1:]
        return self.context_rows(tokens, features)[-1]

    def context_rows(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Rows (e(token), fc(feature)) at the next positions, causal; committed. Returns their outputs [k, D]
        (the last row's alone [1, D] where a fixed-shape context step ran them)."""
        k = len(tokens)
        if self.context_step is not None and self.context_step.fits(k):
            out = self.context_step.run(tokens, features, self.position)
            self.position += k
            return out[None]  # [1, D]: the last row's output (all the callers read)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(self.position, self.position + k, device=self.device)
        visible = torch.ones(k, self.cache.length + k, dtype=torch.bool, device=self.device)
        visible[:, self.cache.length:] = torch.ones(k, k, dtype=torch.bool, device=self.device).tril()
        out = self.net.rows(self.embed(ids).to(self.dtype), self.net.fuse(features), positions, self.cache, visible)
        self.cache.commit()
        self.position += k
        return out

    def expand(self, nodes: list[Candidate], states: torch.Tensor, base: int) -> torch.Tensor:
        """One drafter forward over `nodes` (all of one depth d >= 1): row i reads node i's token and
        its parent's output states[i]; it attends to the context and its ancestors' rows. Returns the
        rows' outputs [n, D] (their heads give the children: `children_of`); sets each node's row."""
        n, start = len(nodes), self.cache.used
        visible = torch.zeros(n, start + n, dtype=torch.bool)
        visible[:, :self.cache.length] = True
        for i, node in enumerate(nodes):
            visible[i, start + i] = True
            node.row = start + i
        for i, node in enumerate(nodes):
            for row in self.ancestor_rows(node):
                visible[i, row] = True
        ids = torch.tensor([node.token for node in nodes], dtype=torch.long, device=self.device)
        positions = torch.full((n,), base + nodes[0].depth, dtype=torch.long, device=self.device)
        return self.net.rows(self.embed(ids).to(self.dtype), states, positions, self.cache, visible.to(self.device))

    def ancestor_rows(self, node: Candidate) -> list[int]:
        rows, parent = [], node.parent
        while parent >= 0:
            rows.append(self.candidates[parent].row)
            parent = self.candidates[parent].parent
        return rows

    def draft_tree(self, root: int, out: torch.Tensor, depth: int) -> TokenTree:
        """EAGLE-2's dynamic tree (see the module docstring), at most `depth` deep: on the device in one
        fixed-shape step where the proposer has one (decode.draft_steps), else depth by depth."""
        base = self.position - 1  # the last context row's position
        if self.step is not None:
            tokens, parents, scores = self.step.run(out, depth, base)
            return select_tree(root, tokens, parents, scores, candidate_depths(self.topk, depth), self.tree_nodes,
                               self.min_score, self.step_seconds())
        self.candidates: list[Candidate] = []
        frontier = self.add_children([-1], *self.children_of(out[None]), [0.0], 1)
        parent_row = {i: 0 for i in frontier}  # frontier node -> the row of `outs` holding its parent's output
        outs = out[None]  # [n, D]: the outputs of the depth before (the root's row for depth 1)
        for d in range(2, depth + 1):
            expandable = [i for i in frontier if self.candidates[i].token not in self.eos_token_ids
                          and self.candidates[i].score >= self.min_score]
            if not expandable:
                break
            nodes = [self.candidates[i] for i in expandable]
            outs = self.expand(nodes, outs[[parent_row[i] for i in expandable]], base)
            children = self.add_children(expandable, *self.children_of(outs), [node.score for node in nodes], d)
            best = heapq.nlargest(self.topk, children, key=lambda i: self.candidates[i].score)
            row_of = {i: r for r, i in enumerate(expandable)}
            parent_row = {i: row_of[self.candidates[i].parent] for i in best}
            frontier = best
        c = self.candidates
        return select_tree(root, [x.token for x in c], [x.parent for x in c], [x.score for x in c],
                           [x.depth for x in c], self.tree_nodes, self.min_score, self.step_seconds())

    def children_of(self, outs: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """The drafter's outputs [P, D] -> each one's top-K children (log-probs, target ids), in one device-to-host
        copy each: the lean rows' `top` where they have one (one library call on int8 matrices), else log_softmax
        of the head's logits, then topk."""
        if isinstance(self.net, LeanEagle3):
            values, indices = self.net.top(outs, self.topk)
        else:
            logq = torch.log_softmax(self.net.logits(outs).float(), dim=-1)  # [P, M]
            values, indices = logq.topk(min(self.topk, logq.shape[-1]), dim=-1)
        return values.tolist(), self.vocab_map[indices].tolist()

    def add_children(self, parents: list[int], values: list[list[float]], tokens: list[list[int]],
                     scores: list[float], depth: int) -> list[int]:
        """Each parent's children (values, tokens [P][K]) as candidates; returns their indices."""
        added = []
        for p, parent in enumerate(parents):
            for token, lq in zip(tokens[p], values[p]):
                self.candidates.append(Candidate(int(token), parent, depth, scores[p] + lq))
                added.append(len(self.candidates) - 1)
        return added

    def draft_chain(self, root: int, out: torch.Tensor, depth: int, sampling: SamplingConfig, generator) -> TokenTree:
        """Sampling: each token drawn from q (over the target's vocabulary) and proposed with it."""
        drafts, probs, base = [], [], self.position - 1
        self.candidates = []
        for d in range(1, depth + 1):
            q_draft = logits_to_probs(self.net.logits(out[None])[0].float().cpu(), sampling)  # [M]
            q = q_draft.new_zeros(self.target_vocab).scatter_(0, self.vocab_map.cpu(), q_draft)  # [V]
            token = sample(q, generator)
            drafts.append(token)
            probs.append(q)
            if d == depth or token in self.eos_token_ids:
                break
            node = Candidate(token, len(self.candidates) - 1, d, 0.0)
            self.candidates.append(node)
            out = self.expand([node], out[None], base)[0]
        return TokenTree.chain(root, drafts, probs)


def build_eagle3_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                          **kw) -> Eagle3Proposer:
    """A loaded eagle3 drafter's proposer: its tree's depth, top-K, size and probability floor from kw
    (eagle3_depth, eagle3_topk, eagle3_tree_nodes, eagle3_min_prob), else from its manifest's
    extra.decoding, else DEFAULT_TREE / DEFAULT_MIN_PROB for the device; eagle3_priced=False (or the manifest's
    priced: false) keeps every tree at its full size (for side-by-side measurements)."""
    options = manifest_decoding(drafter)
    return Eagle3Proposer(drafter.model, target_model.get_input_embeddings(),
                          depth=kw.get("eagle3_depth") or options.get("depth"),
                          topk=kw.get("eagle3_topk") or options.get("topk"),
                          tree_nodes=kw.get("eagle3_tree_nodes") or options.get("tree_nodes"),
                          eos_token_ids=eos_token_ids,
                          weights=eagle3_drafting_weights(drafter.model, kw.get("drafter_weights"),
                                                          kw.get("eagle3_fixed_steps")),
                          fixed_steps=kw.get("eagle3_fixed_steps"), **pricing_options("eagle3", kw, options))


def eagle3_drafting_weights(drafter: Eagle3Drafter, choice: str | None, fixed_steps: bool | None) -> str:
    """models.packed_linear.drafting_weights, plus "q8_0": the drafter's matrices rounded to Q8_0 on the kernel
    library (its AMX form where the CPU has one), and "int8": the same Q8_0 weights times decode-time rows rounded
    to int8 per group of 32, on the library's int8 kernel (models.kernels' Int8Matrix: AVX512-VNNI, or its AVX2
    build's vpmaddubsw loop). "auto" picks int8 wherever those kernels, the lean drafting rows and the drafter's
    shapes allow, else q8_0 wherever the library and the lean rows run: on a 2-core Zen 4 the int8 kernel computes
    the drafter's matrices 2.3-4x faster than Q8_0's FMA form with warm caches, a drafting depth (in two library calls:
    decode.lean_eagle3.FusedRows) costs about 0.03 of a target forward instead of 0.1, and acceptance on MT-bench is the
    same within 0.5% (stop 50; docs/journal.md "Drafting in int8, EAGLE-3's depth in one library call, ..."). q8_0
    streams about half the bytes of fp16 copies (stop 47 on AMX, stop 48 on Zen 4: EAGLE-3 alone 1.025x against 1.010x).
    AMX hosts take int8 too (they have VNNI); not measured there. On a 2-core Zen 3 (AVX2) the int8 loop computes the
    1.5B's drafter's matrices 1.35x / 1.6x / 1.9x faster than Q8_0's FMA form at 1 / 4 / 8 rows
    (`python -m benchmarks.drafting_matrices`; docs/design/exact-kernels.md).
    Asked for where it cannot run: a ValueError that says why."""
    lean = lean_eagle3_runs(drafter) and not fixed_steps
    if choice == "q8_0":
        if not lean or kernel_unavailable() is not None:
            raise ValueError("drafter weights q8_0 need the lean drafting rows (fp32 on the CPU, not fixed-shape "
                             f"steps) and the kernel library ({kernel_unavailable() or 'available'})")
        return "q8_0"
    if choice == "int8":
        if not lean or int8_unavailable() is not None or not int8_shapes(drafter):
            raise ValueError("drafter weights int8 need the lean drafting rows (fp32 on the CPU, not fixed-shape "
                             f"steps), the kernel library's int8 kernels ({int8_unavailable() or 'available'}) and "
                             f"every matrix with K a multiple of 32 and N of 32")
        return "int8"
    if (choice or "auto") == "auto" and lean and int8_unavailable() is None and int8_shapes(drafter):
        return "int8"
    if (choice or "auto") == "auto" and lean and kernel_unavailable() is None and q80_shapes(drafter):
        return "q8_0"
    return drafting_weights(drafter, choice)


def int8_shapes(drafter: Eagle3Drafter) -> bool:
    """Every matrix of the drafter in a shape the int8 kernel takes (K whole groups of 32, N whole pairs of 16-output
    blocks): the default target's drafters are."""
    return all(int8_shapes_supported(m) for m in drafter.modules() if isinstance(m, torch.nn.Linear))


def q80_shapes(drafter: Eagle3Drafter) -> bool:
    """Every matrix of the drafter in a shape the Q8_0 kernel takes (K whole groups of 32, N whole output blocks):
    the default target's drafters are; a tiny test model may not be."""
    return all(shape_supported(m.weight) for m in drafter.modules() if isinstance(m, torch.nn.Linear))


register_proposer("eagle3", build_eagle3_proposer)
