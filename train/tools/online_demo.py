"""Online distillation, end to end: a server, the daemon beside it, and a shifted-domain stream of clients.

    specdistill online-demo --requests 500 --out runs/online_demo \
        [--drafter runs/smollm2_general/drafter] [--anchor-prompts SPEC... | --anchor-data DIR] [--no-rehearse-own]
        [--stream gsm8k.jsonl]

0. the general-domain anchor: the target's answers to general prompts the drafter never trained on
   (Arena-Hard v0.1 by default; teacher data, cached by content), which the daemon rehearses and keeps a
   held-out part of as its guard against forgetting. A guard made of the drafter's own training data
   would measure the memorised examples, which any update perturbs, and reject every candidate. The
   drafter's own training data is rehearsed too (never judged by): found in the cache by the training
   job's content key, it is what the drafter knew;
1. the drafter (trained on general prompts by train/distill.py, configs/distill/smollm2_general.yaml: no
   GSM8K, so the stream is a domain it has not seen) becomes version 0 of a drafter store;
2. its acceptance is measured with the engine on held-out GSM8K questions (the shifted domain) and on
   MT-bench first turns (general prompts);
3. `python -m decode.serve` serves the store and `train/online.py` tails its log, both as subprocesses;
4. N GSM8K questions (disjoint from the held-out ones and from the drafter's training prompts) go through
   /v1/chat/completions, greedy, one client at a time, as a client would send them;
5. once the daemon has used every request, the served version is measured again on the same held-out
   sets; every logged response is checked against the target's own greedy choice (one teacher-forced
   forward per request: a greedy output is the target's iff every token is the argmax after its prefix);
6. DIR/metrics.json and DIR/acceptance.png (specdistill plot-online) are written.

A run interrupted after step 3 (all requests served) is completed with `--finish` and the same arguments: the
daemon runs again until it has used every logged request (it resumes from its ledger in DIR/daemon; a daemon that
had finished stops at once), then steps 5-6 on the store and logs already in DIR.

With `--engine vllm` (`make vllm`), step 3 serves through vLLM instead: the logging front and swap supervisor
(`python -m specdistill.train.engine_swap`) start a vLLM server with v000000's vLLM export as its draft model, the
daemon exports each version it publishes (`export_vllm`) and reads vLLM's own spec-decode counters from the front's
/metrics (`engine_metrics_url`), and the supervisor swaps engines to each new version. The live curve is then
vLLM's acceptance per window of requests (from the daemon's journal), plotted beside a built-in run's
(`--beside DIR/metrics.json`). vLLM drafts over the whole vocabulary, so the per-request prompt vocabulary
(`--prompt-vocab`) is the built-in engine's alone.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from specdistill.decode.questions import load_questions
from specdistill.decode.request_log import list_segments, segment_name
from specdistill.distill.prompts import exclusion_texts, load_prompt_sources
from specdistill.distill.teacher_data import (
    TeacherDataSettings,
    generate_teacher_data,
    teacher_data_dir,
    teacher_data_key,
)
from specdistill.models.drafter_store import current_version, init_store, set_manifest_extra, version_path
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target
from specdistill.train.acceptance import measure_acceptance
from specdistill.train.online_vllm import export_version_for_vllm

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("specdistill.online_demo")
SHARED = ROOT.parent / "shared" / "data"
# general prompts outside smollm2_general's training set (163 after skipping the 3 in-loop eval prompts)
ANCHOR_PROMPTS = [f"jsonl:{SHARED / 'arena_hard' / 'question_v0.1.jsonl'}?limit=163"]
ENGINES = ("builtin", "vllm")
MODEL_NAME = "specdistill"  # the model id the demo's clients ask either server for


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--out", required=True, help="output directory (must not hold an earlier run)")
    p.add_argument("--target", default=None, help="default: the embedded smollm2-135m")
    p.add_argument("--drafter", default="runs/smollm2_general/drafter", help="the general-domain drafter")
    p.add_argument("--anchor-data", default="", help="teacher-data directory the daemon rehearses and guards "
                   "with; default: made from --anchor-prompts")
    p.add_argument("--anchor-prompts", nargs="+", default=ANCHOR_PROMPTS, metavar="SPEC",
                   help="prompt source specs of the anchor's general prompts (the drafter's own training prompts "
                   "and MT-bench are excluded); 'none' = no anchor")
    p.add_argument("--rehearse-own", action=argparse.BooleanOptionalAction, default=True,
                   help="the daemon also rehearses the drafter's own training data (found by its manifest)")
    p.add_argument("--anchor-tokens", type=int, default=128, help="longest anchor answer, in tokens")
    p.add_argument("--stream", default=str(SHARED / "gsm8k" / "train.jsonl"), help="JSONL of shifted-domain "
                   "questions (a `question` field, or the formats distill.prompts reads)")
    p.add_argument("--stream-offset", type=int, default=1000, help="first stream question used")
    p.add_argument("--heldout", type=int, default=24, help="held-out shifted-domain questions (from index 500)")
    p.add_argument("--general", type=int, default=16, help="MT-bench first turns for the general alpha")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=50, help="requests per window of the live-alpha curve")
    p.add_argument("--config", default=str(ROOT / "configs" / "online" / "smollm2_gsm8k.yaml"))
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--daemon-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="daemon config overrides, e.g. update_every_requests=25")
    p.add_argument("--engine", choices=ENGINES, default="builtin",
                   help="who serves the stream: this project's server, or vLLM behind the logging front with the "
                   "swap supervisor (make vllm)")
    p.add_argument("--beside", default="", help="--engine vllm: a built-in run's metrics.json whose live alpha is "
                   "plotted beside vLLM's")
    p.add_argument("--swap-mode", choices=("auto", "two-engines", "stop-start"), default="auto",
                   help="--engine vllm: the supervisor's --mode (auto: two engines when memory allows)")
    p.add_argument("--prompt-vocab", action=argparse.BooleanOptionalAction, default=None,
                   help="serve, train and measure the drafter with its reduced head extended per request by the "
                   "prompt's own tokens (v000000's manifest gets extra.prompt_vocab; the server, the daemon and "
                   "every published version follow it). On by default: two 500-request runs kept MT-bench within "
                   "0.015 with it, against 0.024-0.025 without (docs/journal.md)); the built-in engine's only")
    p.add_argument("--finish", action="store_true", help="complete a run in --out whose stream was served: the "
                   "daemon resumes until it has used every request, then the final measurement (steps 5-6)")
    p.add_argument("--daemon-timeout", type=float, default=3600.0,
                   help="seconds the daemon may take after the stream to use the last requests (then it is "
                   "stopped and `--finish` completes the run)")
    return resolve_engine_options(p.parse_args(argv))


def resolve_engine_options(args: argparse.Namespace) -> argparse.Namespace:
    """--prompt-vocab defaults to on for the built-in engine and cannot be asked of vLLM, which drafts over the
    whole vocabulary (the export writes a reduced head back to it); --beside names a built-in run for vLLM's."""
    if args.engine == "vllm" and args.prompt_vocab:
        raise SystemExit("--prompt-vocab: vLLM drafts over the whole vocabulary; the per-request prompt vocabulary "
                         "is the built-in engine's only (use --no-prompt-vocab or leave it out with --engine vllm)")
    if args.beside and args.engine != "vllm":
        raise SystemExit(f"--beside {args.beside}: only with --engine vllm (a built-in run to plot vLLM's beside)")
    if args.prompt_vocab is None:
        args.prompt_vocab = args.engine == "builtin"
    return args


