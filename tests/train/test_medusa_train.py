"""Medusa-1 training end to end on a tiny peaked target: only the heads change, they learn the shifted
targets, the calibrated tree is stored, and the trained drafter decodes losslessly."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.decode.proposers.medusa import check_tree
from specdistill.models.drafters import load_drafter
from specdistill.models.medusa import MedusaHeads
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from specdistill.train.medusa import (
    MedusaConfig,
    head_rows,
    medusa_loss,
    target_hidden_states,
    topk_accuracy,
    train_medusa,
)
from tests.distill.conftest import VOCAB_SIZE
from tests.train.support import greedy_records, peaked_tiny_target


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_target(VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target, VOCAB_SIZE)


def medusa_config(tmp_path, medusa: dict | None = None, **overrides) -> DistillConfig:
    """A small medusa job; `medusa`: fields of its section over the tiny defaults here, overrides: common fields."""
    section = dict(heads=3, layers=1, tree_nodes=6, topk=4, calibration=4, **(medusa or {}))
    fields = dict(method="medusa", output_dir=str(tmp_path / "medusa"), work_dir=str(tmp_path / "work"),
                  batch_size=8, max_steps=60, lr=1e-2, warmup_steps=2, log_every=10, max_seq_len=48, seed=0,
                  gen_batch_size=8)
    fields.update(overrides)
    return DistillConfig(**fields, medusa=MedusaConfig(**section))


@pytest.fixture(scope="module")
def trained(target, records, tmp_path_factory):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    out = train_medusa(medusa_config(tmp_path_factory.mktemp("medusa")), Accelerator(cpu=True), target, records)
    return out, before


@pytest.fixture(scope="module")
def trained_sequential(target, records, tmp_path_factory):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    path = tmp_path_factory.mktemp("sequential")
    cfg = medusa_config(path, medusa=dict(sequential=True, untrained_dir=str(path / "untrained")))
    return train_medusa(cfg, Accelerator(cpu=True), target, records), before


@pytest.fixture(scope="module")
def trained_prefix(target, records, tmp_path_factory):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = medusa_config(tmp_path_factory.mktemp("prefix"), medusa=dict(sequential=True, prefix_layer=True))
    return train_medusa(cfg, Accelerator(cpu=True), target, records), before


@pytest.fixture(params=["medusa", "sequential", "prefix"])
def any_trained(request, trained, trained_sequential, trained_prefix):
    return {"medusa": trained, "sequential": trained_sequential, "prefix": trained_prefix}[request.param]


def test_training_changes_only_the_heads(target, any_trained):
    out, before = any_trained
    after = target.model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name  # bit for bit
    heads = load_drafter(str(out), target).model
    fresh = MedusaHeads.from_target(target.model, 3, 1, sequential=heads.sequential,
                                    prefix_layer=heads.prefix is not None)
    changed = [not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), heads.state_dict().values())]
    assert all(changed)  # every block and projection of every head trained


def test_the_untrained_starting_point_is_saved_as_initialised_and_calibrated(target, trained_sequential):
    out, _ = trained_sequential
    untrained, trained = load_drafter(str(out.parent / "untrained"), target), load_drafter(str(out), target)
    fresh = MedusaHeads.from_target(target.model, 3, 1, sequential=True)
    saved = untrained.model.state_dict()
    assert fresh.state_dict().keys() == saved.keys()
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor.to(saved[name].dtype), saved[name]), name
    assert untrained.manifest["extra"]["untrained"] is True and "untrained" not in trained.manifest["extra"]
    check_tree(untrained.manifest["extra"]["tree"], 3)
    # calibrated on the same held-out records: training raised head 1's top-1 accuracy there
    assert trained.manifest["extra"]["topk_accuracy"][0][0] > untrained.manifest["extra"]["topk_accuracy"][0][0] + 0.2


def test_hidden_states_batched_by_length_equal_each_record_alone_in_the_records_order(target, records, tmp_path):
    mixed = [records[0], {**records[1], "response_ids": records[1]["response_ids"][:3]}, *records[2:6]]
    batched = target_hidden_states(medusa_config(tmp_path / "a", gen_batch_size=4), target, mixed, "check")
    alone = target_hidden_states(medusa_config(tmp_path / "b", gen_batch_size=1), target, mixed, "check")
    for (hidden, labels), (hidden_1, labels_1) in zip(batched, alone, strict=True):
        assert torch.equal(labels, labels_1)
        torch.testing.assert_close(hidden, hidden_1, atol=1e-4, rtol=1e-4)


def test_heads_learn_the_shifted_tokens(target, records, trained, tmp_path):
    out, _ = trained
    heads = load_drafter(str(out), target).model.float()
    examples = target_hidden_states(medusa_config(tmp_path), target, records, "check")
    learned = topk_accuracy(heads, examples, 1)
    start = topk_accuracy(MedusaHeads.from_target(target.model, 3, 1), examples, 1)
    assert learned[0][0] > start[0][0] + 0.2  # head 1 now predicts t+2, no longer copies the target's t+1
    assert learned[0][0] > 0.4


def test_sequential_heads_learn_more_than_medusa_heads_past_head_1(target, records, trained,
                                                                   trained_sequential, tmp_path):
    """Knowing the token in between is what a sequential head adds: with the same data and steps, its
    heads 2 and 3 (two and three tokens in between) are right more often than Medusa's."""
    examples = target_hidden_states(medusa_config(tmp_path), target, records, "check")
    embed = target.model.get_input_embeddings()
    medusa = topk_accuracy(load_drafter(str(trained[0]), target).model.float(), examples, 1)
    sequential = topk_accuracy(load_drafter(str(trained_sequential[0]), target).model.float(), examples, 1,
                               embed=embed)
    assert sequential[0][0] > 0.4
    assert sequential[1][0] > medusa[1][0] and sequential[2][0] > medusa[2][0]


