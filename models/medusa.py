"""Medusa heads (Cai et al. 2024): K extra heads on the target's last hidden state.

Head k (1-based) reads the hidden state h_t of position t and predicts token t + k + 1; the target's
own head on h_t predicts token t + 1. Each head is `n_layers` residual blocks x + SiLU(W x + b) and
an output projection [V, D]. The blocks' Linear is zero-initialised, so every block starts as the
identity, and the projection starts as a copy of the target's head: training therefore starts from
the target's own next-token distribution (a sensible guess for t + 2 and a stable start), not noise.

Every layer is its own module. `[ResBlock(h)] * n` would put one module n times in the list, sharing
one set of weights, a known bug of the original code; `test_medusa.py` checks the parameter count.

A drafter directory of kind `medusa`:
    manifest.json   config: {"num_heads", "num_layers", "hidden_size", "vocab_size"} plus the training
                    config; extra: {"tree": [[rank, ...], ...], "topk_accuracy": [[...], ...]}
    model/medusa.safetensors   the heads' state dict
    vocab_map.safetensors      optional [M] target ids the heads may propose (config `draft_vocab`):
                               decoding projects onto these rows only; training keeps the full vocabulary
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.drafters import Drafter, checked_vocab_map, load_vocab_map, register_drafter_kind

WEIGHTS_FILE = "medusa.safetensors"
ARCH_KEYS = ("num_heads", "num_layers", "hidden_size", "vocab_size")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); the Linear starts at zero, so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int):
        super().__init__()
        self.blocks = nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))  # distinct modules
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.blocks(hidden))


class MedusaHeads(nn.Module):
    """K heads; forward(hidden [..., D]) -> logits [K, ..., V] (head k-1 at index k-1 predicts t + k + 1)."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.config = {"num_heads": num_heads, "num_layers": num_layers, "hidden_size": hidden_size,
                       "vocab_size": vocab_size}
        self.heads = nn.ModuleList(MedusaHead(hidden_size, vocab_size, num_layers) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.heads])  # [K, ..., V]

    @classmethod
    def from_target(cls, target_model: nn.Module, num_heads: int, num_layers: int = 1) -> "MedusaHeads":
        """Heads for `target_model`: identity blocks and projections copied from its head."""
        head = target_model.get_output_embeddings().weight  # [V, D]
        heads = cls(num_heads, num_layers, head.shape[1], head.shape[0]).to(device=head.device, dtype=head.dtype)
        with torch.no_grad():
            for medusa_head in heads.heads:
                medusa_head.proj.weight.copy_(head.detach())
        return heads

    def save_pretrained(self, directory: str | Path) -> None:
        """Called by models.drafters.save_drafter inside its atomic temporary directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={k: str(v) for k, v in self.config.items()})


def load_medusa_heads(model_dir: Path, config: dict, dtype: torch.dtype) -> MedusaHeads:
    missing = [key for key in ARCH_KEYS if key not in config]
    if missing:
        raise ValueError(f"{model_dir}: the medusa manifest config lacks {', '.join(missing)}")
    heads = MedusaHeads(*(int(config[key]) for key in ARCH_KEYS))
    heads.load_state_dict(load_file(str(model_dir / WEIGHTS_FILE)), strict=True)
    return heads.to(dtype)


def load_medusa_kind(path: Path, manifest: dict, target, device: str) -> Drafter:
    config = manifest.get("config") or {}
    heads = load_medusa_heads(path / (manifest.get("model") or "model"), config, target.dtype)
    if heads.config["vocab_size"] != target.vocab_size:
        raise ValueError(f"medusa drafter {path} has {heads.config['vocab_size']}-token heads but target "
                         f"{target.name!r} has {target.vocab_size} tokens")
    vocab_map = None
    if manifest.get("vocab_map"):
        try:
            vocab_map = checked_vocab_map(load_vocab_map(path / manifest["vocab_map"]), target)
        except ValueError as err:
            raise ValueError(f"medusa drafter {path}: {err}") from err
    return Drafter("medusa", heads.to(device).eval(), vocab_map, manifest, str(path))


register_drafter_kind("medusa", load_medusa_kind)