# ---- prompts ---------------------------------------------------------------------------------------

def read_questions(path: str, start: int, count: int) -> list[str]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            rec = json.loads(line)
            out.append(rec.get("question") or rec.get("prompt") or rec["turns"][0])
            if len(out) == count:
                break
    if len(out) < count:
        raise SystemExit(f"{path} has only {len(out)} questions from index {start}; asked for {count}")
    return out


def general_prompts(target, n: int) -> list[list[int]]:
    questions = load_questions(str(SHARED / "mt_bench" / "question.jsonl"))[:n]
    return [target.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]


def chat_ids(target, questions: list[str]) -> list[list[int]]:
    return [target.encode_chat([{"role": "user", "content": q}]) for q in questions]


# ---- the general-domain anchor ---------------------------------------------------------------------------

def drafter_training_texts(drafter_dir: str) -> set[str]:
    """Normalized texts of the file prompts the drafter was trained on (its manifest's config, limits
    honoured), to keep out of the anchor; self-prompts are the target's own and cannot be listed."""
    manifest = json.loads((Path(drafter_dir) / "manifest.json").read_text())
    specs = [rooted(spec) for spec in (manifest.get("config") or {}).get("prompts") or []
             if not spec.startswith("self:")]
    return exclusion_texts(specs)


def drafter_teacher_data(target, drafter_dir: str) -> str:
    """The teacher-data directory the drafter was trained on, found by the training job's own content key
    (its manifest's prompts and generation settings); made again, resumably, if the cache lacks it."""
    from types import SimpleNamespace

    from specdistill.train.distill_steps import teacher_data_plan

    config = json.loads((Path(drafter_dir) / "manifest.json").read_text()).get("config") or {}
    if not config.get("prompts"):
        raise SystemExit(f"--rehearse-own: {drafter_dir}'s manifest records no training prompts; "
                         "pass --no-rehearse-own")
    config["prompts"] = [rooted(s) for s in config["prompts"]]
    config["exclude_prompts"] = [rooted(s) for s in config.get("exclude_prompts") or []]
    prompts, settings, out_dir = teacher_data_plan(SimpleNamespace(**config), target)
    generate_teacher_data(target, prompts, settings, out_dir=out_dir)
    log.info("the drafter's own teacher data %s: %d prompts", out_dir, len(prompts))
    return str(out_dir)


