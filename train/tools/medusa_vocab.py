"""Give a trained Medusa drafter a candidate vocabulary (and optionally a new tree budget) without retraining.

    specdistill medusa-vocab --drafter DIR --teacher-data TEACHER_DIR --size 8192 \
        [--tree-nodes N] [--out OUT_DIR] [--target T]

The candidate vocabulary is what `draft_vocab` gives a Medusa job at training time: the teacher data's
`size` most frequent response tokens (EOS always in). Decoding then projects the heads onto those rows
only, V / size times cheaper per step; the target still verifies every draft, so output is unchanged.
`--tree-nodes` re-chooses the sparse tree from the per-head accuracies stored in the drafter (measured
on the full vocabulary at training time; the restriction can only lower them by the tokens it drops,
reported as coverage). The drafter directory is rewritten atomically (in place unless --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdistill.decode.proposers.medusa import choose_tree, expected_accept_length
from specdistill.distill.teacher_data import load_teacher_data
from specdistill.distill.vocab import count_response_tokens, coverage, select_draft_vocab
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.target import load_target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a drafter directory of kind medusa")
    p.add_argument("--teacher-data", required=True, help="a teacher-data directory (distill.teacher_data)")
    p.add_argument("--size", type=int, required=True, help="candidate vocabulary size M")
    p.add_argument("--tree-nodes", type=int, default=0, help="re-choose the tree with this many nodes (0 keeps it)")
    p.add_argument("--out", default=None, help="write here instead of rewriting --drafter")
    p.add_argument("--target", default=None, help="the target the drafter belongs to (default: the embedded one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    if drafter.kind != "medusa":
        raise SystemExit(f"{args.drafter} is a {drafter.kind!r} drafter; this script is for kind 'medusa'")
    if drafter.model.reduced:
        raise SystemExit(f"{args.drafter} has reduced heads (medusa.reduced_heads): they hold only their candidates' "
                         "rows, so another candidate vocabulary needs retraining")
    counts = count_response_tokens(load_teacher_data(args.teacher_data))
    vocab_map = select_draft_vocab(counts, args.size, target.vocab_size, always=target.eos_token_ids)
    extra = dict(drafter.manifest.get("extra") or {})
    if args.tree_nodes:
        extra["tree"] = choose_tree(extra["topk_accuracy"], args.tree_nodes)
        extra["expected_accept_length"] = expected_accept_length(extra["tree"], extra["topk_accuracy"])
    extra["candidate_vocab"] = {"size": args.size, "coverage": coverage(counts, vocab_map),
                                "teacher_data": str(Path(args.teacher_data).resolve())}
    out = save_drafter(args.out or args.drafter, drafter.model, target, "medusa", drafter.manifest["config"],
                       vocab_map=vocab_map, extra=extra)
    print(f"{out}: {args.size} candidate tokens ({100 * extra['candidate_vocab']['coverage']:.1f}% of the teacher "
          f"data's response tokens), tree of {len(extra['tree'])} nodes")
    return out


if __name__ == "__main__":
    main()
