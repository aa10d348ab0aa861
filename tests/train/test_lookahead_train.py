"""[LA] training end to end on a tiny peaked target: the [LA] rows of the training forward are those of
plain PaSS decoding, only the embeddings change, acceptance rises, and the trained drafter decodes
losslessly through the drafter directory."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.decode.proposers.lookahead import LookaheadProposer
from specdistill.distill.batching import collate
from specdistill.models.drafters import load_drafter
from specdistill.models.lookahead import LookaheadTokens
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from specdistill.train.lookahead import (
    Insertions,
    LookaheadConfig,
    lookahead_logits,
    measure_acceptance,
    sample_insertions,
    train_lookahead,
)
from tests.train.support import greedy_records, peaked_tiny_target

VOCAB = 24  # a small vocabulary: the peaked target's generations settle on few tokens, learnable by k x D numbers
K = 3


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_target(VOCAB, seed=1)


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target, VOCAB)


def lookahead_config(tmp_path, **overrides) -> DistillConfig:
    fields = dict(method="lookahead", output_dir=str(tmp_path / "lookahead"), work_dir=str(tmp_path / "work"),
                  batch_size=8, max_steps=60, lr=0.05, warmup_steps=2, log_every=10, max_seq_len=48, seed=0,
                  eval_every=20, eval_max_new_tokens=16)
    fields.update(overrides)
    section = LookaheadConfig(tokens=K, insertions=6, chains=K + 1, branches=2, kl_weight=0.0)
    return DistillConfig(**fields, lookahead=section)


def held_out_prompts(records):
    return [r["prompt_ids"] for r in records[32:]]


@pytest.fixture(scope="module")
def trained(target, records, tmp_path_factory):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    out = train_lookahead(lookahead_config(tmp_path_factory.mktemp("la")), Accelerator(cpu=True), target,
                          records[:32], held_out_prompts(records))
    return out, before


def test_training_forward_gives_the_la_rows_of_plain_decoding(target, records):
    """LA_j of a group inserted at t, trained in a batch with other groups and sequences, has the logits of
    a plain causal forward of tokens 0..t followed by LA_1..LA_k; the KL's target logits are the target's
    own at t + j."""
    tokens = LookaheadTokens.from_target(target.model, K, seed=0, noise=1.0)
    batch = collate(records[:4], 0, 48)
    groups = sample_insertions(batch, 5, K, torch.Generator().manual_seed(0))
    with torch.no_grad():
        la_logits, target_logits = lookahead_logits(target.model, tokens(), batch, groups, with_target=True)
        full = target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
        for row, group in [(0, 0), (1, 3), (3, 4)]:
            t = int(groups.t[row, group])
            assert groups.valid[row, group, 0]
            embeds = torch.cat([target.model.get_input_embeddings()(batch.input_ids[row, :t + 1])[None],
                                tokens()[None]], dim=1)
            plain = target.model(inputs_embeds=embeds).logits[0, t + 1:]  # [K, V]
            rows = slice(group * K, (group + 1) * K)
            torch.testing.assert_close(la_logits[row, rows], plain, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(target_logits[row, rows][0], full[row, t + 1], rtol=1e-4, atol=1e-3)


def test_insertions_only_where_labels_exist(records):
    batch = collate(records[:6], 0, 48)
    groups = sample_insertions(batch, 50, K, torch.Generator().manual_seed(1))
    lengths = batch.attention_mask.sum(-1)
    for row in range(6):
        chosen = groups.valid[row, :, 0]
        assert int(chosen.sum()) == int(batch.loss_mask[row].sum()) - 1  # every response position but the last
        for t, ok in zip(groups.t[row].tolist(), groups.valid[row].tolist()):
            assert ok == [bool(ok[0]) and t + 1 + j < int(lengths[row]) for j in range(1, K + 1)]
    assert isinstance(groups, Insertions)


def test_training_changes_only_the_embeddings(target, trained):
    out, before = trained
    after = target.model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name  # bit for bit
    drafter = load_drafter(str(out), target)
    fresh = LookaheadTokens.from_target(target.model, K, seed=0, noise=0.1)
    assert drafter.kind == "lookahead" and drafter.model.embeddings.shape == (K, 32)
    assert sum(p.numel() for p in drafter.model.parameters()) == K * 32  # O(k x D) parameters
    assert not torch.equal(drafter.model.embeddings, fresh.embeddings.to(drafter.model.embeddings.dtype))


def test_training_raises_acceptance(target, records, trained):
    out, _ = trained
    prompts = held_out_prompts(records)
    start = measure_acceptance(target, LookaheadTokens.from_target(target.model, K, 0, 0.1), prompts, 16, K + 1)
    learned = measure_acceptance(target, load_drafter(str(out), target).model, prompts, 16, K + 1)
    assert learned["tau"] > start["tau"] + 0.15
    history = load_drafter(str(out), target).manifest["extra"]["history"]
    assert [h["step"] for h in history] == [0, 20, 40, 60]  # measured in the loop with the engine
    assert load_drafter(str(out), target).manifest["extra"]["held_out_tau"] == max(h["tau"] for h in history)


def test_trained_drafter_decodes_losslessly(target, records, trained):
    out, _ = trained
    drafter = load_drafter(str(out), target)
    proposer = build_proposer(drafter, target.model)
    assert isinstance(proposer, LookaheadProposer)
    assert (proposer.chains, proposer.branches) == (K + 1, 2)  # stored in the manifest
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids)
    accepted = 0
    for record in records[30:38]:
        gen = engine.generate(record["prompt_ids"], 24)
        assert gen.tokens == plain.generate(record["prompt_ids"], 24).tokens
        accepted += gen.stats.accepted
    assert accepted > 10


def test_lookahead_config_is_checked():
    with pytest.raises(ConfigError, match="lookahead.decay"):
        DistillConfig(method="lookahead", lookahead=dict(decay=1.5))
    with pytest.raises(ConfigError, match="lookahead.tokens"):
        DistillConfig(method="lookahead", lookahead=dict(tokens=0))
    with pytest.raises(ConfigError, match="lookahead.branches"):
        DistillConfig(method="lookahead", lookahead=dict(branches=0))
    with pytest.raises(ConfigError, match="lora_r"):
        DistillConfig(method="lookahead", lora_r=4)
    with pytest.raises(ConfigError, match="loss"):
        DistillConfig(method="lookahead", loss="fkl")
