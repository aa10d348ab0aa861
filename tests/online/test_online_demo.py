"""The online demo's general-domain anchor must not contain what the drafter trained on."""

from __future__ import annotations

import json

import pytest

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


def demo_args(*extra: str):
    from specdistill.train.tools.online_demo import parse_args

    return parse_args(["--out", "/tmp/unused", *extra])


def test_vllm_engine_defaults_the_prompt_vocabulary_off_and_refuses_it_when_asked():
    import pytest

    assert demo_args().prompt_vocab is True and demo_args().engine == "builtin"
    assert demo_args("--engine", "vllm").prompt_vocab is False
    with pytest.raises(SystemExit, match="--prompt-vocab"):
        demo_args("--engine", "vllm", "--prompt-vocab")
    with pytest.raises(SystemExit, match="--beside"):
        demo_args("--beside", "runs/x/metrics.json")


def test_with_vllm_the_daemon_exports_versions_and_reads_the_fronts_metrics(tmp_path):
    from specdistill.train.tools.online_demo import daemon_command, front_command

    args = demo_args("--engine", "vllm", "--gamma", "4", "--swap-mode", "stop-start")
    args.anchor_data, args.rehearsal_data = "", ""
    daemon = daemon_command(args, tmp_path / "store", tmp_path / "logs", tmp_path / "work", 8123)
    assert daemon[daemon.index("--export_vllm") + 1] == "true"
    assert daemon[daemon.index("--engine_metrics_url") + 1] == "http://127.0.0.1:8123/metrics"
    front = front_command(args, tmp_path / "store", tmp_path / "logs", 8123)
    assert front[front.index("--port") + 1] == "8123" and front[front.index("--mode") + 1] == "stop-start"
    assert front[front.index("--num-speculative-tokens") + 1] == "4"
    builtin = demo_args()
    builtin.anchor_data, builtin.rehearsal_data = "", ""
    assert "--export_vllm" not in daemon_command(builtin, tmp_path / "s", tmp_path / "l", tmp_path / "w", 1)


def ingest_row(time: float, requests: int, drafts: float, first: float, drafted: float, accepted: float) -> dict:
    return {"event": "ingest", "time": time, "requests_ingested": requests, "engine_drafts": drafts,
            "engine_drafted": drafted, "engine_accepted": accepted,
            "engine_acceptance_per_position": [first / drafts, 0.0]}


def test_vllms_windows_place_each_read_by_the_requests_served_by_its_time():
    """A read of vLLM's counters covers every request the engine answered since the previous read, however few
    the daemon had ingested (it reads the log behind the engine, and not while it trains)."""
    import pytest

    from specdistill.train.tools.online_demo import engine_windows, placed

    served = [float(t) for t in range(1, 61)]  # request i answered at time i
    rows = [ingest_row(10.5, 4, 100, 10, 500, 12),  # 10 served, 4 ingested
            ingest_row(20.5, 8, 300, 90, 1500, 100),  # 20 served
            {"event": "ingest", "time": 25.5, "requests_ingested": 9, "engine_drafts": None},  # not read: skipped
            {"event": "update", "time": 26.0, "requests_ingested": 9},
            ingest_row(55.5, 10, 50, 40, 250, 60)]  # one read after the update spans requests 21-55
    windows = engine_windows(rows, 20, served)
    assert [w["requests"] for w in windows] == [[0, 20], [20, 55]]
    assert windows[0]["alpha"] == pytest.approx((10 + 90) / (100 + 300))  # weighted by drafts, not a mean of ratios
    assert windows[0]["accepted_over_drafted"] == pytest.approx(112 / 2000)
    assert windows[1]["alpha"] == pytest.approx(40 / 50) and windows[1]["tau"] == pytest.approx(1 + 60 / 50)
    tail = engine_windows(rows[:1], 20, served)  # reads short of a window: what they cover
    assert [w["requests"] for w in tail] == [[0, 10]]
    assert [e["requests_served"] for e in placed(rows[3:4], served)] == [26]


