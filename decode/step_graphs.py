"""Fixed-shape verification steps, replayed as CUDA graphs.

At batch size 1 a small target's forward on a GPU is a few hundred kernel launches of microseconds each:
the GPU waits on Python. A CUDA graph records one forward's kernels once and replays them with a single
launch. A graph fixes every shape and address, so a step here is a forward of exactly N rows over the
whole preallocated cache: the rows' token ids, positions, cache slots and attention mask are copied into
buffers the graph reads, a tree of n rows runs in the smallest bucket N >= n (the extra rows are padding
that attends to one cached position and writes its keys past the tree, where no real row looks), and the
outputs are copied out before the next replay overwrites them.

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
    """The forward of exactly `rows` rows: static input buffers, the lean decoder writing at `slots`, the
    head on every row; `graphed` records it as a CUDA graph and replays it."""

    def __init__(self, lean, head, cache, rows: int, feature_layers: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype, graphed: bool, pool=None):
        self.lean, self.head, self.cache = lean, head, cache
        self.rows, self.feature_layers = rows, list(feature_layers)
        self.graphed, self.pool = graphed, pool
        total = cache.max_len
        self.ids = torch.zeros(1, rows, dtype=torch.long, device=device)  # [1, N]
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=device)  # [1, N]
        self.slots = torch.arange(rows, dtype=torch.long, device=device)  # [N] cache positions written
        self.mask = torch.full((1, 1, rows, total), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.mask[..., 0] = 0  # a padding row attends to position 0 only (never to nothing: no NaN)
        self.pad_mask = self.mask[0, 0, :, :].clone()  # [N, T]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None

    def compute(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [N, D], logits [N, V], features [N, F x D] (None without feature layers), from the buffers."""
        last, features = self.lean(self.ids, None, self.mask, self.positions, self.cache, self.feature_layers,
                                   slots=self.slots)
        hidden = last[0]
        logits = self.head(hidden)
        captured = torch.cat([f[0] for f in features], dim=-1) if features else None
        return hidden, logits, captured

    def load(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, prefix: int) -> None:
        """ids [1, n], positions [1, n], mask [1, 1, n, T] into the buffers; rows n..N-1 become padding."""
        n = ids.shape[1]
        self.ids[:, :n].copy_(ids)
        self.positions[:, :n].copy_(positions)
        self.mask[0, 0, :n].copy_(mask[0, 0])
        if n < self.rows:
            self.ids[:, n:].zero_()
            self.positions[:, n:].fill_(prefix)
            self.mask[0, 0, n:].copy_(self.pad_mask[n:])
        # the rows write their keys and values at prefix + i: the tree's nodes, then the padding past them
        torch.arange(prefix, prefix + self.rows, out=self.slots)

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

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, prefix: int,
                feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rows' (hidden [n, D], logits [n, V], features [n, F x D] or None), copied out of the step."""
        n = ids.shape[1]
        rows = bucket_for(n, self.buckets)
        key = (rows, tuple(feature_layers))
        step = self.steps.get(key)
        if step is None:
            step = StaticStep(self.lean, self.head, self.cache, rows, key[1], self.device, self.dtype,
                              self.graphed, self.pool)
            self.steps[key] = step
        step.load(ids, positions, mask, prefix)
        fresh = step.graph is None
        hidden, logits, features = step.run()
        if self.graphed and fresh:
            self.captures += 1
        # copies: the next replay of any step overwrites these buffers
        return hidden[:n].clone(), logits[:n].clone(), None if features is None else features[:n].clone()