def rooted(spec: str) -> str:
    """A jsonl spec relative to the project root (where training jobs run) made absolute."""
    kind, _, rest = spec.partition(":")
    if kind == "jsonl" and not Path(rest.split("?")[0]).is_absolute():
        return f"jsonl:{ROOT / rest}"
    return spec


def make_anchor_data(target, args) -> str:
    """Teacher data of general prompts the drafter never saw: the daemon's rehearsal set and guard."""
    excluded = exclusion_texts([f"jsonl:{SHARED / 'mt_bench' / 'question.jsonl'}",
                                f"jsonl:{SHARED / 'arena_hard' / 'question_v0.1.jsonl'}?limit=3"])
    excluded |= drafter_training_texts(args.drafter)
    prompts = load_prompt_sources(args.anchor_prompts, target=target, exclude=excluded)
    if not prompts:
        raise SystemExit(f"--anchor-prompts {args.anchor_prompts!r} gave no prompts after the exclusions")
    settings = TeacherDataSettings(max_new_tokens=args.anchor_tokens, greedy=True, batch_size=16,
                                   max_prompt_tokens=288)
    out_dir = teacher_data_dir(teacher_data_key(target, prompts, settings))
    generate_teacher_data(target, prompts, settings, out_dir=out_dir)
    log.info("anchor data %s: %d general prompts", out_dir, len(prompts))
    return str(out_dir)


# ---- measuring ---------------------------------------------------------------------------------------

def engine_alpha(target, drafter_dir: Path, prompts: list[list[int]], max_tokens: int, gamma: int) -> dict:
    """The engine's acceptance with the version as the server drafts with it (its manifest's prompt_vocab)."""
    drafter = load_drafter(str(drafter_dir), target)
    prompt_vocab = drafter.vocab_map is not None and bool((drafter.manifest.get("extra") or {}).get("prompt_vocab"))
    stats = measure_acceptance(target, drafter.model, drafter.vocab_map, prompts, max_tokens, gamma, prompt_vocab)
    return {"token_acceptance": stats["acceptance_per_position"][0], "alpha": stats["alpha"], "tau": stats["tau"],
            "acceptance_per_position": stats["acceptance_per_position"], "prompt_vocab": prompt_vocab}


