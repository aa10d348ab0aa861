"""The online demo's general-domain anchor must not contain what the drafter trained on."""

from __future__ import annotations

import json

from specdistill.distill.prompts import load_prompts, normalize_text
from specdistill.train.tools.online_demo import drafter_training_texts


def test_the_anchor_excludes_the_drafters_file_prompts_with_their_limits(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question number {i}?"}) + "\n" for i in range(6)))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "manifest.json").write_text(json.dumps({"config": {"prompts": [f"jsonl:{prompts}?limit=2",
                                                                              "self:4"]}}))
    texts = drafter_training_texts(str(drafter))
    assert texts == {normalize_text(p.text) for p in load_prompts(f"jsonl:{prompts}")[:2]}


def test_a_drafter_without_a_training_config_excludes_nothing(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"kind": "draft_model"}))
    assert drafter_training_texts(str(tmp_path)) == set()


def test_finish_refuses_a_run_whose_stream_did_not_complete(tmp_path):
    import pytest

    from specdistill.decode.request_log import segment_name
    from specdistill.train.tools.online_demo import check_finishable

    with pytest.raises(SystemExit, match="no served run"):
        check_finishable(tmp_path, tmp_path / "store", tmp_path / "logs", 3)
    (tmp_path / "store").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / segment_name(0)).write_text("".join(json.dumps({"id": f"r{i}"}) + "\n" for i in range(2)))
    with pytest.raises(SystemExit, match="logged 2 of 3 requests"):
        check_finishable(tmp_path, tmp_path / "store", tmp_path / "logs", 3)
    check_finishable(tmp_path, tmp_path / "store", tmp_path / "logs", 2)  # complete: no error
