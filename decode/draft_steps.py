"""The EAGLE-3 drafter's whole dynamic tree as one fixed-shape step, replayed as a CUDA graph.

On a GPU a draft depth is one forward of the drafter's single layer over K rows (the K most probable
candidates of the depth before): some forty kernels of microseconds each, launched from Python, then the
depth's top-K read back to the host to choose the next K. Measured on an H200 before this module, about
0.5 ms a depth where the target's whole verification replays in 3 ms (docs/journal.md, "The CUDA path"):
the drafter, not the target, was what a speculative step waited on. Graphing each depth alone (tried on an
H100) still left a host round trip per depth.

Here EAGLE-2's expansion runs on the device, every depth of it: depth 1 is the root's top-K; at each further
depth the K frontier nodes are one drafter forward (rows at the cache's next K rows, each attending to the
committed rows, its ancestors' rows and itself), their children's path scores are the parent's plus the
child's log-probability (children of an EOS node: -inf, never expanded), and the next frontier is the top K
of those K x K scores, its states and visibility gathered from its parents' rows. One graph per depth d
records the d - 1 expansions and replays them with one launch; the host reads every candidate (target id,
parent, score) in one copy and keeps the `tree_nodes` best (decode.tree.select_tree). The
inputs are the root's output row and three integers (position, committed length, first free row) copied in
before the replay; the candidates are the same as the dynamic, per-depth path's up to exact ties of scores.

Before the tree, each step feeds the drafter the positions the target just accepted as committed context
rows (their features and tokens): `ContextStep` runs those rows at a fixed shape too, 1, 2, 4 or 8 rows
(padding rows write past the real ones, where the tree's rows go next), one graph per size.

The same steps run eagerly (`graphed=False`) on any device: the CPU tests compare it with the dynamic path,
and the GPU tests compare the replay with it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdistill.decode.step_graphs import DISABLE_ENV as NO_GRAPHS_ENV

__all__ = ["CONTEXT_BUCKETS", "ContextStep", "DISABLE_ENV", "DraftTreeStep", "candidate_depths",
           "draft_graphs_supported"]

DISABLE_ENV = "SPECDISTILL_NO_DRAFT_GRAPHS"  # the drafter's steps eager (the target's may stay graphed)
CONTEXT_BUCKETS = (1, 2, 4, 8)  # context rows per step: the accepted tokens (at most CATCH_UP_SPLIT at once)


def draft_graphs_supported(device: torch.device) -> bool:
    """CUDA, and neither all graphs ($SPECDISTILL_NO_CUDA_GRAPHS) nor the drafter's switched off."""
    off = any(os.environ.get(name, "") not in ("", "0") for name in (NO_GRAPHS_ENV, DISABLE_ENV))
    return torch.device(device).type == "cuda" and not off


def candidate_depths(topk: int, depth: int) -> list[int]:
    """The depth of each candidate the step returns, in its order: K at depth 1, then K x K per depth."""
    return [1] * topk + [d for d in range(2, depth + 1) for _ in range(topk * topk)]