@torch.inference_mode()
def greedy_mismatches(target, records: list[dict], tie_tolerance: float = 1e-4) -> dict:
    """Responses that are not the target's greedy output: a token that is not the argmax after its prefix.
    A token within `tie_tolerance` of the argmax logit is a numerical tie, counted apart."""
    mismatches, ties = [], 0
    for rec in records:
        seq = rec["prompt_ids"] + rec["output_ids"]
        logits = target.model(torch.tensor([seq], device=target.device)).logits[0].float()  # [T, V]
        rows = logits[len(rec["prompt_ids"]) - 1: len(seq) - 1]  # [R, V] predicting each output token
        out = torch.tensor(rec["output_ids"], device=rows.device)
        chosen, best = rows.gather(1, out[:, None])[:, 0], rows.max(-1).values
        gap = best - chosen  # 0 where the output token is the argmax
        if bool((gap > tie_tolerance).any()):
            mismatches.append(rec["id"])
        elif bool((gap > 0).any()):
            ties += 1
    return {"mismatches": len(mismatches), "mismatched_ids": mismatches[:20], "numerical_ties": ties}


def read_log(log_dir: Path) -> list[dict]:
    out = []
    for n in list_segments(log_dir):
        out += [json.loads(x) for x in (log_dir / segment_name(n)).read_text().splitlines() if x.strip()]
    return out


def live_windows(records: list[dict], size: int) -> list[dict]:
    windows = []
    for start in range(0, len(records), size):
        chunk = records[start:start + size]
        drafted = sum(r["stats"]["drafted"] for r in chunk)
        accepted = sum(r["stats"]["accepted"] for r in chunk)
        first_drafted = sum(r["stats"]["drafted_per_position"][0] for r in chunk if r["stats"]["drafted_per_position"])
        first_accepted = sum(r["stats"]["accepted_per_position"][0] for r in chunk
                             if r["stats"]["accepted_per_position"])
        windows.append({"requests": [start, start + len(chunk)],
                        "alpha": first_accepted / first_drafted if first_drafted else None,
                        "accepted_over_drafted": accepted / drafted if drafted else None,
                        "tau": sum(r["stats"]["new_tokens"] for r in chunk) / sum(r["stats"]["target_forwards"]
                                                                                   for r in chunk),
                        "versions": sorted({r["drafter_version"] for r in chunk})})
    return windows


def served_by(times: list[float], t: float) -> int:
    """How many of the logged requests (their log times, sorted) had been answered at time t."""
    return bisect.bisect_right(times, t)


def engine_windows(rows: list[dict], size: int, served_times: list[float]) -> list[dict]:
    """vLLM's live acceptance per window of about `size` served requests, from the daemon's journal: each ingest
    row carries the increase of vLLM's spec-decode counters since the previous read, which covers every request
    the engine answered in that time (the daemon reads the log behind the engine, and not at all while it trains),
    so a read is placed by the requests answered by its time (`served_times`: the log's times, sorted), not by
    what the daemon had ingested. Consecutive reads are pooled until they span `size` requests; a window's
    `requests` is the span its reads cover. alpha is first-position acceptance (accepted at position 0 / drafts),
    as live_windows' is."""
    windows, start, served = [], 0, 0
    pooled = {"drafts": 0.0, "first_accepted": 0.0, "drafted": 0.0, "accepted": 0.0}

    def close(end: int) -> None:
        if pooled["drafts"]:
            windows.append({"requests": [start, end], "alpha": pooled["first_accepted"] / pooled["drafts"],
                            "accepted_over_drafted": pooled["accepted"] / pooled["drafted"] if pooled["drafted"]
                            else None, "tau": 1 + pooled["accepted"] / pooled["drafts"]})
        for key in pooled:
            pooled[key] = 0.0

    for row in rows:
        if row.get("event") != "ingest" or row.get("engine_drafts") is None:
            continue  # /metrics not read at this ingest: the next read covers its span
        served = served_by(served_times, row["time"])
        pooled["drafts"] += row["engine_drafts"]
        pooled["first_accepted"] += (row.get("engine_acceptance_per_position") or [0.0])[0] * row["engine_drafts"]
        pooled["drafted"] += row["engine_drafted"]
        pooled["accepted"] += row["engine_accepted"]
        if served - start >= size:
            close(served)
            start = served
    close(served)  # the reads short of a full window
    return windows


