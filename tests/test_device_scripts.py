"""scripts/device: drafters trained on a lent GPU come back whole (pieces, fp16 transport, fp32 again)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from models.drafters import load_drafter, save_drafter
from models.eagle3 import Eagle3Drafter
from tests.models.conftest import make_tiny_target

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "device"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pack, unpack = load_script("pack_drafters"), load_script("unpack_drafters")


@pytest.fixture
def trained_runs(tmp_path):
    """runs/gpu_final (a published drafter), runs/gpu_best (only work_dir/best: stopped early), runs/gpu_none."""
    target = make_tiny_target(seed=0, layers=3)
    vocab_map = torch.tensor([1, 3, 4, 7, 9, 12, 20, 33])
    drafters = {}
    for name, where, seed in (("gpu_final", "drafter", 1), ("gpu_best", "drafter.work/best", 2)):
        drafter = Eagle3Drafter.for_target(target.model, vocab_map, [0, 1, 2], seed=seed)
        save_drafter(tmp_path / "runs" / name / where, drafter, target, "eagle3", config=dict(drafter.config),
                     extra={"step": 7 * seed, "held_out_tau": 1.5})
        drafters[name] = drafter
    (tmp_path / "runs" / "gpu_none").mkdir()
    return target, drafters, tmp_path / "runs"


def test_drafters_come_back_with_fp16_values_and_load(trained_runs, tmp_path, capsys):
    target, drafters, runs = trained_runs
    out = tmp_path / "out"
    out.mkdir()
    pieces = pack.main(out, [runs / "gpu_final", runs / "gpu_best", runs / "gpu_none"], piece_bytes=20_000)
    assert len(pieces) > 1 and all(p.stat().st_size <= 20_000 for p in pieces)
    printed = capsys.readouterr().out
    assert "gpu_final final" in printed and "gpu_best best" in printed and "gpu_none no drafter" in printed

    written = unpack.main(out, tmp_path / "back")
    assert [p.parent.name for p in written] == ["gpu_best", "gpu_final"]
    for path in written:
        original = drafters[path.parent.name].state_dict()
        loaded = load_drafter(path, target)
        assert loaded.kind == "eagle3"
        for key, value in loaded.model.state_dict().items():
            assert value.dtype == original[key].dtype  # fp32 again, integer buffers untouched
            expected = original[key].half().float() if original[key].is_floating_point() else original[key]
            assert torch.equal(value, expected), key
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["extra"]["held_out_tau"] == 1.5


def test_missing_or_cut_pieces_are_refused_by_name(trained_runs, tmp_path):
    _, _, runs = trained_runs
    out = tmp_path / "out"
    out.mkdir()
    pieces = pack.main(out, [runs / "gpu_final"], piece_bytes=5_000)
    assert len(pieces) >= 3
    last = pieces[-1].read_bytes()
    pieces[-1].write_bytes(last[: len(last) // 2])
    with pytest.raises(SystemExit, match="whole gzip stream"):
        unpack.main(out, tmp_path / "back")
    pieces[1].unlink()
    with pytest.raises(SystemExit, match="ship.tgz.01"):
        unpack.main(out, tmp_path / "back")
    assert not (tmp_path / "back").exists()
