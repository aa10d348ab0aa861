"""Give a trained EAGLE-3 or DFlash drafter another decoding tree shape without retraining.

    specdistill tree-shape --drafter DIR [--depth D] [--topk K] [--tree-nodes N] [--min-prob P]
        [--priced | --no-priced] [--out OUT_DIR] [--target T]     (`eagle3-tree`: its former name)

The shape lives in the drafter's manifest (`extra.decoding`): the deepest draft D, the top-K tokens
offered under each expanded node (and, for EAGLE-3, the K nodes expanded per depth; for DFlash the K best tokens of
each block row), the N most probable candidates kept as the tree, the floor P on a node's path probability below
which it is neither kept nor expanded (0: none; decode.proposers.eagle3, decode.proposers.dflash), and whether the
tree is cut to what the measured verification cost pays for (priced, the default). Copies written with --out
evaluate side by side in one `decode.evaluate` run (`--drafter A --drafter B ...`), which is how the shipped shape
was chosen. An option left out keeps the drafter's value; the directory is rewritten atomically (in place unless
--out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdistill.models.dflash import DFlashDrafter
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.target import load_target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a drafter directory of kind eagle3 or dflash")
    p.add_argument("--depth", type=int, default=None, help="the deepest draft")
    p.add_argument("--topk", type=int, default=None, help="tokens per expanded node, nodes expanded per depth")
    p.add_argument("--tree-nodes", type=int, default=None, help="tree size, root excluded")
    p.add_argument("--min-prob", type=float, default=None,
                   help="the path-probability floor, in [0, 1); 0 = none (default: the device's, DEFAULT_MIN_PROB)")
    p.add_argument("--priced", action=argparse.BooleanOptionalAction, default=None,
                   help="cut each tree to what the measured verification cost pays for (default: the drafter's, "
                        "else yes)")
    p.add_argument("--out", default=None, help="write here instead of rewriting --drafter")
    p.add_argument("--target", default=None, help="the target the drafter belongs to (default: the embedded one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    chosen = {"depth": args.depth, "topk": args.topk, "tree_nodes": args.tree_nodes}
    bad = [name for name, value in chosen.items() if value is not None and value < 1]
    if bad:
        raise SystemExit(f"{', '.join(bad)}: must be >= 1")
    if args.min_prob is not None and not 0 <= args.min_prob < 1:
        raise SystemExit(f"--min-prob {args.min_prob}: must be in [0, 1)")
    chosen["min_prob"] = args.min_prob
    chosen["priced"] = args.priced
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    classes = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter}
    if drafter.kind not in classes:
        raise SystemExit(f"{args.drafter} is a {drafter.kind!r} drafter; this script is for kinds 'eagle3' and "
                         "'dflash'")
    extra = dict(drafter.manifest.get("extra") or {})
    extra["decoding"] = {**(extra.get("decoding") or {}), **{k: v for k, v in chosen.items() if v is not None}}
    model = classes[drafter.kind](drafter.model.config)
    model.load_state_dict(drafter.model.state_dict())
    out = save_drafter(args.out or args.drafter, model, target, drafter.kind, drafter.manifest["config"], extra=extra)
    print(f"{out}: decoding {extra['decoding']}")
    return out


if __name__ == "__main__":
    main()