def placed(events, served_times: list[float]) -> list[dict]:
    """Journal events (the daemon's updates, the supervisor's engine events), each with `requests_served`: how
    many requests had been answered when it happened, the plot's x (the daemon's `requests_ingested` lags it)."""
    return [{**e, "requests_served": served_by(served_times, e["time"])} for e in events]


# ---- processes -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, store: Path, logs: Path, port: int, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdistill.decode.serve", "--drafter", str(store), "--log-dir", str(logs),
           "--port", str(port), "--model-name", "specdistill", "--gamma", str(args.gamma), "--no-adaptive",
           "--max-tokens-limit", "1024"]
    if args.target:
        cmd += ["--target", args.target]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(out / "server.log", "w"), stderr=subprocess.STDOUT)


def front_command(args, store: Path, logs: Path, port: int) -> list[str]:
    """The logging front with the swap supervisor, serving the store through vLLM (train.engine_swap)."""
    return [sys.executable, "-m", "specdistill.train.engine_swap", "--store", str(store),
            "--target", args.target or "smollm2-135m", "--log-dir", str(logs), "--port", str(port),
            "--model-name", MODEL_NAME, "--mode", args.swap_mode, "--num-speculative-tokens", str(args.gamma)]


def start_front(args, store: Path, logs: Path, port: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(front_command(args, store, logs, port), cwd=ROOT, stdout=open(out / "server.log", "w"),
                            stderr=subprocess.STDOUT)


def daemon_command(args, store: Path, logs: Path, work: Path, port: int) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train" / "online.py"), "--config", args.config, "--log_dir", str(logs),
           "--store", str(store), "--work_dir", str(work), "--init_drafter", str(Path(args.drafter).absolute()),
           "--stop_after_requests", str(args.requests), "--gamma", str(args.gamma)]
    if args.engine == "vllm":  # each version in vLLM's format for the supervisor; vLLM's counters for the live alpha
        cmd += ["--export_vllm", "true", "--engine_metrics_url", f"http://127.0.0.1:{port}/metrics"]
    if args.target:
        cmd += ["--target", args.target]
    if args.anchor_data:
        cmd += ["--anchor_data", str(Path(args.anchor_data).expanduser())]
    if args.rehearsal_data:
        cmd += ["--rehearsal_data", args.rehearsal_data]
    for item in args.daemon_set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--daemon-set {item!r}: expected KEY=VALUE")
        cmd += [f"--{key}", value]
    return cmd


def start_daemon(args, store: Path, logs: Path, work: Path, port: int, out: Path, mode: str = "w") -> subprocess.Popen:
    return subprocess.Popen(daemon_command(args, store, logs, work, port), cwd=ROOT,
                            stdout=open(out / "daemon.log", mode), stderr=subprocess.STDOUT)


def complete_learning(args, store: Path, logs: Path, work: Path, out: Path) -> None:
    """--finish: the daemon again, resuming from its ledger, until it has used every logged request (its log
    appended to). No server runs now, so with --engine vllm its engine reads find nothing and it goes on without."""
    daemon = start_daemon(args, store, logs, work, args.port or free_port(), out, mode="a")
    wait_for(daemon, "daemon", timeout_s=args.daemon_timeout)


def wait_healthy(client: httpx.Client, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit("the server exited during start-up; see server.log")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy in time; see server.log")


def replay_stream(client: httpx.Client, questions: list[str], max_tokens: int) -> list[dict]:
    """Each answer's speculation record: the built-in server's `speculative` field; through the logging front
    (vLLM), which adds none, the response's id and the engine's fingerprint."""
    answers = []
    for i, q in enumerate(questions):
        r = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": max_tokens,
                                                      "temperature": 0, "messages": [{"role": "user", "content": q}]})
        if r.status_code != 200:
            raise SystemExit(f"request {i} failed with {r.status_code}: {r.text[:300]}")
        body = r.json()
        answers.append(body.get("speculative") or {"id": body.get("id"), "drafter_version": None})
        if (i + 1) % 25 == 0:
            log.info("%d/%d requests served (version %s)", i + 1, len(questions), answers[-1]["drafter_version"])
    return answers