def test_a_prefix_layer_lifts_every_sequential_head(target, records, trained_sequential, trained_prefix, tmp_path):
    """The tiny target's next tokens depend on more than its last state says about t + 2 .. t + 4: the
    prefix layer re-reading the sequence lets every head do better with the same data and steps
    (measured: 0.87 / 0.80 / 0.79 against 0.61 / 0.59 / 0.60)."""
    examples = target_hidden_states(medusa_config(tmp_path), target, records, "check")
    embed = target.model.get_input_embeddings()
    sequential, prefix = (topk_accuracy(load_drafter(str(run[0]), target).model.float(), examples, 1, embed=embed)
                          for run in (trained_sequential, trained_prefix))
    assert all(p[0] > s[0] + 0.1 for p, s in zip(prefix, sequential)), (prefix, sequential)


def test_sequential_rows_are_teacher_forced_on_the_targets_tokens(target):
    """head_rows gives head k at row i the state computed from h_i and tokens i .. i + k - 1, and the label i + k."""
    heads = MedusaHeads.from_target(target.model, 3, 1, sequential=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    gen = torch.Generator().manual_seed(0)
    examples = [(torch.randn(r, target.model.config.hidden_size, generator=gen),
                 torch.randint(0, VOCAB_SIZE, (r,), generator=gen)) for r in (6, 2, 5)]
    embed = target.model.get_input_embeddings()
    with torch.no_grad():
        for k, _, states, labels, used in head_rows(heads, examples, embed):
            i = 0
            assert used == [e for e, (h, _) in enumerate(examples) if h.shape[0] > k]
            for e in used:
                h, y = examples[e]
                for row in range(h.shape[0] - k):
                    state = h[row]
                    for j in range(k):
                        state = heads.heads[j].state(state, embed(y[row + j]))
                    torch.testing.assert_close(states[i], state, rtol=1e-5, atol=1e-5)
                    assert labels[i] == y[row + k]
                    i += 1
            assert i == states.shape[0]


def test_prefix_sources_are_one_pass_over_each_whole_sequence(target):
    """With a prefix layer, the heads' s_0 at an example's response rows is the layer's output over
    that example's whole sequence (prompt rows included), whatever else shares the padded batch."""
    from specdistill.train.medusa import head_sources

    heads = MedusaHeads.from_target(target.model, 3, 1, sequential=True, prefix_layer=True)
    with torch.no_grad():
        for p in heads.prefix.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    gen = torch.Generator().manual_seed(0)
    d = target.model.config.hidden_size
    examples = [(torch.randn(t, d, generator=gen), torch.randint(0, VOCAB_SIZE, (r,), generator=gen))
                for t, r in ((9, 4), (3, 3), (12, 2))]
    with torch.no_grad():
        batched = head_sources(heads, examples)
        for (h, y), source in zip(examples, batched):
            alone = heads.source(h[None])[0]  # [T, D]
            torch.testing.assert_close(source, alone[h.shape[0] - y.shape[0]:], rtol=1e-5, atol=1e-5)


def test_loss_over_a_candidate_vocabulary_of_every_token_is_the_full_loss(target):
    heads = MedusaHeads.from_target(target.model, 2, 1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    gen = torch.Generator().manual_seed(1)
    examples = [(torch.randn(r, target.model.config.hidden_size, generator=gen),
                 torch.randint(0, VOCAB_SIZE, (r,), generator=gen)) for r in (7, 4)]
    head = target.model.get_output_embeddings()
    full = medusa_loss(heads, head, examples, 0.8, 1.0)
    every = medusa_loss(heads, head, examples, 0.8, 1.0, vocab_map=torch.arange(VOCAB_SIZE).flip(0))
    torch.testing.assert_close(every, full)
    some = medusa_loss(heads, head, examples, 0.8, 1.0, vocab_map=torch.arange(0, VOCAB_SIZE, 2))
    assert torch.isfinite(some) and not torch.isclose(some, full)  # odd labels are left out of the CE


def test_calibrated_tree_is_stored_and_decoding_is_lossless(target, records, any_trained):
    out, _ = any_trained
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
    with pytest.raises(ConfigError, match="medusa.decay"):
        DistillConfig(method="medusa", medusa=dict(decay=0.0))
    with pytest.raises(ConfigError, match="lora_r"):
        DistillConfig(method="medusa", lora_r=4)
    with pytest.raises(ConfigError, match="medusa.untrained_dir"):
        DistillConfig(method="medusa", output_dir="runs/x/drafter", medusa=dict(untrained_dir="runs/x/drafter/"))


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


# ---- reduced heads, states from the feature cache, a time budget (the 151,936-token real target) -----------

HALF = torch.arange(0, VOCAB_SIZE, 2).flip(0)  # a candidate vocabulary in an order of its own


def perturbed(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return heads


def test_reduced_heads_hold_the_candidate_rows_and_lose_nothing_of_the_loss(target):
    """Reduced heads are full heads cut to the rows training and decoding read: built from the target's rows of
    the candidates, in vocab_map's order, and given the same weights they give the same loss."""
    full = perturbed(MedusaHeads.from_target(target.model, 2, 1))
    reduced = MedusaHeads.from_target(target.model, 2, 1, vocab_map=HALF)
    assert reduced.reduced and reduced.config["vocab_size"] == HALF.numel()
    head = target.model.get_output_embeddings()
    torch.testing.assert_close(reduced.heads[0].proj.weight, head.weight.detach()[HALF])
    reduced.load_state_dict({name: tensor[HALF] if name.endswith("proj.weight") else tensor
                             for name, tensor in full.state_dict().items()})
    gen = torch.Generator().manual_seed(1)
    examples = [(torch.randn(r, target.model.config.hidden_size, generator=gen),
                 torch.randint(0, VOCAB_SIZE, (r,), generator=gen)) for r in (7, 4)]
    torch.testing.assert_close(medusa_loss(reduced, head, examples, 0.8, 1.0, vocab_map=HALF),
                               medusa_loss(full, head, examples, 0.8, 1.0, vocab_map=HALF))
    assert topk_accuracy(reduced, examples, 3, HALF) == topk_accuracy(full, examples, 3, HALF)


def test_reduced_heads_refuse_a_vocab_map_of_another_size(target):
    from specdistill.models.medusa import check_heads_vocab, projection_rows

    reduced = MedusaHeads.from_target(target.model, 2, 1, vocab_map=HALF)
    with pytest.raises(ValueError, match="vocab_map of 32 ids"):
        check_heads_vocab(reduced, HALF[:5], VOCAB_SIZE, "drafter x")
    with pytest.raises(ValueError, match="32-id vocab_map"):
        projection_rows(reduced, None)
    with pytest.raises(ValueError, match="medusa.reduced_heads"):
        DistillConfig(method="medusa", medusa=dict(reduced_heads=True))


@pytest.fixture(scope="module")
def trained_reduced(target, records, tmp_path_factory):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = medusa_config(tmp_path_factory.mktemp("reduced"), medusa=dict(reduced_heads=True), draft_vocab=40)
    return train_medusa(cfg, Accelerator(cpu=True), target, records), before


def test_reduced_heads_train_save_and_decode_losslessly(target, records, trained_reduced):
    out, before = trained_reduced
    for name, tensor in target.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    drafter = load_drafter(str(out), target)
    assert drafter.model.reduced and drafter.vocab_map.numel() == 40
    assert all(head.proj.weight.shape[0] == 40 for head in drafter.model.heads)
    proposer = build_proposer(drafter, target.model)
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    taus = []
    for record in records[:6]:
        gen = engine.generate(record["prompt_ids"], 24)
        assert gen.tokens == plain.generate(record["prompt_ids"], 24).tokens
        taus.append(gen.stats.tau)
    assert sum(taus) / len(taus) > 1.5


def test_final_states_from_the_feature_cache_are_the_targets_own(target, records, tmp_path, monkeypatch):
    """medusa.feature_layers: the examples read from an EAGLE-3 feature cache (bf16) are those of a pass of the
    target over the records: the same labels, the same states to bf16's precision, in the records' order."""
    from specdistill.train.medusa import cached_final_states

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    some = records[:7]
    cfg = medusa_config(tmp_path, medusa=dict(feature_layers=[0, 1, 1]))
    cached = cached_final_states(cfg, Accelerator(cpu=True), target, some)
    direct = target_hidden_states(medusa_config(tmp_path / "direct"), target, some, "check")
    assert list((tmp_path / "cache" / "features").iterdir())  # it built the cache it read
    for (hidden, labels), (hidden_1, labels_1) in zip(cached, direct, strict=True):
        assert torch.equal(labels, labels_1)
        torch.testing.assert_close(hidden.float(), hidden_1, atol=0.05, rtol=0.02)


def test_max_minutes_sizes_the_steps_and_writes_the_summary(target, records, tmp_path, monkeypatch):
    """A budget far below the steps asked for: the run decides fewer steps after its warm-up, still saves a
    calibrated drafter, and its summary records the decided steps, the held-out tau at the end and the peak RSS."""
    import json

    from specdistill.train import step_budget

    monkeypatch.setattr(step_budget, "CALIBRATION_STEPS", 0)
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 0.0)  # the job's 45 s are all the training's
    observe = step_budget.StepBudget.observe_step
    monkeypatch.setattr(step_budget.StepBudget, "observe_step", lambda self, seconds, step: observe(self, 1.0, step))
    cfg = medusa_config(tmp_path, max_steps=1000, max_minutes=0.75, eval_max_new_tokens=8)
    prompts = [r["prompt_ids"] for r in records[:2]]
    out = train_medusa(cfg, Accelerator(cpu=True), target, records, prompts)
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    # decided after the 2 warm-up steps: 1 s a step and 30 steps' worth kept for the final measurement leave 15
    assert summary["step"] == summary["decided_steps"] == 2 + 15
    assert [h["step"] for h in summary["history"]] == [summary["step"]] and summary["best_tau"] >= 1.0
    assert summary["peak_rss_mib_per_process"][0] > 0
    assert load_drafter(str(out), target).manifest["extra"]["tree"]


def test_a_cold_job_with_feature_layers_stages_the_states_where_an_eagle3_job_would(target, tmp_path):
    """medusa.feature_layers: the teacher generation stages the target's states (no second pass of the target), in
    the staging directory an EAGLE-3 job with the same layers uses; without them, none."""
    from specdistill.train.methods import method_named

    staging = method_named("medusa").staging
    staged = staging(medusa_config(tmp_path, medusa=dict(feature_layers=[0, 1, 1])), target)
    eagle3 = method_named("eagle3").staging(DistillConfig(method="eagle3", eagle3=dict(layers=[0, 1, 1])), target)
    assert staged.layers == [0, 1, 1] and staged.directory == eagle3.directory
    assert staging(medusa_config(tmp_path), target) is None


def test_a_job_with_feature_layers_reads_the_staged_states_without_a_pass_of_the_target(target, tmp_path, monkeypatch):
    """The states the teacher generation staged are what the heads learn from: building the feature cache runs no
    forward of the target, and each example's states are the teacher-forced final states (bf16)."""
    from specdistill.distill.generation import generate_batch
    from specdistill.train.medusa import cached_final_states
    from specdistill.train.methods import method_named

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    cfg = medusa_config(tmp_path, medusa=dict(feature_layers=[0, 1, 1]))
    prompts = [torch.randint(9, VOCAB_SIZE, (4 + i % 5,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(6)]
    answers = generate_batch(target.model, prompts, max_new_tokens=10, pad_id=0, eos_token_ids=target.eos_token_ids,
                             staging=method_named("medusa").staging(cfg, target))
    records = [{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, answers)]
    decoder = target.model.get_decoder()
    with torch.no_grad():
        exact = [decoder(input_ids=torch.tensor([r["prompt_ids"] + r["response_ids"]])).last_hidden_state[0]
                 for r in records]  # [T, D] each
    monkeypatch.setattr(type(decoder), "forward", lambda *a, **k: pytest.fail("the target ran a second pass"))
    examples = cached_final_states(cfg, Accelerator(cpu=True), target, records)
    assert len(examples) == len(records)
    for (hidden, labels), record, states in zip(examples, records, exact):
        start = len(record["prompt_ids"]) - 1  # the row predicting the first answer token
        assert labels.tolist() == record["response_ids"][:len(labels)] and len(labels) > 0
        assert hidden.shape[0] == start + len(labels)  # every row up to the last one predicting an answer token
        want = states[:hidden.shape[0]]
        assert torch.allclose(hidden.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
