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
