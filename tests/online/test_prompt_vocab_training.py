"""Training and judging a reduced head as the engine drafts with prompt_vocab: the extended logits are the
engine's scores, ids index each row's own extension, the daemon's simulated acceptance is the engine's, and
an update with it learns tokens a fixed reduced head can never propose."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer
from specdistill.distill.batching import collate
from specdistill.distill.prompt_vocab import (
    extended_logits,
    extra_id_matrix,
    indices_to_target,
    prompt_only_tokens,
    with_prompt_vocab,
)
from specdistill.distill.replay import Entry, ReplayBuffer
from specdistill.distill.vocab import inverse_map
from specdistill.models.draft_models import reduce_head
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_learn import acceptance, score_requests, train_candidate
from tests.conftest import make_tiny_llama

V = 64
PROMPT = list(range(1, 48, 2))  # 24 distinct odd tokens


@pytest.fixture(scope="module")
def tied_target():
    return make_tiny_llama(seed=5, layers=2, tie=True).eval()


def without(tokens) -> torch.Tensor:
    drop = set(tokens)
    return torch.tensor([t for t in range(V) if t not in drop])


def reduced(model, vocab_map):
    return reduce_head(copy.deepcopy(model), vocab_map).eval()


def noisy(model, scale: float, seed: int = 0):
    """The model with its final norm's gains perturbed: embeddings (and so the tie) untouched, agreement partial."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = out.model.norm.weight
        w.mul_(1 + scale * torch.randn(w.shape, generator=gen))
    return out


def test_extended_logits_are_the_tied_full_heads_and_the_engines(tied_target):
    base = without(PROMPT[:10])
    drafter = reduced(tied_target, base)
    extra = extra_id_matrix([prompt_only_tokens(PROMPT, set(base.tolist()))])  # [1, 10]
    assert extra[0].tolist() == PROMPT[:10]
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        got = extended_logits(drafter, ids, torch.ones_like(ids), extra)[0]  # [T, M + N]
        full = tied_target(ids).logits[0]  # [T, V]
        proposer = DraftModelProposer(drafter, gamma=2, vocab_map=base, target_vocab=V, prompt_vocab=True)
        proposer.begin(PROMPT, 64)
        engine_last = proposer._feed(PROMPT)  # [M + N]
    order = torch.cat([base, extra[0]])
    assert torch.allclose(got[-1], full[-1, order], atol=1e-4)  # the answer's first position: every column open
    assert torch.allclose(got[-1], engine_last, atol=1e-4)
    best = got[-1:].argmax(-1)[None]  # [1, 1] an index into the extended head
    assert indices_to_target(best, base, extra).item() == int(order[full[-1, order].argmax()])
    # inside the prompt, a prompt-only token's column opens where the text first reads it (PROMPT[j] at j)
    for t in range(len(PROMPT)):
        opened = got[t, len(base):]
        assert torch.isinf(opened[t + 1:]).all()
        assert torch.allclose(opened[:t + 1], full[t, PROMPT[:10]][:t + 1], atol=1e-4)
        assert torch.allclose(got[t, :len(base)], full[t, base], atol=1e-4)


def test_ids_index_their_own_rows_extension_only():
    base = without([5, 7, 9])  # M = 61
    inverse = inverse_map(base, V)
    records = [{"prompt_ids": [5, 2], "response_ids": [5, 7], "topk_ids": [[5, 9], [7, 5]],
                "topk_logprobs": [[-0.1, -3.0], [-0.2, -2.0]]},
               {"prompt_ids": [7, 9, 2], "response_ids": [5, 9], "topk_ids": [[5, 9], [9, 7]],
                "topk_logprobs": [[-0.1, -3.0], [-0.2, -2.0]]}]
    batch = collate(with_prompt_vocab(records, base), 0, 16, inverse)
    assert batch.extra_ids.tolist() == [[5, -1], [7, 9]]
    absent = 61 + 2
    # row 0 (extension [5]): 5 -> 61, 7 and 9 absent; its label 7 leaves the loss
    assert batch.topk_ids[0, 1].tolist() == [61, absent] and batch.topk_ids[0, 2].tolist() == [absent, 61]
    assert batch.labels[0, 1] == 61 and not bool(batch.loss_mask[0, 2])
    # row 1 (extension [7, 9]): 7 -> 61, 9 -> 62, 5 absent; its label 5 leaves the loss, 9 stays
    assert batch.topk_ids[1, 2].tolist() == [absent, 62] and batch.topk_ids[1, 3].tolist() == [62, 61]
    assert not bool(batch.loss_mask[1, 2]) and batch.labels[1, 3] == 62 and bool(batch.loss_mask[1, 3])
    assert float(batch.topk_logprobs[1, 2, 0]) == float("-inf")
    with pytest.raises(ValueError, match="extra_vocab"):
        collate(with_prompt_vocab(records, base), 0, 16)  # a full head has nothing to extend


