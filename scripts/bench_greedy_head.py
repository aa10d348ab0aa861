"""Benchmark: the default target's head for greedy steps, every logit (the Q8_0 kernel's FMA form, then argmax)
against the greedy head (models.q41_linear.GreedyHead: an int8 pass with a bound, then the few candidates exactly),
and the whole forward each way (ModelRunner.forward against forward_greedy).

    .venv/bin/python scripts/bench_greedy_head.py [--rows 1 2 3 4 6 8] [--reps 25] [--out DIR]

First checks, on the final hidden states of real MT-bench prompts and on random rows, that the greedy head's token
is the full logits' argmax at every row, and counts the candidates it computed exactly. Then times, interleaved rep
by rep (medians): the head alone over N rows after a 100 MB sweep of memory (as in decoding, where the layers'
weights pushed the head out of the caches), and the forward over N rows after a 300-token prefix (not committed,
so each forward writes over the last). Prints tables; writes DIR/greedy_head.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decode.questions import load_questions  # noqa: E402  (ROOT on sys.path first)
from decode.runner import ModelRunner  # noqa: E402
from models.q41_linear import greedy_head_for, head_for_inference, vnni_unavailable  # noqa: E402
from models.target import load_target  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--questions", default=str(ROOT.parent / "shared/data/mt_bench/question.jsonl"))
    p.add_argument("--out", default="runs/bench_greedy_head")
    return p.parse_args(argv)


def check_tokens(target, full, greedy, questions) -> dict:
    """The greedy head's tokens against the full logits' argmax on real and random rows; candidate counts."""
    rows = []
    for question in questions:
        ids = target.encode_chat([{"role": "user", "content": question.turns[0]}])
        rows.append(target.model.model(torch.tensor([ids])).last_hidden_state[0])  # [T, D], after the final norm
    generator = torch.Generator().manual_seed(0)
    rows += [torch.randn(64, 576, generator=generator) * scale for scale in (0.1, 1.0, 10.0)]
    mismatches, counts = 0, []
    for block in torch.cat(rows).split(8):
        block = block.contiguous()
        tokens, candidates = greedy.tokens(block)
        mismatches += int((tokens != full(block[None])[0].argmax(-1)).sum())
        counts += candidates.tolist()
    return {"rows": len(counts), "mismatches": mismatches, "candidates_median": statistics.median(counts),
            "candidates_max": max(counts)}


def time_heads(full, greedy, rows_list, reps) -> dict:
    sweep = torch.randn(25_000_000)  # 100 MB
    x = torch.randn(max(rows_list), 576)
    times = {}
    for _ in range(reps):
        for n in rows_list:
            for name, call in (("full", lambda: full(x[None, :n])[0].argmax(-1)),
                               ("greedy", lambda: greedy.tokens(x[:n]))):
                sweep.add_(1.0)
                start = time.perf_counter()
                call()
                times.setdefault(f"{name} {n}", []).append(time.perf_counter() - start)
    return {key: 1000 * statistics.median(value) for key, value in times.items()}


def time_forwards(target, rows_list, reps) -> dict:
    runner = ModelRunner(target.model)
    runner.start(400)
    runner.forward(list(range(1000, 1300)), logits_rows=slice(299, 300))
    runner.cache.advance(300)
    times = {}
    for _ in range(reps):
        for n in rows_list:
            tokens = list(range(2000, 2000 + n))
            for name, call in (("full", runner.forward), ("greedy", runner.forward_greedy)):
                start = time.perf_counter()
                call(tokens)
                times.setdefault(f"{name} {n}", []).append(time.perf_counter() - start)
    return {key: 1000 * statistics.median(value) for key, value in times.items()}


@torch.inference_mode()
def main(argv=None) -> None:
    args = parse_args(argv)
    if (why := vnni_unavailable()) is not None:
        sys.exit(f"bench_greedy_head: the greedy head does not run here: {why}")
    target = load_target()
    head = target.model.get_output_embeddings()
    full, greedy = head_for_inference(head), greedy_head_for(head)
    if greedy is None:
        sys.exit("bench_greedy_head: the head is not the Q8_0 kernel's FMA form here (an AMX host?)")
    check = check_tokens(target, full, greedy, load_questions(args.questions, per_category=1)[:4])
    print(f"{check['rows']} rows: {check['mismatches']} tokens differ from the full logits' argmax; candidates "
          f"computed exactly per row: median {check['candidates_median']}, max {check['candidates_max']}")
    heads, forwards = time_heads(full, greedy, args.rows, args.reps), time_forwards(target, args.rows, args.reps)
    print(f"medians of {args.reps}, ms (x: the full head's or forward's time over the greedy one's)")
    print("| rows | head, every logit | greedy head | x | forward, every logit | forward_greedy | x |")
    print("|---|---|---|---|---|---|---|")
    for n in args.rows:
        h_full, h_greedy, f_full, f_greedy = (heads[f"full {n}"], heads[f"greedy {n}"], forwards[f"full {n}"],
                                              forwards[f"greedy {n}"])
        print(f"| {n} | {h_full:.2f} | {h_greedy:.2f} | {h_full / h_greedy:.2f} | {f_full:.2f} | {f_greedy:.2f} | "
              f"{f_full / f_greedy:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "greedy_head.json").write_text(json.dumps({"check": check, "head_ms": heads, "forward_ms": forwards},
                                                     indent=1))


if __name__ == "__main__":
    main()
