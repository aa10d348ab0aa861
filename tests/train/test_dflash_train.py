"""DFlash training end to end on a tiny peaked target: only the drafter trains, held-out tau rises, the published
drafter decodes losslessly, resume is exact, the anchors and weights are the paper's, and bad configs name the
field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import build_proposer
from specdistill.models.dflash import DFlashDrafter
from specdistill.models.drafters import load_drafter
from specdistill.train.config import ConfigError
from specdistill.train.dflash import DFlashConfig, block_weights, sample_anchors, target_layers, train_dflash
from specdistill.train.distill_config import DistillConfig
from tests.train.support import greedy_records, peaked_tiny_target

VOCAB = 32


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_target(VOCAB, seed=1)


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target, VOCAB, n=48, new_tokens=20)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def dflash_config(tmp_path, dflash: dict | None = None, **overrides) -> DistillConfig:
    """A small dflash job; `dflash`: fields of its section over the tiny defaults here, overrides: common fields."""
    section = dict(layers=1, block_size=4, target_layers=[1], anchors=8, **(dflash or {}))
    fields = dict(method="dflash", draft_vocab=0, output_dir=str(tmp_path / "dflash"),
                  work_dir=str(tmp_path / "work"), batch_size=8, max_steps=60, lr=3e-3, warmup_steps=2,
                  log_every=20, max_seq_len=48, seed=0, eval_every=30, eval_max_new_tokens=24,
                  checkpoint_every=0, gen_batch_size=8, mixed_precision="no")
    fields.update(overrides)
    return DistillConfig(**fields, dflash=DFlashConfig(**section))


def held_out_prompts(records):
    return [r["prompt_ids"] for r in records[40:44]]


@pytest.fixture(scope="module")
def trained(target, records, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("dflash")
    monkeypatch_module.setenv("SPECDISTILL_CACHE", str(root / "cache"))
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = dflash_config(root)
    out = train_dflash(cfg, Accelerator(cpu=True), target, records[:40], held_out_prompts(records))
    return out, before, cfg


def test_only_the_drafter_trains_and_tau_rises(trained, target):
    out, before, cfg = trained
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, before[name]), f"target weight {name} changed"
    drafter = load_drafter(out, target).model
    fresh = DFlashDrafter.for_target(target.model, None, 1, 4, [1], seed=0, init="target_layers")
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "mask_embedding"):
        assert not torch.equal(drafter.state_dict()[name], fresh.state_dict()[name]), f"{name} did not train"
    history = json.loads((Path(out) / "manifest.json").read_text())["extra"]["history"]
    # the target-layer start already drafts this tiny target's easy tokens (tau about 1.5 at step 0)
    assert history[0]["step"] == 0 and max(h["tau"] for h in history[1:]) > history[0]["tau"] + 0.1


def test_the_trained_drafter_has_the_lower_loss(trained, target, records):
    from specdistill.distill.feature_cache import open_or_build
    from specdistill.train.dflash import dflash_loss

    out, _, cfg = trained
    batch = open_or_build(target, records[:40], [1], cfg.max_seq_len, 8, 0).shard(0)[:8]
    head = target.model.get_output_embeddings().weight.float()
    embed = target.model.get_input_embeddings()
    fresh = DFlashDrafter.for_target(target.model, None, 1, 4, [1], seed=0, init="target_layers")
    with torch.no_grad():
        trained_loss, accuracy = dflash_loss(load_drafter(out, target).model, embed, head, batch, 8, 4.0,
                                             torch.Generator().manual_seed(0))
        fresh_loss, fresh_accuracy = dflash_loss(fresh, embed, head, batch, 8, 4.0, torch.Generator().manual_seed(0))
    assert trained_loss < 0.7 * fresh_loss and accuracy[0] > fresh_accuracy[0] and accuracy[0] > 0.5


def test_published_drafter_decodes_losslessly(trained, target, records):
    out, _, _ = trained
    assert load_drafter(out, target).kind == "dflash"
    for spec in (str(out), f"{out}+prompt_lookup"):
        proposer = build_proposer(load_drafter(spec, target), target.model, eos_token_ids=target.eos_token_ids)
        engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids)
        for prompt in held_out_prompts(records):
            ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                        eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)[0, len(prompt):]
            assert engine.generate(prompt, 20).tokens == ref.tolist()


def test_resume_ends_where_an_uninterrupted_run_does(target, records, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    short = dict(max_steps=8, eval_every=0, checkpoint_every=4)
    whole = train_dflash(dflash_config(tmp_path / "a", **short), Accelerator(cpu=True), target, records[:40], [])
    stopped = dflash_config(tmp_path / "b", stop_at_step=4, **short)
    assert train_dflash(stopped, Accelerator(cpu=True), target, records[:40], []) is None
    resumed = train_dflash(dflash_config(tmp_path / "b", resume=True, **short), Accelerator(cpu=True), target,
                           records[:40], [])
    a, b = load_drafter(whole, target).model.state_dict(), load_drafter(resumed, target).model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)


def test_anchors_are_distinct_response_positions_with_context_before_them():
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, 4:10] = True
    mask[1, :3] = True  # position 0 is never an anchor: nothing before it
    mask[2, 6:] = True
    anchors, valid = sample_anchors(mask, 4, torch.Generator().manual_seed(0))  # [3, 4]
    for b in range(3):
        picked = anchors[b][valid[b]].tolist()
        assert len(set(picked)) == len(picked) and all(mask[b, a] and a >= 1 for a in picked)
    assert valid[0].all() and valid[2].all() and valid[1].sum() == 2
    again, _ = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)  # a seed gives the same anchors (resume replays them)


def test_block_weights_are_the_papers_decay():
    weights = block_weights(16, 7.0)
    assert weights.shape == (15,) and weights[0] == 1.0
    torch.testing.assert_close(weights[7], torch.tensor(float(torch.exp(torch.tensor(-1.0)))))
    assert DFlashConfig(block_size=16).decay() == 7.0 and DFlashConfig(block_size=8).decay() == 4.0
    assert DFlashConfig(block_size=8, gamma=2.5).decay() == 2.5


@pytest.mark.parametrize("section, field", [(dict(block_size=0), "dflash.block_size"),
                                            (dict(block_size=33), "dflash.block_size"),
                                            (dict(layers=0), "dflash.layers"),
                                            (dict(target_layers=[0, 1]), "dflash.target_layers"),
                                            (dict(anchors=0), "dflash.anchors"),
                                            (dict(prompt_weight=1.5), "dflash.prompt_weight"),
                                            (dict(block_size=4, depth=4), "dflash.depth"),
                                            (dict(init="identity"), "dflash.init")])
def test_bad_configs_name_the_field(section, field):
    with pytest.raises(ConfigError, match=field):
        DistillConfig(method="dflash", dflash=section)


def test_target_layers_out_of_range_name_the_field(target):
    cfg = DistillConfig(method="dflash", dflash=dict(target_layers=[1, 2]))  # the tiny target has 2 layers
    with pytest.raises(ConfigError, match=r"dflash.target_layers: \[1, 2\] out of range"):
        target_layers(cfg, target)
    with pytest.raises(ConfigError, match="dflash.nonsense"):
        DistillConfig(method="dflash", dflash=dict(nonsense=1))


def synthetic_records(target, n: int = 3, length: int = 14, response_from: int = 4) -> list:
    """FeatureRecords of random features and final states (the loss only needs their shapes and masks): the
    tokens after position response_from - 1 are the response."""
    from specdistill.distill.feature_cache import FeatureRecord

    gen = torch.Generator().manual_seed(0)
    d = target.model.config.hidden_size
    records = []
    for i in range(n):
        t = length - i
        mask = torch.zeros(t, dtype=torch.bool)
        mask[response_from:t - 1] = True  # positions whose next token is a response token
        records.append(FeatureRecord(torch.randint(4, VOCAB, (t,), generator=gen), torch.randn(t, d, generator=gen),
                                     torch.randn(t, d, generator=gen), mask))
    return records


def test_the_loss_runs_under_bf16_autocast_near_its_fp32_value(target):
    from specdistill.train.dflash import dflash_loss

    drafter = DFlashDrafter.for_target(target.model, None, 1, 4, [1], seed=0).train()
    head = target.model.get_output_embeddings().weight.float()
    embed = target.model.get_input_embeddings()
    records = synthetic_records(target)
    exact, accuracy = dflash_loss(drafter, embed, head, records, 4, 4.0, torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = dflash_loss(drafter, embed, head, records, 4, 4.0, torch.Generator().manual_seed(1))
    mixed.backward()
    exact, mixed_value = float(exact.detach()), float(mixed.detach())
    assert torch.isfinite(mixed) and abs(mixed_value - exact) < 0.05 * exact
    assert drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0 and len(accuracy) == 3


def test_prompt_weight_trains_blocks_in_the_prompt_and_nothing_else(target):
    from specdistill.train.dflash import dflash_loss

    drafter = DFlashDrafter.for_target(target.model, None, 1, 4, [1], seed=0).train()
    head = target.model.get_output_embeddings().weight.float()
    embed = target.model.get_input_embeddings()

    def loss(records, prompt_weight):
        value, accuracy = dflash_loss(drafter, embed, head, records, 4, 4.0, torch.Generator().manual_seed(1),
                                      prompt_weight)
        return float(value.detach()), accuracy

    all_response = synthetic_records(target, response_from=0)  # every next token is a response token
    assert loss(all_response, 0.0) == loss(all_response, 0.5)  # prompt_weight changes no response row
    all_prompt = synthetic_records(target, response_from=14)  # no response token at all
    untrained, accuracy = loss(all_prompt, 0.0)
    assert untrained == 0.0 and all(math.isnan(a) for a in accuracy)  # no block, no row
    trained, accuracy = loss(all_prompt, 0.5)
    assert trained > 0 and not any(math.isnan(a) for a in accuracy)
    mixed = synthetic_records(target)
    assert loss(mixed, 0.0)[0] != loss(mixed, 1.0)[0]  # prompt rows and prompt anchors enter the loss


@pytest.mark.parametrize("dflash_job, eagle3_job, target_layer_count",
                         [("smollm2_dflash.yaml", "smollm2_eagle3.yaml", 30),
                          ("qwen_coder_dflash.yaml", "qwen_coder_eagle3.yaml", 28)])
def test_shipped_dflash_jobs_read_the_eagle3_jobs_caches(dflash_job, eagle3_job, target_layer_count, monkeypatch):
    """The shipped configs say so: the same teacher data (everything distill.teacher_data keys on) and the same
    hidden-state cache (the same fused layers and window) as the EAGLE-3 job for that target."""
    from specdistill.models.eagle3 import default_target_layers as eagle3_layers
    from specdistill.train.config import load_config
    from specdistill.train.distill_steps import teacher_settings

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    dflash, eagle3 = (load_config(DistillConfig, ["--config", f"configs/distill/{name}"])
                      for name in (dflash_job, eagle3_job))
    for field in ("target", "prompts", "exclude_prompts", "max_prompts", "seed", "follow_up_share", "follow_ups",
                  "max_seq_len", "draft_vocab"):
        assert getattr(dflash, field) == getattr(eagle3, field), field
    assert teacher_settings(dflash) == teacher_settings(eagle3)
    assert dflash.dflash.target_layers == (eagle3.eagle3.layers or eagle3_layers(target_layer_count))
