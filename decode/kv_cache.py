"""A preallocated KV cache that speculative decoding can roll back by moving a length.

The cache holds `length` committed positions. A forward of q new tokens writes them at
[length, length + q) and attends over [0, length + q); nothing is committed until the engine says
which of those q entries survive (`commit_path` for a verified tree, `advance` for a chain the
drafter wrote itself). Rolling back is therefore free: entries past `length` are simply overwritten
by the next forward. Accepted tree nodes that are not already contiguous are moved down in one
`index_copy_` over all layers (accepted-path compaction): the layers' keys (and values) are views of one
[layers, B, H, max_len, D] buffer where their shapes agree, as they do in Llama-family models; a GPU
replaying a whole forward as one CUDA graph would otherwise spend more launching 4 x layers copies than
verifying.

With `static_shapes=True` (CUDA, for CUDA graphs / torch.compile) every forward sees the whole
buffer and the caller's mask hides the unused tail; on CPU the attended length follows the real
length, which keeps attention cost proportional to the context.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    """One decoder layer's keys and values, [B, H, max_len, D], written in place. It reaches its cache through a
    weak reference: the cache holds its layers, and a layer holding its cache back would make every cache a
    reference cycle, whose buffers only Python's full garbage collection frees (the batched teacher generation,
    dropping caches as it goes, kept gigabytes of dead KV buffers between collections)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "SpecCache", index: int):
        super().__init__()
        self._owner = weakref.ref(owner)
        self.index = index

    @property
    def owner(self) -> "SpecCache":
        owner = self._owner()
        if owner is None:
            raise RuntimeError(f"cache layer {self.index}: its SpecCache no longer exists")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # [B, H, L, D] each: views of the owner's stacked buffers where the shapes agree
        self.keys, self.values = self.owner.layer_buffers(self.index, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.length
        end = start + key_states.shape[-2]
        if end > self.owner.max_len:
            raise RuntimeError(f"KV cache overflow: {end} positions needed, {self.owner.max_len} allocated")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        if self.owner.static_shapes:
            return self.keys, self.values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: torch.Tensor):
        """Write the N new entries at cache positions `slots` [N] (a tensor on the cache's device, so the
        write is the same kernel whatever the positions: what a CUDA graph replays) and return the whole
        buffers, [B, H, max_len, D]; the caller's mask hides what is not the sequence's."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.owner.static_shapes:
            return self.owner.max_len, 0
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.max_len

    def move_entries(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy cache entries at positions `src` [n] to [dst_start, dst_start + n)."""
        if not self.is_initialized:
            return
        dst = torch.arange(dst_start, dst_start + src.numel(), device=self.keys.device)
        self.keys.index_copy_(2, dst, self.keys.index_select(2, src))
        self.values.index_copy_(2, dst, self.values.index_select(2, src))


class SpecCache(Cache):
    """KV cache for one sequence (batch size 1) with a committed `length` the engine controls."""

    def __init__(self, num_layers: int, max_len: int, static_shapes: bool = False):
        self.max_len = max_len
        self.length = 0
        self.static_shapes = static_shapes
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # [layers, B, H, max_len, D] keys, values
        self.uniform = True  # every layer's buffers are views of `stacked`
        super().__init__(layers=[PreallocatedLayer(self, i) for i in range(num_layers)])

    def layer_buffers(self, index: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Layer `index`'s zeroed [B, H, max_len, D] key and value buffers, shaped like the states given."""
        batch, heads = key_states.shape[:2]
        shape = (batch, heads, self.max_len)
        k_shape, v_shape = (*shape, key_states.shape[-1]), (*shape, value_states.shape[-1])
        if self.stacked is None and self.uniform:
            self.stacked = (key_states.new_zeros(len(self.layers), *k_shape),
                            value_states.new_zeros(len(self.layers), *v_shape))
        keys, values = self.stacked if self.stacked is not None else (None, None)
        if keys is not None and keys.shape[1:] == k_shape and values.shape[1:] == v_shape \
                and keys.dtype == key_states.dtype and keys.device == key_states.device:
            return keys[index], values[index]
        self.uniform = False  # a layer of another shape: it gets buffers of its own, compaction goes layer by layer
        return key_states.new_zeros(*k_shape), value_states.new_zeros(*v_shape)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reset(self) -> None:
        """Forget everything; the buffers stay allocated."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (a length move, no copy)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def advance(self, n: int) -> None:
        """Commit the n entries the last forward wrote after `length` (a chain, in order)."""
        self.length += n

    def commit_path(self, node_indices: list[int]) -> None:
        """Commit the tree nodes `node_indices` (written at length + index by the last forward),
        in order, as the next positions of the sequence."""
        if node_indices == list(range(len(node_indices))):
            self.length += len(node_indices)  # the accepted path is already contiguous
            return
        src = torch.tensor(node_indices, dtype=torch.long) + self.length
        if self.uniform and self.stacked is not None:
            keys, values = self.stacked  # [layers, B, H, max_len, D]: every layer's entries in one copy each
            src = src.to(keys.device)
            dst = torch.arange(self.length, self.length + src.numel(), device=keys.device)
            keys.index_copy_(3, dst, keys.index_select(3, src))
            values.index_copy_(3, dst, values.index_select(3, src))
        else:
            for layer in self.layers:
                layer.move_entries(src.to(layer.device if layer.is_initialized else "cpu"), self.length)
        self.length += len(node_indices)
