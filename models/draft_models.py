"""Draft language models built from a target: truncated copies, fresh small Llamas, LoRA adapters.

All builders work for any HF Llama-family target (`model.model.layers`, `model.model.embed_tokens`,
`model.model.norm`, `model.lm_head`), and give a model that speaks the target's vocabulary.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.models.gguf_blocks import ATTRIBUTE as GGUF_BLOCKS

LLAMA_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMALL_KEYS = {"layers": "decoder layers (required)", "hidden": "hidden size (required)",
              "heads": "attention heads", "kv_heads": "key/value heads", "intermediate": "MLP size",
              "seed": "initialisation seed"}


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a Llama-family causal LM, with a clear error for anything else."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or getattr(inner, "norm", None) is None:
        raise ValueError(f"{type(model).__name__} is not a Llama-family causal LM "
                         "(needs model.model.layers, model.model.embed_tokens, model.model.norm, lm_head)")
    return layers


def build_truncated_drafter(target_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A new model of the target's class holding copies of its embeddings, first `num_layers`
    decoder layers, final norm and head: the cheapest drafter that already speaks like the target.

    The weights are copied (not shared), so training the drafter never changes the target."""
    n_target = len(decoder_layers(target_model))
    if not 1 <= num_layers <= n_target:
        raise ValueError(f"truncated:{num_layers} needs 1 <= N <= {n_target} (the target's decoder layers)")
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    reference = next(target_model.parameters())
    draft = type(target_model)(config).to(device=reference.device, dtype=reference.dtype)
    draft.load_state_dict(truncated_state_dict(target_model, num_layers), strict=True)
    draft.generation_config = copy.deepcopy(target_model.generation_config)
    return draft.eval()


def truncated_state_dict(model: torch.nn.Module, num_layers: int) -> dict[str, torch.Tensor]:
    """The state dict without decoder layers >= num_layers (load_state_dict copies these tensors)."""
    def keep(name: str) -> bool:
        parts = name.split(".")
        return not (parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers)
    return {name: tensor for name, tensor in model.state_dict().items() if keep(name)}


def default_heads(hidden: int) -> int:
    """Heads of 64 dimensions where the hidden size allows, else the largest of 32, 16, 8, else one."""
    for head_dim in (64, 32, 16, 8):
        if hidden % head_dim == 0:
            return hidden // head_dim
    return 1


def build_small_drafter(target_model: torch.nn.Module, layers: int, hidden: int, heads: int | None = None,
                        kv_heads: int | None = None, intermediate: int | None = None, seed: int = 0,
                        init_from_target: bool = True) -> LlamaForCausalLM:
    """A fresh small Llama with the target's vocabulary, special ids and rope settings.

    With `init_from_target` and the target's hidden size, the embeddings start as the target's
    (tied to the head), which speeds up distillation a lot; otherwise everything is random."""
    if layers < 1 or hidden < 1:
        raise ValueError(f"small drafter needs layers >= 1 and hidden >= 1, got layers={layers}, hidden={hidden}")
    heads = heads or default_heads(hidden)
    kv_heads = kv_heads or heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"small drafter: hidden={hidden} must divide into heads={heads}, "
                         f"which must divide into kv_heads={kv_heads}")
    config = small_config(target_model, layers, hidden, heads, kv_heads, intermediate)
    reference = next(target_model.parameters())
    with torch.random.fork_rng(devices=[]):  # a seeded init that leaves the caller's RNG alone
        torch.manual_seed(seed)
        draft = LlamaForCausalLM(config)
    draft.to(device=reference.device, dtype=reference.dtype)
    target_embed = target_model.get_input_embeddings().weight
    if init_from_target and target_embed.shape[1] == hidden:
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target_embed)
    draft.generation_config = copy.deepcopy(target_model.generation_config)
    return draft.eval()


