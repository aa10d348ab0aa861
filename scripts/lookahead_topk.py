"""How often the target's next token is among LA_1's top k, measured while decoding (what `lookahead_branches` buys).

    .venv/bin/python scripts/lookahead_topk.py DRAFTER_DIR [--questions FILE] [--every 10] [--limit 8]
        [--max-new-tokens 96] [--k 3] [--out DIR]

Decodes the first turn of every `--every`-th question (greedy, full depth, the drafter's manifest settings)
and, at every step whose drafts come from an LA_1 row, checks whether the token the target then emitted at
that position is the row's top-1, in its top 2, ..., top k. Prints the rates; writes DIR/lookahead_topk.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decode.engine import SpeculativeEngine  # noqa: E402  (ROOT on sys.path first)
from decode.proposers.lookahead import LookaheadProposer, decoding_options  # noqa: E402
from decode.questions import load_questions  # noqa: E402
from models.drafters import load_drafter  # noqa: E402
from models.target import load_target  # noqa: E402

QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


class RankingProposer(LookaheadProposer):
    """Records, for each proposal, the position it drafts and LA_1's top-k tokens there."""

    def __init__(self, *args, k: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.topk_k, self.first_row_topk, self.records = k, None, []

    def observe_rows(self, logits: torch.Tensor, last_node: int) -> None:
        super().observe_rows(logits, last_node)
        owner, shift = self.nearest_owner(last_node)
        self.first_row_topk = None
        if owner is not None and shift == 0:  # drafts from LA_1 itself
            row = self.owner_row[owner] * self.active
            self.first_row_topk = logits[row].topk(self.topk_k).indices.tolist()

    def propose(self, seq, max_depth, sampling, generator):
        if self.first_row_topk is not None:
            self.records.append((len(seq), self.first_row_topk))  # drafts the token at index len(seq)
        return super().propose(seq, max_depth, sampling, generator)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter")
    p.add_argument("--target", default=None)
    p.add_argument("--questions", default=str(QUESTIONS))
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", default="runs/lookahead_topk")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    if drafter.kind != "lookahead":
        raise SystemExit(f"{args.drafter}: a drafter of kind {drafter.kind!r}, not lookahead")
    proposer = RankingProposer(drafter.model, target.model, **decoding_options(drafter.manifest), k=args.k)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    hits, positions = [0] * args.k, 0
    for question in load_questions(args.questions)[::args.every][:args.limit]:
        prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
        proposer.records = []
        seq = prompt + engine.generate(prompt, args.max_new_tokens).tokens
        for index, ranked in proposer.records:
            if index < len(seq):
                positions += 1
                for k in range(args.k):
                    hits[k] += seq[index] in ranked[:k + 1]
    rates = [h / max(positions, 1) for h in hits]
    print(f"{args.drafter}: {positions} positions; target's token in LA_1's top 1..{args.k}: "
          + " / ".join(f"{r:.3f}" for r in rates))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"drafter": args.drafter, "positions": positions, "topk_rates": rates}
    (out / "lookahead_topk.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
