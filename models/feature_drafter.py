"""What the drafters over the target's own hidden states share: EAGLE-3 (models.eagle3) and DFlash (models.dflash).

Both take their attention and MLP shapes from the target, draft into a head over M of the target's V tokens
(`ReducedVocab`: EAGLE-3's d2t/t2d buffers), start as Llama does with the head and final norm the target's, may
start their layers as the target's own, and are saved as one safetensors file in a drafter directory:

    target_shapes(target_model, draft_vocab_size, intermediate_size)  the config keys both take from the target
    check_shapes(config, kind, intermediate_field)                      errors naming the field
    rope_tables(inv_freq, positions, dtype) / rotate(x, cos, sin)       RoPE, rotate-half as Llama
    SwiGLU                                                              the gate/up/down MLP of Llama and Qwen
    start_like_target(drafter, target_model, vocab_map, seed)           Llama's init; the target's head rows, norm
    copy_mlp(dst, src)                                                  a target layer's MLP into one of any width
    save_weights(module, directory, file) / load_kind(...)              the directory's weights; a kind's loader
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from specdistill.models.drafters import Drafter


def target_shapes(target_model: nn.Module, draft_vocab_size: int, intermediate_size: int = 0) -> dict:
    """The drafter's attention and MLP shapes, norm epsilon, RoPE base and vocabulary sizes from the target's
    config; a positive intermediate_size replaces the target's MLP width, draft_vocab_size 0 means the target's."""
    text = target_model.config.get_text_config()
    vocab = target_model.get_output_embeddings().weight.shape[0]
    rope = getattr(text, "rope_parameters", None) or {}
    heads = text.num_attention_heads
    return {"hidden_size": text.hidden_size, "target_hidden_size": text.hidden_size,
            "num_attention_heads": heads, "num_key_value_heads": getattr(text, "num_key_value_heads", heads),
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
            "intermediate_size": int(intermediate_size or text.intermediate_size),
            "rms_norm_eps": float(text.rms_norm_eps),
            "rope_theta": float(rope.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0),
            "draft_vocab_size": int(draft_vocab_size or vocab), "vocab_size": int(vocab)}


def check_shapes(config: dict, kind: str, intermediate_field: str) -> None:
    """The checks of `target_shapes`' keys; errors name `kind` and, for the MLP width, `intermediate_field` (the
    training config's spelling)."""
    if not 0 < config["draft_vocab_size"] <= config["vocab_size"]:
        raise ValueError(f"draft_vocab: {config['draft_vocab_size']} must be in 1..{config['vocab_size']} "
                         "(the target's vocabulary)")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError(f"{kind}: {config['num_attention_heads']} attention heads are not a multiple of "
                         f"{config['num_key_value_heads']} key/value heads")
    if config["intermediate_size"] < 1:
        raise ValueError(f"{intermediate_field}: must be positive, got {config['intermediate_size']}")
    if config["head_dim"] % 2:
        raise ValueError(f"{kind}: head_dim {config['head_dim']} must be even for RoPE")


