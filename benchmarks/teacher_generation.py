"""Teacher data's greedy answers: transformers' `generate` against the engine's forward with prompts side by side.

    python -m benchmarks.teacher_generation [--target T] [--prompts SPEC ...] [--limit 32] [--max-new-tokens 128]
        [--max-prompt-tokens 512] [--batch 16] [--generators generate engine] [--reps 1] [--out DIR]

Both generators answer the same prompts (chat-templated by the target, longest first as distill.teacher_data
orders them) as the built-in teacher backend runs them: `generate` in batches of `--batch` (distill.generation:
left padding, every row until the batch's longest answer ends), `engine` with `--batch` sequences per forward
(decode.batch_generation: no padding, a sequence leaves when it ends, the next prompt takes its place). Timed
whole, the generators taking turns rep by rep after `--warmup` untimed runs on the first `--batch` prompts. Prints
the answer tokens per second of each and their ratio, how many answers agree token for token and where the first
disagreement of each other one lies, and how many of the engine's answers to the first `--check-plain` prompts are
its plain decoding's (decode.engine, each prompt alone); writes DIR/teacher_generation.json.
"""

from __future__ import annotations

import resource

from benchmarks.harness import interleave, parser, print_table, write_report

DEFAULT_PROMPTS = ["jsonl:../shared/data/arena_hard/question_v2.0.jsonl?limit=24",
                   "jsonl:../shared/data/humaneval/HumanEval.jsonl.gz?skip=8&limit=16"]  # the qwen configs' kinds


def parse_args(argv=None):
    p = parser(__doc__, "teacher_generation", reps=1)
    p.add_argument("--target", default=None, help="the target (models.target.load_target; default: the embedded one)")
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS, help="prompt sources (distill.prompts specs)")
    p.add_argument("--limit", type=int, default=32, help="prompts, at most (the sources' first, in order)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="leave out longer prompts (as teacher data's "
                   "max_prompt_tokens)")
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call / sequences per engine forward")
    p.add_argument("--generators", nargs="+", default=["generate", "engine"], choices=["generate", "engine"])
    p.add_argument("--check-plain", type=int, default=4, metavar="N", help="also decode the first N prompts one by "
                   "one with the engine's plain decoding (decode.engine) and count the engine's answers equal to them")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or not 1 <= args.batch <= 64 or args.reps < 1:
        p.error("--limit, --max-new-tokens and --reps at least 1, --batch between 1 and 64")
    return args


def generators(model, prompts: list[list[int]], args, eos: set[int], pad_id: int) -> dict:
    """{name: a call answering `prompts`, returning the answers}."""
    from specdistill.decode.batch_generation import generate_greedy_together
    from specdistill.distill.generation import generate_batch

    def by_generate(chosen):
        out = []
        for start in range(0, len(chosen), args.batch):
            out += generate_batch(model, chosen[start:start + args.batch], max_new_tokens=args.max_new_tokens,
                                  pad_id=pad_id, eos_token_ids=eos)
        return out

    def by_engine(chosen):
        return generate_greedy_together(model, chosen, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                                        max_batch=args.batch)

    calls = {"generate": by_generate, "engine": by_engine}
    return {name: calls[name] for name in args.generators}


def plain_decodes(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int]) -> list[list[int]]:
    from specdistill.decode.engine import SpeculativeEngine

    engine = SpeculativeEngine(model, None, eos_token_ids=eos)
    return [engine.generate(p, max_new_tokens).tokens for p in prompts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first answer position where a and b differ (a length counts), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    args = parse_args(argv)
    from specdistill.distill.generation import pad_token_id
    from specdistill.distill.prompts import load_prompt_sources
    from specdistill.models.target import load_target

    target = load_target(args.target) if args.target else load_target()
    eos = set(target.eos_token_ids)
    pad_id = pad_token_id(target.tokenizer, eos)
    prompts = [list(target.encode_chat(p.messages)) for p in load_prompt_sources(args.prompts)]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens][:args.limit]
    prompts.sort(key=len, reverse=True)  # as distill.teacher_data orders a shard's jobs
    calls = generators(target.model, prompts, args, eos, pad_id)
    answers: dict[str, list[list[int]]] = {}

    def timed(name):
        return lambda: answers.__setitem__(name, calls[name](prompts))

    for call in calls.values():
        for _ in range(args.warmup):
            call(prompts[:args.batch])
    times = interleave({name: timed(name) for name in calls}, args.reps, warmup=0)
    tokens = {name: sum(len(a) for a in answers[name]) for name in calls}
    speed = {name: tokens[name] / min(times[name]) for name in calls}
    first = next(iter(calls))
    rows = [[name, tokens[name], min(times[name]), speed[name], speed[name] / speed[first]] for name in calls]
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), {args.max_new_tokens} new tokens at most, "
          f"batch {args.batch}, target {target.name}")
    print_table(["generator", "answer tokens", "s", "tokens/s", f"x {first}"], rows)
    results = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
               "generators": {name: {"answer_tokens": tokens[name], "seconds": times[name],
                                     "tokens_per_s": speed[name]} for name in calls},
               "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if len(calls) == 2:
        a, b = (answers[name] for name in calls)
        differences = [first_difference(x, y) for x, y in zip(a, b)]
        agree = sum(d is None for d in differences)
        print(f"answers equal token for token: {agree} of {len(a)}; first differences at "
              f"{sorted(d for d in differences if d is not None)}")
        results["answers_equal"] = agree
        results["first_differences"] = differences
    if args.check_plain and "engine" in answers:
        plain = plain_decodes(target.model, prompts[:args.check_plain], args.max_new_tokens, eos)
        equal = sum(a == b for a, b in zip(answers["engine"], plain))
        print(f"engine answers equal to the engine's plain decoding of each prompt alone: {equal} of {len(plain)}")
        results["engine_equals_plain_decoding"] = [equal, len(plain)]
    print(f"peak RSS {results['peak_rss_gb']:.1f} GB")
    write_report(args.out, "teacher_generation", results, args)
    return results


if __name__ == "__main__":
    main()