class DraftTreeStep:
    """A dynamic tree of up to `max_depth` depths, K = `topk` nodes expanded per depth. `net` is the drafter
    (or its packed inference copy), `embed` the target's input embedding, `cache` the proposer's
    models.eagle3.DraftCache (its buffers are written in place), `eos_draft` [M] bool: draft indices that are
    EOS."""

    def __init__(self, net, embed, cache, vocab_map: torch.Tensor, eos_draft: torch.Tensor, topk: int,
                 max_depth: int, graphed: bool, pool=None):
        self.net, self.embed, self.cache = net, embed, cache
        if vocab_map.numel() < topk:
            raise ValueError(f"EAGLE-3 draft step: top-{topk} expansions need at least {topk} draft tokens, "
                             f"the drafter has {vocab_map.numel()}")
        self.k, self.max_depth, self.graphed, self.pool = topk, max_depth, graphed, pool
        device, dtype = cache.keys.device, cache.keys.dtype
        self.dtype = dtype
        self.vocab_map = vocab_map.to(device)  # [M] target id of each draft index
        self.eos_draft = eos_draft.to(device)  # [M]
        self.tree_rows = topk * max(max_depth - 1, 1)  # R: rows the expansions write past the committed ones
        self.host_ints = torch.zeros(2, dtype=torch.long)  # [position of the root row, committed length]
        self.ints = torch.zeros(2, dtype=torch.long, device=device)
        self.root = torch.zeros(net.norm.weight.shape[-1], dtype=dtype, device=device)  # [D] the root row's output
        self.rows = torch.arange(topk, device=device)  # [K]
        self.tree_columns = torch.arange(self.tree_rows, device=device)  # [R]
        self.columns = torch.arange(cache.keys.shape[1], device=device)  # [C]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # depth -> (graph, output)

    def compute(self, depth: int) -> torch.Tensor:
        """[3, Nc] float: every candidate's target id, parent (candidate index, -1 for the root) and log path
        probability, Nc = K + (depth - 1) K^2, in candidate_depths' order."""
        k, layer, cache = self.k, self.net.midlayer, self.cache
        position, length = self.ints[0], self.ints[1]
        logq = torch.log_softmax(self.net.logits(self.root[None]).float(), dim=-1)  # [1, M]
        top = logq.topk(k, dim=-1)
        score, index = top.values[0], top.indices[0]  # [K]: the frontier (depth 1)
        node = torch.arange(k, device=score.device)  # [K] candidate index of each frontier node
        tokens, parents, scores = [self.vocab_map[index]], [torch.full_like(node, -1)], [score]
        states = self.root[None].expand(k, -1)  # [K, D] each frontier node's parent output
        seen = torch.zeros(k, self.tree_rows, dtype=torch.bool, device=score.device)  # [K, R] ancestors' rows
        for d in range(2, depth + 1):
            own = (d - 2) * k + self.rows  # [K] the frontier's rows, after the committed ones
            seen = seen | (self.tree_columns[None, :] == own[:, None])  # each row sees itself too
            q, key, value = layer.project(self.embed(self.vocab_map[index]).to(self.dtype), states,
                                          (position + d - 1).expand(k))
            attended = write_and_attend(layer, cache, q, key, value, length + own, self.visible(seen, length))
            out = layer.finish(states, attended)  # [K, D]
            top = torch.log_softmax(self.net.logits(out).float(), dim=-1).topk(k, dim=-1)  # [K, K]
            expandable = (score > float("-inf")) & ~self.eos_draft[index]  # [K]
            child = (score[:, None] + top.values).masked_fill(~expandable[:, None], float("-inf")).flatten()
            first = k + (d - 2) * k * k  # candidate index of the depth's first child
            tokens.append(self.vocab_map[top.indices].flatten())
            parents.append(node[:, None].expand(k, k).flatten())
            scores.append(child)
            best = child.topk(k).indices  # [K] the next frontier, most probable first
            parent_row = best // k
            score, index = child[best], top.indices.flatten()[best]
            node = first + best
            states, seen = out[parent_row], seen[parent_row]
        return torch.stack([torch.cat(tokens).float(), torch.cat(parents).float(), torch.cat(scores)])

    def visible(self, seen: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """[K, C] bool: the committed rows, and each row's tree rows (seen [K, R]) at length + j."""
        offset = self.columns - length  # [C]: tree row of each column
        in_tree = (offset >= 0) & (offset < self.tree_rows)
        return (self.columns < length) | (seen[:, offset.clamp(0, self.tree_rows - 1)] & in_tree)

    @torch.no_grad()
    def run(self, root_out: torch.Tensor, depth: int, position: int) -> tuple[list[int], list[int], list[float]]:
        """The tree below the root row (its output root_out [D], at `position`), `depth` deep: every
        candidate's (target ids, parents, scores) as lists. Writes the cache's rows past the committed ones."""
        cache = self.cache
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"EAGLE-3 draft step: depth {depth} outside 1..{self.max_depth}")
        if cache.length + self.tree_rows > cache.keys.shape[1]:
            raise RuntimeError(f"EAGLE-3 draft step past its buffers: rows {cache.length}.."
                               f"{cache.length + self.tree_rows}, cache {cache.keys.shape[1]}")
        self.host_ints[0], self.host_ints[1] = position, cache.length
        self.ints.copy_(self.host_ints)
        self.root.copy_(root_out)
        found = replay_or_compute(self, depth)
        cache.used = cache.length + self.k * (depth - 1)
        tokens, parents, scores = found.cpu().tolist()  # one device-to-host copy
        return [int(t) for t in tokens], [int(p) for p in parents], scores


