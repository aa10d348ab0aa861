"""Benchmark: the two teacher-data backends on the same prompts (`teacher_backend: builtin` and `vllm`).

    .venv/bin/python scripts/teacher_backends.py [--prompts SOURCE] [--limit 64] [--max-new-tokens 128]
        [--batch-size 16] [--out runs/teacher_backends]

Both write one shard of the same prompts with the same settings, greedy (distill.teacher_data.generate_shard):
the built-in generator (the target here, batched `generate`) and vLLM's offline batched generation (after
`make vllm`; its engine start is timed apart). Prints each backend's answer tokens per second and how often the
greedy answers agree token for token (and, where not, the first differing position). Writes DIR/backends.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from distill.prompts import load_prompt_sources  # noqa: E402
from distill.teacher_data import TeacherDataSettings, generate_shard  # noqa: E402
from distill.teacher_vllm import VllmTeacher  # noqa: E402
from models.target import load_target  # noqa: E402
from scripts.bench_engine import first_difference  # noqa: E402

DEFAULT_PROMPTS = f"jsonl:{ROOT.parent / 'shared' / 'data' / 'arena_hard' / 'question_v2.0.jsonl'}"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="the built-in generator's batch (vLLM batches itself)")
    p.add_argument("--max-prompt-tokens", type=int, default=288,
                   help="skip longer prompts, as the distill configs do (max_seq_len); 0 keeps all")
    p.add_argument("--out", default="runs/teacher_backends")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = load_target()
    prompts = load_prompt_sources([args.prompts], target=target)
    if args.max_prompt_tokens:  # the first `limit` prompts that a training job would keep
        prompts = [p for p in prompts if len(target.encode_chat(p.messages)) <= args.max_prompt_tokens]
    prompts = prompts[:args.limit]
    settings = {backend: TeacherDataSettings(max_new_tokens=args.max_new_tokens, greedy=True, batch_size=args.batch_size,
                                             shard_size=len(prompts), backend=backend,
                                             max_prompt_tokens=args.max_prompt_tokens or None)
                for backend in ("builtin", "vllm")}
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads()}
    start = time.perf_counter()
    rows = {"builtin": generate_shard(target, prompts, settings["builtin"], 0)}
    report["builtin_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with VllmTeacher(target) as teacher:
        report["vllm_startup_s"] = time.perf_counter() - start
        start = time.perf_counter()
        rows["vllm"] = generate_shard(target, prompts, settings["vllm"], 0, teacher)
        report["vllm_s"] = time.perf_counter() - start
    for backend in rows:
        tokens = sum(len(r["response_ids"]) for r in rows[backend])
        report[f"{backend}_tokens"] = tokens
        report[f"{backend}_tok_s"] = tokens / report[f"{backend}_s"]
    pairs = list(zip(rows["builtin"], rows["vllm"]))
    assert all(a["prompt_id"] == b["prompt_id"] for a, b in pairs)
    firsts = [first_difference(a["response_ids"], b["response_ids"]) for a, b in pairs]
    report["identical"] = sum(f is None for f in firsts)
    report["first_difference"] = firsts
    print(f"{len(prompts)} prompts of at most {args.max_prompt_tokens} tokens, {args.max_new_tokens} new tokens, "
          f"greedy, {report['threads']} threads")
    print("| backend | answer tokens | seconds | tok/s |")
    print("|---|---|---|---|")
    for backend in rows:
        extra = f" (+{report['vllm_startup_s']:.0f} s engine start)" if backend == "vllm" else ""
        print(f"| {backend} | {report[backend + '_tokens']} | {report[backend + '_s']:.1f}{extra} | "
              f"{report[backend + '_tok_s']:.1f} |")
    print(f"greedy answers identical token for token: {report['identical']} of {len(pairs)}; first differing "
          f"positions of the others: {sorted(f for f in firsts if f is not None)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":  # vLLM's engine core starts by spawn
    main()
