"""`specdistill replay-online` (train.tools.replay_online): a logged stream replayed through the daemon's update
rule, offline."""

from __future__ import annotations

import json

from specdistill.decode.request_log import RequestLogWriter
from specdistill.distill.replay import is_held_out
from specdistill.models.target import load_target
from tests.online.support import prompt_for, save_target_dir, save_tiny_drafter, served_record


def test_replay_trains_on_the_non_held_out_requests_and_writes_the_agreement_curve(tmp_path, monkeypatch):
    from specdistill.train.tools.replay_online import main

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    target_dir = save_target_dir(tmp_path / "target")
    target = load_target(str(target_dir))
    drafter = save_tiny_drafter(tmp_path / "drafter", target, seed=1)
    writer = RequestLogWriter(tmp_path / "logs", max_bytes=4096)
    records = [served_record(target, f"req-{i:03d}", prompt_for(i)) for i in range(24)]
    for r in records:
        writer.append(r)
    writer.close()
    config = tmp_path / "online.yaml"
    config.write_text(f"target: {target_dir}\nlog_dir: x\nstore: x\nwork_dir: x\ntopk: 8\nbatch_size: 4\n"
                      "max_seq_len: 96\nholdout_every: 5\n")
    out = tmp_path / "curve.json"
    result = main(["--logs", str(tmp_path / "logs"), "--out", str(out), "--drafter", str(drafter),
                   "--config", str(config), "--set", "lr=3e-3", "--steps", "4", "--every", "2",
                   "--heldout", "3", "--general", "2", "--max-tokens", "6"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    held_out = sum(is_held_out(r["id"], 5) for r in records)
    assert 0 < held_out < len(records)
    assert result["settings"]["training_requests"] == len(records) - held_out
    assert [row["step"] for row in result["curve"]] == [0, 2, 4]
    for row in result["curve"]:
        assert 0.0 <= row["heldout"] <= 1.0 and 0.0 <= row["mt_bench"] <= 1.0
    assert all(row["loss"] > 0 for row in result["curve"][1:])
