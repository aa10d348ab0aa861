"""What prompt-lookup policies would accept on the target's own greedy answers: tokens a step and rows a step.

    .venv/bin/python scripts/prompt_lookup_study.py TEACHER_DATA_DIR [TEACHER_DATA_DIR ...] [--out FILE.json]

TEACHER_DATA_DIR: a `$SPECDISTILL_CACHE/teacher/<key>` directory of greedy answers (a training run's log names it).
Each answer is replayed step by step as the engine would decode it: at each step a policy proposes continuations
of the sequence so far (prompt and answer up to there), merged into a tree of shared prefixes; the step accepts the
longest proposed prefix equal to the answer and emits one token more. No model runs and nothing is timed, so the
figures are exact for greedy decoding: tau (tokens a step) and the tree's rows a step (the root included), what a
verification costs. The first policy is the engine's (decode.proposers.prompt_lookup.lookup_match: the latest
earlier occurrence of the longest n-gram, n from 3 to 1, 10 tokens; a test pins the two together); the others
try longer n-grams, longer chains and the continuations of several occurrences as a tree (BENCHMARKS.md
"Prompt-lookup trees and longer n-grams").
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from distill.teacher_data import load_teacher_data


@dataclass(frozen=True)
class Policy:
    name: str
    max_ngram: int = 3
    min_ngram: int = 1
    num_tokens: int = 10
    matches: int = 1  # continuations of up to this many distinct occurrences, latest first
    any_n: bool = False  # take further matches from shorter n-grams too
    max_nodes: int | None = None  # drop whole continuations that would make the tree larger


POLICIES = [
    Policy("the engine's: latest match of the longest n-gram (3 to 1), 10 tokens"),
    Policy("n-grams up to 4", max_ngram=4),
    Policy("n-grams up to 6", max_ngram=6),
    Policy("16 tokens", num_tokens=16),
    Policy("two matches' continuations as a tree", matches=2),
    Policy("three matches, at most 16 nodes", matches=3, max_nodes=16),
    Policy("three matches of any n, at most 16 nodes", max_ngram=4, matches=3, max_nodes=16, any_n=True),
    Policy("n-grams of 2 and 3 only", min_ngram=2),
]


class NgramIndex:
    """Start positions of every n-gram of `seq` (n <= max_n), in increasing order."""

    def __init__(self, seq: list[int], max_n: int):
        self.seq = seq
        self.starts: dict[int, dict[tuple, list[int]]] = {n: defaultdict(list) for n in range(1, max_n + 1)}
        for n in self.starts:
            for start in range(len(seq) - n + 1):
                self.starts[n][tuple(seq[start:start + n])].append(start)

    def earlier(self, end: int, n: int) -> list[int]:
        """Starts of earlier occurrences of seq[end - n:end] (not that suffix itself), latest first."""
        if end - n < 0:
            return []
        starts = self.starts[n].get(tuple(self.seq[end - n:end]), [])
        return starts[:bisect.bisect_left(starts, end - n)][::-1]


def proposals(index: NgramIndex, end: int, policy: Policy) -> tuple[int, list[list[int]]]:
    """(n of the longest matched n-gram, 0 if none; continuations) proposed after seq[:end]."""
    seq, found, chains = index.seq, 0, []
    for n in range(min(policy.max_ngram, end - 1), policy.min_ngram - 1, -1):
        for start in index.earlier(end, n):
            chain = seq[start + n:min(start + n + policy.num_tokens, end)]
            found = found or n
            if chain and chain not in chains:
                chains.append(chain)
            if len(chains) >= policy.matches:
                break
        if found and (not policy.any_n or len(chains) >= policy.matches):
            break
    return found, within_nodes(chains, policy.max_nodes)


def within_nodes(chains: list[list[int]], max_nodes: int | None) -> list[list[int]]:
    """The first chains, in order, whose merged tree has at most max_nodes nodes (the first chain cut to fit)."""
    if max_nodes is None:
        return chains
    kept, nodes = [], set()
    for chain in chains:
        new = {tuple(chain[:i + 1]) for i in range(len(chain))} - nodes
        if len(nodes) + len(new) > max_nodes:
            if not kept:
                kept.append(chain[:max_nodes])
            break
        kept.append(chain)
        nodes |= new
    return kept


def accepted_and_rows(chains: list[list[int]], truth: list[int]) -> tuple[int, int]:
    """(longest prefix of `truth` some chain proposes, the merged tree's nodes)."""
    nodes, best = set(), 0
    for chain in chains:
        nodes.update(tuple(chain[:i + 1]) for i in range(len(chain)))
        length = 0
        while length < min(len(chain), len(truth)) and chain[length] == truth[length]:
            length += 1
        best = max(best, length)
    return best, len(nodes)


def replay(records: list[tuple[list[int], list[int]]], policy: Policy) -> dict:
    """Decode every (prompt, answer) as the policy would: tau, rows a step, share of steps with an n >= 2 match
    and the tokens those steps accept."""
    steps = tokens = rows = strong = strong_accepted = 0
    for prompt, answer in records:
        seq = prompt + answer
        index = NgramIndex(seq, policy.max_ngram)
        end = len(prompt)
        while end < len(seq):
            n, chains = proposals(index, end, policy)
            accepted, nodes = accepted_and_rows(chains, seq[end:])
            accepted = min(accepted, len(seq) - end - 1)  # the last token of the answer is the step's own
            steps, tokens, rows = steps + 1, tokens + accepted + 1, rows + nodes + 1
            strong, strong_accepted = strong + (n >= 2), strong_accepted + accepted * (n >= 2)
            end += accepted + 1
    return {"tau": tokens / steps, "rows_per_step": rows / steps, "strong_match_share": strong / steps,
            "accepted_after_strong_match": strong_accepted / max(strong, 1), "steps": steps}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("teacher_data", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    return p


def load_answers(parser: argparse.ArgumentParser, directories: list[Path]) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) token lists of every directory; a missing or unfinished one is an argparse error."""
    records = []
    for directory in directories:
        try:
            records += [(row["prompt_ids"], row["response_ids"]) for row in load_teacher_data(directory)]
        except FileNotFoundError as err:
            parser.error(f"argument teacher_data: {err}")
    return records


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    records = load_answers(parser, args.teacher_data)
    report = {"answers": len(records), "policies": [{**asdict(p), **replay(records, p)} for p in POLICIES]}
    print(f"{len(records)} answers")
    print("| policy | tau | rows a step | steps after an n >= 2 match | tokens they accept |")
    print("|---|---|---|---|---|")
    for row in report["policies"]:
        print(f"| {row['name']} | {row['tau']:.3f} | {row['rows_per_step']:.2f} | {row['strong_match_share']:.2f} | "
              f"{row['accepted_after_strong_match']:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
