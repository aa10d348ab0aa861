"""Medusa heads (Cai et al. 2024): K extra heads on the target's last hidden state.

Head k (1-based) reads the hidden state h_t of position t and predicts token t + k + 1; the target's
own head on h_t predicts token t + 1. Each head is `n_layers` residual blocks x + SiLU(W x + b) and
an output projection [V, D]. The blocks' Linear is zero-initialised, so every block starts as the
identity, and the projection starts as a copy of the target's head: training therefore starts from
the target's own next-token distribution (a sensible guess for t + 2 and a stable start), not noise.

Sequential heads (`sequential: true`, Hydra-style, Ankner et al. 2024). A Medusa head guesses token
t + k + 1 from h_t alone, blind to the tokens in between, which the tree has already chosen. A
sequential head also reads them: head k maps the previous head's state s_{k-1} (s_0 = h_t) and the
target's input embedding of the token at depth k - 1 of the tree (the root, t + 1, for head 1) to
    s_k = blocks_k(s_{k-1} + fuse_k([s_{k-1}; e(token)]))      logits_k = proj_k(s_k)
so each node's children depend on the path to it. fuse_k starts at zero: the heads start as Medusa's.
Drafting runs the heads depth by depth over the tree's inner nodes (decode.proposers.medusa); the
embeddings are the frozen target's own and are not stored.

Prefix attention (`prefix`, Hydra++): the target's last hidden state is specialised for the next
token. One extra causal decoder layer over the whole sequence of those states, h_0 .. h_t, re-reads
the context for the heads: s_0 = PrefixLayer(h_0 .. h_t)[t] instead of h_t. Its attention and MLP
outputs start at zero, so it starts as the identity. At decoding it keeps its own KV cache of the
accepted positions (`PrefixCache`): one layer's work on the rows each step accepts.

Every layer is its own module. `[ResBlock(h)] * n` would put one module n times in the list, sharing
one set of weights, a known bug of the original code; `test_medusa.py` checks the parameter count.

A drafter directory of kind `medusa`:
    manifest.json   config: {"num_heads", "num_layers", "hidden_size", "vocab_size"} plus the training
                    config; extra: {"tree": [[rank, ...], ...], "topk_accuracy": [[...], ...]}
                    config may carry "prefix": {"num_heads", "intermediate_size", "rope_theta"}
    model/medusa.safetensors   the heads' state dict (the prefix layer's under "prefix.")
    vocab_map.safetensors      optional [M] target ids the heads may propose (config `draft_vocab`):
                               decoding projects onto these rows only
    A reduced drafter (config "reduced": true, `medusa.reduced_heads`) stores only those rows: each projection
    is [M, D] and "vocab_size" is M. For a 151,936-token target (Qwen2.5) full [V, D] projections are 233M
    parameters a head, four heads 3.7 GB in fp32 and 15 GB with their gradients and AdamW's moments, of which
    training and decoding only ever read the M candidate rows (the others keep the target head's copy).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdistill.models.drafters import Drafter, checked_vocab_map, load_vocab_map, register_drafter_kind

WEIGHTS_FILE = "medusa.safetensors"
ARCH_KEYS = ("num_heads", "num_layers", "hidden_size", "vocab_size")  # "sequential", "prefix", "reduced" optional


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); the Linear starts at zero, so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class PrefixLayer(nn.Module):
    """One pre-norm causal decoder layer (RoPE attention + SiLU-gated MLP) over hidden states.

    forward(hidden [B, T, D]) -> [B, T, D] at positions 0 .. T-1 (training; right padding is harmless
    under the causal mask); extend(hidden [n, D], cache) -> [n, D] for the next n positions of one
    sequence, attending to the cached ones (decoding)."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, rope_theta: float):
        super().__init__()
        if hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(f"prefix layer: hidden size {hidden_size} needs an even head size for {num_heads} heads")
        self.config = {"num_heads": num_heads, "intermediate_size": intermediate_size, "rope_theta": rope_theta}
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.attn_norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)  # both residual branches start at zero: the layer is the identity
        nn.init.zeros_(self.down.weight)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [hd / 2]

    def heads_of(self, hidden: torch.Tensor, positions: torch.Tensor):
        """[..., T, D] -> q, k, v [..., H, T, hd], q and k rotated to their positions [T]."""
        q, k, v = self.qkv(self.attn_norm(hidden)).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        q, k, v = (x.transpose(-3, -2) for x in (q, k, v))  # [..., H, T, hd]
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq  # [T, hd / 2]
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(hidden.dtype) for f in (torch.cos, torch.sin))
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """hidden [..., T, D] + attention output [..., H, T, hd] -> the layer's output [..., T, D]."""
        hidden = hidden + self.out(attended.transpose(-3, -2).flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down(nn.functional.silu(gate) * up)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads_of(hidden, torch.arange(hidden.shape[-2]))
        return self.finish(hidden, nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))

    def extend(self, hidden: torch.Tensor, cache: "PrefixCache") -> torch.Tensor:
        n, start = hidden.shape[0], cache.length
        q, k, v = self.heads_of(hidden, torch.arange(start, start + n))  # [H, n, hd]
        keys, values = cache.append(k, v)  # [H, start + n, hd]
        mask = None
        if n > 1:  # row i sees the cache and new rows 0..i
            mask = (torch.arange(start + n, device=hidden.device)
                    <= start + torch.arange(n, device=hidden.device)[:, None])
        return self.finish(hidden, nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [..., T, hd] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class PrefixCache:
    """The prefix layer's keys and values [H, capacity, hd] for one sequence's accepted positions."""

    def __init__(self, layer: PrefixLayer, capacity: int, device, dtype):
        shape = (layer.num_heads, capacity, layer.head_dim)
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        end = self.length + k.shape[-2]
        if end > self.keys.shape[1]:
            raise RuntimeError(f"prefix cache full: {end} positions, capacity {self.keys.shape[1]}")
        self.keys[:, self.length:end] = k
        self.values[:, self.length:end] = v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, sequential: bool = False):
        super().__init__()
        self.fuse = nn.Linear(2 * hidden_size, hidden_size) if sequential else None
        if self.fuse is not None:
            nn.init.zeros_(self.fuse.weight)  # starts as a Medusa head: the token adds nothing yet
            nn.init.zeros_(self.fuse.bias)
        self.blocks = nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))  # distinct modules
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)

    def state(self, hidden: torch.Tensor, token_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """[..., D] -> [..., D], the input of proj. A sequential head also reads the embedding [..., D] of
        the token before the one it predicts; hidden is then the previous head's state."""
        if self.fuse is not None:
            if token_embedding is None:
                raise ValueError("a sequential Medusa head needs the embedding of the token before its own")
            hidden = hidden + self.fuse(torch.cat([hidden, token_embedding.to(hidden.dtype)], dim=-1))
        return self.blocks(hidden)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.state(hidden, token_embedding))


