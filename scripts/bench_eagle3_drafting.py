"""Benchmark: what an EAGLE-3 drafter's pieces cost on this machine, against one target forward (the unit of
every cost the adaptive depth weighs).

    .venv/bin/python scripts/bench_eagle3_drafting.py DRAFTER [--drafter-weights auto] [--reps 40] [--out DIR]

Decodes one MT-bench question (128 tokens, greedy) so that the target's and the drafter's caches hold a real
context, then times, interleaved rep by rep (medians): the target's one-row forward; the drafter's context rows
(k = 1 and 3 accepted tokens: `context_rows`); its layer over n = 1 and 3 tree rows (`net.rows`) and its head
(`children_of`: log-softmax + top-K, the per-depth tail); and whole dynamic trees (`draft_tree`) at depths 1-8 with
no probability floor, so every depth is drafted. Every timed call is undone (cache lengths and positions put
back), so each rep sees the same state. Prints a table (ms, and as a fraction of a target forward); writes
DIR/eagle3_drafting.json.
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

from decode.engine import SpeculativeEngine  # noqa: E402  (ROOT on sys.path first)
from decode.proposers import build_proposer  # noqa: E402
from decode.questions import load_questions  # noqa: E402
from decode.runner import ModelRunner  # noqa: E402
from models.drafters import load_drafter  # noqa: E402
from models.target import load_target  # noqa: E402

DEPTHS = (1, 2, 3, 4, 6, 8)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="an eagle3 drafter directory")
    p.add_argument("--drafter-weights", default="auto", choices=["auto", "float32", "float16", "q8_0", "int8"])
    p.add_argument("--questions", default=str(ROOT.parent / "shared/data/mt_bench/question.jsonl"))
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out", default="runs/bench_eagle3_drafting")
    return p.parse_args(argv)


def undone(proposer, call):
    """A timed call on the proposer whose cache rows and position are put back afterwards."""
    def run():
        length, position = proposer.cache.length, proposer.position
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        proposer.cache.length = proposer.cache.used = length
        proposer.position = position
        return seconds
    return run


def timed_calls(target, proposer, seq: list[int], features: torch.Tensor) -> dict[str, callable]:
    """name -> a function returning the seconds of one call."""
    runner = ModelRunner(target.model)
    runner.start(len(seq) + 2)
    runner.forward(seq[:-1], logits_rows=slice(len(seq) - 2, len(seq) - 1))
    runner.cache.advance(len(seq) - 1)

    def target_row():
        start = time.perf_counter()
        runner.forward(seq[-1:])
        return time.perf_counter() - start

    proposer.cache.drop_uncommitted()  # the last step's tree rows
    out = proposer.context_rows(seq[-1:], features[-1:])[-1]  # [D] the root's output
    proposer.cache.commit()
    base = proposer.position - 1
    root = seq[-1]
    rows3 = torch.stack([out] * 3)  # [3, D]
    embeds = {n: proposer.embed(torch.tensor(seq[-n:])).to(proposer.dtype) for n in (1, 3)}

    def layer_rows(n):
        start = proposer.cache.length
        visible = torch.zeros(n, start + n, dtype=torch.bool)
        visible[:, :start] = True
        visible[:, start:] = torch.eye(n, dtype=torch.bool)
        positions = torch.full((n,), base + 1, dtype=torch.long)
        return lambda: proposer.net.rows(embeds[n], rows3[:n], positions, proposer.cache, visible)

    def head(n):
        return lambda: proposer.children_of(rows3[:n])

    calls = {"target forward, 1 row": target_row}
    for k in (1, 3):
        calls[f"context rows, k={k}"] = undone(proposer, lambda k=k: proposer.context_rows(seq[-k:], features[-k:]))
    for n in (1, 3):
        calls[f"layer, {n} row(s)"] = undone(proposer, layer_rows(n))
        calls[f"head + top-K, {n} row(s)"] = undone(proposer, head(n))
    for depth in DEPTHS:
        calls[f"tree, depth {depth}"] = undone(proposer, lambda d=depth: proposer.draft_tree(root, out, d))
    return calls


@torch.inference_mode()
def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    target = load_target()
    drafter = load_drafter(args.drafter, target)
    if drafter.kind != "eagle3":
        sys.exit(f"bench_eagle3_drafting: {args.drafter} is a {drafter.kind} drafter, not eagle3")
    proposer = build_proposer(drafter, target.model, eos_token_ids=target.eos_token_ids,
                              drafter_weights=args.drafter_weights, eagle3_min_prob=0.0)
    question = load_questions(args.questions, per_category=1)[0]
    prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    tokens = engine.generate(prompt, 128).tokens
    seq = prompt + tokens
    features = torch.randn(3, proposer.drafter.fc.in_features, dtype=proposer.dtype)  # [3, 3D]; cost only
    proposer.pending = []
    calls = timed_calls(target, proposer, seq, features)
    times = {name: [] for name in calls}
    for rep in range(args.reps + 2):  # two warm-up reps
        for name, call in calls.items():
            seconds = call()
            if rep >= 2:
                times[name].append(seconds)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    unit = ms["target forward, 1 row"]
    print(f"context {len(seq)} tokens, drafter weights {args.drafter_weights}, medians of {args.reps}")
    print("| piece | ms | x target forward |\n|---|---|---|")
    for name, value in ms.items():
        print(f"| {name} | {value:.3f} | {value / unit:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eagle3_drafting.json").write_text(json.dumps({"drafter": args.drafter, "context": len(seq),
                                                          "weights": args.drafter_weights, "ms": ms}, indent=1))


if __name__ == "__main__":
    main()
