"""Check a drafter exported for vLLM (EAGLE-3, DFlash, Medusa heads, a draft model) against our engine: the same
drafter, the same chain depth, the same prompts, greedy; prints both engines' tau and acceptance per position and
vLLM's mismatches against our plain decoding. Our engine drafts what vLLM drafts: a top-1 chain, in full every step
(EAGLE-3 and a draft model `--depth` deep, Medusa one token per head, DFlash its whole block: its rows attend to
each other, so a shorter block would be another computation). Needs `make vllm` (vLLM compiles for about 3.5
minutes at start).

    specdistill vllm-check [DRAFTER] [--depth 6] [--max-new-tokens 96]
"""
import argparse
import json
from pathlib import Path

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers import build_proposer
from specdistill.decode.proposers.medusa import MedusaProposer, default_chain
from specdistill.decode.questions import load_questions
from specdistill.decode.vllm_peer import VllmWorker, exported_config, stats_from, target_directory
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]


def chain_proposer(drafter, target, depth: int):
    """Ours drafting what vLLM drafts for this drafter: a top-1 chain `depth` deep."""
    if drafter.kind == "medusa":
        return MedusaProposer(drafter.model, tree=default_chain(depth), vocab_map=drafter.vocab_map,
                              embed=target.model.get_input_embeddings())
    # fp32 drafter weights: vLLM runs the drafter as exported, so ours must not round it to fp16
    if drafter.kind == "dflash":  # the whole block as a chain, no floor, no price: what vLLM drafts
        return build_proposer(drafter, target.model, dflash_depth=depth, dflash_topk=1, dflash_tree_nodes=depth,
                              dflash_min_prob=0, dflash_priced=False, eos_token_ids=target.eos_token_ids,
                              drafter_weights="float32")
    if drafter.kind == "eagle3":
        return build_proposer(drafter, target.model, eagle3_depth=depth, eagle3_topk=1, eagle3_tree_nodes=depth,
                              drafter_weights="float32")
    return build_proposer(drafter, target.model, gamma=depth, eos_token_ids=target.eos_token_ids,
                          drafter_weights="float32")


def chain_depth(drafter, asked: int) -> int:
    """How deep both engines draft: Medusa one token per head, DFlash its whole block, the others `asked`."""
    if drafter.kind == "medusa":
        return drafter.model.config["num_heads"]
    if drafter.kind == "dflash":
        return drafter.model.block_size - 1
    return asked


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", nargs="?", default="runs/smollm2_eagle3_gpu/drafter")
    p.add_argument("--target", default=None, help="the drafter's target (default: the embedded smollm2-135m), "
                   "e.g. qwen2.5-coder-1.5b; vLLM loads its converted directory")
    p.add_argument("--questions", default=str(ROOT.parent / "shared/data/mt_bench/question.jsonl"))
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--depth", type=int, default=6,
                   help="chain depth (EAGLE-3, draft model; Medusa: its heads; DFlash: its block)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="runs/vllm_check.json")
    args = p.parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    questions = load_questions(args.questions, per_category=args.per_category)
    prompts = [target.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
    n, eos = args.max_new_tokens, sorted(target.eos_token_ids)
    depth = chain_depth(drafter, args.depth)
    proposer = chain_proposer(drafter, target, depth)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False)
    ours = aggregate_stats([engine.generate(prompt, n).stats for prompt in prompts])
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids)
    plain_tokens = [plain.generate(prompt, n).tokens for prompt in prompts]
    config = exported_config(drafter.path, drafter, target, ROOT / "runs" / "vllm_exports")
    config["num_speculative_tokens"] = depth
    worker = VllmWorker(target_directory(target), "float32", config)
    try:
        replies = [worker.generate(prompt, n, eos) for prompt in prompts]
    finally:
        worker.close()
    errors = [r["error"] for r in replies if "error" in r]
    if errors:
        raise SystemExit(f"vLLM failed: {errors[0]}")
    stats = [stats_from(r) for r in replies]
    positions = len(stats[0].accepted_per_position)
    vllm = {"tau": sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats),
            "alpha": sum(s.accepted for s in stats) / sum(s.drafted for s in stats),
            "per_position": [sum(s.accepted_per_position[i] for s in stats)
                             / sum(s.drafted_per_position[i] for s in stats) for i in range(positions)],
            "mismatches_vs_our_plain": sum(r["tokens"] != t for r, t in zip(replies, plain_tokens))}
    ours_per_position = [a / d if d else None
                         for a, d in zip(ours["accepted_per_position"], ours["drafted_per_position"])]
    report = {"depth": depth, "prompts": len(prompts), "ours": {"tau": ours["tau"], "alpha": ours["alpha"],
              "per_position": ours_per_position}, "vllm": vllm, "speculative_config": config}
    print(f"chain depth {depth}, {len(prompts)} prompts, {n} tokens: ours tau {ours['tau']:.3f}, vLLM tau "
          f"{vllm['tau']:.3f}; per position ours {[round(x, 3) for x in ours_per_position if x is not None]}, "
          f"vLLM {[round(x, 3) for x in vllm['per_position']]}; vLLM mismatches vs our plain "
          f"{vllm['mismatches_vs_our_plain']}/{len(prompts)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
