"""Fixed-shape verification steps, replayed as CUDA graphs.

At batch size 1 a small target's forward on a GPU is a few hundred kernel launches of microseconds each:
the GPU waits on Python. A CUDA graph records one forward's kernels once and replays them with a single
launch. A graph fixes every shape and address, so a step here is a forward of exactly N rows over the
whole preallocated cache: the rows' token ids, positions, cache slots and attention mask are copied into
buffers the graph reads, a tree of n rows runs in the smallest bucket N >= n (the extra rows are padding
that attends to the prefix and itself and writes its keys past the tree, where no real row looks), and
the outputs are copied out before the next replay overwrites them.

In reduced precision a row's logits depend on how many rows its forward had (the GEMM kernels differ by
shape), so speculation would not reproduce plain decoding token for token; with one bucket for every
step (`buckets=(N,)`, what the engine does for a bf16/fp16 target on CUDA) every token's projections
come from the same kernels whatever was drafted, plain decoding included. Measured on an H200 (bf16,
8 MT-bench answers of 128 tokens, docs/journal.md "The CUDA path"): EAGLE-3 trees left plain decoding's
answer on 4-6 of 8 prompts in buckets and on 0-1 in one shape, prompt-lookup chains on none. What one
shape cannot remove: a tree node attends to its ancestors at other cache slots than plain decoding put
them (siblings share a depth), so attention sums the same terms in another order; a chain's nodes sit
where plain decoding puts them. fp32 showed no mismatch either way.

One graph per (bucket, captured feature layers) is recorded on first use and kept while the cache stays
the same buffers: a new request reuses them (`ModelRunner.start` reallocates, and so drops them, only
when a request needs more positions than the cache has). Rows beyond the largest bucket (a prompt's
prefill), rows given as embeddings ([LA] lookahead) and models the lean forward does not run go through
the eager forward as before.

The same step runs eagerly (`graphed=False`) on any device: that is what the CPU tests exercise, padding
and slot writes included, and what the GPU tests compare the replay against.
"""

from __future__ import annotations

import os

import torch

