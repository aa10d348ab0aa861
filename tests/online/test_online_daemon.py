"""The online daemon: every request used exactly once across restarts and crashes, bad lines to the dead
letters with their reason, candidates published only when acceptance does not fall."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from specdistill.decode.request_log import RequestLogWriter, segment_name
from specdistill.models.drafter_store import current_version, list_versions
from specdistill.models.target import load_target
from specdistill.train.config import ConfigError
from specdistill.train.online import OnlineDaemon
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_state import DEAD, METRICS, STATE, USED
from tests.conftest import ROOT
from tests.online.support import prompt_for, save_target_dir, save_tiny_drafter, served_record


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    target_dir = save_target_dir(root / "target")
    target = load_target(str(target_dir))
    drafter = save_tiny_drafter(root / "drafter", target, seed=1)
    records = [served_record(target, f"req-{i:03d}", prompt_for(i)) for i in range(40)]
    return {"root": root, "target_dir": target_dir, "target": target, "drafter": drafter, "records": records}


def config(env, tmp_path, **kw) -> OnlineConfig:
    base = dict(target=str(env["target_dir"]), log_dir=str(tmp_path / "logs"), store=str(tmp_path / "store"),
                init_drafter=str(env["drafter"]), work_dir=str(tmp_path / "work"), read_batch=5,
                update_every_requests=1000, min_buffer=4, topk=8, steps_per_update=4, batch_size=4,
                max_seq_len=64, holdout_every=5, poll_seconds=0.05, device="cpu")
    base.update(kw)
    return OnlineConfig(**base)


def write_log(tmp_path, records, max_bytes=4096):
    writer = RequestLogWriter(tmp_path / "logs", max_bytes=max_bytes)
    for r in records:
        writer.append(r)
    writer.close()


def used_ids(work):
    return [json.loads(x)["id"] for x in (work / USED).read_text().splitlines()]


def drain(daemon):
    from specdistill.decode.request_log import read_lines
    while lines := read_lines(daemon.cfg.log_dir, daemon.state.position, daemon.cfg.read_batch):
        daemon.ingest(lines)


def test_offsets_survive_a_restart(env, tmp_path):
    write_log(tmp_path, env["records"][:20])
    cfg = config(env, tmp_path)
    first = OnlineDaemon(cfg)
    drain(first)
    position = first.state.position
    write_log(tmp_path, env["records"][20:])
    second = OnlineDaemon(cfg)
    assert second.state.position == position and second.state.counters.ingested == 20
    drain(second)
    ids = used_ids(tmp_path / "work")
    assert sorted(ids) == sorted(r["id"] for r in env["records"]) and len(ids) == 40
    assert len(second.state.buffer) + len(second.state.buffer.holdout) == 40


@pytest.mark.parametrize("crash_at", ["after_chunk", "after_journal", "before_state_rename"])
def test_a_crash_inside_a_commit_neither_loses_nor_repeats_a_request(env, tmp_path, monkeypatch, crash_at):
    write_log(tmp_path, env["records"][:15])
    cfg = config(env, tmp_path)
    daemon = OnlineDaemon(cfg)
    from specdistill.decode.request_log import read_lines
    daemon.ingest(read_lines(cfg.log_dir, daemon.state.position, 5))  # one clean commit first

    import specdistill.train.online_state as st

    class Crash(Exception):
        pass

    def boom(*a, **k):
        raise Crash

    if crash_at == "after_chunk":
        real = st.write_chunk
        monkeypatch.setattr(st, "write_chunk", lambda *a, **k: (real(*a, **k), boom()))
    elif crash_at == "after_journal":
        monkeypatch.setattr(st.OnlineState, "commit", boom)
    else:
        monkeypatch.setattr(st.os, "replace", boom)
    with pytest.raises(Crash):
        daemon.ingest(read_lines(cfg.log_dir, daemon.state.position, 5))
    monkeypatch.undo()
    restarted = OnlineDaemon(cfg)
    assert restarted.state.counters.ingested == 5
    drain(restarted)
    ids = used_ids(tmp_path / "work")
    assert sorted(ids) == sorted(r["id"] for r in env["records"][:15])


def test_each_kind_of_bad_line_goes_to_the_dead_letters_and_good_lines_around_it_are_used(env, tmp_path):
    good = env["records"][:6]
    foreign = dict(env["records"][6], id="foreign", tokenizer_fingerprint="0" * 64)
    missing = {k: v for k, v in env["records"][7].items() if k not in ("output_ids", "stats")}
    wrong_type = dict(env["records"][8], id="wrongtype", prompt_ids="w1 w2")
    bad_ids = dict(env["records"][9], id="badids", output_ids=[1, 10**6])
    oversized = dict(env["records"][10], id="huge", prompt="w9 " * 3000)
    (tmp_path / "logs").mkdir()
    lines = [json.dumps(good[0]), "this is not json", json.dumps(good[1]), json.dumps(foreign), json.dumps(missing),
             json.dumps(good[2]), json.dumps(wrong_type), json.dumps(bad_ids), json.dumps(oversized),
             json.dumps(good[3]), json.dumps(good[3]), "[1, 2]", json.dumps(good[4])]
    seg0 = "\n".join(lines) + "\n" + json.dumps(good[5])[:40]  # the segment ends in a cut line
    (tmp_path / "logs" / segment_name(0)).write_text(seg0)
    (tmp_path / "logs" / segment_name(1)).write_text(json.dumps(good[5]) + "\n")
    daemon = OnlineDaemon(config(env, tmp_path, max_line_bytes=5000))
    drain(daemon)
    letters = [json.loads(x) for x in (tmp_path / "work" / DEAD).read_text().splitlines()]
    reasons = [x["reason"].split(":")[0] for x in letters]
    assert reasons == ["not JSON", "foreign", "missing fields", "wrong types", "output_ids", "oversized",
                       "duplicate", "not a JSON object", "truncated"]
    assert "output_ids, stats" in letters[2]["reason"]
    assert sorted(used_ids(tmp_path / "work")) == sorted(r["id"] for r in good)


def test_sigkill_at_random_points_during_a_stream_then_restart_uses_every_request_exactly_once(env, tmp_path):
    cfg_path = tmp_path / "online.yaml"
    cfg = config(env, tmp_path, read_batch=3, update_every_requests=6, steps_per_update=25,
                 stop_when_idle_seconds=1.0)
    cfg_path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in vars(cfg).items()) + "\n")
    cmd = [sys.executable, str(ROOT / "train" / "online.py"), "--config", str(cfg_path)]
    env_vars = {**os.environ, "PYTHONPATH": str(ROOT)}

    def stream():  # the server keeps logging while the daemon is killed and restarted; segments rotate
        writer = RequestLogWriter(tmp_path / "logs", max_bytes=3000)
        for r in env["records"]:
            writer.append(r)
            time.sleep(0.3)
        writer.close()

    import threading
    (tmp_path / "logs").mkdir()
    server = threading.Thread(target=stream)
    server.start()
    rng = random.Random(0)
    kills = 0
    for _ in range(5):
        proc = subprocess.Popen(cmd, env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(1.0, 9.0))  # start-up takes seconds: some kills land in it, most in the work
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    server.join()
    print(f"kills: {kills}")
    assert kills >= 3, "the daemon finished before it could be killed: give it more work"
    final = subprocess.run(cmd, env=env_vars, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    ids = used_ids(tmp_path / "work")
    from collections import Counter
    twice = [i for i, n in Counter(ids).items() if n > 1]
    missing = sorted({r["id"] for r in env["records"]} - set(ids))
    assert not twice and not missing, (f"after {kills} kills: used twice {twice}, missing {missing}; "
                                       f"{final.stderr[-3000:]}")
    state = json.loads((tmp_path / "work" / STATE).read_text())
    assert state["counters"]["ingested"] == 40 and state["counters"]["updates"] >= 1
    assert current_version(tmp_path / "store") in list_versions(tmp_path / "store")


def test_an_update_publishes_a_better_candidate_and_rolls_back_a_worse_one(env, tmp_path, monkeypatch):
    write_log(tmp_path, env["records"])
    cfg = config(env, tmp_path, steps_per_update=30, lr=3e-3, batch_size=8)
    daemon = OnlineDaemon(cfg)
    drain(daemon)
    daemon.update()
    events = [json.loads(x) for x in (tmp_path / "work" / METRICS).read_text().splitlines()]
    first = [e for e in events if e["event"] == "update"][-1]
    assert first["published"], first["reason"]
    assert first["heldout_alpha_candidate"] >= first["heldout_alpha_served"]
    assert current_version(tmp_path / "store") == "v000001"

    import torch

    import specdistill.train.online as online

    def sabotage(model, *a, **k):
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        return 0.0

    monkeypatch.setattr(online, "train_candidate", sabotage)
    daemon.state.counters.since_update = 1
    daemon.update()
    last = [json.loads(x) for x in (tmp_path / "work" / METRICS).read_text().splitlines()][-1]
    assert not last["published"] and "held-out alpha" in last["reason"]
    assert current_version(tmp_path / "store") == "v000001" and daemon.state.counters.rollbacks == 1


def test_config_errors_name_the_field(env, tmp_path):
    with pytest.raises(ConfigError, match="store"):
        OnlineConfig(log_dir="x", work_dir="y")
    with pytest.raises(ConfigError, match="loss"):
        config(env, tmp_path, loss="kl")
    with pytest.raises(ConfigError, match="init_drafter"):
        OnlineDaemon(config(env, tmp_path, init_drafter=""))


def test_plot_reads_a_daemon_journal(env, tmp_path):
    from specdistill.train.tools.plot_online import from_daemon_journal, plot

    write_log(tmp_path, env["records"][:24])
    daemon = OnlineDaemon(config(env, tmp_path))
    drain(daemon)
    daemon.update()
    metrics = from_daemon_journal(tmp_path / "work" / METRICS)
    assert len(metrics["daemon_updates"]) == 1 and metrics["windows"]
    png = plot(metrics, tmp_path / "a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vocab_growth_adds_the_traffics_missing_tokens_to_a_reduced_head_and_publishes_the_grown_map(
        env, tmp_path, monkeypatch):
    import torch

    import specdistill.train.online as online
    from specdistill.distill.vocab import count_response_tokens
    from specdistill.models.draft_models import reduce_head
    from specdistill.models.drafters import load_drafter, save_drafter
    from tests.conftest import make_tiny_llama
    from tests.online.support import VOCAB

    vocab_map = torch.arange(0, VOCAB, 4)  # a quarter of the vocabulary: the traffic needs tokens it lacks
    model = reduce_head(make_tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=1), vocab_map)
    drafter = save_drafter(tmp_path / "reduced", model, env["target"], "draft_model", config={},
                           vocab_map=vocab_map)
    write_log(tmp_path, env["records"])
    cfg = config(env, tmp_path, init_drafter=str(drafter), vocab_growth=5, vocab_growth_min_count=2)
    daemon = OnlineDaemon(cfg)
    drain(daemon)
    counts = count_response_tokens(e.record() for e in daemon.state.buffer.train.values())
    frequent_missing = [t for t, c in counts.items() if c >= 2 and t % 4]
    assert len(frequent_missing) >= 5
    monkeypatch.setattr(online, "decide", lambda served, trial, cfg: (True, "forced"))
    daemon.update()
    event = [json.loads(x) for x in (tmp_path / "work" / METRICS).read_text().splitlines()][-1]
    assert event["published"] and event["head_rows_added"] == 5
    published = load_drafter(str(tmp_path / "store" / "versions" / "v000001"), env["target"])
    grown = published.vocab_map.tolist()
    assert grown[:len(vocab_map)] == vocab_map.tolist() and len(grown) == len(vocab_map) + 5
    assert set(grown[len(vocab_map):]) <= set(frequent_missing)
    assert published.model.get_output_embeddings().weight.shape[0] == len(grown)
    assert daemon.vocab_map.tolist() == grown  # the next update grows from the published map


def test_the_guard_comes_from_the_anchor_only_and_rehearsal_data_is_rehearsed_whole(env, tmp_path):
    from specdistill.distill.prompts import Prompt
    from specdistill.distill.teacher_data import TeacherDataSettings, generate_teacher_data
    from specdistill.train.online import load_anchors
    from tests.online.support import words

    settings = TeacherDataSettings(max_new_tokens=6, greedy=True, batch_size=4)

    def teacher_dir(name, first):
        prompts = [Prompt(f"{name}{i}", [{"role": "user", "content": words(prompt_for(first + i))}]) for i in range(5)]
        generate_teacher_data(env["target"], prompts, settings, out_dir=tmp_path / name)
        return str(tmp_path / name)

    anchor, own = teacher_dir("anchor", 0), teacher_dir("own", 25)
    rehearse, guard = load_anchors(config(env, tmp_path, anchor_data=anchor, anchor_guard=2, rehearsal_data=[own]))
    own_rows = load_anchors(config(env, tmp_path, anchor_data=own, anchor_guard=0))[0]
    assert len(guard) == 2 and len(rehearse) == 3 + len(own_rows)
    guarded = {tuple(g.prompt_ids) for g in guard}
    assert not guarded & {tuple(r["prompt_ids"]) for r in rehearse}  # judged, never rehearsed
    assert not guarded & {tuple(r["prompt_ids"]) for r in own_rows}  # the guard is the anchor's alone
    with pytest.raises(ConfigError, match="rehearsal_data"):
        load_anchors(config(env, tmp_path, rehearsal_data=[own]))


def test_a_drafter_served_with_prompt_vocab_is_judged_and_trained_with_it_and_its_versions_keep_it(
        env, tmp_path, monkeypatch):
    import torch

    import specdistill.train.online as online
    import specdistill.train.online_learn as learn
    from specdistill.models.draft_models import reduce_head
    from specdistill.models.drafters import load_drafter, save_drafter
    from tests.conftest import make_tiny_llama
    from tests.online.support import VOCAB

    vocab_map = torch.arange(0, VOCAB, 2)
    model = reduce_head(make_tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=1), vocab_map)
    drafter = save_drafter(tmp_path / "reduced", model, env["target"], "draft_model", config={},
                           vocab_map=vocab_map, extra={"prompt_vocab": True})
    write_log(tmp_path, env["records"])
    seen = {"acceptance": set(), "train": set()}
    real_acceptance, real_train = learn.acceptance, learn.train_candidate

    def spy_acceptance(*a, **kw):
        seen["acceptance"].add(a[6] if len(a) > 6 else kw.get("prompt_vocab", False))
        return real_acceptance(*a, **kw)

    def spy_train(*a, **kw):
        seen["train"].add(kw.get("prompt_vocab", False))
        return real_train(*a, **kw)

    monkeypatch.setattr(online, "acceptance", spy_acceptance)
    monkeypatch.setattr(online, "train_candidate", spy_train)
    monkeypatch.setattr(online, "decide", lambda served, trial, cfg: (True, "forced"))
    daemon = OnlineDaemon(config(env, tmp_path, init_drafter=str(drafter)))
    assert daemon.prompt_vocab is True
    drain(daemon)
    daemon.update()
    assert seen == {"acceptance": {True}, "train": {True}}
    published = load_drafter(str(tmp_path / "store" / "versions" / "v000001"), env["target"])
    assert published.manifest["extra"]["prompt_vocab"] is True
    off = OnlineDaemon(config(env, tmp_path / "off", init_drafter=str(drafter), prompt_vocab="off"))
    assert off.prompt_vocab is False