class MedusaHeads(nn.Module):
    """K heads; forward(hidden [..., D]) -> logits [K, ..., V] (head k-1 at index k-1 predicts t + k + 1).

    Sequential heads also take token_embeddings [K, ..., D]: row k-1 the embedding of token t + k (the
    one before head k's), teacher-forced; see `states`."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
                 sequential: bool = False, prefix: dict | None = None, reduced: bool = False):
        """reduced: the projections hold only a candidate vocabulary's rows (vocab_size = its size M, the
        order of the drafter's vocab_map), not the target's whole vocabulary."""
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.config = {"num_heads": num_heads, "num_layers": num_layers, "hidden_size": hidden_size,
                       "vocab_size": vocab_size, "sequential": bool(sequential), "reduced": bool(reduced)}
        self.heads = nn.ModuleList(MedusaHead(hidden_size, vocab_size, num_layers, sequential)
                                   for _ in range(num_heads))
        self.prefix = None
        if prefix:
            self.prefix = PrefixLayer(hidden_size, int(prefix["num_heads"]), int(prefix["intermediate_size"]),
                                      float(prefix["rope_theta"]))
            self.config["prefix"] = dict(self.prefix.config)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def sequential(self) -> bool:
        return self.config["sequential"]

    @property
    def reduced(self) -> bool:
        return bool(self.config.get("reduced", False))

    def source(self, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' input s_0 at every position of a sequence: [B, T, D] target states -> [B, T, D]
        (the prefix layer's output, or the states themselves without one)."""
        return hidden if self.prefix is None else self.prefix(hidden)

    def states(self, hidden: torch.Tensor, token_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """s_0 [..., D] (see `source`) -> [K, ..., D], each head's input to its projection. Medusa heads each read
        hidden; sequential head k reads head k-1's state (hidden for head 1) and token_embeddings[k-1]."""
        if not self.sequential:
            return torch.stack([head.state(hidden) for head in self.heads])
        if token_embeddings is None or token_embeddings.shape[0] != self.num_heads:
            raise ValueError(f"sequential Medusa heads need token_embeddings [{self.num_heads}, ..., D]")
        states, state = [], hidden
        for head, embedding in zip(self.heads, token_embeddings):
            state = head.state(state, embedding)
            states.append(state)
        return torch.stack(states)

    def forward(self, hidden: torch.Tensor, token_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        states = self.states(hidden, token_embeddings)  # [K, ..., D]
        return torch.stack([head.proj(state) for head, state in zip(self.heads, states)])  # [K, ..., V]

    @classmethod
    def from_target(cls, target_model: nn.Module, num_heads: int, num_layers: int = 1,
                    sequential: bool = False, prefix_layer: bool = False,
                    vocab_map: torch.Tensor | None = None) -> "MedusaHeads":
        """Heads for `target_model`: identity blocks and projections copied from its head; with
        prefix_layer, an identity prefix layer shaped like the target's layers (heads, MLP width, RoPE).
        vocab_map [M] (target ids): reduced heads, their projections copies of those rows of the head only."""
        head = target_model.get_output_embeddings().weight.detach()  # [V, D]
        if vocab_map is not None:
            head = head[checked_rows(vocab_map, head.shape[0])]  # [M, D]
        prefix = prefix_config(target_model) if prefix_layer else None
        heads = cls(num_heads, num_layers, head.shape[1], head.shape[0], sequential, prefix,
                    reduced=vocab_map is not None).to(device=head.device, dtype=head.dtype)
        with torch.no_grad():
            for medusa_head in heads.heads:
                medusa_head.proj.weight.copy_(head)
        return heads

    def save_pretrained(self, directory: str | Path) -> None:
        """Called by models.drafters.save_drafter inside its atomic temporary directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={k: str(v) for k, v in self.config.items()})


def checked_rows(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """vocab_map as row indices of a [vocab_size, D] head, refused when empty or outside it."""
    rows = vocab_map.long().flatten()
    if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= vocab_size:
        raise ValueError(f"vocab_map: {rows.numel()} ids must be non-empty and within the head's {vocab_size} rows")
    return rows.to(vocab_map.device)


def projection_rows(heads: MedusaHeads, vocab_map: torch.Tensor | None) -> list[torch.Tensor]:
    """Per head its output rows over the candidates, K x [M, D] in vocab_map's order (K x [V, D] without one): a
    reduced head's own rows, a full head's rows restricted to vocab_map. What decoding projects onto."""
    weights = [head.proj.weight.detach() for head in heads.heads]
    if heads.reduced:
        if vocab_map is None or vocab_map.numel() != weights[0].shape[0]:
            raise ValueError(f"reduced Medusa heads of {weights[0].shape[0]} rows need their {weights[0].shape[0]}-id "
                             f"vocab_map, got {None if vocab_map is None else vocab_map.numel()} ids")
        return weights
    if vocab_map is None:
        return weights
    return [w[checked_rows(vocab_map, w.shape[0]).to(w.device)] for w in weights]


def check_heads_vocab(heads: MedusaHeads, vocab_map: torch.Tensor | None, target_vocab: int, where: str) -> None:
    """Full heads predict the target's vocabulary; reduced heads exactly their vocab_map's ids. `where` names the
    drafter in the error."""
    rows = int(heads.config["vocab_size"])
    if heads.reduced:
        if vocab_map is None or vocab_map.numel() != rows:
            raise ValueError(f"{where}: reduced Medusa heads of {rows} rows need a vocab_map of {rows} ids, got "
                             f"{None if vocab_map is None else vocab_map.numel()}")
    elif rows != target_vocab:
        raise ValueError(f"{where} has {rows}-token heads but the target has {target_vocab} tokens")


def prefix_config(target_model: nn.Module) -> dict:
    """The prefix layer's shape from the target's config: its attention heads, MLP width and RoPE base."""
    text = target_model.config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0
    return {"num_heads": text.num_attention_heads, "intermediate_size": text.intermediate_size,
            "rope_theta": float(theta)}


def load_medusa_heads(model_dir: Path, config: dict, dtype: torch.dtype) -> MedusaHeads:
    missing = [key for key in ARCH_KEYS if key not in config]
    if missing:
        raise ValueError(f"{model_dir}: the medusa manifest config lacks {', '.join(missing)}")
    heads = MedusaHeads(*(int(config[key]) for key in ARCH_KEYS), sequential=bool(config.get("sequential", False)),
                        prefix=config.get("prefix"), reduced=bool(config.get("reduced", False)))
    heads.load_state_dict(load_file(str(model_dir / WEIGHTS_FILE)), strict=True)
    return heads.to(dtype)


def load_medusa_kind(path: Path, manifest: dict, target, device: str) -> Drafter:
    config = manifest.get("config") or {}
    heads = load_medusa_heads(path / (manifest.get("model") or "model"), config, target.dtype)
    vocab_map = None
    if manifest.get("vocab_map"):
        try:
            vocab_map = checked_vocab_map(load_vocab_map(path / manifest["vocab_map"]), target)
        except ValueError as err:
            raise ValueError(f"medusa drafter {path}: {err}") from err
    check_heads_vocab(heads, vocab_map, target.vocab_size, f"medusa drafter {path} (target {target.name!r})")
    return Drafter("medusa", heads.to(device).eval(), vocab_map, manifest, str(path))


register_drafter_kind("medusa", load_medusa_kind)