def test_a_prompt_only_id_is_absent_where_its_column_is_still_closed():
    """Positions inside the prompt (prompt_weight) predict the prompt's next token: before the text has read
    a prompt-only token its column is -inf, so there the id is absent (tail bucket, label out of the loss)."""
    base = without([5, 7, 9])  # M = 61
    # prompt [2, 5, 5, 7] moved to the trained side as Entry.record(prompt_weight) does, then the output [7]
    records = [{"prompt_ids": [2], "response_ids": [5, 5, 7, 7], "topk_ids": [[5, 7], [5, 7], [7, 5], [7, 5]],
                "topk_logprobs": [[-0.1, -3.0]] * 4, "weights": [1.0, 1.0, 1.0, 1.0]}]
    batch = collate(with_prompt_vocab(records, base, prompts=[[2, 5, 5, 7]]), 0, 16, inverse_map(base, V))
    assert batch.extra_ids.tolist() == [[5, 7]]
    col5, col7, absent = 61, 62, 63
    # position 0 reads [2]: neither 5 nor 7 read yet; position 1 reads 5; position 3 reads 7 too
    assert batch.topk_ids[0, 0].tolist() == [absent, absent] and not bool(batch.loss_mask[0, 0])
    assert batch.topk_ids[0, 1].tolist() == [col5, absent] and batch.labels[0, 1] == col5
    assert batch.topk_ids[0, 2].tolist() == [absent, col5] and not bool(batch.loss_mask[0, 2])
    assert batch.topk_ids[0, 3].tolist() == [col7, col5] and batch.labels[0, 3] == col7
    assert torch.isinf(batch.topk_logprobs[0, 0]).all() and torch.isfinite(batch.topk_logprobs[0, 3]).all()


def prompt_position_batches(tied_target):
    """(drafter, a fresh batch each call): 4 requests scored at their prompt positions too, with the head
    extended by each prompt's tokens. Prompt-only tokens' first appearances are in it."""
    base = without(PROMPT)
    drafter = reduced(noisy(tied_target, 1.0), base)
    prompts = [[52, 53] + PROMPT[i:i + 8] for i in range(0, 16, 4)]
    records = [{"id": str(i), "prompt_ids": p, "output_ids": p[2:6], "sampling": {"max_tokens": 4}}
               for i, p in enumerate(prompts)]
    entries = score_requests(SimpleNamespace(model=tied_target), records, k=4, pad_id=0, with_prompt=True)

    def batch():
        rows = with_prompt_vocab([e.record(1.0, 64) for e in entries], base, prompts=[e.prompt_ids for e in entries])
        return collate(rows, 0, 64, inverse_map(base, V))

    return drafter, batch


@pytest.mark.parametrize("loss", ["fkl", "rkl", "ce"])
def test_the_daemons_loss_stays_bounded_with_prompt_weight_and_prompt_vocab(tied_target, loss):
    """Every batch with prompt positions holds some prompt-only token's first appearance; a target id
    mapped to its still-closed (-inf) column made the loss infinite (fkl 2e36 here: the losses' floor of -inf)."""
    from specdistill.train.online_learn import kd_step_loss

    drafter, batch = prompt_position_batches(tied_target)
    value = kd_step_loss(drafter, batch(), loss, 0.5, 0.25)
    assert 0 < float(value) < 20  # a divergence between two real distributions of a tiny model, not a floored inf


def test_ce_leaves_out_a_greedy_token_the_head_cannot_draft(tied_target):
    """At a prompt position the label is the prompt's next token (in the head), yet the target's greedy
    token there may be outside it (the absent column): ce on it was -log 0 = inf. It must leave the loss,
    which then equals the loss over the other positions."""
    from specdistill.train.online_learn import kd_step_loss

    drafter, batch = prompt_position_batches(tied_target)
    plain = batch()
    position = tuple(int(i) for i in plain.loss_mask.nonzero()[0])  # a position in the loss
    absent = V - len(PROMPT) + plain.extra_ids.shape[1]  # the head's M + N columns; the absent one is next
    moved = batch()
    moved.topk_ids[position][0] = absent  # the target's greedy token there: outside the head
    dropped = batch()
    dropped.loss_mask[position] = False
    got = kd_step_loss(drafter, moved, "ce", 0.5, 1.0)
    assert torch.isfinite(got)
    assert torch.allclose(got, kd_step_loss(drafter, dropped, "ce", 0.5, 1.0), atol=1e-6)


