"""What prompt lookup's chains are worth by the length of the n-gram they matched, on a target's greedy answers.

    python -m benchmarks.lookup_depths --data ~/.cache/specdistill/teacher/KEY [--limit 300]
        [--row-cost 0.09 0.17 0.35] [--out DIR]

Under greedy decoding a lookup chain is accepted as far as it agrees with the target's own answer, so its acceptance
needs no model: this replays decoding step by step on the answers in a teacher-data directory (the target's
greedy answers to its prompts; `specdistill train` writes them under $SPECDISTILL_CACHE/teacher/), drafting with the
engine's own `lookup_match` (3- to 1-grams, the latest occurrence). Per matched length n: the steps, the tokens
accepted at depths 1 to 10. Then, for a verified row costing `--row-cost` of a one-row forward (on the
targets here 0.09-0.4: `python -m benchmarks.forward_rows`), tokens per unit of forward cost at the best single
depth for every step against the best depth per length (as `PromptLookupProposer.by_length` lets the engine's
adaptive depth choose; here chosen with hindsight, a coordinate search over 0..10). Deterministic: no timing.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import parser, print_table, write_report

DEPTHS = (0, 1, 2, 3, 4, 6, 8, 10)
MAX_NGRAM = 3


def replay(records, depth_of) -> tuple[int, int, dict]:
    """Decode every (prompt, answer) record with lookup chains cut at depth_of(n) for a match of n tokens:
    (tokens, verified rows past the first, {n: [steps, accepted at DEPTHS' cuts]})."""
    from specdistill.decode.proposers.prompt_lookup import lookup_match

    tokens = rows = 0
    by_length: dict[int, list] = {}
    for prompt, answer in records:
        seq, i = list(prompt), 0
        while i < len(answer):
            n, drafts = lookup_match(seq, max(DEPTHS), MAX_NGRAM, 1)
            agree = next((j for j, token in enumerate(drafts) if i + j >= len(answer) or token != answer[i + j]),
                         len(drafts))
            cut = drafts[:depth_of(n)] if n else []
            accepted = min(agree, len(cut))
            stats = by_length.setdefault(n, [0] + [0] * len(DEPTHS))
            stats[0] += 1
            for k, depth in enumerate(DEPTHS):
                stats[1 + k] += min(agree, depth)
            advance = min(accepted + 1, len(answer) - i)
            seq += answer[i:i + advance]
            i += advance
            tokens += advance
            rows += len(cut)
    return tokens, rows, by_length


def speed(records, depth_of, row_cost: float) -> float:
    """Tokens per unit of forward cost (a one-row forward = 1, each further verified row `row_cost`)."""
    tokens, rows, by_length = replay(records, depth_of)
    steps = sum(stats[0] for stats in by_length.values())
    return tokens / (steps + row_cost * rows)


def best_depths(records, row_cost: float) -> tuple[int, float, dict[int, int], float]:
    """(the best single depth, its speed, the best depth per matched length, its speed): each length's depth
    searched in turn over DEPTHS, twice round, from the single best."""
    single = {d: speed(records, lambda n, d=d: d, row_cost) for d in DEPTHS}
    one = max(single, key=single.get)
    per = {n: one for n in range(1, MAX_NGRAM + 1)}
    for _ in range(2):
        for n in per:
            scores = {d: speed(records, lambda m, t={**per, n: d}: t[m], row_cost) for d in DEPTHS}
            per[n] = max(scores, key=scores.get)
    return one, single[one], per, speed(records, lambda m: per[m], row_cost)


def answers(directory: str, limit: int) -> list[tuple[list[int], list[int]]]:
    """The first `limit` (prompt ids, answer ids) of a teacher-data directory's finished shards (an interrupted
    generation's too: which shards were read is printed)."""
    from specdistill.distill.teacher_data import concatenate_shards, read_settings_file, shard_path

    out = Path(directory).expanduser()
    settings = read_settings_file(out)
    if settings is None:
        raise SystemExit(f"no teacher data in {out} (settings.json missing)")
    done = [k for k in range(settings["num_shards"]) if shard_path(out, k).exists()]
    if not done:
        raise SystemExit(f"teacher data in {out} has no finished shard yet")
    print(f"{out.name}: {len(done)} of {settings['num_shards']} shards finished, reading them")
    data = concatenate_shards(out, done)
    return [(r["prompt_ids"], r["response_ids"]) for r in data.select(range(min(limit, len(data))))]


def main(argv=None) -> dict:
    p = parser(__doc__, "lookup_depths", reps=1)
    p.add_argument("--data", required=True, help="a teacher-data directory (settings.json, shards/): its finished "
                   "shards")
    p.add_argument("--limit", type=int, default=300, help="the first N records")
    p.add_argument("--row-cost", type=float, nargs="+", default=[0.09, 0.17, 0.35])
    args = p.parse_args(argv)
    if args.limit < 1 or any(not 0 <= c <= 2 for c in args.row_cost):
        p.error("--limit at least 1, --row-cost between 0 and 2")
    records = answers(args.data, args.limit)
    _, _, by_length = replay(records, lambda n: max(DEPTHS))
    print(f"{len(records)} answers, {sum(len(a) for _, a in records)} tokens; accepted tokens a step by matched "
          f"length and depth")
    print_table(["n", "steps"] + [f"depth {d}" for d in DEPTHS[1:]],
                [[n, s[0]] + [round(v / s[0], 2) for v in s[2:]] for n, s in sorted(by_length.items()) if n])
    choices = {c: best_depths(records, c) for c in args.row_cost}
    print_table(["row cost", "one depth", "tokens / cost", "depth per length", "tokens / cost", "ratio"],
                [[c, one, round(s1, 3), " ".join(f"{n}:{d}" for n, d in per.items()), round(s2, 3),
                  round(s2 / s1, 3)] for c, (one, s1, per, s2) in choices.items()])
    results = {"answers": len(records), "by_length": {n: {"steps": s[0], "accepted": dict(zip(DEPTHS, s[1:]))}
                                                      for n, s in by_length.items()},
               "choices": {c: {"one_depth": one, "one_speed": s1, "per_length": per, "per_length_speed": s2}
                           for c, (one, s1, per, s2) in choices.items()}}
    write_report(args.out, "lookup_depths", results, args)
    return results


if __name__ == "__main__":
    main()
