"""Proposers draft candidate continuations as a token tree rooted at the last emitted token.

A proposer never decides what is emitted; the target's verification does. A proposer that is
always wrong costs time, never correctness.

This module holds what every kind shares: the Proposer interface, the vocabulary helpers, and the
registry that `build_proposer` looks drafter kinds up in. Each kind lives in a module of its own
that registers its builder at import (`register_proposer`); the package's __init__ imports them all.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from typing import Callable

import torch

from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.tree import DEFAULT_MIN_PROB, TokenTree
from specdistill.models.packed_linear import packing_supported

Alternate = tuple[int, int, float]  # (depth in the chain, target token id, log path probability)
CATCH_UP_SPLIT = 8  # a draft model fed more tokens than this at once is resuming after steps without drafting


class Proposer(ABC):
    """What the engine may ask of a proposer. Besides `propose`, a kind declares what it needs from the target's
    forwards by overriding the capabilities below (the engine reads them; it never probes for attributes):

    - `self_drafting`: it drafts from the target's states of the forward just run (Medusa, EAGLE-3); the engine
      hands them over through `observe_prefill` and `observe_verification`.
    - `feature_layers`: the target layers whose inputs those states are (EAGLE-3), instead of the last state.
    - `adds_rows`: it puts rows of its own into the target's forwards ([LA] lookahead): `max_extra_rows`,
      `prefill_rows`, `verification_rows` and `observe_rows`.
    - `regime`: which of several ways of drafting it will use next (each gets its own depth controller)."""

    name: str = "proposer"
    max_depth: int = 1  # the deepest tree it drafts; the engine may ask for less
    self_drafting: bool = False  # the engine calls observe_prefill / observe_verification after each forward
    feature_layers: list[int] | None = None  # target layers whose inputs it reads; None: the last hidden state
    adds_rows: bool = False  # the engine calls prefill_rows / verification_rows / observe_rows
    max_extra_rows: int = 0  # with adds_rows: the most rows it adds to one forward (the cache reserves them)

    def begin(self, prompt_ids: list[int], capacity: int) -> None:  # noqa: B027 (a hook, a no-op by default)
        """A new request starts; `capacity` bounds the sequence length it will reach."""

    def last_catch_up_s(self) -> float:
        """Seconds of the last propose() spent catching up on tokens emitted while it did not draft."""
        return 0.0

    def weight_format(self) -> str | None:
        """The format its drafter's linear weights draft in on this machine, resolved ("int8", "q8_0", "float16",
        "float32"; `--drafter-weights auto` decides it per drafter), for reports (decode.runtime_facts); None: it
        has no weights of its own (prompt lookup; [LA] rows run in the target's forward)."""
        return None

    def price_verification(self, seconds: Callable[[int], float] | None) -> None:  # noqa: B027 (a hook, a no-op by default)
        """The engine's measured price of verifying a tree, before each adaptive greedy step: seconds(n) is the
        expected time of the target's forward over a tree of n nodes (root included) on this machine (the
        step's controller, decode.adaptive), None while nothing is measured. A proposer whose trees come with
        calibrated node probabilities (EAGLE-3) sizes them by it; the others draft their fixed sizes."""

    def regime(self, seq: list[int]) -> tuple[str | None, int]:
        """(name, deepest draft) of the way it will draft after seq. A proposer that drafts in several ways whose
        acceptance and costs differ (WithPromptLookup: a long n-gram match's chain alone, else the inner tree)
        names them, and the engine keeps a depth controller per name; by default one unnamed way."""
        return None, self.max_depth

    def observe_prefill(self, hidden: torch.Tensor) -> None:
        """self_drafting: the prompt's rows of the prefill forward, [n, D] (or [n, len(feature_layers) x D])."""
        raise NotImplementedError(f"{type(self).__name__} is self-drafting but reads no prefill states")

    def observe_verification(self, hidden: torch.Tensor, verdict) -> None:
        """self_drafting: the tree's rows of the verification forward [N, D (or 3 x D)] and its verdict."""
        raise NotImplementedError(f"{type(self).__name__} is self-drafting but reads no verification states")

    def prefill_rows(self, prompt_len: int):
        """adds_rows: the rows (decode.runner.ExtraRows) that follow the prompt in the prefill forward."""
        raise NotImplementedError(f"{type(self).__name__} declares adds_rows but has no prefill rows")

    def verification_rows(self, tree: TokenTree, depth: int | None = None):
        """adds_rows: the rows that follow the tree in its verification forward, for a next draft up to `depth`
        deep; None: none this step."""
        raise NotImplementedError(f"{type(self).__name__} declares adds_rows but has no verification rows")

    def observe_rows(self, logits: torch.Tensor, last_node: int) -> None:
        """adds_rows: the logits [L, V] of the rows it added, and the tree node the step's accepted path ends at."""
        raise NotImplementedError(f"{type(self).__name__} declares adds_rows but reads no rows")

    @abstractmethod
    def propose(
        self, seq: list[int], max_depth: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> TokenTree:
        """Draft after `seq` (prompt + emitted tokens); the tree's root is seq[-1]."""


ProposerBuilder = Callable[..., Proposer]  # (drafter, target_model, gamma, eos_token_ids, **kw) -> Proposer
ProposerWrapper = Callable[..., Proposer]  # (inner, drafter, target_model, gamma, eos_token_ids, **kw) -> Proposer
_BUILDERS: dict[str, ProposerBuilder] = {}
_WRAPPERS: dict[str, ProposerWrapper] = {}


class QueuedFeatures:
    """For self-drafting proposers that read the target's features of each position once it is committed
    (EAGLE-3, DFlash): the prompt's rows and each verification's accepted path wait in `pending` until the
    next proposal feeds them to the drafter."""

    pending: list[torch.Tensor]

    def observe_prefill(self, features: torch.Tensor) -> None:
        """features [n, K x D]: the prompt's positions."""
        self.pending.append(features)

    def observe_verification(self, features: torch.Tensor, verdict) -> None:
        """features [N, K x D] of the verified tree; the accepted path's rows are the next positions."""
        self.pending.append(features[verdict.path])


class PricedTrees:
    """For proposers whose greedy trees are cut by path probability (EAGLE-3, DFlash; decode.tree.select_tree): the
    floor `min_prob` and the engine's price of verification, with the drafting time of the step so far."""

    def init_pricing(self, kind: str, device: torch.device, min_prob: float | None, priced: bool) -> None:
        """min_prob: the path-probability floor, in [0, 1); 0 = none, None = DEFAULT_MIN_PROB for the device (an
        error naming `kind`.min_prob otherwise). priced: trees keep only what the measured verification pays for."""
        self.min_prob = DEFAULT_MIN_PROB["cuda" if device.type == "cuda" else "cpu"] if min_prob is None \
            else float(min_prob)
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"{kind}.min_prob (the tree's path-probability floor) must be in [0, 1), got {min_prob}")
        self.min_score = math.log(self.min_prob) if self.min_prob > 0 else float("-inf")  # on log path probabilities
        self.priced = priced
        self.verify_seconds: Callable[[int], float] | None = None  # from the engine (price_verification)
        self.started = 0.0  # perf_counter() when the step's propose() began: its drafting time so far

    def price_verification(self, seconds: Callable[[int], float] | None) -> None:
        self.verify_seconds = seconds if self.priced else None

    def start_step(self) -> None:
        """Called first in propose(): the step's drafting time counts from here."""
        self.started = time.perf_counter()

    def step_seconds(self) -> Callable[[int], float] | None:
        """n -> the expected seconds of this step with a tree of n nodes: the drafting done so far (its candidates
        are on the host) plus the engine's price of verifying n nodes; None when unpriced."""
        if self.verify_seconds is None:
            return None
        drafted, verify = time.perf_counter() - self.started, self.verify_seconds
        return lambda n: drafted + verify(n)


def manifest_decoding(drafter) -> dict:
    """The drafter manifest's extra.decoding: how it asks to be decoded (a tree's depth and floor, a lookup's
    regimes); {} where it has none, or no manifest (a drafter built in code)."""
    manifest = getattr(drafter, "manifest", None) or {}
    return (manifest.get("extra") or {}).get("decoding") or {}


def pricing_options(kind: str, kw: dict, options: dict) -> dict:
    """min_prob and priced for a PricedTrees proposer: kw's `<kind>_min_prob` / `<kind>_priced`, else the drafter
    manifest's extra.decoding `options`, else None (the device's floor) and True. A min_prob of 0 is a value (no
    floor), not "unset"."""
    min_prob, priced = kw.get(f"{kind}_min_prob"), kw.get(f"{kind}_priced")
    return {"min_prob": options.get("min_prob") if min_prob is None else min_prob,
            "priced": bool(options.get("priced", True) if priced is None else priced)}


def register_proposer(kind: str, builder: ProposerBuilder) -> None:
    """Teach build_proposer a drafter kind: builder(drafter, target_model, gamma, eos_token_ids, **kw) -> Proposer."""
    _BUILDERS[kind] = builder


def register_wrapper(flag: str, wrapper: ProposerWrapper) -> None:
    """Wrap the proposer of every drafter whose attribute `flag` is true (`with_lookup`: spec
    `...+prompt_lookup`): wrapper(inner, drafter, target_model, gamma, eos_token_ids, **kw) -> Proposer."""
    _WRAPPERS[flag] = wrapper


def build_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(), **kw) -> Proposer:
    """The proposer for a loaded drafter (models.drafters.Drafter), checked against the target;
    with the drafter's `with_lookup` (spec `...+prompt_lookup`), its trees gain a prompt-lookup chain."""
    proposer = drafter_proposer(drafter, target_model, gamma, eos_token_ids, **kw)
    for flag, wrap in _WRAPPERS.items():
        if getattr(drafter, flag, False):
            proposer = wrap(proposer, drafter, target_model, gamma, eos_token_ids, **kw)
    return proposer