def small_config(target_model, layers: int, hidden: int, heads: int, kv_heads: int,
                 intermediate: int | None) -> LlamaConfig:
    text = target_model.config.get_text_config()
    rope = getattr(text, "rope_parameters", None)
    config = LlamaConfig(
        vocab_size=target_model.get_output_embeddings().weight.shape[0],
        hidden_size=hidden,
        intermediate_size=intermediate or 64 * math.ceil(8 * hidden / 3 / 64),  # Llama's 8/3 ratio
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=getattr(text, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
        rope_parameters=copy.deepcopy(rope) if rope else None,
        tie_word_embeddings=True,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )
    config._attn_implementation = getattr(target_model.config, "_attn_implementation", None) or "sdpa"
    return config


def parse_small_spec(text: str) -> dict[str, int]:
    """'layers=2,hidden=256[,heads=4,...]' -> keyword arguments of build_small_drafter."""
    kwargs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in SMALL_KEYS:
            raise ValueError(f"small drafter spec item {item!r}: expected key=value with keys "
                             + ", ".join(f"{k} ({v})" for k, v in SMALL_KEYS.items()))
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise ValueError(f"small drafter spec: {key}={value!r} is not an integer") from None
    missing = [key for key in ("layers", "hidden") if key not in kwargs]
    if missing:
        raise ValueError(f"small drafter spec {text!r} lacks {', '.join(missing)} (e.g. small:layers=2,hidden=256)")
    return kwargs


def drop_gguf_blocks(model: torch.nn.Module) -> int:
    """Forget the GGUF blocks attached to the model's linears (models.gguf_blocks), returning how many. A drafter
    started from a named real target (`qwen2.5-coder-0.5b`) comes with its file's K-quant blocks attached, and the
    engine computes a linear from its blocks wherever it has them: once training changes the fp32 weights, the
    blocks are the untrained model's, and measuring or decoding the drafter would silently run the model it
    started as. Changes `model`."""
    dropped = 0
    for module in model.modules():
        if getattr(module, GGUF_BLOCKS, None) is not None:
            delattr(module, GGUF_BLOCKS)
            dropped += 1
    return dropped


def apply_lora(model: torch.nn.Module, r: int = 8, alpha: int = 16,
               target_modules: Sequence[str] | None = None, dropout: float = 0.0):
    """Wrap `model` (changed in place) with LoRA adapters; only the adapters train.
    save_drafter merges them, so a saved drafter loads as a plain model."""
    from peft import LoraConfig, get_peft_model  # peft is slow to import; only LoRA jobs need it

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                        target_modules=list(target_modules or LLAMA_LORA_MODULES))
    return get_peft_model(model, config)


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A PEFT model's LoRA weights merged into a copy of its base model; any other model as is."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def replace_output_head(model: torch.nn.Module, rows: int) -> None:
    """Give `model` an untied [rows, D] head, the shape of a reduced-vocabulary checkpoint's head."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Linear(head.weight.shape[1], rows, bias=False,
                                                device=head.weight.device, dtype=head.weight.dtype))
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False


def reduce_head(model: torch.nn.Module, vocab_map: torch.Tensor) -> torch.nn.Module:
    """Keep only the head rows of `vocab_map` ([M] target ids): an untied [M, D] head initialised
    from the full head's rows (the input embeddings keep the full vocabulary). Changes `model`."""
    rows = model.get_output_embeddings().weight.detach()[vocab_map.to(model.device)].clone()  # [M, D]
    replace_output_head(model, rows.shape[0])
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(rows)
    return model


class ScatterHead(torch.nn.Module):
    """A reduced [M, D] head that answers over the full vocabulary: its logits at `vocab_map`'s ids,
    -inf elsewhere. Lets code that expects the target's vocabulary (transformers' assisted
    generation) run a reduced-head drafter unchanged."""

    def __init__(self, reduced: torch.nn.Linear, vocab_map: torch.Tensor, vocab_size: int):
        super().__init__()
        self.reduced = reduced
        self.register_buffer("vocab_map", vocab_map.clone(), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.reduced(hidden)  # [..., M]
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return full.index_copy_(-1, self.vocab_map.to(logits.device), logits)


def full_vocab_view(model: torch.nn.Module, vocab_map: torch.Tensor, vocab_size: int) -> torch.nn.Module:
    """A copy of a reduced-head drafter whose head scatters into the full vocabulary (see ScatterHead)."""
    view = copy.deepcopy(model)
    view.set_output_embeddings(ScatterHead(view.get_output_embeddings(), vocab_map, vocab_size))
    return view


def grow_head(model: torch.nn.Module, vocab_map: torch.Tensor, new_ids: torch.Tensor) -> torch.Tensor:
    """Append head rows for target ids `new_ids` ([N], absent from `vocab_map` [M]) to a reduced-head
    drafter; returns the [M + N] map. A new row starts as the drafter's own input embedding of its token,
    which is the head row itself in a model with tied embeddings (SmolLM2, and every truncated drafter
    of one), so a grown token is scored as the untrained head would have. Changes `model`."""
    kept = set(vocab_map.tolist())
    if any(int(t) in kept for t in new_ids):
        raise ValueError("grow_head: some new ids are already in the vocab_map")
    if new_ids.numel() == 0:
        return vocab_map
    old = model.get_output_embeddings().weight.detach()  # [M, D]
    rows = model.get_input_embeddings().weight.detach()[new_ids.to(old.device)]  # [N, D]
    if rows.shape[1] != old.shape[1]:
        raise ValueError(f"grow_head: input embeddings are {rows.shape[1]} wide, the head {old.shape[1]}")
    replace_output_head(model, old.shape[0] + rows.shape[0])
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(torch.cat([old, rows.to(old.dtype)]))
    return torch.cat([vocab_map.cpu(), new_ids.cpu()])