def inverse_frequencies(config: dict) -> torch.Tensor:
    """[head_dim / 2] RoPE's inverse frequencies for the config's head_dim and rope_theta."""
    hd = config["head_dim"]
    return 1.0 / config["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [..., T] -> cos, sin [..., 1, T, hd] in dtype (broadcast over heads)."""
    angles = positions.to(inv_freq.device, torch.float32)[..., None] * inv_freq  # [..., T, hd / 2]
    return tuple(torch.cat([f(angles)] * 2, dim=-1).to(dtype).unsqueeze(-3) for f in (torch.cos, torch.sin))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [..., T, hd] (rotate-half, as Llama)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class SwiGLU(nn.Module):
    """Llama's and Qwen's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: dict):
        super().__init__()
        d, i = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReducedVocab:
    """A drafter head over M of the target's V ids, kept as EAGLE-3's d2t offsets and t2d mask (buffers the
    subclass registers: d2t [M] long, t2d [V] bool); shared by EAGLE-3 and DFlash drafters."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def vocab_map(self) -> torch.Tensor:
        """[M] target id of each draft index."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_vocab(self, vocab_map: torch.Tensor) -> None:
        """vocab_map [M]: sorted distinct target ids (the d2t offsets need them increasing)."""
        vocab_map = vocab_map.long().to(self.d2t.device)
        if vocab_map.numel() != self.d2t.numel() or bool((vocab_map[1:] <= vocab_map[:-1]).any()):
            raise ValueError(f"vocab map: {self.d2t.numel()} increasing target ids needed")
        self.d2t.copy_(vocab_map - torch.arange(vocab_map.numel(), device=vocab_map.device))
        self.t2d.zero_()
        self.t2d[vocab_map] = True


def full_vocab_map(target_model: nn.Module, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """[M] the draft vocabulary's target ids on the CPU; None: every target id."""
    head = target_model.get_output_embeddings().weight  # [V, D]
    return torch.arange(head.shape[0]) if vocab_map is None else vocab_map.long().cpu()


@torch.no_grad()
def start_like_target(drafter: nn.Module, target_model: nn.Module, vocab_map: torch.Tensor, seed: int) -> None:
    """Every linear normal with std 0.02 (Llama's init, seeded), then the head (`lm_head`) the target's own rows
    for the draft vocabulary and the final norm (`norm`) the target's, so the head starts reading the target's
    way."""
    generator = torch.Generator().manual_seed(seed)
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
    head = target_model.get_output_embeddings().weight  # [V, D]
    drafter.lm_head.weight.copy_(head.detach()[vocab_map.to(head.device)].float().cpu())
    final_norm = getattr(target_model.get_decoder(), "norm", None)
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm.weight.detach().float().cpu())


@torch.no_grad()
def copy_mlp(dst: SwiGLU, src: nn.Module) -> None:
    """A target layer's MLP into the drafter's of any width: a wider one holds the target's units in its first rows
    (gate, up) and columns (down), its other down columns zero, so it starts computing the target's output and the
    new units grow from there; a narrower one keeps the target's first units."""
    width = min(dst.gate_proj.weight.shape[0], src.gate_proj.weight.shape[0])
    for name in ("gate_proj", "up_proj"):
        weight = getattr(dst, name).weight
        weight[:width].copy_(getattr(src, name).weight[:width].detach().to(weight.device, weight.dtype))  # [I, D]
    down = dst.down_proj.weight  # [D, I]
    down[:, width:].zero_()
    down[:, :width].copy_(src.down_proj.weight[:, :width].detach().to(down.device, down.dtype))


def save_weights(module: nn.Module, directory: str | Path, file_name: str) -> None:
    """The module's state dict as directory/file_name (safetensors, on the CPU); called by
    models.drafters.save_drafter inside its atomic temporary directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in module.state_dict().items()}
    save_file(state, str(directory / file_name))


def load_weights(cls: Callable[[dict], nn.Module], model_dir: Path, file_name: str, config: dict,
                 dtype: torch.dtype) -> nn.Module:
    """cls(config) with model_dir/file_name's weights (every key, nothing else), in dtype; a bad config is an
    error naming the directory."""
    try:
        drafter = cls(config)
    except ValueError as err:
        raise ValueError(f"{model_dir}: {err}") from err
    drafter.load_state_dict(load_file(str(model_dir / file_name)), strict=True)
    return drafter.to(dtype)


def load_kind(kind: str, cls: Callable[[dict], nn.Module], file_name: str, arch_keys: tuple[str, ...],
              check_config: Callable[[dict, int], None], path: Path, manifest: dict, target, device: str) -> Drafter:
    """A drafter directory of `kind` against `target`: the manifest's architecture keys, the weights in the
    target's dtype, and errors naming the directory where it does not fit the target (its vocabulary, its
    layer count)."""
    config = {key: value for key, value in (manifest.get("config") or {}).items() if key in arch_keys}
    drafter = load_weights(cls, path / (manifest.get("model") or "model"), file_name, config, target.dtype)
    if config["vocab_size"] != target.vocab_size:
        raise ValueError(f"{kind} drafter {path} was built for a {config['vocab_size']}-token vocabulary but "
                         f"target {target.name!r} has {target.vocab_size} tokens")
    try:
        check_config(config, target.model.config.get_text_config().num_hidden_layers)
    except ValueError as err:
        raise ValueError(f"{kind} drafter {path}: {err}") from err
    return Drafter(kind, drafter.to(device).eval(), drafter.vocab_map.cpu(), manifest, str(path))
