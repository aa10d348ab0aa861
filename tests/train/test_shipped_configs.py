"""Every shipped job config loads: its fields exist and pass the config's checks (run from the repo root, as
the README's commands are)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdistill.train.config import load_config
from specdistill.train.distill_config import DistillConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs/distill").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_distill_config_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(DistillConfig, ["--config", str(path.relative_to(ROOT))])
    assert cfg.method and cfg.prompts


def shipped(name: str, monkeypatch) -> DistillConfig:
    monkeypatch.chdir(ROOT)
    return load_config(DistillConfig, ["--config", f"configs/distill/{name}"])


@pytest.mark.parametrize("name", ["qwen_coder_medusa.yaml", "qwen_coder_seqkd.yaml"])
def test_qwen_coder_jobs_share_the_eagle3_jobs_teacher_data(name, monkeypatch):
    """The real target's teacher data costs half an hour of a 2-core CPU: every qwen_coder job must ask for exactly
    what qwen_coder_eagle3.yaml asked for, everything distill.teacher_data keys its cache on (the target, the
    prompts and exclusions, the generation settings, the follow-up turns), so that it reads that cache."""
    from specdistill.train.distill_steps import teacher_settings

    eagle3, job = shipped("qwen_coder_eagle3.yaml", monkeypatch), shipped(name, monkeypatch)
    for field in ("target", "prompts", "exclude_prompts", "max_prompts", "seed", "follow_up_share", "follow_ups"):
        assert getattr(job, field) == getattr(eagle3, field), field
    assert teacher_settings(job) == teacher_settings(eagle3)


def test_qwen_coder_medusa_reads_the_eagle3_jobs_feature_cache(monkeypatch):
    """medusa.feature_layers names the EAGLE-3 job's layers (the feature cache's key), so its final states are read,
    not recomputed by a half-hour pass of the 1.5B."""
    eagle3, medusa = shipped("qwen_coder_eagle3.yaml", monkeypatch), shipped("qwen_coder_medusa.yaml", monkeypatch)
    assert medusa.medusa.feature_layers == eagle3.eagle3.layers and medusa.max_seq_len == eagle3.max_seq_len
    assert medusa.medusa.reduced_heads and medusa.draft_vocab == eagle3.draft_vocab
