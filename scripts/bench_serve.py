"""Load benchmark of the serving endpoint: concurrent streaming clients on loopback, a bounded request mix.

    .venv/bin/python scripts/bench_serve.py [--drafter prompt_lookup] [--concurrency 1 4 16] [--requests 16]
        [--max-tokens 64] [--questions ../shared/data/mt_bench/question.jsonl] [--out runs/bench_serve]

Starts `python -m decode.serve` on the default target (a subprocess, as a user runs it), then for each
concurrency level sends the same requests (MT-bench first turns, greedy, streamed) from that many clients at
once and reports throughput (generated tokens/s over the level's wall time), p50/p95/p99 end-to-end latency and
time to first token, and failures. The peer is a vLLM server (`vllm serve` with n-gram speculation) from the
vLLM environment of the vLLM issue; where that environment does not exist the report says so.
Writes OUT/bench_serve.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ours(drafter: str, port: int, log_dir: str, max_queue: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "decode.serve", "--port", str(port), "--log-dir", log_dir, "--device", "cpu",
           "--max-queue", str(max_queue), "--model-name", "default"]
    if drafter != "none":
        cmd += ["--drafter", drafter]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout_s:.0f} s")


def load_prompts(path: str, n: int) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] if "turns" in r else r["prompt"] for r in rows]
    return [prompts[i % len(prompts)] for i in range(n)]


def one_request(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy chat request: latency, time to first token, generated tokens."""
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"ok": True, "latency_s": end - start, "ttft_s": (first or end) - start, "tokens": tokens}


def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    todo = list(enumerate(prompts))
    lock, results = threading.Lock(), []

    def client_loop():
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    _, prompt = todo.pop(0)
                results.append(one_request(client, model, prompt, max_tokens))

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    lat, ttft = sorted(r["latency_s"] for r in ok), sorted(r["ttft_s"] for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
            "wall_s": wall, "tokens": sum(r["tokens"] for r in ok),
            "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
            **{f"latency_p{q}_s": percentile(lat, q) for q in (50, 95, 99)},
            **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 95, 99)}}


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def bench_ours(args, drafter: str) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir = tempfile.mkdtemp(prefix="bench-serve-logs-")
    proc = start_ours(drafter, port, log_dir, max_queue=max(args.concurrency) + 1)
    try:
        wait_healthy(proc, url)
        prompts = load_prompts(args.questions, args.requests)
        one_request(httpx.Client(base_url=url, timeout=600), "default", prompts[0], 8)  # warm-up
        return [run_level(url, "default", prompts, c, args.max_tokens) for c in args.concurrency]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(log_dir, ignore_errors=True)


def vllm_status() -> str | None:
    """None when a vLLM environment exists; else why the vLLM peer cannot run."""
    if not VLLM_PYTHON.exists():
        return f"not run: no vLLM environment at {VLLM_PYTHON.parent.parent} (built by `make vllm`, the vLLM issue)"
    return "not run: the vLLM server peer is not wired into this benchmark yet"


def table(rows: list[dict]) -> str:
    head = ("| server | clients | requests | failed | tokens/s | p50 s | p95 s | p99 s | TTFT p50 s | TTFT p95 s "
            "| TTFT p99 s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['failed']} | {r['throughput_tok_s']:.1f} "
             f"| {fmt(r['latency_p50_s'])} | {fmt(r['latency_p95_s'])} | {fmt(r['latency_p99_s'])} "
             f"| {fmt(r['ttft_p50_s'])} | {fmt(r['ttft_p95_s'])} | {fmt(r['ttft_p99_s'])} |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", default=None,
                   help="drafter(s) our server runs with (repeatable; 'none' = plain decoding); "
                        "default: prompt_lookup")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--questions", default=str(ROOT.parent / "shared/data/mt_bench/question.jsonl"))
    p.add_argument("--out", default="runs/bench_serve")
    args = p.parse_args(argv)
    rows = []
    for drafter in args.drafter or ["prompt_lookup"]:
        for row in bench_ours(args, drafter):
            rows.append({"server": f"specdistill[{drafter}]", **row})
            print(json.dumps(rows[-1]), flush=True)
    peer = vllm_status()
    report = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "args": vars(args),
              "rows": rows, "vllm": peer or "run"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.json").write_text(json.dumps(report, indent=2))
    print(table(rows))
    print(f"\nvLLM peer: {peer}")


if __name__ == "__main__":
    main()
