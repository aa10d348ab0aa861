"""Benchmark: one EAGLE-3 training step (loss, backward, AdamW) on real cached hidden states, unrolling
every position against only the positions the loss counts, with and without prompt positions in the loss,
in fp32 and under bf16 autocast (what `mixed_precision: bf16` runs).

    .venv/bin/python scripts/bench_eagle3_train_step.py FEATURE_CACHE_DIR [--batches 2] [--reps 3]
        [--batch-size 8] [--steps 7] [--draft-vocab 8192] [--threads 2] [--variants NAME ...]
        [--precisions no bf16] [--out DIR]

FEATURE_CACHE_DIR: a complete `$SPECDISTILL_CACHE/features/<key>` directory of the default target (a
training run's log names it; layers 2, 15, 27). The variants run interleaved batch by batch, so the
machine's noise hits all alike; the draft vocabulary is the first M ids (a timing needs its size only).
The first variant in the first precision is the table's reference.
Prints a table; writes DIR/eagle3_train_step.json.
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

from distill.feature_cache import FeatureCache  # noqa: E402  (ROOT on sys.path first)
from models.cache import MARKER  # noqa: E402
from models.eagle3 import Eagle3Drafter  # noqa: E402
from models.target import load_target  # noqa: E402
from train.eagle3 import eagle3_loss, target_head_rows  # noqa: E402

VARIANTS = {  # name -> (every_row, prompt_weight)
    "every position, response loss": (True, 0.0),
    "counted positions, response loss": (False, 0.0),
    "every position, prompt weight 1": (True, 1.0),
    "counted positions, prompt weight 1": (False, 1.0),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("features", type=Path)
    p.add_argument("--target", default=None)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--precisions", nargs="+", choices=["no", "bf16"], default=["no"],
                   help="no: fp32; bf16: the loss under torch.autocast(cpu, bfloat16), as mixed_precision bf16 runs it")
    p.add_argument("--out", type=Path, default=Path("runs/bench_eagle3_train_step"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    info = json.loads((args.features / MARKER).read_text())
    records = FeatureCache(args.features, info["key"], target.fingerprint).shard(0)
    vocab_map = torch.arange(args.draft_vocab)
    drafter = Eagle3Drafter.for_target(target.model, vocab_map, None, init="target_layer").float().train()
    head_rows, embed = target_head_rows(target, vocab_map), target.model.get_input_embeddings()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-6)
    runs = [(name, precision) for name in args.variants for precision in args.precisions]
    seconds: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for _ in range(args.reps):
        for b in range(args.batches):
            batch = records[b * args.batch_size:(b + 1) * args.batch_size]
            for name, precision in runs:
                every_row, prompt_weight = VARIANTS[name]
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss, _ = eagle3_loss(drafter, embed, head_rows, batch, args.steps, 0.8, prompt_weight,
                                          every_row=every_row)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                seconds[name, precision].append(time.perf_counter() - start)
    base = statistics.median(seconds[runs[0]])
    rows = [{"variant": name, "precision": precision, "seconds_per_step": statistics.median(ts),
             "speedup": base / statistics.median(ts)} for (name, precision), ts in seconds.items()]
    print(f"EAGLE-3 training step, batch {args.batch_size}, {args.steps} unrolled steps, M {args.draft_vocab}, "
          f"{args.threads} threads (median of {args.reps * args.batches})")
    print(f"| variant | precision | s/step | against {runs[0][0]}, {runs[0][1]} |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['precision']} | {row['seconds_per_step']:.2f} | {row['speedup']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    (args.out / "eagle3_train_step.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
