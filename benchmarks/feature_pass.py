"""The target's teacher-forced pass over teacher data: what a feature cache costs where generation staged nothing.

    python -m benchmarks.feature_pass [--target T] [--by engine transformers] [--prompts SPEC ...] [--limit 32]
        [--response-tokens 128] [--batch 32] [--layers 2 14 25] [--max-seq-len 288] [--max-prompt-tokens 288]
        [--reps 1] [--out DIR]

A drafter over the target's hidden states (EAGLE-3, Medusa, DFlash) reads them from distill.feature_cache; records
the teacher generation did not stage (its data was cached by a job of another kind, another layer set) are computed
by `compute_shard`, by one of two makers (`--by`, both by default, interleaved):
  engine        the decoding engine's forward (decode.target_states.EngineStates: each record's prompt in one
                forward, its response in calls of up to 64 rows; on a real target the GGUF's K-quant kernels):
                what the training jobs use on the CPU
  transformers  the model's own fp32 decoder, `--batch` sequences side by side (32 sequences of 400 tokens:
                12,800 rows a call): what they used before, and still do on a GPU
This times that call on `--limit` records built from real prompts (chat-templated by the target) with
`--response-tokens` tokens of answer each (the pass's cost does not depend on which tokens), prints records and
positions per second, and how far the two makers' final states are apart (mean relative L2 over positions);
writes DIR/feature_pass.json.
"""

from __future__ import annotations

import resource

from benchmarks.harness import interleave, parser, print_table, write_report
from benchmarks.teacher_generation import DEFAULT_PROMPTS  # the qwen configs' kinds of prompt

MAKERS = ("engine", "transformers")


def parse_args(argv=None):
    p = parser(__doc__, "feature_pass", reps=1)
    p.add_argument("--target", default=None, help="the target (models.target.load_target; default: the embedded one)")
    p.add_argument("--by", nargs="+", choices=MAKERS, default=list(MAKERS), help="what computes the states")
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS, help="prompt sources (distill.prompts specs)")
    p.add_argument("--limit", type=int, default=32, help="records, at most (the sources' first prompts)")
    p.add_argument("--response-tokens", type=int, default=128, help="answer tokens of each record")
    p.add_argument("--batch", type=int, default=32, help="sequences per forward (the jobs' gen_batch_size)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 14, 25], help="the states kept (qwen_coder_eagle3's)")
    p.add_argument("--max-seq-len", type=int, default=288, help="each record's training window (the jobs')")
    p.add_argument("--max-prompt-tokens", type=int, default=288, help="leave out longer prompts, as the teacher "
                   "data does (max_seq_len): one long prompt pads every sequence of its batch to its length")
    args = p.parse_args(argv)
    if args.limit < 1 or args.response_tokens < 1 or args.batch < 1 or args.reps < 1:
        p.error("--limit, --response-tokens, --batch and --reps at least 1")
    return args


def records_of(prompts: list[list[int]], response_tokens: int) -> list[dict]:
    """Teacher-data records: each prompt with `response_tokens` answer tokens (the prompt's own tokens, cycled)."""
    return [{"prompt_ids": p, "response_ids": [p[i % len(p)] for i in range(response_tokens)]} for p in prompts]


def main(argv=None) -> dict:
    args = parse_args(argv)
    from specdistill.decode.target_states import EngineStates
    from specdistill.distill.feature_cache import compute_shard
    from specdistill.distill.generation import pad_token_id
    from specdistill.distill.prompts import load_prompt_sources
    from specdistill.models.target import load_target

    target = load_target(args.target) if args.target else load_target()
    pad_id = pad_token_id(target.tokenizer, set(target.eos_token_ids))
    prompts = [list(target.encode_chat(p.messages)) for p in load_prompt_sources(args.prompts)]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens][:args.limit]
    records = records_of(prompts, args.response_tokens)
    positions = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)

    made = {}
    makers = {"engine": EngineStates(target.model, args.layers), "transformers": None}

    def pass_by(by: str):
        def run():
            made[by] = compute_shard(target, records, args.layers, args.max_seq_len, args.batch, pad_id,
                                     states=makers[by])
        return run

    if "engine" in args.by:  # its lean copy of the target and kernels built once, untimed (a job builds them once)
        makers["engine"](records[0]["prompt_ids"][:8], [])
    times = interleave({by: pass_by(by) for by in args.by}, args.reps, warmup=args.warmup)
    print(f"{len(records)} records, {positions} positions, batch {args.batch}, layers {args.layers}, "
          f"target {target.name}")
    rows, results = [], {"records": len(records), "positions": positions, "by": {}}
    for by in args.by:
        seconds = min(times[by])
        results["by"][by] = {"seconds": seconds, "positions_per_s": positions / seconds}
        rows.append([by, len(records), positions, seconds, len(records) / seconds, positions / seconds])
    print_table(["by", "records", "positions", "s", "records/s", "positions/s"], rows)
    if len(made) == 2:
        results["final_relative_l2"] = relative_l2(made["engine"], made["transformers"])
        print(f"final states, engine against transformers: mean relative L2 {results['final_relative_l2']:.2e}")
    results["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {results['peak_rss_gb']:.1f} GB")
    write_report(args.out, "feature_pass", results, args)
    return results


def relative_l2(a: list, b: list) -> float:
    """Mean over positions of |a - b| / |b| for the records' final states (FeatureRecord.final [T, D])."""
    import torch

    ratios = [(x.final.float() - y.final.float()).norm(dim=-1) / y.final.float().norm(dim=-1).clamp_min(1e-12)
              for x, y in zip(a, b)]
    return float(torch.cat(ratios).mean())


if __name__ == "__main__":
    main()
