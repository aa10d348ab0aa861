"""The head of a greedy step: every logit (the Q8_0 kernel, then argmax) against the greedy head (an int8 pass with
a bound, then the few candidates the bound cannot rule out computed exactly), alone and in the whole forward.

    python -m benchmarks.greedy_head [--rows 1 2 3 4 6 8] [--reps 25] [--out DIR]

The decision it backs: docs/design/exact-kernels.md. First checks, on the final hidden states of real MT-bench
prompts and on random rows, that the greedy head's token is the full logits' argmax at every row, and counts the
candidates it computed exactly. Then times, interleaved rep by rep (medians): the head alone over N rows after a
100 MB sweep of memory (as in decoding, where the layers' weights pushed the head out of the caches), and the
forward over N rows after a 300-token prefix (ModelRunner.forward against forward_greedy). Needs the int8
kernels (AVX512-VNNI or the library's AVX2 build).
Writes DIR/greedy_head.json.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.harness import QUESTIONS, interleave, median_ms, parser, print_table, write_report


def check_tokens(target, full, greedy, questions) -> dict:
    """The greedy head's tokens against the full logits' argmax on real and random rows; candidate counts."""
    import torch

    rows = []
    for question in questions:
        ids = target.encode_chat([{"role": "user", "content": question.turns[0]}])
        rows.append(target.model.model(torch.tensor([ids])).last_hidden_state[0])  # [T, D], after the final norm
    generator = torch.Generator().manual_seed(0)
    width = rows[0].shape[-1]
    rows += [torch.randn(64, width, generator=generator) * scale for scale in (0.1, 1.0, 10.0)]
    mismatches, counts = 0, []
    for block in torch.cat(rows).split(8):
        block = block.contiguous()
        tokens, candidates = greedy.tokens(block)
        mismatches += int((tokens != full(block[None])[0].argmax(-1)).sum())
        counts += candidates.tolist()
    return {"rows": len(counts), "mismatches": mismatches, "candidates_median": statistics.median(counts),
            "candidates_max": max(counts)}


def time_heads(full, greedy, args, width: int) -> dict:
    import torch

    sweep = torch.randn(25_000_000)  # 100 MB
    x = torch.randn(max(args.rows), width)
    calls = {}
    for n in args.rows:
        calls["full", n] = lambda n=n: full(x[None, :n])[0].argmax(-1)
        calls["greedy", n] = lambda n=n: greedy.tokens(x[:n])
    return median_ms(interleave(calls, args.reps, args.warmup, before=lambda: sweep.add_(1.0)))


def time_forwards(target, args, greedy) -> dict:
    from specdistill.decode.runner import ModelRunner

    runner = ModelRunner(target.model)
    runner.greedy_head = greedy  # forward_greedy's head, whether or not the engine picks it on this CPU
    runner.start(400)
    runner.forward(list(range(1000, 1300)), logits_rows=slice(299, 300))
    runner.cache.advance(300)  # each timed forward writes its rows after it, uncommitted
    calls = {}
    for n in args.rows:
        tokens = list(range(2000, 2000 + n))
        calls["full", n] = lambda t=tokens: runner.forward(t)
        calls["greedy", n] = lambda t=tokens: runner.forward_greedy(t)
    return median_ms(interleave(calls, args.reps, args.warmup))


def parse_args(argv=None):
    p = parser(__doc__, "greedy_head", reps=25)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--questions", default=str(QUESTIONS))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from specdistill.decode.questions import load_questions
    from specdistill.models.kernel_linear import GreedyHead, Q80Linear, head_for_inference
    from specdistill.models.kernels import int8_unavailable, library
    from specdistill.models.target import load_target

    if (why := int8_unavailable()) is not None:
        sys.exit(f"benchmarks.greedy_head: the greedy head does not run here: {why}")
    with torch.inference_mode():
        target = load_target()
        head = target.model.get_output_embeddings()
        full = head_for_inference(head)
        if not isinstance(full, Q80Linear) or full.codes.form != "fma":
            sys.exit("benchmarks.greedy_head: the head is not the Q8_0 kernel's FMA form here (an AMX host?)")
        greedy = GreedyHead(head.weight, library())  # where it runs, whether or not the engine picks it
        check = check_tokens(target, full, greedy, load_questions(args.questions, per_category=1)[:4])
        heads, forwards = time_heads(full, greedy, args, head.weight.shape[1]), time_forwards(target, args, greedy)
    print(f"{check['rows']} rows: {check['mismatches']} tokens differ from the full logits' argmax; candidates "
          f"computed exactly per row: median {check['candidates_median']}, max {check['candidates_max']}")
    print(f"medians of {args.reps}, ms (x: the full head's or forward's time over the greedy one's)")
    print_table(["rows", "head, every logit", "greedy head", "x", "forward, every logit", "forward_greedy", "x"],
                [[n, heads["full", n], heads["greedy", n], heads["full", n] / heads["greedy", n],
                  forwards["full", n], forwards["greedy", n], forwards["full", n] / forwards["greedy", n]]
                 for n in args.rows])
    results = {"check": check, "head_ms": {f"{k} {n}": v for (k, n), v in heads.items()},
               "forward_ms": {f"{k} {n}": v for (k, n), v in forwards.items()}}
    write_report(args.out, "greedy_head", results, args)
    return results


if __name__ == "__main__":
    main()