def wait_for(proc: subprocess.Popen, name: str, timeout_s: float) -> None:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"the {name} did not finish in {timeout_s:.0f} s; it was stopped (rerun with --finish to "
                         "complete the run)") from None
    if rc != 0:
        raise SystemExit(f"the {name} exited with {rc}; see its log")


def read_daemon_metrics(work: Path) -> list[dict]:
    path = work / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# ---- main --------------------------------------------------------------------------------------------

def measure_before(target, args, store: Path, heldout, general, out: Path) -> dict:
    """The starting version's acceptance, kept in DIR/before.json so that `--finish` can complete a run."""
    t0 = time.time()
    before = {"heldout": engine_alpha(target, version_path(store, "v000000"), heldout, args.max_tokens, args.gamma),
              "general": engine_alpha(target, version_path(store, "v000000"), general, args.max_tokens, args.gamma)}
    (out / "before.json").write_text(json.dumps(before, indent=1))
    log.info("before: held-out alpha %.3f, general alpha %.3f (%.0f s)", before["heldout"]["token_acceptance"],
             before["general"]["token_acceptance"], time.time() - t0)
    return before


def serve_and_learn(target, args, store: Path, logs: Path, work: Path, out: Path, stream: list[str]) -> None:
    """Steps 3-4: the server and the daemon as subprocesses, the stream replayed through HTTP; returns once the
    daemon has used every request. DIR/serve.json records the replay."""
    port = args.port or free_port()
    vllm = args.engine == "vllm"
    if vllm:  # the supervisor's first engine serves v000000's vLLM export; the daemon, which exports every later
        export_version_for_vllm(store, "v000000", target, args.gamma)  # version, starts once that engine is healthy
    server = start_front(args, store, logs, port, out) if vllm else start_server(args, store, logs, port, out)
    daemon = None
    try:
        # the front listens once its first vLLM engine is healthy (it compiles for minutes); a stop-start swap holds
        # a request in the front's line while the next one compiles
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800 if vllm else 600) as client:
            wait_healthy(client, server, timeout_s=1800 if vllm else 300)
            daemon = start_daemon(args, store, logs, work, port, out)
            t1 = time.time()
            answers = replay_stream(client, stream, args.max_tokens)
            (out / "serve.json").write_text(json.dumps({"requests": len(answers), "serve_seconds": time.time() - t1}))
        wait_for(daemon, "daemon", timeout_s=args.daemon_timeout)
    finally:
        server.terminate()
        server.wait(timeout=60)
        if daemon is not None and daemon.poll() is None:
            daemon.kill()