def test_the_plot_draws_vllms_curve_beside_the_builtin_one(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from specdistill.train.tools.plot_online import plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its lines

    metrics = {"engine": "vllm",
               "windows": [{"requests": [0, 20], "alpha": 0.1}, {"requests": [20, 40], "alpha": 0.3}],
               "builtin_windows": [{"requests": [0, 20], "alpha": 0.2}], "requests": 40,
               "engine_swaps": [{"event": "engine_swap", "requests_ingested": 25}],
               "alpha_first_window": 0.1, "alpha_last_window": 0.3, "general_alpha_before": 0.2,
               "general_alpha_after": 0.2, "versions_published": 1, "rollbacks": 0, "mismatches": 0}
    assert plot(metrics, tmp_path / "a.png").is_file()
    ax = figures[0].axes[0]
    curves = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
              if not line.get_label().startswith("_")}
    assert curves["vLLM's live alpha (its /metrics, per window)"] == [0.1, 0.3]
    assert curves["built-in server's live alpha (its log, per window)"] == [0.2]
    assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("_")] == [25]  # the swap


def test_plot_online_beside_reads_a_builtin_runs_windows_and_refuses_a_vllm_run(tmp_path, monkeypatch):
    from specdistill.train.tools import plot_online

    drawn = []
    monkeypatch.setattr(plot_online, "plot", lambda metrics, out: drawn.append(metrics) or out)
    vllm = {"engine": "vllm", "windows": [{"requests": [0, 20], "alpha": 0.1}]}
    builtin = {"engine": "builtin", "windows": [{"requests": [0, 20], "alpha": 0.2}]}
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    (tmp_path / "builtin.json").write_text(json.dumps(builtin))
    plot_online.main([str(tmp_path / "vllm.json"), "--beside", str(tmp_path / "builtin.json")])
    assert drawn[0]["builtin_windows"] == builtin["windows"] and drawn[0]["windows"] == vllm["windows"]
    with pytest.raises(SystemExit, match="vllm.json: not a built-in"):
        plot_online.main([str(tmp_path / "vllm.json"), "--beside", str(tmp_path / "vllm.json")])


def test_with_vllm_the_first_version_is_exported_before_the_front_starts(tmp_path, monkeypatch):
    """The supervisor's first engine serves v000000's vLLM export, and the daemon (which writes the later ones)
    starts only once that engine is healthy: the demo must write the first export itself, before the front."""
    from specdistill.train.tools import online_demo

    calls = []
    monkeypatch.setattr(online_demo, "export_version_for_vllm",
                        lambda store, version, target, gamma: calls.append(("export", version, gamma)))

    def front(*a, **k):
        calls.append(("front",))
        raise RuntimeError("stop here")

    monkeypatch.setattr(online_demo, "start_front", front)
    monkeypatch.setattr(online_demo, "start_server", front)
    args = demo_args("--engine", "vllm", "--gamma", "4")
    with pytest.raises(RuntimeError, match="stop here"):
        online_demo.serve_and_learn(object(), args, tmp_path / "store", tmp_path / "logs", tmp_path / "work", tmp_path,
                                    [])
    assert calls == [("export", "v000000", 4), ("front",)]
    calls.clear()
    with pytest.raises(RuntimeError, match="stop here"):
        online_demo.serve_and_learn(object(), demo_args(), tmp_path / "store", tmp_path / "logs", tmp_path / "work",
                                    tmp_path, [])
    assert calls == [("front",)]


def test_finish_lets_the_daemon_use_the_last_requests_before_measuring(tmp_path, monkeypatch):
    """A daemon stopped mid-update (the stream served, its last requests not yet learned from) resumes under
    --finish, its log appended to, before the final measurement; one that overruns is stopped, naming --finish."""
    from specdistill.train.tools import online_demo

    class Daemon:
        def __init__(self, rc=0, hangs=False):
            self.rc, self.hangs, self.killed = rc, hangs, False

        def wait(self, timeout=None):
            if self.hangs:
                import subprocess
                raise subprocess.TimeoutExpired("daemon", timeout)
            return self.rc

        def kill(self):
            self.killed = True

    started = []
    monkeypatch.setattr(online_demo, "start_daemon", lambda *a, mode="w", **k: started.append(mode) or Daemon())
    args = demo_args("--finish", "--daemon-timeout", "5")
    online_demo.complete_learning(args, tmp_path / "store", tmp_path / "logs", tmp_path / "work", tmp_path)
    assert started == ["a"]
    hung = Daemon(hangs=True)
    monkeypatch.setattr(online_demo, "start_daemon", lambda *a, **k: hung)
    with pytest.raises(SystemExit, match="--finish"):
        online_demo.complete_learning(args, tmp_path / "store", tmp_path / "logs", tmp_path / "work", tmp_path)
    assert hung.killed
