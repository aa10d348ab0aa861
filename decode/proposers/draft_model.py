"""The draft-model proposer: a small causal LM that drafts a chain autoregressively (drafter kind
`draft_model`), with its own KV cache rolled back to what verification kept."""

from __future__ import annotations

import torch

from specdistill.decode.proposers.base import (
    CATCH_UP_SPLIT,
    Alternate,
    Proposer,
    common_prefix_len,
    register_proposer,
    stored_format,
    use_gemv_friendly_head,
    vocab_size,
)
from specdistill.decode.runner import ModelRunner, synchronized_clock
from specdistill.decode.sampling import SamplingConfig, logits_to_probs, sample
from specdistill.decode.tree import TokenTree
from specdistill.models.kernel_linear import kquant_segments, kquant_usable
from specdistill.models.packed_linear import drafting_weights, inference_weights, set_inference_weights

__all__ = ["DraftModelProposer", "build_draft_model_proposer", "check_vocab"]


class DraftModelProposer(Proposer):
    """A small causal LM that drafts a chain of `gamma` tokens autoregressively.

    Its cache holds `cached` = the tokens it has processed. After verification the sequence is the
    old one plus the accepted drafts plus the bonus token, so the cache is valid up to the longest
    common prefix with the new sequence: roll back to it (a length move) and feed the rest.

    After steps without drafting (the adaptive depth chose plain decoding) the rest is long: every
    token emitted meanwhile. Feeding it is a one-off cost of resuming, not a cost of the depth being
    drafted, so beyond CATCH_UP_SPLIT tokens it runs as its own forward, timed (`last_catch_up_s`),
    and the engine leaves it out of what the adaptive depth learns drafting costs. Charged to the
    probe that resumes, it made a 4-layer drafter's one-token probe cost a third of a target forward
    after 64 idle steps, and kept a drafter that pays when drafting steadily from ever starting.
    """

    name = "draft_model"

    def __init__(self, model: torch.nn.Module, gamma: int = 5, vocab_map: torch.Tensor | None = None,
                 eos_token_ids: set[int] = frozenset(), target_vocab: int | None = None,
                 prompt_vocab: bool = False):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if prompt_vocab and vocab_map is None:
            raise ValueError("prompt_vocab extends a reduced draft head; this drafter has the full vocabulary")
        self.runner = ModelRunner(model)
        self.gamma = self.max_depth = gamma
        self.base_map = None if vocab_map is None else vocab_map.to(self.runner.device)
        self.vocab_map = self.base_map  # [M (+ N)] this request's head index -> target id
        self.eos_token_ids = set(eos_token_ids)
        # a reduced head's probabilities are scattered into the target's vocabulary for sampling
        self.target_vocab = target_vocab or (None if vocab_map is None else int(vocab_map.max()) + 1)
        self.prompt_vocab = prompt_vocab
        self.extra_rows: torch.Tensor | None = None  # [N, D] head rows of this request's prompt-only tokens
        self.cached: list[int] = []
        self.catch_up_s = 0.0  # of the last draft_chain

    def weight_format(self) -> str:
        """What its runner reads: the formats of the GGUF blocks it computes on where the kernels take them
        ("Q4_K+Q5_0+Q6_K+Q8_0" for the 0.5B as it comes, "Q8_0" for a model trained from it), else the weights'
        format ("float16", "float32")."""
        weights = inference_weights(self.runner.model)
        blocks = sorted({b.kind for m in self.runner.model.modules() if kquant_usable(m) for b in kquant_segments(m)})
        return "+".join(blocks) if weights == "float32" and blocks else stored_format(weights, self.runner.model)

    def begin(self, prompt_ids: list[int], capacity: int) -> None:
        self.runner.start(capacity + self.gamma + 1)
        self.cached = []
        if self.prompt_vocab:
            self.extend_head_by_prompt(prompt_ids)

    def extend_head_by_prompt(self, prompt_ids: list[int]) -> None:
        """Make this request's prompt tokens draftable: the reduced head gets, for this request only, a
        row for every prompt token it lacks (answers copy names and objects from their question: 90% of
        the GSM8K answer tokens an 8k head lacks are in the prompt). A row is the drafter's input
        embedding of the token, which is the head row itself in a tied-embedding model (every SmolLM2
        truncated drafter), so such a token scores as the drafter's own untrained full head would.
        Lossless like any draft: verification decides."""
        known = set(self.base_map.tolist())
        extra = sorted({t for t in prompt_ids if t not in known})
        if not extra:
            self.vocab_map, self.extra_rows = self.base_map, None
            return
        ids = torch.tensor(extra, dtype=torch.long, device=self.runner.device)  # [N]
        embed = self.runner.model.get_input_embeddings().weight  # [V, D]
        self.extra_rows = embed.detach()[ids].float()  # [N, D]
        self.vocab_map = torch.cat([self.base_map, ids])  # [M + N]

    def propose(self, seq, max_depth, sampling, generator):
        drafts, probs, _ = self.draft_chain(seq, max_depth, sampling, generator)
        return TokenTree.chain(seq[-1], drafts, probs)

    def draft_chain(self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator,
                    alternates: int = 0) -> tuple[list[int], list[torch.Tensor | None], list[Alternate]]:
        """(drafts, q per draft, alternates): the chain after `seq`, and in greedy mode, at every
        depth d of the chain, the next `alternates` most likely tokens after the chain's own there,
        as (d, target id, log path probability: the chain's log q up to d plus the alternate's),
        best first within a depth. They cost no extra forward (the chain computed those logits), and
        a tree builder ranks them by path probability to spend its node budget where this drafter
        itself expects acceptance (as EAGLE-2 does). Sampling drafts no alternates: a deterministic
        top-k is not a draw from q, which the multi-draft rule needs."""
        depth = min(self.gamma, max_depth)
        self.catch_up_s = 0.0
        if depth <= 0:
            return [], [], []
        keep = min(common_prefix_len(self.cached, seq), len(seq) - 1)
        self.runner.cache.truncate(keep)
        behind = seq[keep:]
        if len(behind) > CATCH_UP_SPLIT:
            self.catch_up_s = self._catch_up(behind[:-1])
            behind = behind[-1:]
        logits = self._feed(behind)
        branching = alternates > 0 and sampling.greedy
        drafts, probs, others, path_logq = [], [], [], 0.0
        for i in range(depth):
            token, q = self._choose(logits, sampling, generator)
            if branching:
                path_logq = self._add_alternates(others, i, logits, alternates, path_logq)
            drafts.append(token)
            probs.append(q)
            if i == depth - 1 or token in self.eos_token_ids:
                break
            logits = self._feed([token])
        self.cached = seq + drafts[:-1]
        return drafts, probs, others

    def _add_alternates(self, out: list[Alternate], depth: int, logits: torch.Tensor, n: int,
                        path_logq: float) -> float:
        """Append the 2nd..(n+1)-th most likely tokens of [V_draft] `logits` at `depth`, scored by
        path_logq + their log q; return the path's log q through the chain's own (top-1) token."""
        logq = torch.log_softmax(logits.float(), dim=-1)  # [V_draft]
        top = logq.topk(min(n + 1, logq.shape[-1]))  # the chain's argmax first (ties: topk's order)
        ids = top.indices if self.vocab_map is None else self.vocab_map[top.indices]
        for token, lq in zip(ids[1:].tolist(), top.values[1:].tolist()):
            out.append((depth, int(token), path_logq + lq))
        return path_logq + float(top.values[0])

    def last_catch_up_s(self) -> float:
        return self.catch_up_s

    def _catch_up(self, tokens: list[int]) -> float:
        """Feed `tokens` into the cache without computing logits; the seconds it took."""
        start = synchronized_clock(self.runner.device)
        self.runner.forward(tokens, logits_rows=slice(0, 0))
        self.runner.cache.advance(len(tokens))
        return synchronized_clock(self.runner.device) - start

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        hidden, logits = self.runner.forward(tokens, logits_rows=slice(-1, None))
        self.runner.cache.advance(len(tokens))
        if self.extra_rows is None:
            return logits[0]  # [V_draft]
        extra = self.extra_rows @ hidden[-1].float()  # [N]
        return torch.cat([logits[0], extra])  # [V_draft + N]

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[int, torch.Tensor | None]:
        if sampling.greedy:
            idx = int(logits.argmax())
            return (idx if self.vocab_map is None else int(self.vocab_map[idx])), None
        q = logits_to_probs(logits.cpu(), sampling)  # [V_draft]
        if self.vocab_map is not None:
            q = q.new_zeros(self.target_vocab).scatter_(0, self.vocab_map.cpu(), q)  # [V]
        return sample(q, generator), q


