"""On-policy distillation (DistillSpec / GKD): the drafter writes the responses, the target scores them.

Training on the drafter's own samples puts the loss where the drafter actually goes at decoding
time, which is what acceptance depends on. The target's distributions on those samples are
computed live (a teacher-forced forward), and expressed over the drafter's head (a reduced head
sees the target's log-probs of its own tokens; the rest of the mass is the tail bucket).
"""

from __future__ import annotations

import torch

from specdistill.distill.losses import TopK
from specdistill.models.hf_compat import cache_argument, output_cache


@torch.no_grad()
def sample_draft_responses(draft_model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                           eos_token_ids: set[int], pad_id: int, vocab_map: torch.Tensor | None = None,
                           generator: torch.Generator | None = None) -> list[list[int]]:
    """Batched sampling from the drafter (left-padded prompts, a KV cache); returns target token
    ids per prompt, cut after the first EOS. Works with a reduced head through `vocab_map`."""
    device = next(draft_model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # [B, T]
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = [[] for _ in prompts]
    past, step_ids = None, ids
    for _ in range(max_new_tokens):
        positions = (attention.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1]:]
        result = draft_model(input_ids=step_ids, attention_mask=attention, position_ids=positions,
                             **cache_argument(draft_model, past), use_cache=True)
        past = output_cache(result)
        probs = torch.softmax(result.logits[:, -1].float() / max(temperature, 1e-5), dim=-1).cpu()  # [B, V_d]
        picked = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
        tokens = picked if vocab_map is None else vocab_map.cpu()[picked]
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                out[i].append(token)
                done[i] = token in eos_token_ids
        if done.all():
            break
        step_ids = tokens.to(device)[:, None]
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
    return out


def target_topk_over_draft_head(target_logits: torch.Tensor, vocab_map: torch.Tensor | None) -> TopK:
    """The target's live distribution as a TopK over the drafter's head: [B, T, V] logits ->
    log-probs of the head's tokens (all V when the head is full, so nothing is lost)."""
    logp = torch.log_softmax(target_logits.float(), dim=-1)  # [B, T, V]
    if vocab_map is None:
        ids = torch.arange(logp.shape[-1], device=logp.device).expand_as(logp)
        return TopK(ids, logp)
    vm = vocab_map.to(logp.device)
    ids = torch.arange(vm.numel(), device=logp.device).expand(*logp.shape[:-1], -1)  # draft indices
    return TopK(ids, logp[..., vm])
