"""The decoding table of docs/results.md: every method against plain decoding of the default target, in one process.

    python -m benchmarks.decode_methods [--preset lookup|table|qwen-coder|dflash|qwen-coder-dflash]
                                        [--sets mt-bench arena-heldout humaneval] [--fixed-depth] [--dry-run]

A wrapper around `python -m decode.evaluate` (Spec-Bench's protocol: greedy, batch size 1, warm-up, methods
interleaved per question, turn 2 on the method's own turn 1; greedy outputs checked token for token) that fixes the
methods and question sets the results page quotes, so its figures come from one committed command:

- `--preset lookup` (the default, what `make bench` runs; needs no training, minutes of CPU): prompt lookup and
  transformers' peers (`generate`, its prompt lookup) against our plain decoding.
- `--preset table`: the results page's table: prompt lookup, EAGLE-3 alone and with prompt lookup, the Medusa
  quickstart's heads, [LA], the Seq-KD quickstart's drafter. Each drafter is the `output_dir` of its shipped job
  (train them first: `specdistill train configs/distill/<job>.yaml`; `--drafter` replaces the list, and a
  missing drafter is an error that names the job to run).
- `--preset qwen-coder`: the real-size target (`--target qwen2.5-coder-1.5b`, docs/design/kquant-kernels.md) on
  HumanEval's first 8 problems and MT-bench `--per-category 1`: prompt lookup, the 0.5B sibling as a draft model
  alone and with prompt lookup, the EAGLE-3 drafter of configs/distill/qwen_coder_eagle3.yaml alone and with prompt
  lookup, and llama.cpp's plain decoding, n-gram and draft-model speculation on the same GGUF (`--peers llamacpp`;
  `make llamacpp` first).
- `--preset dflash`: the DFlash block drafter of configs/distill/smollm2_dflash.yaml beside EAGLE-3
  (smollm2_eagle3.yaml, the same data) and prompt lookup, each alone and with prompt lookup; `--fixed-depth` for the
  tau of each drafter's full depth.
- `--preset qwen-coder-dflash`: the same on the real-size target: the DFlash drafter of
  configs/distill/qwen_coder_dflash.yaml beside EAGLE-3 (qwen_coder_eagle3.yaml, the same data) and prompt lookup,
  each alone and with prompt lookup, on the qwen-coder preset's question sets.

Question sets, 128 new tokens a turn: `mt-bench` (MT-bench `--per-category 2`: 16 questions, both turns; the
qwen-coder preset: 1 a category), `arena-heldout` (8 Arena-Hard v2.0 prompts no shipped job trains on: records past
the 400th under 700 characters, at most 4 per subcategory; written to OUT/heldout_arena_v2.jsonl) and `humaneval`
(HumanEval's first 8 problems, which configs/distill/qwen_coder_eagle3.yaml leaves out of its training). Each set
writes OUT/<set>/report.{json,md}, turns.jsonl and plots (decode.evaluate's report records the machine) and prints
its tables.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from benchmarks.harness import QUESTIONS, ROOT, parser

ARENA = ROOT.parent / "shared" / "data" / "arena_hard" / "question_v2.0.jsonl"
HUMANEVAL = ROOT.parent / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"
EAGLE3 = "runs/smollm2_eagle3/drafter"
QWEN_EAGLE3 = "runs/qwen_coder_eagle3/drafter"
DFLASH = "runs/smollm2_dflash/drafter"
QWEN_DFLASH = "runs/qwen_coder_dflash/drafter"
JOBS = {  # drafter of the table -> the shipped job that writes it
    EAGLE3: "configs/distill/smollm2_eagle3.yaml",
    "runs/quickstart/drafter": "configs/distill/quickstart.yaml",
    "runs/smollm2_lookahead/drafter": "configs/distill/smollm2_lookahead.yaml",
    "runs/quickstart_seqkd/drafter": "configs/distill/quickstart_seqkd.yaml",
    QWEN_EAGLE3: "configs/distill/qwen_coder_eagle3.yaml",
    DFLASH: "configs/distill/smollm2_dflash.yaml",
    QWEN_DFLASH: "configs/distill/qwen_coder_dflash.yaml",
}
PRESETS = {
    "lookup": {"drafters": ["prompt_lookup"], "peers": ["hf"], "sets": ["mt-bench"]},
    "table": {"drafters": ["prompt_lookup", EAGLE3, f"{EAGLE3}+prompt_lookup", "runs/quickstart/drafter",
                           "runs/smollm2_lookahead/drafter", "runs/quickstart_seqkd/drafter"],
              "peers": [], "sets": ["mt-bench", "arena-heldout"]},
    "qwen-coder": {"drafters": ["prompt_lookup", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b+prompt_lookup", QWEN_EAGLE3,
                                f"{QWEN_EAGLE3}+prompt_lookup"],
                   "peers": ["llamacpp"], "sets": ["humaneval", "mt-bench"], "target": "qwen2.5-coder-1.5b",
                   "per_category": 1, "llamacpp_extra": ["--llamacpp-draft", "qwen2.5-coder-0.5b"]},
    "dflash": {"drafters": ["prompt_lookup", EAGLE3, f"{EAGLE3}+prompt_lookup", DFLASH, f"{DFLASH}+prompt_lookup"],
               "peers": [], "sets": ["mt-bench", "arena-heldout"]},
    "qwen-coder-dflash": {"drafters": ["prompt_lookup", QWEN_EAGLE3, f"{QWEN_EAGLE3}+prompt_lookup", QWEN_DFLASH,
                                       f"{QWEN_DFLASH}+prompt_lookup"],
                          "peers": [], "sets": ["humaneval", "mt-bench"], "target": "qwen2.5-coder-1.5b",
                          "per_category": 1},
}
SETS = ("mt-bench", "arena-heldout", "humaneval")


def write_heldout_arena(source: Path, dest: Path, skip: int = 400, max_chars: int = 700, per_category: int = 4) -> Path:
    """The held-out Arena-Hard set: records from `skip` on with a prompt under `max_chars` characters, at most
    `per_category` per subcategory, as {"question_id", "category", "prompt"} lines."""
    taken: Counter = Counter()
    lines = []
    with open(source, encoding="utf-8") as f:
        for i, line in enumerate(f):
            record = json.loads(line)
            category = record.get("subcategory") or record["category"]
            if i >= skip and len(record["prompt"]) < max_chars and taken[category] < per_category:
                taken[category] += 1
                lines.append(json.dumps({"question_id": record["uid"], "category": category,
                                         "prompt": record["prompt"]}))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(line + "\n" for line in lines))
    return dest


def evaluate_argv(args, question_set: str, questions: Path | str) -> list[str]:
    """The decode.evaluate command line for one question set."""
    argv = ["--questions", str(questions), "--max-new-tokens", str(args.max_new_tokens), "--warmup",
            str(args.warmup), "--out", str(Path(args.out) / question_set)]
    if question_set == "mt-bench":
        argv += ["--per-category", str(PRESETS[args.preset].get("per_category", 2))]
    if question_set == "humaneval":
        argv += ["--limit", "8"]
    if "llamacpp" in args.peers:  # the preset's settings for llama.cpp's peers
        argv += PRESETS[args.preset].get("llamacpp_extra", [])
    if args.fixed_depth:
        argv += ["--fixed-depth"]
    for spec in args.drafter:
        argv += ["--drafter", spec]
    for peer in args.peers:
        argv += ["--peers", peer]
    for option in ("target", "device", "dtype", "threads"):
        if getattr(args, option) is not None:
            argv += [f"--{option}", str(getattr(args, option))]
    return argv


def missing_drafters(drafters: list[str]) -> list[str]:
    """An error line per drafter directory that does not exist, naming the job that trains it."""
    missing = []
    for spec in drafters:
        path = spec.removesuffix("+prompt_lookup")
        if path.startswith("runs/") and not (ROOT / path).is_dir():
            job = JOBS.get(path)
            missing.append(f"{path} does not exist" + (f": train it with `specdistill train {job}`" if job else ""))
    return sorted(set(missing))


def parse_args(argv=None):
    p = parser(__doc__, "decode_methods", reps=1)
    p.set_defaults(warmup=2)  # decode.evaluate's default, as the results page's runs used
    p.add_argument("--preset", choices=list(PRESETS), default="lookup")
    p.add_argument("--sets", nargs="+", choices=SETS, default=None, help="default: the preset's")
    p.add_argument("--drafter", action="append", default=None, help="replaces the preset's drafters (repeat)")
    p.add_argument("--peers", action="append", choices=["hf", "vllm", "llamacpp", "none"], default=None,
                   help="replaces the preset's peers (repeat); `--peers none`: our methods only")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--mt-bench", default=str(QUESTIONS), help="MT-bench's question.jsonl")
    p.add_argument("--arena", default=str(ARENA), help="Arena-Hard v2.0's question_v2.0.jsonl")
    for option in ("target", "device", "dtype", "threads"):
        p.add_argument(f"--{option}", default=None, help=f"passed to decode.evaluate's --{option}")
    p.add_argument("--fixed-depth", action="store_true", help="passed to decode.evaluate: every drafter drafts its "
                   "full depth (tau comparable across kinds; speed is then not the engine's)")
    p.add_argument("--dry-run", action="store_true", help="print the decode.evaluate commands and stop")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.drafter = args.drafter or list(preset["drafters"])
    args.peers = args.peers if args.peers is not None else list(preset["peers"])
    if "none" in args.peers:
        if len(args.peers) > 1:
            p.error(f"--peers none runs no peers; it cannot join {', '.join(x for x in args.peers if x != 'none')}")
        args.peers = []
    args.sets = args.sets or list(preset["sets"])
    args.target = args.target or preset.get("target")
    if args.reps != 1:
        p.error("--reps: decode.evaluate runs each question once per method; run the benchmark again instead")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = []
    for question_set in args.sets:
        questions = {"mt-bench": Path(args.mt_bench), "humaneval": HUMANEVAL,
                     "arena-heldout": Path(args.out) / "heldout_arena_v2.jsonl"}[question_set]
        runs.append((question_set, questions, evaluate_argv(args, question_set, questions)))
    for _, _, argv_ in runs:
        print("python -m decode.evaluate " + " ".join(argv_))
    if args.dry_run:
        return 0
    if missing := missing_drafters(args.drafter):
        print("\n".join(missing), file=sys.stderr)
        return 2
    from specdistill.decode.evaluate import main as evaluate

    worst = 0
    for question_set, questions, argv_ in runs:
        if question_set == "arena-heldout":
            write_heldout_arena(Path(args.arena), questions)
        worst = max(worst, evaluate(argv_) or 0)
    return worst


if __name__ == "__main__":
    sys.exit(main())
