"""The online loop where users serve, with everything real but the engine (fake engines stand in for vLLM): clients
through the logging front, the daemon learning from its log and publishing a version with its vLLM export, the
supervisor swapping engines to it while clients keep sending; every answered request logged once and used once."""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specdistill.decode.request_log import LogPosition, read_lines
from specdistill.decode.upstream import build_front, create_front_app
from specdistill.models.drafter_store import current_version
from specdistill.models.export_vllm import PROVENANCE_FILE
from specdistill.models.target import load_target
from specdistill.train.engine_swap import CommandLauncher, Supervisor
from specdistill.train.online import OnlineDaemon
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_state import USED
from specdistill.train.online_vllm import read_engine_events, vllm_export_path
from tests.online.fake_upstream import MODEL, ServerThread
from tests.online.support import save_target_dir, save_tiny_drafter

FAKE = str(Path(__file__).with_name("fake_upstream.py"))


def send_all(url: str, prompts: list[str], stream_every: int = 3) -> list[tuple[int, str | None, str | None]]:
    """(status, engine version, upstream id) of each prompt, 8 clients at a time."""
    def one(i: int):
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 8}
        with httpx.Client(base_url=url, timeout=60) as client:
            if i % stream_every:
                r = client.post("/v1/chat/completions", json=body)
                return r.status_code, r.json().get("system_fingerprint"), r.json().get("id") or r.text
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                last = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")][-1]
            return r.status_code, last.get("system_fingerprint"), last.get("id")

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_front_daemon_and_supervisor_learn_publish_and_swap_without_losing_a_request(tmp_path):
    target_dir = save_target_dir(tmp_path / "target")
    target = load_target(str(target_dir))
    cfg = OnlineConfig(target=str(target_dir), log_dir=str(tmp_path / "logs"), store=str(tmp_path / "store"),
                       init_drafter=str(save_tiny_drafter(tmp_path / "drafter", target)),
                       work_dir=str(tmp_path / "work"), read_batch=16, min_buffer=4, topk=4, steps_per_update=3,
                       batch_size=4, max_seq_len=64, holdout_every=4, device="cpu", export_vllm=True,
                       min_gain=-1.0)  # publish whatever the update makes: this test is about the plumbing
    daemon = OnlineDaemon(cfg)
    front = build_front(target, None, cfg.log_dir, timeout_s=60)
    launcher = CommandLauncher((sys.executable, FAKE, "--port", "{port}", "--version", "{version}",
                                "--chunk-delay-s", "0.01"))
    supervisor = Supervisor(front.router, launcher, Path(cfg.store), health_timeout_s=30, drain_timeout_s=30,
                            export_wait_s=5, stop_grace_s=5)
    supervisor.start_first()
    try:
        with ServerThread(create_front_app(front)) as server:
            before = send_all(server.url, [f"w{10 + i % 30} w{20 + i % 11}" for i in range(24)])
            while lines := read_lines(cfg.log_dir, daemon.state.position, cfg.read_batch):
                daemon.ingest(lines)
            daemon.update()
            assert current_version(cfg.store) == "v000001"
            assert (vllm_export_path(cfg.store, "v000001") / PROVENANCE_FILE).is_file()
            during: list = []
            clients = threading.Thread(target=lambda: during.extend(
                send_all(server.url, [f"w{30 + i % 20} w{12 + i % 9}" for i in range(24)])))
            clients.start()
            assert supervisor.swap_if_new() is True
            clients.join()
            after = send_all(server.url, [f"w{15 + i % 25}" for i in range(8)])
    finally:
        supervisor.close()
    while lines := read_lines(cfg.log_dir, daemon.state.position, cfg.read_batch):
        daemon.ingest(lines)
    answered = before + during + after
    assert all(status == 200 for status, _, _ in answered), answered
    records = [json.loads(x.raw) for x in read_lines(cfg.log_dir, LogPosition(), 10_000)]
    assert sorted(r["upstream"]["id"] for r in records) == sorted(upstream_id for _, _, upstream_id in answered)
    used = [json.loads(x)["id"] for x in (Path(cfg.work_dir) / USED).read_text().splitlines()]
    assert sorted(used) == sorted(r["id"] for r in records)  # every logged request used by the daemon, once
    assert {version for _, version, _ in before} == {"v000000"}
    assert {version for _, version, _ in after} == {"v000001"}
    assert [e["version"] for e in read_engine_events(cfg.store) if e["event"] == "swap"] == ["v000001"]