class ContextStep:
    """The drafter's context rows for the accepted positions: k <= 8 rows (e(token), fc(feature)) at the next
    positions, causal, written to the cache's next rows and committed; in the smallest of CONTEXT_BUCKETS."""

    def __init__(self, net, embed, cache, feature_size: int, graphed: bool, pool=None):
        self.net, self.embed, self.cache, self.graphed, self.pool = net, embed, cache, graphed, pool
        device, size = cache.keys.device, CONTEXT_BUCKETS[-1]
        self.dtype = cache.keys.dtype
        self.host_ints = torch.zeros(size + 3, dtype=torch.long)  # [ids | position, committed length, k]
        self.ints = torch.zeros(size + 3, dtype=torch.long, device=device)
        self.features = torch.zeros(size, feature_size, dtype=self.dtype, device=device)  # [8, F x D_target]
        self.rows = torch.arange(size, device=device)
        self.columns = torch.arange(cache.keys.shape[1], device=device)  # [C]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # rows -> (graph, output)

    def compute(self, rows: int) -> torch.Tensor:
        """The last real row's output [D], from the buffers."""
        layer, cache, size = self.net.midlayer, self.cache, CONTEXT_BUCKETS[-1]
        position, length, k = self.ints[size], self.ints[size + 1], self.ints[size + 2]
        index = self.rows[:rows]
        states = self.net.fuse(self.features[:rows])  # [B, D]
        q, key, value = layer.project(self.embed(self.ints[:rows]).to(self.dtype), states, position + index)
        visible = self.columns[None, :] <= (length + index)[:, None]  # [B, C]: committed rows and causal
        out = layer.finish(states, write_and_attend(layer, cache, q, key, value, length + index, visible))
        return out.index_select(0, k - 1)[0]

    def fits(self, k: int) -> bool:
        return k <= CONTEXT_BUCKETS[-1] and self.cache.length + CONTEXT_BUCKETS[-1] <= self.cache.keys.shape[1]

    @torch.no_grad()
    def run(self, tokens: list[int], features: torch.Tensor, position: int) -> torch.Tensor:
        """k = len(tokens) rows (features [k, F]) at `position` on: committed; the last row's output [D]."""
        k, size, cache = len(tokens), CONTEXT_BUCKETS[-1], self.cache
        if not self.fits(k):
            raise RuntimeError(f"EAGLE-3 context step: {k} rows after {cache.length} do not fit "
                               f"{size} rows of a {cache.keys.shape[1]}-row cache")
        rows = next(b for b in CONTEXT_BUCKETS if b >= k)
        ints = self.host_ints
        ints.zero_()
        ints[:k] = torch.tensor(tokens, dtype=torch.long)
        ints[size:] = torch.tensor([position, cache.length, k])
        self.ints.copy_(ints)
        self.features[:k].copy_(features)
        out = replay_or_compute(self, rows)
        cache.length = cache.used = cache.length + k
        return out.clone()  # the next replay overwrites the graph's output


def write_and_attend(layer, cache, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
    """The rows' keys and values (key, value [Hkv, n, hd]) written at cache rows `slots` [n], then q [H, n, hd]
    attending over the whole cache where visible [n, C]: -> [H, n, hd]."""
    cache.keys.index_copy_(1, slots, key)
    cache.values.index_copy_(1, slots, value)
    keys, values = cache.keys, cache.values  # [Hkv, C, hd]
    groups = layer.self_attn.num_heads // layer.self_attn.num_kv_heads
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)


def replay_or_compute(step, shape: int) -> torch.Tensor:
    """step.compute(shape) from the buffers as loaded: eagerly, or by replaying the graph recorded for `shape`
    (recorded on first use, kept in step.graphs). Returns the output (the graph's own buffer when graphed)."""
    if not step.graphed:
        return step.compute(shape)
    if shape not in step.graphs:
        step.graphs[shape] = record(lambda: step.compute(shape), step.pool)
    graph, out = step.graphs[shape]
    graph.replay()
    return out


def record(compute, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm `compute` up on a side stream, then record it as a CUDA graph: (graph, its output). Warm-ups read
    the buffers as loaded and write only the cache rows the replay writes, so they change nothing the
    replay would not."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compute()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = compute()
    return graph, out
