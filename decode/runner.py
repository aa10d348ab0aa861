"""A causal LM bound to its own preallocated cache: forward a chain or a tree at the cache's end."""

from __future__ import annotations

import torch

from decode.kv_cache import SpecCache
from decode.tree import attention_bias


class ModelRunner:
    """Runs an HF causal LM (Llama-family decoder + head) over new tokens appended to its cache.

    The decoder and the head are called separately so that the head (a [V, D] matmul, the
    dominant cost of a small drafter) runs only on the rows whose logits are needed, and so that
    hidden states are available to heads that read them (Medusa).
    """

    def __init__(self, model: torch.nn.Module, static_shapes: bool = False):
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.static_shapes = static_shapes
        self.cache = SpecCache(self.num_layers, 0, static_shapes)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def start(self, capacity: int) -> None:
        """Begin a new sequence; reallocate only when the buffers are too small."""
        if capacity > self.cache.max_len:
            self.cache = SpecCache(self.num_layers, _round_up(capacity, 256), self.static_shapes)
        self.cache.reset()

    def forward(
        self,
        tokens: list[int],
        depths: list[int] | None = None,
        ancestors: torch.Tensor | None = None,
        logits_rows: slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `tokens` after the committed prefix and return (hidden [N, D], logits [n_rows, V]).

        depths: position offset of each node from the prefix end (a chain: 0..N-1).
        ancestors: [N, N] bool tree mask (a chain: lower triangular).
        logits_rows: which rows get the head (default all).
        """
        n = len(tokens)
        prefix = self.cache.length
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, N]
        if depths is None:
            positions = torch.arange(prefix, prefix + n, device=self.device)
        else:
            positions = torch.tensor(depths, dtype=torch.long, device=self.device) + prefix
        if ancestors is None:
            ancestors = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        total = self.cache.max_len if self.static_shapes else prefix + n
        mask = attention_bias(prefix, ancestors.to(self.device), total, self.dtype)  # [1, 1, N, total]
        out = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions[None],
                           past_key_values=self.cache, use_cache=True)
        hidden = out.last_hidden_state[0]  # [N, D]
        rows = hidden if logits_rows is None else hidden[logits_rows]
        return hidden, self.head(rows).float()  # [n_rows, V]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
