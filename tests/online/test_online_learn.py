"""The daemon's held-out acceptance equals the engine's, and its KD update moves the drafter toward the target."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer
from specdistill.distill.batching import collate
from specdistill.distill.replay import Entry, ReplayBuffer, is_held_out, mismatch_priority
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_learn import (
    acceptance,
    kd_step_loss,
    score_requests,
    simulate_chain_acceptance,
    train_candidate,
)
from tests.conftest import make_tiny_llama
from tests.online.support import VOCAB, make_target, prompt_for


@pytest.fixture(scope="module")
def target():
    target = make_target()
    target.eos_token_ids.clear()  # no EOS: outputs run to max_new_tokens, where the simulation is exact
    return target


def half_right_drafter(target, noise: float = 1.0):
    """The target with a noisy head: it agrees with the target often, not always."""
    drafter = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head = drafter.get_output_embeddings().weight
        head.add_(noise * head.std() * torch.randn(head.shape, generator=gen))
    return drafter


def generate(target, drafter, prompts, max_new, gamma):
    engine = SpeculativeEngine(target.model, DraftModelProposer(drafter, gamma=gamma), set(), adaptive=False)
    return [engine.generate(p, max_new) for p in prompts]


@pytest.mark.parametrize("gamma,max_new", [(1, 9), (3, 17), (5, 24)])
def test_simulated_acceptance_equals_the_engines(target, gamma, max_new):
    drafter = half_right_drafter(target)
    prompts = [prompt_for(i) for i in range(6)]
    gens = generate(target, drafter, prompts, max_new, gamma)
    records = [{"id": str(i), "prompt_ids": p, "output_ids": g.tokens, "sampling": {"max_tokens": max_new}}
               for i, (p, g) in enumerate(zip(prompts, gens))]
    entries = score_requests(target, records, k=4, pad_id=0)
    got = acceptance(drafter, None, entries, pad_id=0, max_len=128, gamma=gamma)
    assert got["drafted"] == sum(g.stats.drafted for g in gens)
    assert got["accepted"] == sum(g.stats.accepted for g in gens)
    assert 0 < got["accepted"] < got["drafted"], "the case must exercise both outcomes"


def test_simulation_counts_a_full_run_and_stops_at_the_limit():
    assert simulate_chain_acceptance([True] * 11, max_new_tokens=11, gamma=4) == (8, 8)  # 1 + (4+1) + (4+1) = 11
    assert simulate_chain_acceptance([True] + [False] * 4, max_new_tokens=5, gamma=2) == (5, 0)


@pytest.mark.parametrize("loss", ["fkl", "ce"])
def test_an_update_raises_held_out_acceptance_and_never_touches_the_target(target, loss):
    before_target = {k: v.clone() for k, v in target.model.state_dict().items()}
    drafter = make_tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=3)
    prompts = [prompt_for(i) for i in range(48)]
    gens = generate(target, drafter, prompts, 12, 3)
    records = [{"id": f"r{i}", "prompt_ids": p, "output_ids": g.tokens} for i, (p, g) in enumerate(zip(prompts, gens))]
    entries = score_requests(target, records, k=8, pad_id=0)
    buffer = ReplayBuffer(capacity=100, holdout_capacity=100)
    for e in entries:
        buffer.add(e, held_out=is_held_out(e.id, 4))
    holdout = list(buffer.holdout)
    assert 4 <= len(holdout) <= 24
    cfg = OnlineConfig(log_dir="x", store="y", work_dir="z", steps_per_update=60, lr=3e-3, batch_size=8, max_seq_len=64,
                       loss=loss)
    base = acceptance(drafter, None, holdout, 0, 64, 3)["alpha"]
    train_candidate(drafter.requires_grad_(True), None, buffer, [], cfg, 0, random.Random(0))
    after = acceptance(drafter, None, holdout, 0, 64, 3)["alpha"]
    assert after > base + 0.1
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, before_target[k]), k


def test_ce_loss_is_the_cross_entropy_of_the_targets_greedy_token(target):
    drafter = half_right_drafter(target)
    prompts = [prompt_for(i) for i in range(3)]
    records = [{"id": str(i), "prompt_ids": p, "output_ids": g.tokens}
               for i, (p, g) in enumerate(zip(prompts, generate(target, drafter, prompts, 7, 2)))]
    batch = collate([e.record() for e in score_requests(target, records, k=4, pad_id=0)], 0, 64)
    logits = drafter(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
    nll = -torch.log_softmax(logits, -1).gather(-1, batch.topk_ids[..., :1])[..., 0]  # [B, T]
    expected = nll[batch.loss_mask].mean()
    got = kd_step_loss(drafter, batch, "ce", mix_weight=0.5, right_weight=1.0)
    assert torch.allclose(got, expected, atol=1e-5)
    # positions the drafter already gets right weigh right_weight
    right = (logits.argmax(-1) == batch.topk_ids[..., 0]) & batch.loss_mask
    assert 0 < int(right.sum()) < int(batch.loss_mask.sum())
    w = torch.where(right, 0.25, 1.0)[batch.loss_mask]
    weighted = kd_step_loss(drafter, batch, "ce", mix_weight=0.5, right_weight=0.25)
    assert torch.allclose(weighted, (nll[batch.loss_mask] * w).sum() / w.sum(), atol=1e-5)


def prompt_scored_records(target, n: int = 3, max_new: int = 6) -> list[dict]:
    drafter = half_right_drafter(target)
    prompts = [prompt_for(i) for i in range(n)]
    return [{"id": str(i), "prompt_ids": p, "output_ids": g.tokens}
            for i, (p, g) in enumerate(zip(prompts, generate(target, drafter, prompts, max_new, 2)))]


def test_prompt_scoring_adds_prompt_positions_and_leaves_the_outputs_top_k_unchanged(target):
    records = prompt_scored_records(target)
    plain = score_requests(target, records, k=4, pad_id=0)
    both = score_requests(target, records, k=4, pad_id=0, with_prompt=True)
    for rec, a, b in zip(records, plain, both):
        assert a.prompt_topk_ids == [] and len(b.prompt_topk_ids) == len(rec["prompt_ids"]) - 1
        assert a.topk_ids == b.topk_ids
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-5)
    # the prompt's top-k is the target's own next-token distribution over the prompt
    full = target.model(input_ids=torch.tensor([records[0]["prompt_ids"]])).logits[0].log_softmax(-1)  # [P, V]
    expected = full[:-1].topk(4, -1).indices.tolist()
    assert both[0].prompt_topk_ids == expected


def test_prompt_record_keeps_the_sequence_and_weighs_prompt_positions(target):
    entry = score_requests(target, prompt_scored_records(target, n=1), k=4, pad_id=0, with_prompt=True)[0]
    n_prompt, n_out = len(entry.prompt_ids), len(entry.response_ids)
    rec = entry.record(prompt_weight=0.5)
    assert rec["prompt_ids"] + rec["response_ids"] == entry.prompt_ids + entry.response_ids
    assert rec["weights"] == [0.5] * (n_prompt - 1) + [1.0] * n_out
    assert len(rec["topk_ids"]) == len(rec["response_ids"])
    assert entry.record() == entry.record(prompt_weight=0.0) and "weights" not in entry.record()
    # too long for max_len: the oldest prompt positions go, never the output
    cut = entry.record(prompt_weight=0.5, max_len=n_out + 3)
    assert cut["response_ids"] == entry.prompt_ids[-2:] + entry.response_ids
    assert cut["weights"] == [0.5, 0.5] + [1.0] * n_out
    assert cut["topk_ids"] == entry.prompt_topk_ids[-2:] + entry.topk_ids
    batch = collate([cut], 0, n_out + 3)
    assert batch.input_ids.shape[1] == n_out + 3 and int(batch.loss_mask.sum()) == n_out + 2


def test_prompt_weight_zero_positions_leave_the_loss_of_the_outputs_alone(target):
    entries = score_requests(target, prompt_scored_records(target), k=4, pad_id=0, with_prompt=True)
    drafter = half_right_drafter(target)
    outputs_only = kd_step_loss(drafter, collate([e.record() for e in entries], 0, 64), "fkl", 0.5, 0.25)
    # prompt positions present but weighing (almost) nothing: the outputs' loss
    tiny = kd_step_loss(drafter, collate([e.record(1e-9) for e in entries], 0, 64), "fkl", 0.5, 0.25)
    assert torch.allclose(outputs_only, tiny, atol=1e-5)
    weighted = kd_step_loss(drafter, collate([e.record(1.0) for e in entries], 0, 64), "fkl", 0.5, 0.25)
    assert not torch.allclose(outputs_only, weighted, atol=1e-3)


def test_a_negative_prompt_weight_is_refused():
    from specdistill.train.config import ConfigError
    with pytest.raises(ConfigError, match="prompt_weight"):
        OnlineConfig(log_dir="x", store="y", work_dir="z", prompt_weight=-1.0)


def test_replay_buffer_evicts_oldest_and_samples_by_priority():
    buf = ReplayBuffer(capacity=3, holdout_capacity=1)
    entries = [Entry(f"e{i}", [1], [2], [[2]], [[0.0]], priority=p) for i, p in enumerate([1, 1, 1, 50])]
    evicted = [x for e in entries for x in buf.add(e, held_out=False)]
    assert evicted == ["e0"] and list(buf.train) == ["e1", "e2", "e3"]
    draws = [e.id for e in buf.sample(1000, random.Random(0))]
    assert draws.count("e3") > 900
    assert mismatch_priority([1, 2, 3], [1, 0, 0]) == 3.0
    assert is_held_out("abc", 0) is False
    assert [is_held_out(f"id{i}", 5) for i in range(200)].count(True) in range(20, 60)
