"""The speculative decoding loop: prefill, then draft -> verify -> commit until done.

The target's cache always holds the sequence minus its last token (the "root"), which the next
verification forward feeds together with the drafted tree. With no proposer every tree is the
root alone, and the loop is plain autoregressive decoding: the baseline runs through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdistill.decode.adaptive import DraftLengthController
from specdistill.decode.metrics import RequestStats
from specdistill.decode.proposers import Proposer
from specdistill.decode.runner import ModelRunner
from specdistill.decode.sampling import (
    SamplingConfig,
    Verdict,
    logits_to_probs,
    sample,
    verify_greedy,
    verify_greedy_tokens,
    verify_sampling,
)
from specdistill.decode.step_graphs import BUCKETS
from specdistill.decode.tree import TokenTree

__all__ = ["SpeculativeEngine", "Generation", "SamplingConfig"]

_GREEDY = SamplingConfig()  # generate()'s default; frozen, so one shared instance is safe


@dataclass
class Generation:
    tokens: list[int]  # new tokens only; ends with EOS if one was emitted
    stats: RequestStats


class SpeculativeEngine:
    def __init__(self, target_model: torch.nn.Module, proposer: Proposer | None = None,
                 eos_token_ids: set[int] | frozenset = frozenset(), static_shapes: bool | None = None,
                 max_tree_nodes: int = 64, adaptive: bool = True,
                 fixed_steps: bool | None = None, one_shape: bool | None = None):
        """adaptive: in greedy mode, choose each step's draft depth by measured cost and
        acceptance (decode.adaptive). Sampling always drafts the proposer's full depth, so that a
        seed reproduces its output (timings must not steer which random draws are made).
        static_shapes, fixed_steps: see decode.runner.ModelRunner (by default both on CUDA: CUDA graphs).
        one_shape: every target forward of up to max_tree_nodes rows, plain decoding's one-row steps included, runs
        as a step of exactly that many rows, so that every token's projections come from the same kernels; the
        default for a bf16/fp16 target on CUDA, where a row's rounding depends on the forward's row count and
        speculation would otherwise leave plain decoding's output (decode.step_graphs has the measured effect,
        and the residual case of trees)."""
        param = next(target_model.parameters())
        if one_shape is None:
            one_shape = param.device.type == "cuda" and param.dtype in (torch.bfloat16, torch.float16)
        self.one_shape = one_shape
        buckets = (max_tree_nodes,) if one_shape else BUCKETS
        self.target = ModelRunner(target_model, static_shapes=static_shapes, fixed_steps=fixed_steps,
                                  step_buckets=buckets)
        self.proposer = proposer
        self.eos_token_ids = set(eos_token_ids)
        self.max_tree_nodes = max_tree_nodes
        # a self-drafting proposer (decode.proposers.medusa) reads the target's hidden states after each forward
        self.self_drafting = proposer is not None and proposer.self_drafting
        # an EAGLE-3 proposer (decode.proposers.eagle3) reads the inputs of some target layers, not the last state
        self.target.feature_layers = list(proposer.feature_layers or []) if proposer is not None else []
        # a lookahead proposer (decode.proposers.lookahead) adds rows fed by embedding to the target forwards
        # whose next step may draft, and reads the next proposals from them: `prefill_rows`, `verification_rows`,
        # `observe_rows`
        self.lookahead = proposer is not None and proposer.adds_rows
        # one controller per drafting regime (see regime()); `controller` is the proposer's only or default one
        self.controllers: dict[str | None, DraftLengthController] = {}
        self.controller = self.controller_for(None, proposer.max_depth) if proposer is not None and adaptive else None

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingConfig = _GREEDY,
                 on_emit: Callable[[list[int]], bool | None] | None = None) -> Generation:
        """on_emit(new_tokens) is called after every step with the tokens it emitted (for
        streaming); returning True stops generation there (a stop sequence was produced)."""
        check_request(prompt_ids, max_new_tokens)
        stats = RequestStats()
        generator = make_generator(sampling, self.target.device)
        start = time.perf_counter()
        seq = list(prompt_ids)  # prompt + emitted tokens, grown in place
        emitted = [self.prefill(seq, max_new_tokens, sampling, generator)]
        seq += emitted
        stats.target_forwards = 1
        stop = self.notify(on_emit, emitted, 0, max_new_tokens)
        while not stop and not self.finished(emitted, len(seq) - len(prompt_ids), max_new_tokens):
            n_out = len(seq) - len(prompt_ids)
            emitted = self.step(seq, max_new_tokens - n_out, sampling, generator, stats)
            seq += emitted
            stop = self.notify(on_emit, emitted, n_out, max_new_tokens)
        out = truncate_at_eos(seq[len(prompt_ids):], self.eos_token_ids)[:max_new_tokens]
        stats.new_tokens = len(out)
        stats.total_time_s = time.perf_counter() - start
        return Generation(out, stats)

    def notify(self, on_emit, emitted: list[int], n_before: int, max_new_tokens: int) -> bool:
        """Hand a step's visible tokens (cut at EOS and at max_new_tokens) to on_emit."""
        if on_emit is None:
            return False
        visible = truncate_at_eos(emitted, self.eos_token_ids)[:max_new_tokens - n_before]
        return bool(on_emit(visible))

    def prefill(self, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> int:
        """Run the prompt through the target and emit the first new token."""
        n = len(prompt)
        extra_rows = self.proposer.max_extra_rows if self.lookahead else 0
        capacity = n + max_new_tokens + self.max_tree_nodes + 1 + extra_rows
        self.target.start(capacity)
        if self.proposer is not None:
            self.proposer.begin(prompt, capacity)
        extra = self.proposer.prefill_rows(n) if self.lookahead else None
        if sampling.greedy and extra is None:  # the next token alone (runner.forward_greedy: no logits needed)
            hidden, best = self.target.forward_greedy(prompt, logits_rows=slice(n - 1, None))  # [T, D], [1]
        else:  # the last prompt row's logits, and the [LA] rows' in the same head call
            hidden, logits = self.target.forward(prompt, logits_rows=slice(n - 1, None),
                                                 extra=extra)  # [T(+L), D], [1(+L), V]
        self.target.cache.advance(n)  # the first emitted token becomes the first root; extra rows stay uncommitted
        if self.self_drafting:
            # the last row is the state the first emitted token comes from
            self.proposer.observe_prefill(self.drafting_states(hidden)[:n])
        if sampling.greedy and extra is None:
            return int(best[0])
        if extra is not None:
            self.proposer.observe_rows(logits[1:], n - 1)
        return pick_token(logits[0], sampling, generator)

    def step(self, seq: list[int], remaining: int, sampling: SamplingConfig,
             generator: torch.Generator | None, stats: RequestStats) -> list[int]:
        """One target forward: draft a tree after seq, verify it, commit the accepted path.
        Returns the emitted tokens (accepted drafts + the bonus token)."""
        adapt = self.controller is not None and sampling.greedy
        controller = self.controller_for(*self.regime(seq)) if adapt else None
        depth = controller.choose(remaining - 1) if adapt else remaining - 1
        if adapt:  # a proposer that sizes its trees by what verification costs here
            self.proposer.price_verification(controller.predicted_verify_cost if controller.verify_cost else None)
        t0 = time.perf_counter()
        tree = self.draft(seq, depth, sampling, generator)
        t1 = time.perf_counter()
        n = len(tree)
        # [LA] chains as deep as the next step can draft: its proposals, without rows it won't use
        extra = self.proposer.verification_rows(tree, self.next_depth_bound(depth, remaining, controller)) \
            if self.lookahead else None
        if sampling.greedy and extra is None:  # each row's next token alone (runner.forward_greedy)
            hidden, best = self.target.forward_greedy(tree.tokens, tree.depths, tree.ancestor_mask())  # [N, D], [N]
            verdict = verify_greedy_tokens(tree, best.tolist())
        else:
            hidden, logits = self.target.forward(tree.tokens, tree.depths, tree.ancestor_mask(),
                                                 logits_rows=slice(0, None), extra=extra)  # [N(+L), D], [N(+L), V]
            verdict = verify(tree, logits[:n], sampling, generator)
        self.target.cache.commit_path(verdict.path)  # tree nodes only: extra rows lie past them, uncommitted
        if self.self_drafting:  # Medusa, EAGLE-3: the next proposals come from this forward's hidden states
            self.proposer.observe_verification(self.drafting_states(hidden)[:n], verdict)
        if extra is not None:  # [LA]: the next proposals come from the rows under the last accepted node
            self.proposer.observe_rows(logits[n:], verdict.path[-1])
        sync(self.target.device)
        t2 = time.perf_counter()
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
        stats.record_step(tree.max_depth, len(verdict.path) - 1)
        if adapt:  # resuming after plain-decoding steps is a one-off, not a cost of this depth
            draft_s = t1 - t0 - (self.proposer.last_catch_up_s() if depth > 0 else 0.0)  # drafted iff depth > 0
            controller.observe(tree.max_depth, len(verdict.path) - 1, len(tree), draft_s, t2 - t1)
        return [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]

    def drafting_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a self-drafting proposer reads per row: the last hidden states [N, D] (Medusa), or the
        fused layers' inputs [N, 3 x D] (EAGLE-3), both from the forward just run."""
        return self.target.features if self.target.feature_layers else hidden

    def next_depth_bound(self, depth: int, remaining: int, controller: DraftLengthController | None) -> int:
        """How deep the next step may draft: what the controller would choose (its probes included),
        else one deeper than this step, which drafts the proposer's full depth anyway."""
        if controller is not None:
            return controller.next_step_bound(remaining - 2)  # this step emits at least one token
        return depth + 1

    def regime(self, seq: list[int]) -> tuple[str | None, int]:
        """(name, deepest draft) of the way the proposer will draft after seq (Proposer.regime). Each name gets a
        controller of its own, so that the depth chosen for one way is not priced by another's acceptance."""
        return self.proposer.regime(seq)

    def controller_for(self, name: str | None, max_depth: int) -> DraftLengthController:
        if name not in self.controllers:
            self.controllers[name] = DraftLengthController(max_depth=max_depth)
        return self.controllers[name]

    def draft(self, seq: list[int], max_depth: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> TokenTree:
        if self.proposer is None or max_depth <= 0:
            return TokenTree.root(seq[-1])
        tree = self.proposer.propose(seq, max_depth, sampling, generator)
        if len(tree) > self.max_tree_nodes:
            raise ValueError(f"proposer {self.proposer.name} drafted {len(tree)} nodes, "
                             f"more than max_tree_nodes={self.max_tree_nodes}")
        return tree

    def finished(self, emitted: list[int], n_out: int, max_new_tokens: int) -> bool:
        """Done when max_new_tokens are out or the last step emitted an EOS (earlier steps had none)."""
        return n_out >= max_new_tokens or any(t in self.eos_token_ids for t in emitted)


def verify(tree: TokenTree, logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None) -> Verdict:
    if sampling.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampling, generator)


def pick_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """[V] logits -> the token plain decoding would emit."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample(logits_to_probs(logits.cpu(), sampling), generator)


def make_generator(sampling: SamplingConfig, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    return torch.Generator(device="cpu").manual_seed(sampling.seed)


def truncate_at_eos(tokens: list[int], eos_token_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def check_request(prompt_ids: list[int], max_new_tokens: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed to start generation")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def sync(device: torch.device) -> None:
    """Wait for queued kernels so that wall-clock timings are honest on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