def engine_and_simulation(target_model, drafter, base, prompts, max_new, gamma, prompt_vocab):
    proposer = DraftModelProposer(drafter, gamma=gamma, vocab_map=base, target_vocab=V, prompt_vocab=prompt_vocab)
    engine = SpeculativeEngine(target_model, proposer, set(), adaptive=False)
    gens = [engine.generate(p, max_new) for p in prompts]
    records = [{"id": str(i), "prompt_ids": p, "output_ids": g.tokens, "sampling": {"max_tokens": max_new}}
               for i, (p, g) in enumerate(zip(prompts, gens))]
    entries = score_requests(SimpleNamespace(model=target_model), records, k=4, pad_id=0)
    return gens, entries, acceptance(drafter, base, entries, 0, 128, gamma, prompt_vocab=prompt_vocab)


@pytest.mark.parametrize("gamma", [2, 4])
def test_simulated_acceptance_with_prompt_vocab_is_the_engines(tied_target, gamma):
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(0, 24, 4)]
    base = without(PROMPT)
    drafter = reduced(noisy(tied_target, 2.0), base)
    got = {}
    for on in (False, True):
        gens, _, sim = engine_and_simulation(tied_target, drafter, base, prompts, 20, gamma, on)
        assert sim["drafted"] == sum(g.stats.drafted for g in gens)
        assert sim["accepted"] == sum(g.stats.accepted for g in gens)
        got[on] = sim["alpha"]
    assert 0 < got[True] < 1 and got[True] > got[False]


def copy_entries(n: int, seed: int = 0) -> list[Entry]:
    """Requests whose answer alternates the prompt's one odd token with 50: a reduced head without the odd
    tokens can never propose it, and an untrained drafter does not know to."""
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        odd = rng.choice(PROMPT)
        prompt = rng.choices(range(52, 64), k=10)
        prompt.insert(rng.randrange(11), odd)
        answer = [odd, 50] * 4
        topk = [[t] + [o for o in (49, 50, 51, 52) if o != t][:3] for t in answer]
        entries.append(Entry(f"r{i}", prompt, answer, topk, [[-0.05, -4.0, -4.0, -4.0]] * 8))
    return entries


def test_an_update_with_prompt_vocab_learns_tokens_the_fixed_head_cannot():
    """Same stream, same steps: trained and judged with the prompt's tokens draftable, acceptance rises well
    above the untrained drafter's, where training without them cannot move it from 0."""
    base = without(PROMPT)
    start = reduced(make_tiny_llama(seed=9, layers=1), base)
    buffer = ReplayBuffer(capacity=100, holdout_capacity=100)
    for i, e in enumerate(copy_entries(60)):
        buffer.add(e, held_out=i % 5 == 0)
    holdout = list(buffer.holdout)
    cfg = OnlineConfig(log_dir="x", store="y", work_dir="z", steps_per_update=150, lr=3e-3, batch_size=8,
                       max_seq_len=64)
    alpha = {"untrained": acceptance(start, base, holdout, 0, 64, 3, prompt_vocab=True)["alpha"]}
    for on in (False, True):
        drafter = copy.deepcopy(start).requires_grad_(True)
        train_candidate(drafter, inverse_map(base, V), buffer, [], cfg, 0, random.Random(1), prompt_vocab=on)
        alpha[on] = acceptance(drafter, base, holdout, 0, 64, 3, prompt_vocab=on)["alpha"]
    assert alpha[True] > alpha["untrained"] + 0.3 and alpha[True] > alpha[False] + 0.2


def test_train_candidate_refuses_prompt_vocab_on_a_full_head(tied_target):
    cfg = OnlineConfig(log_dir="x", store="y", work_dir="z")
    with pytest.raises(ValueError, match="full vocabulary"):
        train_candidate(copy.deepcopy(tied_target), None, ReplayBuffer(4, 0), [], cfg, 0, random.Random(0),
                        prompt_vocab=True)


def test_the_daemon_follows_the_served_manifest_unless_told():
    from specdistill.train.config import ConfigError
    from specdistill.train.online import resolve_prompt_vocab

    reduced_on = SimpleNamespace(vocab_map=without(PROMPT), manifest={"extra": {"prompt_vocab": True}})
    reduced_off = SimpleNamespace(vocab_map=without(PROMPT), manifest={"extra": {}})
    full_on = SimpleNamespace(vocab_map=None, manifest={"extra": {"prompt_vocab": True}})
    assert resolve_prompt_vocab("manifest", reduced_on) is True
    assert resolve_prompt_vocab("manifest", reduced_off) is False
    assert resolve_prompt_vocab("off", reduced_on) is False
    assert resolve_prompt_vocab("on", reduced_off) is True
    assert resolve_prompt_vocab("manifest", full_on) is False  # the engine ignores it for a full head too
    with pytest.raises(ConfigError, match="prompt_vocab"):
        resolve_prompt_vocab("on", full_on)
    with pytest.raises(ConfigError, match="prompt_vocab"):
        OnlineConfig(log_dir="x", store="y", work_dir="z", prompt_vocab="yes")
