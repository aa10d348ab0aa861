"""Where an EAGLE-3 step's drafting time goes on CUDA: the tree step's graph replay, the whole `run()` (inputs
copied in, replay, candidates copied back), the same step eager, `select_tree`, and the context rows' step.

    python scripts/profile_draft_steps.py DRAFTER [--questions FILE] [--calls 50]

Needs a CUDA device (decode.draft_steps records its graphs there). Prints one line per depth count.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode.draft_steps import candidate_depths  # noqa: E402
from decode.engine import SpeculativeEngine  # noqa: E402
from decode.proposers import build_proposer  # noqa: E402
from decode.proposers.eagle3 import select_tree  # noqa: E402
from decode.questions import load_questions  # noqa: E402
from models.drafters import load_drafter  # noqa: E402
from models.target import load_target  # noqa: E402


def per_call_ms(f, calls: int) -> float:
    f()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / calls


@torch.inference_mode()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter")
    p.add_argument("--questions", default=str(ROOT.parent / "shared/data/mt_bench/question.jsonl"))
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_draft_steps: needs a CUDA device")
    target = load_target(device="cuda", dtype="bfloat16")
    proposer = build_proposer(load_drafter(args.drafter, target), target.model, eos_token_ids=target.eos_token_ids)
    question = load_questions(args.questions, per_category=1)[0]
    prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
    SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False).generate(prompt, 64)
    step, context, n = proposer.step, proposer.context_step, args.calls
    root = torch.randn(step.root.shape, device="cuda", dtype=step.root.dtype)
    position = proposer.cache.length
    for depth in sorted({2, max(2, step.max_depth // 2), step.max_depth}):
        step.run(root, depth, position)  # records the depth's graph if the request did not
        graph, _ = step.graphs[depth]
        replay = per_call_ms(lambda: (graph.replay(), torch.cuda.synchronize()), n)
        run = per_call_ms(lambda: step.run(root, depth, position), n)
        eager = per_call_ms(lambda: step.compute(depth), n)
        print(f"depth {depth}: replay+sync {replay:.3f} ms; run() {run:.3f} ms; the same step eager {eager:.3f} ms")
    tokens, parents, scores = step.run(root, step.max_depth, position)
    depths = candidate_depths(step.k, step.max_depth)
    ms = per_call_ms(lambda: select_tree(0, tokens, parents, scores, depths, proposer.tree_nodes), n)
    print(f"select_tree over {len(tokens)} candidates: {ms:.3f} ms")
    features = torch.randn(3, context.features.shape[1], device="cuda", dtype=context.features.dtype)

    def three_rows():
        proposer.cache.length = proposer.cache.used = position
        context.run([5, 6, 7], features, position)
    print(f"context step, 3 rows: {per_call_ms(three_rows, n):.3f} ms")


if __name__ == "__main__":
    main()
