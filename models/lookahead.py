"""[LA] lookahead tokens (PaSS, Monea et al. 2023): k learnable input embeddings for a frozen target.

The target reads the sequence x_1..x_n followed by the k embeddings LA_1..LA_k at positions n+1..n+k.
Its output at x_n predicts x_{n+1}, as always; its output at LA_j predicts x_{n+1+j}. So one forward
predicts the next k + 1 tokens, and only the k x D embeddings are trained (the target is frozen and
unchanged: the [LA] rows are never attended by the real tokens).

Initialisation: every LA_j starts at the mean of the target's input embeddings (a "typical token"
the target has seen, rather than an out-of-distribution vector) plus seeded Gaussian noise of
`noise` x the embeddings' per-dimension spread, so the k tokens start distinct.

A drafter directory of kind `lookahead`:
    manifest.json   config: {"num_tokens", "hidden_size"} plus the training config;
                    extra: {"chains": int, "branches": int} (how many tree nodes get an [LA] chain when
                    decoding; how many of LA_1's most likely tokens the tree holds, 1 if absent)
    model/lookahead.safetensors   {"embeddings": [K, D]}
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdistill.models.drafters import Drafter, register_drafter_kind

WEIGHTS_FILE = "lookahead.safetensors"
ARCH_KEYS = ("num_tokens", "hidden_size")


class LookaheadTokens(nn.Module):
    """k lookahead embeddings; forward() -> [K, D]. Embedding k-1 (LA_k) predicts the token k+1 after
    the last real token."""

    def __init__(self, num_tokens: int, hidden_size: int):
        super().__init__()
        if num_tokens < 1 or hidden_size < 1:
            raise ValueError(f"lookahead tokens need num_tokens >= 1 and hidden_size >= 1, "
                             f"got {num_tokens}, {hidden_size}")
        self.config = {"num_tokens": num_tokens, "hidden_size": hidden_size}
        self.embeddings = nn.Parameter(torch.zeros(num_tokens, hidden_size))  # [K, D]

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]

    def forward(self) -> torch.Tensor:
        return self.embeddings  # [K, D]

    @classmethod
    def from_target(cls, target_model: nn.Module, num_tokens: int, seed: int = 0,
                    noise: float = 0.1) -> "LookaheadTokens":
        """k tokens at the target's mean input embedding plus seeded noise (noise x per-dim std)."""
        table = target_model.get_input_embeddings().weight.detach().float()  # [V, D]
        gen = torch.Generator().manual_seed(seed)
        jitter = torch.randn(num_tokens, table.shape[1], generator=gen) * table.std(0).cpu() * noise  # [K, D]
        tokens = cls(num_tokens, table.shape[1])
        with torch.no_grad():
            tokens.embeddings.copy_(table.mean(0).cpu() + jitter)
        return tokens.to(device=table.device)

    def save_pretrained(self, directory: str | Path) -> None:
        """Called by models.drafters.save_drafter inside its atomic temporary directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {"embeddings": self.embeddings.detach().to("cpu").contiguous()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={k: str(v) for k, v in self.config.items()})


def load_lookahead_tokens(model_dir: Path, config: dict, dtype: torch.dtype) -> LookaheadTokens:
    missing = [key for key in ARCH_KEYS if key not in config]
    if missing:
        raise ValueError(f"{model_dir}: the lookahead manifest config lacks {', '.join(missing)}")
    file = model_dir / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{model_dir}: lookahead drafter has no {WEIGHTS_FILE}")
    tokens = LookaheadTokens(int(config["num_tokens"]), int(config["hidden_size"]))
    state = load_file(str(file))
    if set(state) != {"embeddings"} or tuple(state["embeddings"].shape) != tuple(tokens.embeddings.shape):
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        raise ValueError(f"{file}: expected embeddings {tuple(tokens.embeddings.shape)}, found {shapes}")
    tokens.load_state_dict(state, strict=True)
    return tokens.to(dtype)


def load_lookahead_kind(path: Path, manifest: dict, target, device: str) -> Drafter:
    config = manifest.get("config") or {}
    tokens = load_lookahead_tokens(path / (manifest.get("model") or "model"), config, target.dtype)
    width = target.model.get_input_embeddings().weight.shape[1]
    if tokens.config["hidden_size"] != width:
        raise ValueError(f"lookahead drafter {path} has {tokens.config['hidden_size']}-wide embeddings but target "
                         f"{target.name!r} has hidden size {width}")
    return Drafter("lookahead", tokens.to(device).eval(), None, manifest, str(path))


register_drafter_kind("lookahead", load_lookahead_kind)