__all__ = ["BUCKETS", "DISABLE_ENV", "StepSet", "StaticStep", "bucket_for", "graphs_supported"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the tree sizes recorded; the adaptive controller's trees fit in 64
DISABLE_ENV = "SPECDISTILL_NO_CUDA_GRAPHS"  # eager fixed-shape steps instead, for side-by-side timing


def graphs_supported(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and os.environ.get(DISABLE_ENV, "") in ("", "0")


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding n rows; None beyond the largest."""
    return next((b for b in buckets if b >= n), None)


class StaticStep:
    """The forward of exactly `rows` rows: static input buffers, the lean decoder writing at the rows' cache
    slots, the head on every row; `graphed` records it as a CUDA graph and replays it.

    A step's inputs are two small tensors copied from the host per step, token ids, depths and the prefix
    length in one [2N + 1] int64 tensor and the tree's [N, N] ancestor mask; positions, cache slots and the
    [N, T] attention mask over the whole cache are computed inside the step (inside the graph), so that a
    step costs the host two copies and one launch."""

    def __init__(self, lean, head, cache, rows: int, feature_layers: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype, graphed: bool, pool=None):
        self.lean, self.head, self.cache = lean, head, cache
        self.rows, self.feature_layers = rows, list(feature_layers)
        self.dtype, self.graphed, self.pool = dtype, graphed, pool
        n = rows
        self.host_ints = torch.zeros(2 * n + 1, dtype=torch.long)  # [ids | depths | prefix], staged on the host
        self.host_ancestors = torch.zeros(n, n, dtype=torch.bool)
        self.ints = torch.zeros(2 * n + 1, dtype=torch.long, device=device)
        self.ancestors = torch.zeros(n, n, dtype=torch.bool, device=device)  # [N, N] row i sees node j
        self.row_index = torch.arange(n, device=device)  # [N]
        self.columns = torch.arange(cache.max_len, device=device)  # [T]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None

    def compute(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [N, D], logits [N, V], features [N, F x D] (None without feature layers), from the buffers."""
        n = self.rows
        ids = self.ints[None, :n]  # [1, N]
        prefix = self.ints[2 * n:]  # [1]
        positions = (prefix + self.ints[n:2 * n])[None]  # [1, N]
        slots = prefix + self.row_index  # [N]: the tree's nodes at prefix + i, the padding past them
        last, features = self.lean(ids, None, self.attention_mask(prefix), positions, self.cache,
                                   self.feature_layers, slots=slots)
        hidden = last[0]
        logits = self.head(hidden)
        captured = torch.cat([f[0] for f in features], dim=-1) if features else None
        return hidden, logits, captured

    def attention_mask(self, prefix: torch.Tensor) -> torch.Tensor:
        """[1, 1, N, T] additive: the committed prefix, and node i's ancestors at prefix + j (decode.tree's
        attention_bias, computed from the buffers)."""
        n = self.rows
        offset = self.columns - prefix  # [T]: tree node index of each column
        in_tree = (offset >= 0) & (offset < n)
        allowed = (self.columns < prefix) | (self.ancestors[:, offset.clamp(0, n - 1)] & in_tree)  # [N, T]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]

    def load(self, tokens: list[int], depths: list[int], ancestors: torch.Tensor, prefix: int) -> None:
        """A tree of n <= N nodes (ancestors [n, n] bool, on the host) after `prefix` committed positions; rows
        n..N-1 become padding that sees the prefix and itself."""
        n, size = len(tokens), self.rows
        ints, anc = self.host_ints, self.host_ancestors
        ints.zero_()
        ints[:n] = torch.tensor(tokens, dtype=torch.long)
        ints[size:size + n] = torch.tensor(depths, dtype=torch.long)
        ints[2 * size] = prefix
        anc.zero_()
        anc[:n, :n] = ancestors
        anc[range(n, size), range(n, size)] = True
        self.ints.copy_(ints)
        self.ancestors.copy_(anc)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self.graphed:
            return self.compute()
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.outputs

    def capture(self) -> None:
        """Warm up on a side stream (lazy allocations, cuBLAS workspaces), then record. The warm-ups and the
        recording read the buffers as loaded, so what they write into the cache is what the replay writes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.compute()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = self.compute()


class StepSet:
    """A runner's fixed-shape steps, one per (bucket, feature layers), over one cache."""

    def __init__(self, lean, head, device: torch.device, dtype: torch.dtype, graphed: bool,
                 buckets: tuple[int, ...] = BUCKETS):
        self.lean, self.head = lean, head
        self.device, self.dtype, self.graphed, self.buckets = device, dtype, graphed, buckets
        self.steps: dict[tuple, StaticStep] = {}
        self.cache = None
        self.pool = torch.cuda.graph_pool_handle() if graphed else None
        self.captures = 0  # graphs recorded so far (the tests check that requests reuse them)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bind(self, cache) -> None:
        """Steps for `cache`; the graphs of another cache's buffers are dropped."""
        if cache is not self.cache:
            self.steps.clear()
            self.cache = cache

    def forward(self, tokens: list[int], depths: list[int], ancestors: torch.Tensor, prefix: int,
                feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """n tokens at `depths` below the committed `prefix` (ancestors [n, n] bool): the rows' (hidden [n, D],
        logits [n, V], features [n, F x D] or None), copied out of the step."""
        n = len(tokens)
        rows = bucket_for(n, self.buckets)
        key = (rows, tuple(feature_layers))
        step = self.steps.get(key)
        if step is None:
            step = StaticStep(self.lean, self.head, self.cache, rows, key[1], self.device, self.dtype,
                              self.graphed, self.pool)
            self.steps[key] = step
        step.load(tokens, depths, ancestors, prefix)
        fresh = step.graph is None
        hidden, logits, features = step.run()
        if self.graphed and fresh:
            self.captures += 1
        # copies: the next replay of any step overwrites these buffers
        return hidden[:n].clone(), logits[:n].clone(), None if features is None else features[:n].clone()
