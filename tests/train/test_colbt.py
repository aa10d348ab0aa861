"""Collective boost-tuning end to end on a tiny peaked target: the ensemble directory (members that load
on their own, manifest, coverage), greedy losslessness of the merged members, boosting weights placed
exactly on the earlier members' misses, and strength 0 = every member trained as if alone."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import DraftModelProposer
from specdistill.decode.proposers.ensemble import EnsembleProposer
from specdistill.models.drafters import load_drafter
from specdistill.models.target import target_from_model
from specdistill.train.colbt import split_held_out, train_colbt, with_boost_weights
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from tests.conftest import make_tiny_llama
from tests.distill.conftest import VOCAB_SIZE, make_tiny_tokenizer

MEMBERS = ["truncated:1", "small:layers=1,hidden=32,seed=1", "truncated:2"]


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(vocab_size=VOCAB_SIZE, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a clear greedy choice at every step: learnable by tiny drafters
    return target_from_model(model, make_tiny_tokenizer(), name="tiny")


@pytest.fixture(scope="module")
def records(target):
    """The target's greedy answers to 24 prompts of random words (4 records per prompt id pair)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(24):
        prompt = torch.randint(9, VOCAB_SIZE, (4 + i % 5,), generator=gen).tolist()
        with torch.no_grad():
            ids = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)
        out.append({"prompt_id": f"p{i // 2}", "prompt_ids": prompt, "response_ids": ids[0, len(prompt):].tolist()})
    return out


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0))


def colbt_config(tmp_path, colbt: dict | None = None, **overrides) -> DistillConfig:
    """A small colbt job; `colbt`: fields of its section over the tiny defaults here, overrides: common fields."""
    section = dict(members=MEMBERS, strength=2.0, holdout=3, max_tree_nodes=8)
    section.update(colbt or {})
    fields = dict(method="colbt", output_dir=str(tmp_path / "ensemble"), batch_size=4, epochs=3, max_seq_len=48,
                  lr=1e-2, warmup_steps=2, log_every=5, eval_max_new_tokens=12, eval_gamma=3, seed=0)
    fields.update(overrides)
    return DistillConfig(**fields, colbt=section)


