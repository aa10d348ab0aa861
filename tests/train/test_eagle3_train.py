"""EAGLE-3 training end to end on a tiny peaked target: the hidden-state cache is reused or refused as it
should be, only the drafter trains, acceptance rises, resume is exact, and the published drafter decodes
losslessly through the drafter directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.distill.feature_cache import (
    FeatureCache,
    FeatureCacheError,
    compute_shard,
    feature_cache_dir,
    feature_cache_key,
    open_or_build,
    partial_dir,
)
from specdistill.models.drafters import load_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from specdistill.train.eagle3 import (
    Eagle3Config,
    eagle3_loss,
    lengths_mask,
    noisy_features,
    pad_batch,
    position_weights,
    repeats_context,
    train_eagle3,
)
from tests.train.support import greedy_records, peaked_tiny_target

VOCAB = 32
LAYERS = [0, 1, 1]


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_target(VOCAB, seed=1)


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target, VOCAB, n=48, new_tokens=20)


def eagle3_config(tmp_path, eagle3: dict | None = None, **overrides) -> DistillConfig:
    """A small eagle3 job; `eagle3`: fields of its section over the tiny defaults here, overrides: common fields."""
    section = dict(layers=LAYERS, steps=3, depth=4, topk=2, tree_nodes=6, **(eagle3 or {}))
    fields = dict(method="eagle3", draft_vocab=0, output_dir=str(tmp_path / "eagle3"),
                  work_dir=str(tmp_path / "work"), batch_size=8, max_steps=80, lr=3e-3, warmup_steps=2,
                  log_every=20, max_seq_len=48, seed=0, eval_every=40, eval_max_new_tokens=16,
                  checkpoint_every=0, gen_batch_size=8)
    fields.update(overrides)
    return DistillConfig(**fields, eagle3=Eagle3Config(**section))


def held_out_prompts(records):
    return [r["prompt_ids"] for r in records[40:]]


@pytest.fixture(scope="module")
def trained(target, records, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("eagle3")
    monkeypatch_module.setenv("SPECDISTILL_CACHE", str(root / "cache"))
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = eagle3_config(root)
    out = train_eagle3(cfg, Accelerator(cpu=True), target, records[:40], held_out_prompts(records))
    return out, before, cfg


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_only_the_drafter_trains_and_acceptance_rises(trained, target):
    out, before, cfg = trained
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, before[name]), f"target weight {name} changed"
    drafter = load_drafter(out, target)
    fresh = Eagle3Drafter.for_target(target.model, None, LAYERS, seed=0)
    assert not torch.equal(drafter.model.midlayer.self_attn.q_proj.weight, fresh.midlayer.self_attn.q_proj.weight)
    history = json.loads((Path(out) / "manifest.json").read_text())["extra"]["history"]
    assert history[0]["step"] == 0 and max(h["tau"] for h in history[1:]) > history[0]["tau"] + 0.5


def test_published_drafter_decodes_losslessly(trained, target, records):
    out, _, _ = trained
    drafter = load_drafter(out, target)
    assert drafter.kind == "eagle3"
    for spec in (str(out), f"{out}+prompt_lookup"):
        proposer = build_proposer(load_drafter(spec, target), target.model, eos_token_ids=target.eos_token_ids)
        engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids)
        for prompt in held_out_prompts(records):
            ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                        eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)[0, len(prompt):]
            assert engine.generate(prompt, 24).tokens == ref.tolist()


def test_the_loss_is_lower_for_the_trained_drafter(trained, target, records):
    out, _, cfg = trained
    cache = open_or_build(target, records[:40], LAYERS, cfg.max_seq_len, 8, 0)
    batch = cache.shard(0)[:8]
    head = target.model.get_output_embeddings().weight.float()
    embed = target.model.get_input_embeddings()
    fresh = Eagle3Drafter.for_target(target.model, None, LAYERS, seed=0)
    with torch.no_grad():
        trained_loss, accuracy = eagle3_loss(load_drafter(out, target).model, embed, head, batch, 3, 0.8)
        fresh_loss, _ = eagle3_loss(fresh, embed, head, batch, 3, 0.8)
    assert trained_loss < 0.5 * fresh_loss and accuracy[0] > 0.5


def test_position_weights_are_one_on_responses_the_prompt_weight_before_and_zero_past_the_end():
    mask = torch.tensor([[False, False, True, True, False], [False, True, True, False, False]])  # [2, 5]
    lengths = torch.tensor([5, 3])  # the second record is right-padded from position 3
    weight = position_weights(mask, lengths, 0.25)
    assert weight.tolist() == [[0.25, 0.25, 1.0, 1.0, 0.0], [0.25, 1.0, 1.0, 0.0, 0.0]]
    assert torch.equal(position_weights(mask, lengths, 0.0), mask.float())


def test_repeats_context_marks_positions_whose_next_token_a_two_gram_lookup_names():
    ids = torch.tensor([[5, 6, 7, 1, 5, 6, 7, 5, 6, 8, 0], [5, 6, 7, 5, 6, 7, 0, 0, 0, 0, 0]])  # [2, 11]
    lengths = torch.tensor([11, 6])  # the second record is right-padded with token 0
    marked = repeats_context(ids, lengths)
    # record 0: (5, 6) -> 7 at 4-5 repeats 0-1 (p = 5); (6, 7) at 5-6 was followed by 1, now by 5: no; at 7-8
    # (5, 6) is followed by 8, not 7: no. record 1: p = 4 ((5, 6) -> 7); p = 5 has no next token in the record
    assert marked.nonzero().tolist() == [[0, 5], [1, 4]]
    brute = torch.zeros_like(marked)
    for b in range(2):
        x, n = ids[b].tolist(), int(lengths[b])
        for p in range(1, n - 1):
            brute[b, p] = any(x[s - 1:s + 2] == x[p - 1:p + 2] for s in range(1, p))
    assert torch.equal(marked, brute)


@pytest.mark.parametrize("prompt_weight,copy_weight", [(0.0, 1.0), (0.5, 1.0), (0.0, 4.0)])
def test_one_step_loss_is_the_weighted_mean_of_each_positions_cross_entropy(target, records, prompt_weight,
                                                                             copy_weight):
    cache = open_or_build(target, records[:8], LAYERS, 48, 8, 0)
    batch = cache.shard(0)[:4]
    head = target.model.get_output_embeddings().weight.float()  # [V, D]
    embed = target.model.get_input_embeddings()
    drafter = Eagle3Drafter.for_target(target.model, None, LAYERS, seed=0).float()
    with torch.no_grad():
        loss, _ = eagle3_loss(drafter, embed, head, batch, 1, 0.8, prompt_weight, copy_weight=copy_weight)
        ids, features, final, mask, lengths = pad_batch(batch, "cpu")
        copies = repeats_context(ids, lengths)  # [B, T]
        out = drafter.unroll([embed(torch.roll(ids, -1, dims=1)).float()], features)[0]  # [B, T, D]
        expected_sum, weight_sum = 0.0, 0.0
        for b, record in enumerate(batch):
            for t in range(int(lengths[b]) - 2):  # row t reads token t + 1, predicts t + 2 as the target at t + 1
                w = (1.0 if record.mask[t + 1] else prompt_weight) * (copy_weight if copies[b, t + 1] else 1.0)
                p = torch.softmax(final[b, t + 1] @ head.T, -1)
                ce = -(p * torch.log_softmax(drafter.logits(out[b, t]), -1)).sum()
                expected_sum, weight_sum = expected_sum + w * float(ce), weight_sum + w
    assert weight_sum > 0 and (copy_weight == 1.0 or copies.any())
    assert float(loss) == pytest.approx(expected_sum / weight_sum, rel=1e-4)


def test_unrolling_chosen_rows_computes_what_the_whole_unroll_computes_there(target, records):
    cache = open_or_build(target, records[:8], LAYERS, 48, 8, 0)
    ids, features, *_ = pad_batch(cache.shard(0)[:4], "cpu")  # [B, T], [B, T, 3D]
    embed = target.model.get_input_embeddings()
    drafter = Eagle3Drafter.for_target(target.model, None, LAYERS, seed=0, init="target_layer").float()
    embeds = [embed(torch.roll(ids, -1 - j, dims=1)).float() for j in range(3)]
    generator = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(ids.shape[1], generator=generator)[:9] for _ in range(ids.shape[0])])  # [B, 9]
    with torch.no_grad():
        whole = drafter.unroll(embeds, features)  # steps x [B, T, D]
        chosen = drafter.unroll(embeds, features, rows)  # steps x [B, 9, D]
    for step_whole, step_chosen in zip(whole, chosen):
        expected = torch.stack([step_whole[b, rows[b]] for b in range(rows.shape[0])])
        torch.testing.assert_close(step_chosen, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prompt_weight", [0.0, 1.0])
def test_unrolling_only_the_counted_positions_leaves_the_loss_and_its_gradient_unchanged(target, records,
                                                                                        prompt_weight):
    cache = open_or_build(target, records[:8], LAYERS, 48, 8, 0)
    batch = cache.shard(0)[:4]
    head = target.model.get_output_embeddings().weight.float()
    embed = target.model.get_input_embeddings()
    drafter = Eagle3Drafter.for_target(target.model, None, LAYERS, seed=0, init="target_layer").float()
    results = []
    for every_row in (True, False):
        loss, accuracy = eagle3_loss(drafter, embed, head, batch, 3, 0.8, prompt_weight, every_row=every_row)
        loss.backward()
        results.append((float(loss), accuracy, drafter.fc.weight.grad.clone()))
        drafter.zero_grad()
    (whole, whole_acc, whole_grad), (counted, counted_acc, counted_grad) = results
    assert counted == pytest.approx(whole, rel=1e-5) and counted_acc == whole_acc
    torch.testing.assert_close(counted_grad, whole_grad, atol=1e-6, rtol=1e-4)


def test_feature_noise_is_a_share_of_each_dimensions_size_on_real_positions_only():
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-2, 2, 96)  # dimensions orders of magnitude apart
    features = torch.randn(4, 50, 96, generator=generator) * scales  # [B, T, F]
    features[:, 0, 5] = 1e4  # an attention sink: one position, one dimension
    lengths = torch.tensor([50, 40, 30, 20])
    mask = lengths_mask(lengths, 50)  # [B, T]
    noisy = noisy_features(features, mask, 0.1, torch.Generator().manual_seed(1))
    delta = noisy - features
    assert torch.equal(delta[~mask], torch.zeros_like(delta[~mask]))  # padding untouched
    size = features[mask].abs().median(dim=0).values  # [F]
    ratio = delta[mask].std(dim=0) / size  # [F]: 140 draws each
    assert float(ratio.mean()) == pytest.approx(0.1, rel=0.03)
    torch.testing.assert_close(ratio, torch.full((96,), 0.1), rtol=0.3, atol=0)
    again = noisy_features(features, mask, 0.1, torch.Generator().manual_seed(1))
    assert torch.equal(noisy, again)  # a seed gives the same draws (resume replays them)
    assert noisy_features(features, mask, 0.0) is features


def test_feature_noise_changes_the_loss_and_no_noise_leaves_it(target, records):
    cache = open_or_build(target, records[:8], LAYERS, 48, 8, 0)
    batch = cache.shard(0)[:4]
    head = target.model.get_output_embeddings().weight.float()
    embed = target.model.get_input_embeddings()
    drafter = Eagle3Drafter.for_target(target.model, None, LAYERS, seed=0, init="target_layer").float()
    with torch.no_grad():
        clean = float(eagle3_loss(drafter, embed, head, batch, 2, 0.8)[0])
        again = float(eagle3_loss(drafter, embed, head, batch, 2, 0.8, feature_noise=0.0)[0])
        noisy = float(eagle3_loss(drafter, embed, head, batch, 2, 0.8, feature_noise=0.5)[0])
    assert again == clean and noisy != pytest.approx(clean, rel=1e-3)


def test_feature_cache_is_reused_and_refused_for_another_target(trained, target, records, tmp_path):
    _, _, cfg = trained
    key = feature_cache_key(target.fingerprint, records[:40], LAYERS, cfg.max_seq_len)
    directory = feature_cache_dir(key)
    assert directory.is_dir()
    stamp = [(p.name, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())]
    open_or_build(target, records[:40], LAYERS, cfg.max_seq_len, 8, 0)  # valid: reused, nothing rewritten
    assert [(p.name, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())] == stamp
    with pytest.raises(FeatureCacheError, match="another target"):
        FeatureCache(directory, key, "not-this-target")
    other = feature_cache_key("other-target", records[:40], LAYERS, cfg.max_seq_len)
    assert other != key  # another target never even looks in this directory


def test_an_incomplete_feature_cache_is_never_used(target, records, tmp_path):
    key = feature_cache_key(target.fingerprint, records[:8], LAYERS, 48)
    directory = feature_cache_dir(key, tmp_path)
    partial_dir(directory).mkdir(parents=True)  # an interrupted build: no marker, never published
    with pytest.raises(FeatureCacheError, match="not a complete"):
        FeatureCache(directory, key, target.fingerprint)
    cache = open_or_build(target, records[:8], LAYERS, 48, 4, 0, root=tmp_path)  # finishes the build
    (directory / "shard-00000.safetensors").unlink()
    with pytest.raises(FeatureCacheError, match="incomplete"):
        FeatureCache(directory, key, target.fingerprint)
    assert cache.num_records == 8


@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_resume_ends_where_an_uninterrupted_run_does(target, records, tmp_path, monkeypatch, noise):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    short = dict(max_steps=12, eval_every=0, checkpoint_every=4, eagle3=dict(feature_noise=noise))
    whole = train_eagle3(eagle3_config(tmp_path / "a", **short), Accelerator(cpu=True), target, records[:40], [])
    stopped = eagle3_config(tmp_path / "b", stop_at_step=8, **short)
    assert train_eagle3(stopped, Accelerator(cpu=True), target, records[:40], []) is None
    resumed = train_eagle3(eagle3_config(tmp_path / "b", resume=True, **short), Accelerator(cpu=True), target,
                           records[:40], [])
    a, b = load_drafter(whole, target).model.state_dict(), load_drafter(resumed, target).model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision, autocast", [("bf16", True), ("no", False)])
def test_mixed_precision_runs_the_loss_under_autocast_and_keeps_fp32_weights(target, records, tmp_path, monkeypatch,
                                                                              precision, autocast):
    import specdistill.train.eagle3 as eagle3_training

    seen, loss = [], eagle3_training.eagle3_loss

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return loss(*args, **kwargs)

    monkeypatch.setattr(eagle3_training, "eagle3_loss", spy)
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    AcceleratorState._reset_state(reset_partial_state=True)  # a process's accelerate state holds one precision
    try:
        accelerator = Accelerator(cpu=True, mixed_precision=precision)
        out = train_eagle3(eagle3_config(tmp_path, max_steps=4, eval_every=0), accelerator, target, records[:40], [])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert len(seen) == 4 and set(seen) == {autocast}
    drafter = load_drafter(out, target).model
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}


@pytest.mark.parametrize("override, field", [(dict(eagle3=dict(layers=[1, 2])), "eagle3.layers"),
                                             (dict(eagle3=dict(steps=0)), "eagle3.steps"),
                                             (dict(eagle3=dict(decay=1.5)), "eagle3.decay"),
                                             (dict(eagle3=dict(init="target")), "eagle3.init"),
                                             (dict(eagle3=dict(prompt_weight=1.5)), "eagle3.prompt_weight"),
                                             (dict(eagle3=dict(feature_noise=-0.1)), "eagle3.feature_noise"),
                                             (dict(eagle3=dict(copy_weight=0)), "eagle3.copy_weight"),
                                             (dict(eagle3=dict(intermediate_size=-1)), "eagle3.intermediate_size"),
                                             (dict(eagle3=dict(tree_node=4)), "eagle3.tree_node"),
                                             (dict(loss="fkl"), "loss")])
def test_bad_configs_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        DistillConfig(method="eagle3", **override)


@pytest.mark.parametrize("width", [0, 3])  # 0: the target's MLP width; 3: three times it
def test_target_layer_start_computes_the_targets_own_layer(target, records, width):
    """With the token's half of q/k/v silenced, step 0 of a target_layer start is the target's layer 0 over
    its own input, at every position, for the target's MLP width and a wider one (the new units start
    silent); the head and final norm are the target's either way."""
    size = width * target.model.config.intermediate_size
    drafter = Eagle3Drafter.for_target(target.model, None, [0, 0, 0], seed=0, init="target_layer",
                                       intermediate_size=size).float()
    assert drafter.midlayer.mlp.up_proj.weight.shape[0] == (size or target.model.config.intermediate_size)
    d = drafter.config["hidden_size"]
    for proj in (drafter.midlayer.self_attn.q_proj, drafter.midlayer.self_attn.k_proj,
                 drafter.midlayer.self_attn.v_proj):
        with torch.no_grad():
            proj.weight[:, :d].zero_()
    seq = torch.tensor([records[0]["prompt_ids"] + records[0]["response_ids"]])  # [1, T]
    with torch.no_grad():
        hidden = target.model(input_ids=seq, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[0]] * 3, dim=-1)  # [1, T, 3D]
        embeds = [target.model.get_input_embeddings()(seq).float()]
        step0 = drafter.unroll(embeds, features)[0]
    torch.testing.assert_close(step0, hidden[1], atol=1e-4, rtol=1e-4)
    random = Eagle3Drafter.for_target(target.model, None, [0, 0, 0], seed=0, intermediate_size=size)
    assert torch.equal(random.lm_head.weight, drafter.lm_head.weight)
    assert not torch.allclose(random.midlayer.mlp.up_proj.weight, drafter.midlayer.mlp.up_proj.weight)
    with pytest.raises(ValueError, match="eagle3_init"):
        Eagle3Drafter.for_target(target.model, None, [0, 0, 0], init="last")


def test_layer_out_of_range_and_oversized_vocabulary_name_the_field(target, records, tmp_path):
    with pytest.raises(ValueError, match="eagle3_layers"):
        Eagle3Drafter.for_target(target.model, None, [0, 1, 7])
    with pytest.raises(ValueError, match="draft_vocab"):
        train_eagle3(eagle3_config(tmp_path, draft_vocab=VOCAB + 1), Accelerator(cpu=True), target, records[:8], [])


def test_features_batched_by_length_equal_each_record_alone_in_the_records_order(target, records):
    mixed = [records[0], {**records[1], "response_ids": records[1]["response_ids"][:3]}, *records[2:6]]
    batched = compute_shard(target, mixed, [0, 1], 48, 4, pad_id=0)
    for record, got in zip(mixed, batched):
        alone = compute_shard(target, [record], [0, 1], 48, 1, pad_id=0)[0]
        assert torch.equal(got.ids, alone.ids) and torch.equal(got.mask, alone.mask)
        torch.testing.assert_close(got.features.float(), alone.features.float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got.final.float(), alone.final.float(), atol=2e-2, rtol=1e-2)
