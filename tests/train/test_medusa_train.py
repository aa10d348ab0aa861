"""Medusa-1 training end to end on a tiny peaked target: only the heads change, they learn the shifted
targets, the calibrated tree is stored, and the trained drafter decodes losslessly."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from decode.engine import SpeculativeEngine
from decode.proposers import build_proposer
from decode.self_draft import check_tree
from models.drafters import load_drafter
from models.medusa import MedusaHeads
from tests.distill.conftest import VOCAB_SIZE
from tests.train.support import greedy_records, peaked_tiny_target
from train.config import ConfigError
from train.distill_config import DistillConfig
from train.medusa import target_hidden_states, topk_accuracy, train_medusa


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_target(VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target, VOCAB_SIZE)


def medusa_config(tmp_path, **overrides):
    fields = {f.name: getattr(DistillConfig(), f.name) for f in dataclasses.fields(DistillConfig)}
    fields.update(method="medusa", medusa_heads=3, medusa_layers=1, medusa_tree_nodes=6, medusa_topk=4,
                  medusa_calibration=4, output_dir=str(tmp_path / "medusa"), work_dir=str(tmp_path / "work"),
                  batch_size=8, max_steps=60, lr=1e-2, warmup_steps=2, log_every=10, max_seq_len=48, seed=0,
                  gen_batch_size=8)
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.fixture(scope="module")
def trained(target, records, tmp_path_factory):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    out = train_medusa(medusa_config(tmp_path_factory.mktemp("medusa")), Accelerator(cpu=True), target, records)
    return out, before


def test_training_changes_only_the_heads(target, trained):
    out, before = trained
    after = target.model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name  # bit for bit
    heads = load_drafter(str(out), target).model
    fresh = MedusaHeads.from_target(target.model, 3, 1)
    changed = [not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), heads.state_dict().values())]
    assert all(changed)  # every block and projection of every head trained


def test_heads_learn_the_shifted_tokens(target, records, trained, tmp_path):
    out, _ = trained
    heads = load_drafter(str(out), target).model.float()
    examples = target_hidden_states(medusa_config(tmp_path), target, records, "check")
    learned = topk_accuracy(heads, examples, 1)
    start = topk_accuracy(MedusaHeads.from_target(target.model, 3, 1), examples, 1)
    assert learned[0][0] > start[0][0] + 0.2  # head 1 now predicts t+2, no longer copies the target's t+1
    assert learned[0][0] > 0.4


def test_calibrated_tree_is_stored_and_decoding_is_lossless(target, records, trained):
    out, _ = trained
    drafter = load_drafter(str(out), target)
    tree = drafter.manifest["extra"]["tree"]
    assert len(check_tree(tree, 3)) == 6
    assert len(drafter.manifest["extra"]["topk_accuracy"]) == 3
    proposer = build_proposer(drafter, target.model)
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    taus = []
    for record in records[:6]:
        prompt = record["prompt_ids"]
        gen = engine.generate(prompt, 24)
        assert gen.tokens == plain.generate(prompt, 24).tokens
        taus.append(gen.stats.tau)
    assert sum(taus) / len(taus) > 1.5  # the trained heads are accepted


def test_medusa_config_is_checked():
    with pytest.raises(ConfigError, match="medusa_decay"):
        DistillConfig(method="medusa", medusa_decay=0.0)
    with pytest.raises(ConfigError, match="lora_r"):
        DistillConfig(method="medusa", lora_r=4)


def test_draft_vocab_stores_the_candidate_vocabulary(target, records, tmp_path):
    cfg = medusa_config(tmp_path, draft_vocab=12, max_steps=5)
    drafter = load_drafter(str(train_medusa(cfg, Accelerator(cpu=True), target, records)), target)
    counts = torch.bincount(torch.tensor([t for r in records for t in r["response_ids"]]), minlength=VOCAB_SIZE)
    assert drafter.vocab_map is not None and drafter.vocab_map.numel() == 12
    assert set(target.eos_token_ids) <= set(drafter.vocab_map.tolist())
    assert int(counts.argmax()) in drafter.vocab_map.tolist()  # the most frequent response token is kept
    engine = SpeculativeEngine(target.model, build_proposer(drafter, target.model), target.eos_token_ids,
                               adaptive=False)
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids)
    prompt = records[0]["prompt_ids"]
    assert engine.generate(prompt, 24).tokens == plain.generate(prompt, 24).tokens
