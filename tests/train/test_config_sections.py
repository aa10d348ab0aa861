"""The training config's method sections: YAML `eagle3: {steps: 4}`, flags `--eagle3.steps 4`, precedence
default < YAML < command line inside a section, old flat keys refused with their new spelling, unknown keys in
a section named, and the registry of methods agreeing with the config's sections."""

from __future__ import annotations

import dataclasses

import pytest

from specdistill.train.config import ConfigError, load_config, sections, to_dict
from specdistill.train.distill_config import DistillConfig
from specdistill.train.eagle3 import Eagle3Config
from specdistill.train.methods import method_named, methods


def job(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def test_a_section_in_yaml_sets_its_fields_and_the_rest_keep_their_defaults(tmp_path):
    cfg = load_config(DistillConfig, job(tmp_path, "method: eagle3\neagle3:\n  steps: 4\n  layers: [0, 1, 2]\n"))
    assert (cfg.eagle3.steps, cfg.eagle3.layers) == (4, [0, 1, 2])
    assert cfg.eagle3.decay == Eagle3Config().decay
    assert cfg.medusa is None and cfg.colbt is None and cfg.lookahead is None  # another method's: unset


def test_a_dotted_flag_sets_the_sections_field_over_the_yaml(tmp_path):
    argv = job(tmp_path, "method: eagle3\neagle3: {steps: 4, decay: 0.5}\n")
    cfg = load_config(DistillConfig, argv + ["--eagle3.steps", "2", "--eagle3.layers", "0", "1", "1"])
    assert (cfg.eagle3.steps, cfg.eagle3.decay, cfg.eagle3.layers) == (2, 0.5, [0, 1, 1])  # default < YAML < flag
    cfg = load_config(DistillConfig, ["--method", "medusa", "--medusa.sequential"])  # no YAML: a bool flag alone
    assert cfg.medusa.sequential is True and cfg.medusa.heads == 4


def test_the_methods_section_exists_with_its_defaults_when_not_given():
    assert load_config(DistillConfig, ["--method", "lookahead"]).lookahead.tokens == 4
    assert DistillConfig(method="colbt").colbt.max_tree_nodes == 16


@pytest.mark.parametrize("old, new", [("eagle3_layers", "eagle3.layers"), ("medusa_heads", "medusa.heads"),
                                      ("lookahead_branches", "lookahead.branches"),
                                      ("colbt_members", "colbt.members"), ("max_tree_nodes", "colbt.max_tree_nodes")])
def test_an_old_flat_key_is_refused_naming_its_new_spelling(tmp_path, old, new):
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        load_config(DistillConfig, job(tmp_path, f"method: seqkd\n{old}: 2\n"))
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        load_config(DistillConfig, [f"--{old}", "2"])
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        load_config(DistillConfig, [f"--{old}=2"])


def test_an_unknown_key_in_a_section_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="eagle3.stepz"):
        load_config(DistillConfig, job(tmp_path, "method: eagle3\neagle3: {stepz: 4}\n"))
    with pytest.raises(ConfigError, match="eagle3.stepz"):
        DistillConfig(method="eagle3", eagle3={"stepz": 4})
    with pytest.raises(SystemExit):  # argparse: no such flag
        load_config(DistillConfig, ["--method", "eagle3", "--eagle3.stepz", "4"])
    with pytest.raises(ConfigError, match="eagle3.steps: expected int"):
        load_config(DistillConfig, job(tmp_path, "method: eagle3\neagle3: {steps: many}\n"))
    with pytest.raises(ConfigError, match="eagle3 is a section"):
        load_config(DistillConfig, job(tmp_path, "method: eagle3\neagle3: 4\n"))


def test_a_section_of_another_method_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="medusa: a section of method medusa, but this job's method is eagle3"):
        load_config(DistillConfig, job(tmp_path, "method: eagle3\nmedusa: {heads: 2}\n"))
    with pytest.raises(ConfigError, match="eagle3: a section of method eagle3"):
        load_config(DistillConfig, ["--method", "seqkd", "--eagle3.steps", "2"])


def test_the_saved_config_holds_the_section_as_a_mapping_and_rebuilds_the_job():
    cfg = load_config(DistillConfig, ["--method", "eagle3", "--eagle3.steps", "3"])
    saved = to_dict(cfg)  # what manifests, summaries and trackers record
    assert saved["eagle3"]["steps"] == 3 and "medusa" not in saved and "eagle3_steps" not in saved
    assert DistillConfig(**saved) == cfg


def test_every_method_with_a_section_is_a_field_of_the_config_and_the_other_way_round():
    config_sections = sections(DistillConfig)
    with_section = {m.name: m.section for m in methods() if m.section is not None}
    assert config_sections == with_section
    assert {m.name for m in methods()} >= {"seqkd", "kd", "colbt", "medusa", "lookahead", "eagle3"}
    for name, kind in config_sections.items():  # every section field has help text
        assert all(f.metadata.get("help") for f in dataclasses.fields(kind)), name
    assert method_named("eagle3").budgeted and method_named("medusa").budgeted
    assert not method_named("lookahead").budgeted


def test_a_drafter_saved_with_the_flat_config_of_before_still_loads(tmp_path):
    """Manifests keep the config they were written with; loading reads only the architecture's keys."""
    from specdistill.models.drafters import load_drafter, save_drafter
    from specdistill.models.medusa import MedusaHeads
    from tests.train.support import peaked_tiny_target

    target = peaked_tiny_target(64, seed=0)
    heads = MedusaHeads.from_target(target.model, 2)
    flat = {**heads.config, "method": "medusa", "medusa_heads": 2, "medusa_tree_nodes": 4, "max_tree_nodes": 16}
    save_drafter(tmp_path / "old", heads, target, "medusa", config=flat, extra={"tree": [[0], [0, 0]]})
    drafter = load_drafter(str(tmp_path / "old"), target)
    assert drafter.kind == "medusa" and drafter.manifest["config"]["medusa_heads"] == 2
