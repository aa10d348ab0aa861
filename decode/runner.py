"""A causal LM bound to its own preallocated cache: forward a chain or a tree at the cache's end."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdistill.decode.attention import grouped_mask_argument, use_grouped_query_sdpa
from specdistill.decode.kv_cache import SpecCache
from specdistill.decode.lean_decoder import lean_decoder
from specdistill.decode.step_graphs import BUCKETS, StepSet, graphs_supported
from specdistill.decode.tree import attention_bias
from specdistill.models.hf_compat import cache_argument
from specdistill.models.kernel_linear import greedy_head_for, head_for_inference
from specdistill.models.kernels import MAX_ROWS
from specdistill.models.packed_linear import inference_weights, packed_for_inference


@dataclass
class ExtraRows:
    """Rows fed by embedding rather than token id, after a forward's N token rows: [LA] lookahead
    positions (decode.proposers.lookahead). Each attends to the committed prefix and to the rows
    `mask` allows; no token row ever attends to an extra row, so the token rows' outputs are what
    they would be without them, and the extra rows' KV, written past the token rows, is never
    committed."""

    embeds: torch.Tensor  # [L, D] input embeddings
    depths: list[int]  # [L] position offset from the prefix end, as for tree nodes
    mask: torch.Tensor  # [L, N + L] bool: the token rows and extra rows each extra row attends to


class ModelRunner:
    """Runs an HF causal LM (Llama-family decoder + head) over new tokens appended to its cache.

    The decoder and the head are called separately so that the head (a [V, D] matmul, the
    dominant cost of a small drafter) runs only on the rows whose logits are needed, and so that
    hidden states are available to heads that read them (Medusa). On CPU in fp32 both run on
    packed copies of the weights (models.packed_linear): the same values, about twice as fast at
    batch size 1, and a few rows cost little more than one. Grouped-query attention over several rows
    runs without copying the key/value cache per group (decode.attention; the model's attention
    implementation is switched from `sdpa`, the same attention). On a Llama-family model on the CPU the
    decoder is not transformers' forward but decode.lean_decoder's (the same layers in fewer, fused
    operations); under the float16-weights precision both read fp16 weight copies (models.packed_linear).

    static_shapes (default: on CUDA): every forward attends over the whole preallocated cache, and
    forwards of up to 64 token rows run as fixed-shape steps (decode.step_graphs), replayed as CUDA graphs
    on a GPU; `fixed_steps=True` runs those steps eagerly elsewhere (the tests' view of the same path).
    step_buckets: the step sizes (one size: every forward of up to that many rows computed by the same kernels).
    """

    def __init__(self, model: torch.nn.Module, static_shapes: bool | None = None, fixed_steps: bool | None = None,
                 step_buckets: tuple[int, ...] = BUCKETS):
        self.model = model
        use_grouped_query_sdpa(model)
        weights = inference_weights(model)  # "float16" for the float16-weights precision (models.target)
        # the hand-written Llama forward where it applies (decode.lean_decoder), else transformers' decoder
        self.lean = lean_decoder(model, weights)
        self.decoder = None if self.lean is not None else packed_for_inference(model.get_decoder(), weights)
        head = model.get_output_embeddings()  # fp32: on the Q8_0 kernel where it is exactly Q8_0 (models.kernel_linear)
        self.head = head_for_inference(head) if weights == "float32" else packed_for_inference(head, weights)
        # greedy steps' next tokens without every logit, where the head is the Q8_0 kernel's (models.kernel_linear)
        self.greedy_head = greedy_head_for(head) if weights == "float32" and head.weight.is_cpu else None
        self.num_layers = model.config.get_text_config().num_hidden_layers
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.static_shapes = self.device.type == "cuda" if static_shapes is None else static_shapes
        self.cache = SpecCache(self.num_layers, 0, self.static_shapes)
        # fixed-shape steps: CUDA graphs on a GPU (unless $SPECDISTILL_NO_CUDA_GRAPHS), eager when asked for
        graphed = graphs_supported(self.device)
        wanted = graphed if fixed_steps is None else fixed_steps
        self.steps = None
        if wanted and self.static_shapes and self.lean is not None:
            self.steps = StepSet(self.lean, self.head, self.device, self.dtype, graphed=graphed, buckets=step_buckets)
        # EAGLE-3 reads these layers' inputs at every row (decode.proposers.eagle3): `features` after a forward
        self.feature_layers: list[int] = []
        self.features: torch.Tensor | None = None  # [N + L, len(feature_layers) x D]

    def start(self, capacity: int) -> None:
        """Begin a new sequence; reallocate only when the buffers are too small."""
        if self.steps is not None:
            capacity += self.steps.max_rows  # a padded step writes up to a bucket past the committed prefix
        if capacity > self.cache.max_len:
            # with recorded steps, room to spare: a reallocation drops them (they point at the old buffers)
            multiple = 1024 if self.steps is not None else 256
            self.cache = SpecCache(self.num_layers, _round_up(capacity, multiple), self.static_shapes)
        if self.steps is not None:
            self.steps.bind(self.cache)
        self.cache.reset()

    def forward(
        self,
        tokens: list[int],
        depths: list[int] | None = None,
        ancestors: torch.Tensor | None = None,
        logits_rows: slice | None = None,
        extra: ExtraRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `tokens` (and `extra` rows after them) after the committed prefix and return
        (hidden [N + L, D], logits [n_rows, V]).

        depths: position offset of each node from the prefix end (a chain: 0..N-1).
        ancestors: [N, N] bool tree mask (a chain: lower triangular).
        logits_rows: which rows get the head (default all).
        extra: L rows given as embeddings (see ExtraRows); none by default.
        """
        hidden, rows, logits = self.run(tokens, depths, ancestors, logits_rows, extra)
        return hidden, (logits if logits is not None else self.head(rows).float())  # [n_rows, V]

    def forward_greedy(self, tokens: list[int], depths: list[int] | None = None,
                       ancestors: torch.Tensor | None = None,
                       logits_rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward (no extra rows), then each head row's most probable next token: (hidden [N, D], tokens [n_rows]
        int64), the argmax of forward's logits, ties to the first. On the greedy head where it runs (the exact
        argmax without computing every logit: models.kernel_linear.GreedyHead), else from the logits."""
        hidden, rows, logits = self.run(tokens, depths, ancestors, logits_rows, None)
        return hidden, self.greedy_tokens(rows) if logits is None else logits.argmax(-1)

    def greedy_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, D] final hidden states -> each row's most probable next token [n] int64 (ties to the first): the
        greedy head's where it runs, else the argmax of the head's logits."""
        if self.greedy_head is not None and rows.shape[0] <= MAX_ROWS:
            best, _ = self.greedy_head.tokens(rows)
            if bool((best >= 0).all()):
                return best
        return self.head(rows).float().argmax(-1)  # no greedy head here, or a row without candidates (NaN)

    def run(self, tokens: list[int], depths: list[int] | None, ancestors: torch.Tensor | None,
            logits_rows: slice | None,
            extra: ExtraRows | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """forward's rows: (hidden [N + L, D], the head's rows [n_rows, D], and their logits where a fixed-shape
        step computed them already, else None)."""
        n = len(tokens)
        prefix = self.cache.length
        if depths is None:
            depths = list(range(n))
        if ancestors is None:
            ancestors = torch.ones(n, n, dtype=torch.bool).tril()
        if self.steps is not None and extra is None and n <= self.steps.max_rows:  # a fixed-shape step
            hidden, logits, self.features = self.steps.forward(tokens, list(depths), ancestors.cpu(), prefix,
                                                               self.feature_layers)
            rows = hidden if logits_rows is None else hidden[logits_rows]
            return hidden, rows, (logits if logits_rows is None else logits[logits_rows]).float()
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, N]
        inputs = {"input_ids": ids}
        if extra is not None:
            inputs = {"inputs_embeds": with_extra_embeds(self.model.get_input_embeddings()(ids), extra)}
            depths, ancestors = list(depths) + list(extra.depths), with_extra_mask(ancestors, extra)
        positions = torch.tensor(depths, dtype=torch.long, device=self.device) + prefix  # [N + L]
        total = self.cache.max_len if self.static_shapes else prefix + len(depths)
        mask = attention_bias(prefix, ancestors.to(self.device), total, self.dtype)  # [1, 1, N + L, total]
        if self.lean is not None:
            last, features = self.lean(inputs.get("input_ids"), inputs.get("inputs_embeds"), mask, positions[None],
                                       self.cache, self.feature_layers)
        else:
            capture = {"output_hidden_states": True} if self.feature_layers else {}
            out = self.decoder(**inputs, attention_mask=mask, position_ids=positions[None],
                               **cache_argument(self.decoder, self.cache), use_cache=True,
                               **grouped_mask_argument(self.model, mask), **capture)
            last = out.last_hidden_state
            # hidden_states[i] is the input of layer i (0: the embeddings)
            features = [out.hidden_states[i] for i in self.feature_layers] if self.feature_layers else []
        hidden = last[0]  # [N + L, D]
        if self.feature_layers:
            self.features = torch.cat([f[0] for f in features], dim=-1)
        return hidden, (hidden if logits_rows is None else hidden[logits_rows]), None


