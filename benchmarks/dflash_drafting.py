"""What one DFlash block costs to draft in each weight format the proposer can draft in, on the lean forward
(decode.lean_dflash) and on the drafter's own modules, against the target's own forward of one row and of a block's
rows: the choices `dflash_drafting_weights` makes on "auto" and the proposer makes between the two forwards.

    python -m benchmarks.dflash_drafting DRAFTER [--target T] [--context 300] [--forms float16 int8 float32]
        [--paths lean modules] [--reps 30] [--out DIR]

One process loads the target and the DFlash drafter, builds a DFlashProposer per weight format (float32: oneDNN's
packed fp32 GEMM; float16: FBGEMM's fp16 copies; int8: the kernel library's int8 kernel over Q8_0 weights) and path
(`modules`: $SPECDISTILL_NO_LEAN_DRAFTER set while it is built), gives each the same `--context` positions of context
(the target's states at its layers for those tokens, so the block reads what decoding reads), then times one block
(the drafter forward of block_size rows and its head) per variant and the target's forward of 1 and of block_size
rows after the same context, every variant interleaved rep by rep (medians). Checks how often each variant's greedy
draft at each block row is float32's on the modules. Writes DIR/dflash_drafting.json.
"""

from __future__ import annotations

import os
import sys

from benchmarks.forward_rows import forward_rows, runner_for
from benchmarks.harness import interleave, median_ms, parser, print_table, switched_off, write_report


def parse_args(argv=None):
    p = parser(__doc__, "dflash_drafting", reps=30)
    p.add_argument("drafter", help="a DFlash drafter directory (method: dflash)")
    p.add_argument("--target", default=None, help="the drafter's target (default: the embedded default target)")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--forms", nargs="+", default=["float16", "int8", "float32"])
    p.add_argument("--paths", nargs="+", default=["lean", "modules"], choices=["lean", "modules"])
    return p.parse_args(argv)


def primed_proposer(drafter, target, features, weights: str, path: str = "lean"):
    """A DFlashProposer drafting in `weights` on `path` whose context holds `features` [T, K x D] (positions
    0..T-1)."""
    from specdistill.decode.lean_eagle3 import DISABLE_ENV
    from specdistill.decode.proposers.dflash import DFlashProposer

    with switched_off(DISABLE_ENV, path == "modules"):
        proposer = DFlashProposer(drafter, target.get_input_embeddings(), weights=weights)
    proposer.begin([], features.shape[0] + 1)
    proposer.observe_prefill(features)
    return proposer


def block_argmax(proposer, seq: list[int]):
    """One block drafted after seq (the context is not extended): each row's greedy draft index."""
    return proposer.draft_block(seq).argmax(-1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from specdistill.decode.proposers.dflash import dflash_drafting_weights
    from specdistill.models.dflash import DFlashDrafter
    from specdistill.models.drafters import load_drafter
    from specdistill.models.target import load_target

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    loaded_target = load_target(args.target)
    drafter = load_drafter(args.drafter, loaded_target).model
    if not isinstance(drafter, DFlashDrafter):
        sys.exit(f"benchmarks.dflash_drafting: {args.drafter} is not a DFlash drafter ({type(drafter).__name__})")
    drafter.eval()
    target = loaded_target.model
    context = [(37 * i) % 30000 + 100 for i in range(args.context)]
    block = drafter.block_size
    runner = runner_for(target, "fma", context, block)
    with torch.inference_mode():
        features = target_features(target, context, drafter.target_layers)  # [T, K x D]
        proposers = {(form, path): primed_proposer(drafter, target, features, form, path)
                     for form in args.forms for path in args.paths}
        seq = context + [context[-1]]
        drafts = {key: block_argmax(p, seq) for key, p in proposers.items()}  # adds the context once
        variants = {("draft", key): (lambda p=p: p.draft_block(seq)) for key, p in proposers.items()}
        variants.update({("target", rows): (lambda r=rows: forward_rows(runner, r)) for rows in (1, block)})
        ms = median_ms(interleave(variants, args.reps, args.warmup))
    reference = drafts.get(("float32", "modules"), next(iter(drafts.values())))
    agree = {key: float((d == reference).float().mean()) for key, d in drafts.items()}
    one_row = ms["target", 1]
    print(f"one block of {block} rows after {args.context} positions of context, median of {args.reps}; the "
          f"target's forward: 1 row {one_row:.2f} ms, {block} rows {ms['target', block]:.2f} ms; auto drafts in "
          f"{dflash_drafting_weights(drafter, 'auto')}")
    print_table(["weights", "path", "block, ms", "x the target's one row", "greedy drafts equal to float32's"],
                [[form, path, ms["draft", (form, path)], ms["draft", (form, path)] / one_row, agree[form, path]]
                 for form, path in proposers])
    results = {"drafter": args.drafter, "context": args.context, "block_size": block,
               "auto": dflash_drafting_weights(drafter, "auto"),
               "target_ms": {1: one_row, block: ms["target", block]},
               "block_ms": {f"{form} {path}": ms["draft", (form, path)] for form, path in proposers},
               "drafts_equal_to_float32": {f"{form} {path}": value for (form, path), value in agree.items()}}
    write_report(args.out, "dflash_drafting", results, args)
    return results


def target_features(target, tokens: list[int], layers: list[int]):
    """The inputs of the target's `layers` for `tokens` [T, K x D] (hidden_states[i] is layer i's input)."""
    import torch

    out = target(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


if __name__ == "__main__":
    main()