def member_weights(directory, member: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted((directory / member / "model").glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.fixture(scope="module")
def boosted(target, records, accelerator, tmp_path_factory):
    cfg = colbt_config(tmp_path_factory.mktemp("boosted"))
    return train_colbt(cfg, accelerator, target, records, eval_prompts=[[9, 10, 11], [20, 30, 40, 50]])


def test_the_ensemble_directory_and_its_members(boosted, target):
    manifest = json.loads((boosted / "manifest.json").read_text())
    assert manifest["kind"] == "ensemble" and manifest["format_version"] == 1
    assert manifest["members"] == ["member-0", "member-1", "member-2"]
    assert manifest["target"]["fingerprint"] == target.fingerprint and manifest["max_tree_nodes"] == 8
    assert manifest["config"]["colbt"]["members"] == MEMBERS
    for i, member in enumerate(manifest["members"]):
        drafter = load_drafter(boosted / member, target)  # each member is a drafter directory of its own
        assert drafter.kind == "draft_model"
        assert drafter.manifest["config"]["drafter"] == MEMBERS[i]
    assert set(manifest["extra"]["held_out_tau"]) == {"member-0", "member-1", "member-2", "ensemble"}


@pytest.mark.parametrize("key,value", [("branches", 0), ("branches", "2"), ("max_tree_nodes", 1),
                                       ("max_tree_nodes", True)])
def test_an_ensemble_manifest_with_a_bad_tree_setting_is_refused(boosted, target, tmp_path, key, value):
    copy = tmp_path / "ensemble"
    shutil.copytree(boosted, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["branches"] == 1  # written by the job (the default)
    (copy / "manifest.json").write_text(json.dumps(dict(manifest, **{key: value})))
    with pytest.raises(ValueError, match=f"`{key}` must be an integer"):
        load_drafter(copy, target)


def test_coverage_is_logged_per_member_and_cumulatively(boosted):
    coverage = json.loads((boosted / "manifest.json").read_text())["extra"]["coverage"]
    per = [c["held_out_coverage"] for c in coverage]
    cumulative = [c["cumulative_coverage"] for c in coverage]
    assert cumulative[0] == per[0]
    assert all(b >= a for a, b in zip(cumulative, cumulative[1:]))
    assert all(c >= p for c, p in zip(cumulative, per))
    assert coverage[0]["held_out_positions"] > 0 and per[0] > 0.3  # the peaked target is learnable
    assert coverage[0]["boosted_fraction"] == 0.0  # the first member trains on uniform weights
    assert coverage[1]["max_weight"] > 1.0


def test_merged_members_decode_the_targets_greedy_output(boosted, target):
    members = [load_drafter(boosted / f"member-{i}", target) for i in range(3)]
    proposer = EnsembleProposer([DraftModelProposer(d.model, 3, d.vocab_map, target.eos_token_ids)
                                 for d in members], max_tree_nodes=8)
    prompt = [9, 12, 30, 41]
    got = SpeculativeEngine(target.model, proposer, target.eos_token_ids).generate(prompt, 20).tokens
    ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)[0, len(prompt):]
    assert got == ref.tolist()


def test_without_boosting_each_member_trains_as_if_alone(target, records, accelerator, tmp_path, boosted):
    pair = train_colbt(colbt_config(tmp_path / "a", colbt=dict(members=MEMBERS[:2], strength=0.0)),
                       accelerator, target, records)
    alone = train_colbt(colbt_config(tmp_path / "b", colbt=dict(members=MEMBERS[1:2], strength=0.0)),
                        accelerator, target, records)
    a, b = member_weights(pair, "member-1"), member_weights(alone, "member-0")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    coverage = json.loads((pair / "manifest.json").read_text())["extra"]["coverage"]
    assert coverage[1]["boosted_fraction"] == 0.0 and coverage[1]["max_weight"] == 1.0
    boosted_member = member_weights(boosted, "member-1")  # same spec and data, boosted weights
    assert any(not torch.allclose(a[name], boosted_member[name]) for name in a)


def test_weights_rise_exactly_on_the_positions_the_earlier_members_missed():
    records = [{"prompt_ids": [1], "response_ids": [5, 6, 7]}, {"prompt_ids": [1], "response_ids": [8, 9]}]
    covered = [[[True, False, True], [True, True]],  # member 0
               [[True, False, False], [False, True]]]  # member 1: position (0, 1) missed by both
    cfg = colbt_config(Path("unused"), colbt=dict(strength=3.0, scheme="linear"))
    weighted = with_boost_weights(records, covered, cfg)
    w = [x for r in weighted for x in r["weights"]]
    assert w[1] == pytest.approx(4 * w[0]) and w[0] == w[2] == w[3] == w[4]
    assert sum(w) == pytest.approx(5.0)
    assert "weights" not in records[0]  # the caller's records are left alone
    assert all(r["weights"] is None for r in with_boost_weights(records, [], cfg))


def test_held_out_split_keeps_prompts_together(records):
    train, held = split_held_out(records, 3, seed=0)
    held_ids = {r["prompt_id"] for r in held}
    assert len(held_ids) == 3 and len(held) == 6 and len(train) == len(records) - 6
    assert not held_ids & {r["prompt_id"] for r in train}
    with pytest.raises(ValueError, match="colbt.holdout"):
        split_held_out(records, 12, seed=0)


@pytest.mark.parametrize("key,value", [("members", []), ("rule", "top2"), ("scheme", "ada"), ("m", 0),
                                       ("strength", -1.0), ("holdout", 0), ("branches", 0), ("max_tree_nodes", 1)])
def test_bad_colbt_settings_name_the_key(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"colbt.{key}"):
        colbt_config(tmp_path, colbt={key: value})
    with pytest.raises(ConfigError, match="loss"):
        colbt_config(tmp_path, loss="fkl")


def test_the_job_config_names_only_known_fields(tmp_path):
    import yaml

    from tests.conftest import ROOT

    values = yaml.safe_load((ROOT / "configs/distill/smollm2_colbt.yaml").read_text())
    known = {f.name for f in dataclasses.fields(DistillConfig)}
    assert set(values) <= known, set(values) - known
    assert values["method"] == "colbt" and len(values["colbt"]["members"]) == 3
    assert colbt_config(tmp_path, colbt=values["colbt"]).colbt.max_tree_nodes == values["colbt"]["max_tree_nodes"]