def with_extra_embeds(token_embeds: torch.Tensor, extra: ExtraRows) -> torch.Tensor:
    """[1, N, D] token embeddings + the extra rows -> [1, N + L, D]."""
    return torch.cat([token_embeds, extra.embeds.to(token_embeds.dtype)[None]], dim=1)


def with_extra_mask(ancestors: torch.Tensor, extra: ExtraRows) -> torch.Tensor:
    """The [N + L, N + L] attention mask: token rows see only token rows (their ancestors), extra
    rows see what extra.mask allows."""
    n, n_extra = ancestors.shape[0], len(extra.depths)
    if extra.mask.shape != (n_extra, n + n_extra) or extra.embeds.shape[0] != n_extra:
        raise ValueError(f"extra rows: mask {tuple(extra.mask.shape)} and embeds {tuple(extra.embeds.shape)} "
                         f"do not fit {n_extra} rows after {n} token rows")
    top = torch.cat([ancestors.cpu(), torch.zeros(n, n_extra, dtype=torch.bool)], dim=1)  # [N, N + L]
    return torch.cat([top, extra.mask.cpu()], dim=0)  # [N + L, N + L]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def synchronized_clock(device: torch.device) -> float:
    """perf_counter after queued kernels finish, so that CUDA timings are honest."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
