"""scripts/draft_vocab_coverage.py: the held-out share a reduced draft vocabulary can propose, on real teacher data."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from distill.teacher_data import TeacherDataSettings, generate_teacher_data
from distill.vocab import select_draft_vocab
from tests.distill.conftest import VOCAB_SIZE, make_tiny_target
from tests.distill.test_teacher_data import make_prompts

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "draft_vocab_coverage.py"


def load_script():
    spec = importlib.util.spec_from_file_location("draft_vocab_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    settings = TeacherDataSettings(max_new_tokens=10, greedy=True, num_samples=0, temperature=1.0, topk=0,
                                   batch_size=3, shard_size=4, seed=1)
    data = generate_teacher_data(make_tiny_target(), make_prompts(6), settings, out_dir=out)
    return out, Counter(t for r in data for t in r["response_ids"])


def write_turns(path: Path, baseline: list[list[int]], other: list[int]) -> Path:
    with open(path, "w") as f:
        for tokens in baseline:
            f.write(json.dumps({"method": "baseline", "tokens": tokens}) + "\n")
        f.write(json.dumps({"method": "speculative[x]", "tokens": other}) + "\n")  # never counted
    return path


def test_held_out_share_is_the_hand_count_and_grows_to_one(teacher_dir, tmp_path):
    script = load_script()
    out, counts = teacher_dir
    held_out = [[0, 1, 2, 3, 10, 20], [30, 40, 50, 63]]
    turns = write_turns(tmp_path / "turns.jsonl", held_out, other=[5] * 100)
    sizes = [2, 8, 16, VOCAB_SIZE]
    rows = script.main(["--teacher-data", str(out), "--turns", str(turns), "--sizes", *map(str, sizes),
                        "--target-vocab", str(VOCAB_SIZE), "--eos", "2", "--out", str(tmp_path / "c.json")])
    tokens = [t for turn in held_out for t in turn]
    for row in rows:  # the script's share is exactly the share of baseline tokens inside the selection
        chosen = set(select_draft_vocab(counts, row["size"], VOCAB_SIZE, always=[2]).tolist())
        assert row["held_out"] == pytest.approx(sum(t in chosen for t in tokens) / len(tokens))
        assert row["id_order"] == pytest.approx(sum(t < row["size"] for t in tokens) / len(tokens))
    assert [r["held_out"] for r in rows] == sorted(r["held_out"] for r in rows)  # a larger head never covers less
    assert rows[-1]["held_out"] == rows[-1]["training"] == 1.0  # the whole vocabulary covers everything
    assert json.loads((tmp_path / "c.json").read_text()) == rows


def test_a_turns_file_without_baseline_turns_is_refused(tmp_path):
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"method": "speculative[x]", "tokens": [1, 2]}) + "\n")
    with pytest.raises(SystemExit, match="no baseline turns"):
        load_script().baseline_tokens(turns)