def finish(target, args, store: Path, logs: Path, work: Path, out: Path, heldout, general, before: dict) -> dict:
    """Steps 5-6: the final version measured on the same sets, every response checked, metrics written."""
    final = current_version(store)
    after = {"heldout": engine_alpha(target, version_path(store, final), heldout, args.max_tokens, args.gamma),
             "general": engine_alpha(target, version_path(store, final), general, args.max_tokens, args.gamma)}
    records = read_log(logs)
    check = greedy_mismatches(target, records)
    journal = read_daemon_metrics(work)
    served_times = sorted(r["time"] for r in records)
    updates = placed((e for e in journal if e["event"] == "update"), served_times)
    served = json.loads((out / "serve.json").read_text()) if (out / "serve.json").exists() else {}
    metrics = {
        "requests": served.get("requests", len(records)), "logged": len(records), "max_tokens": args.max_tokens,
        "gamma": args.gamma,
        "engine": args.engine,
        "windows": (engine_windows(journal, args.window, served_times) if args.engine == "vllm"
                    else live_windows(records, args.window)),
        "builtin_windows": json.loads(Path(args.beside).read_text())["windows"] if args.beside else None,
        "engine_swaps": placed((e for e in journal if e["event"].startswith("engine_")), served_times),
        "alpha_first_window": before["heldout"]["token_acceptance"],
        "alpha_last_window": after["heldout"]["token_acceptance"],
        "general_alpha_before": before["general"]["token_acceptance"],
        "general_alpha_after": after["general"]["token_acceptance"],
        "heldout_before": before["heldout"], "heldout_after": after["heldout"],
        "general_before": before["general"], "general_after": after["general"],
        "mismatches": check["mismatches"], "mismatch_check": check,
        "versions_published": sum(1 for e in updates if e["published"]),
        "rollbacks": sum(1 for e in updates if not e["published"]),
        "final_version": final, "daemon_updates": updates,
        "serve_seconds": served.get("serve_seconds"), "anchor_data": args.anchor_data or None,
        "rehearsal_data": args.rehearsal_data or None,
        "definitions": {
            "alpha": "the token acceptance rate of OSD and Leviathan et al.: P(the first draft of a step is "
                     "accepted), measured by the engine (greedy, fixed gamma). The engine's accepted / drafted "
                     "over all gamma positions is reported beside it (heldout_before.alpha etc.)",
            "alpha_first_window": "alpha on held-out shifted-domain questions with the version that served the "
                                  "first window (v000000)",
            "alpha_last_window": "the same with the version serving at the end of the stream",
            "general_alpha_before/after": "alpha on MT-bench first turns with v000000 / the final version",
            "windows": "the server's live alpha per window of requests: the built-in server's from its request "
                       "log; vLLM's from its own spec-decode counters, read by the daemon at each ingest",
            "builtin_windows": "--beside: the built-in run's windows, plotted beside vLLM's",
        },
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    from specdistill.train.tools.plot_online import plot

    plot(metrics, out / "acceptance.png")
    log.info("held-out alpha %.3f -> %.3f; general %.3f -> %.3f; %d mismatches; %d published, %d rollbacks",
             metrics["alpha_first_window"], metrics["alpha_last_window"], metrics["general_alpha_before"],
             metrics["general_alpha_after"], metrics["mismatches"], metrics["versions_published"], metrics["rollbacks"])
    return metrics


def check_finishable(out: Path, store: Path, logs: Path, requests: int) -> None:
    """`--finish` completes a run whose stream was served and learned from; anything less is an error."""
    if not (store.exists() and logs.exists()):
        raise SystemExit(f"--finish: {out} holds no served run (no store/ or logs/)")
    logged = len(read_log(logs))
    if logged < requests:
        raise SystemExit(f"--finish: {out} logged {logged} of {requests} requests; the stream did not complete")


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out).absolute()
    store, logs, work = out / "store", out / "logs", out / "daemon"
    if args.finish:
        check_finishable(out, store, logs, args.requests)
    elif out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} holds an earlier run; choose another --out, delete it, or --finish it")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stream = read_questions(args.stream, args.stream_offset, args.requests)
    heldout_q = read_questions(args.stream, 500, args.heldout)
    if not args.finish:
        init_store(store, args.drafter)
        if args.prompt_vocab:
            set_manifest_extra(version_path(store, "v000000"), prompt_vocab=True)
    target = load_target(args.target)
    if not args.anchor_data and args.anchor_prompts != ["none"]:  # cached: --finish only looks it up
        args.anchor_data = make_anchor_data(target, args)
    args.rehearsal_data = drafter_teacher_data(target, args.drafter) if args.rehearse_own and args.anchor_data else ""
    heldout, general = chat_ids(target, heldout_q), general_prompts(target, args.general)
    if args.finish and (out / "before.json").exists():
        before = json.loads((out / "before.json").read_text())
    else:  # v000000 is the starting drafter, so a finished run can measure it again
        before = measure_before(target, args, store, heldout, general, out)
    if args.finish:
        complete_learning(args, store, logs, work, out)
    else:
        serve_and_learn(target, args, store, logs, work, out, stream)
    return finish(target, args, store, logs, work, out, heldout, general, before)


if __name__ == "__main__":
    main()