def build_draft_model_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(),
                               **kw) -> DraftModelProposer:
    """A loaded draft_model drafter's proposer, checked against the target's vocabulary."""
    check_vocab(drafter.model, target_model, drafter.vocab_map)
    use_gemv_friendly_head(drafter.model)
    # fp16 weights draft at half the bytes wherever FBGEMM runs them (models.packed_linear.drafting_weights)
    set_inference_weights(drafter.model, drafting_weights(drafter.model, kw.get("drafter_weights")))
    prompt_vocab = kw.get("prompt_vocab")
    if prompt_vocab is None:  # default: what the drafter's manifest asks for
        prompt_vocab = bool((drafter.manifest.get("extra") or {}).get("prompt_vocab", False))
    return DraftModelProposer(drafter.model, gamma, drafter.vocab_map, eos_token_ids,
                              target_vocab=vocab_size(target_model),
                              prompt_vocab=prompt_vocab and drafter.vocab_map is not None)


def check_vocab(draft_model, target_model, vocab_map: torch.Tensor | None) -> None:
    """A drafter must speak the target's vocabulary: same head size, or a map into it."""
    v_target, v_draft = vocab_size(target_model), vocab_size(draft_model)
    if vocab_map is None and v_draft != v_target:
        raise ValueError(f"drafter vocabulary ({v_draft} tokens) does not match the target's ({v_target}); "
                         "train the drafter on this target or give a vocab_map")
    if vocab_map is not None:
        if vocab_map.numel() != v_draft:
            raise ValueError(f"vocab_map has {vocab_map.numel()} entries but the drafter head has {v_draft}")
        if int(vocab_map.max()) >= v_target or int(vocab_map.min()) < 0:
            raise ValueError(f"vocab_map points outside the target's vocabulary of {v_target} tokens")


register_proposer("draft_model", build_draft_model_proposer)