def drafter_proposer(drafter, target_model, gamma: int = 5, eos_token_ids: set[int] = frozenset(), **kw) -> Proposer:
    """The registered kind's proposer, unwrapped."""
    builder = _BUILDERS.get(drafter.kind)
    if builder is None:
        raise ValueError(f"no proposer for drafter kind {drafter.kind!r} (known: {', '.join(sorted(_BUILDERS))})")
    return builder(drafter, target_model, gamma, eos_token_ids, **kw)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def use_gemv_friendly_head(model: torch.nn.Module) -> None:
    """Store a CPU drafter's [V, D] head column-major (same values, transposed memory layout).

    A drafter runs its head on one row at a time; the CPU BLAS here computes x @ W.T about twice as
    fast when W.T is contiguous (measured: 4.4 ms against 8.6 ms for the 49k x 576 head), and the
    head is most of a small drafter's step. Not needed where fp32 weights are packed for oneDNN
    (models.packed_linear), which is faster still. Only for inference-time drafters: a model being trained
    keeps its layout (optimizers and DDP hold views of it)."""
    head = model.get_output_embeddings()
    if head is None or head.weight.device.type != "cpu" or head.weight.dim() != 2:
        return
    if packing_supported(model):  # the runner reads a packed copy; the layout of this one does not matter
        return
    with torch.no_grad():
        head.weight.data = head.weight.data.t().contiguous().t()


def stored_format(weights: str, module: torch.nn.Module) -> str:
    """A drafting weight format as reports name it (Proposer.weight_format): "float32", which means the parameters
    as they are (models.packed_linear.drafting_weights), becomes their dtype ("bfloat16" on a GPU)."""
    if weights != "float32":
        return weights
    return str(next(module.parameters()).dtype).removeprefix("torch.")


def vocab_size(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().weight.shape[0]

