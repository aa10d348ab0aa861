"""specdistill head-coverage: the share of plain decoding's answer tokens a reduced head holds, and with each turn's
prompt (the earlier answers included, as the evaluation rebuilt them)."""

import json

import pytest
import torch

from specdistill.models.drafters import save_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.target import load_target
from specdistill.train.tools import head_coverage
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_tokenizer


@pytest.fixture
def tiny_target_dir(tmp_path):
    path = tmp_path / "target"
    make_tiny_llama(layers=2, seed=0).save_pretrained(path)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    return path


def write_report(report, questions, target_dir, rows):
    report.mkdir()
    config = {"questions": str(questions), "limit": None, "per_category": None, "target_name": str(target_dir)}
    (report / "report.json").write_text(json.dumps({"config": config}))
    (report / "turns.jsonl").write_text("".join(json.dumps({"question_id": "1", "category": "writing", "turn": k,
                                                            "method": m, "tokens": t}) + "\n" for m, k, t in rows))


def test_answer_tokens_in_the_head_and_in_each_turns_prompt(tmp_path, tiny_target_dir):
    target = load_target(str(tiny_target_dir))
    drafter = Eagle3Drafter.for_target(target.model, torch.arange(4, 30), [0, 1, 1], seed=3).eval()
    save_drafter(tmp_path / "drafter", drafter, target, "eagle3", dict(drafter.config))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "1", "category": "writing", "turns": ["w40 w41", "w50"]}) + "\n")
    rows = [("baseline", 0, [5, 40, 45]), ("baseline", 1, [45, 50, 60]), ("speculative", 0, [1, 2, 3])]
    write_report(tmp_path / "report", questions, tiny_target_dir, rows)
    result = head_coverage.main([str(tmp_path / "report"), "--drafter", str(tmp_path / "drafter")])
    result = result[str(tmp_path / "report")]
    # the head holds 5 alone; the prompts hold 40 (turn 0), then 45 (turn 0's answer) and 50 (turn 1); 60 is nowhere
    assert result["all"] == {"tokens": 6, "head": round(1 / 6, 4), "head_or_prompt": round(4 / 6, 4)}
    assert list(result) == ["writing", "all"]
    saved = json.loads((tmp_path / "report" / "head_coverage.json").read_text())
    assert saved["coverage"] == result and saved["head_tokens"] == 26


def test_a_full_head_and_a_report_without_plain_decoding_are_errors(tmp_path, tiny_target_dir):
    target = load_target(str(tiny_target_dir))
    full = Eagle3Drafter.for_target(target.model, None, [0, 1, 1], seed=3).eval()
    save_drafter(tmp_path / "full", full, target, "eagle3", dict(full.config))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "1", "category": "writing", "turns": ["w40"]}) + "\n")
    write_report(tmp_path / "report", questions, tiny_target_dir, [("baseline", 0, [5])])
    with pytest.raises(SystemExit, match="full vocabulary"):
        head_coverage.main([str(tmp_path / "report"), "--drafter", str(tmp_path / "full")])
    reduced = Eagle3Drafter.for_target(target.model, torch.arange(4, 30), [0, 1, 1], seed=3).eval()
    save_drafter(tmp_path / "reduced", reduced, target, "eagle3", dict(reduced.config))
    write_report(tmp_path / "other", questions, tiny_target_dir, [("speculative", 0, [5])])
    with pytest.raises(SystemExit, match="no 'baseline' turns"):
        head_coverage.main([str(tmp_path / "other"), "--drafter", str(tmp_path / "reduced")])
