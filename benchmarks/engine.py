"""The engine's own speed, variant by variant, on the same prompts in one process: plain decoding's tokens/s.

    python -m benchmarks.engine [--limit 8] [--max-new-tokens 128] [--drafter prompt_lookup ...]
        [--variants fp32-hf fp32 fp16w bf16] [--rows 1 2 4 8 16] [--reps 10] [--out DIR]

Variants of our engine (decode.runner):
  fp32-hf   fp32, transformers' decoder forward on oneDNN-packed weights (the engine before decode.lean_decoder)
  fp32      fp32, the lean Llama forward (decode.lean_decoder) on the same packed weights: the same model
  fp16w     the float16-weights precision: the lean forward on FBGEMM fp16 weight copies (another model)
  bf16      the model in bfloat16 (transformers' decoder; fast only on CPUs with native bf16)
On a GPU (`--device cuda`):
  cuda-bf16-hf      bf16, transformers' decoder, dynamic shapes (the CUDA engine before decode.step_graphs)
  cuda-bf16-eager   bf16, the lean forward in fixed-shape steps over the static cache, run eagerly
  cuda-bf16-buckets bf16, the same steps replayed as CUDA graphs, each forward in the smallest of 1-64 rows
  cuda-bf16         bf16, CUDA graphs, every forward a 64-row step (the default on CUDA: token-exact speculation);
                    the EAGLE-3 drafter's context rows and whole tree graphed too (decode.draft_steps)
  cuda-bf16-draft-eager  the same with the drafter's steps eager (the engine before decode.draft_steps)
  cuda-fp32         fp32, CUDA graphs in buckets (the first-divergence reference for bf16)
and transformers' `generate` (fp32 on the CPU, bf16 on CUDA) as the peer every user has, and vLLM's plain decoding
in fp32 (`--vllm-dtypes float32 float16 bfloat16`: one engine per dtype) when its environment exists (`make vllm`;
decode/vllm_peer.py), else the report says why it was not run.

It prints the machine's plain-decoding speed first (fp32, our engine: the figure every table cites),
then one target forward of N rows after a 300-token context (the shape of a verification) for each
variant, interleaved rep by rep so the machine's noise hits all alike, then whole greedy generations
of the first turns of `--limit` MT-bench questions (interleaved per prompt), then each `--drafter`
speculating under each variant with its speedup over that variant's own plain decoding. Greedy
output of every speculative run is checked against plain decoding of the same variant (mismatches),
and each variant's plain output against fp32's (first diverging token per prompt). Writes
DIR/engine.json (with the machine's fingerprint, benchmarks.harness).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch

from benchmarks.harness import QUESTIONS, fingerprint, parser, switched_off, write_report
from specdistill.decode.draft_steps import DISABLE_ENV as NO_DRAFT_GRAPHS_ENV
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.lean_decoder import DISABLE_ENV as NO_LEAN_ENV
from specdistill.decode.proposers import build_proposer
from specdistill.decode.questions import load_questions
from specdistill.decode.runner import synchronized_clock
from specdistill.decode.step_graphs import DISABLE_ENV as NO_GRAPHS_ENV
from specdistill.decode.vllm_peer import VllmWorker, target_directory, unavailable_reason
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target

VARIANTS = {  # name: (precision, lean forward, device, CUDA graphs); cuda-bf16 runs one step shape
    "fp32-hf": ("float32", False, "cpu", False),
    "fp32": ("float32", True, "cpu", False),
    "fp16w": ("float16-weights", True, "cpu", False),
    # the model in bf16 (transformers' forward: bf16 is not packable); as a torch dtype, because the precision name
    # is refused on CPUs without native bf16 (their 1-row and N-row kernels round differently)
    "bf16": (torch.bfloat16, True, "cpu", False),
    "cuda-bf16-hf": ("bfloat16", False, "cuda", False),
    "cuda-bf16-eager": ("bfloat16", True, "cuda", False),
    "cuda-bf16-buckets": ("bfloat16", True, "cuda", True),
    "cuda-bf16": ("bfloat16", True, "cuda", True),
    "cuda-bf16-draft-eager": ("bfloat16", True, "cuda", True),
    "cuda-fp32": ("float32", True, "cuda", True),
}
DEFAULT_VARIANTS = {"cpu": ["fp32-hf", "fp32", "fp16w"],
                    "cuda": ["cuda-bf16-hf", "cuda-bf16-eager", "cuda-bf16-buckets", "cuda-bf16", "cuda-fp32"]}
REFERENCES = {"cpu": "fp32", "cuda": "cuda-bf16"}  # the plain decoding every figure of a device is cited against
REFERENCE = REFERENCES["cpu"]


def parse_args(argv):
    p = parser(__doc__, "engine", reps=10)
    p.add_argument("--target", default=None)
    p.add_argument("--questions", default=str(QUESTIONS))
    p.add_argument("--limit", type=int, default=8, help="first turns of the first N questions")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", choices=list(REFERENCES), default="cpu")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help="default: fp32-hf fp32 fp16w on the CPU, every cuda-* variant on CUDA")
    p.add_argument("--drafter", action="append", default=None,
                   help="drafter specs to speculate with under each variant (default: prompt_lookup)")
    p.add_argument("--plain-only", nargs="*", default=[], metavar="VARIANT",
                   help="variants timed in plain decoding only (no drafters), e.g. the slow ones kept as the reference")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--fixed-depth", action="store_true",
                   help="drafters draft their full depth every step (default: the adaptive depth): drafting "
                        "costs then compare variant against variant at the same trees")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's plain decoding (run when `make vllm` was)")
    p.add_argument("--vllm-dtypes", nargs="+", choices=["float32", "float16", "bfloat16"], default=["float32"],
                   help="vLLM's plain decoding in each of these dtypes, one engine each (default: float32)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=300)
    return p.parse_args(argv)


def engine_options(name: str) -> dict:
    """How variant `name` builds its engines: on CUDA the hf variant with dynamic shapes (the engine before fixed
    steps), the eager one in fixed steps without graphs, cuda-bf16-buckets in buckets, the others as the
    engine's defaults (bf16 on CUDA: one step shape)."""
    _, lean, device, graphs = VARIANTS[name]
    if name == "cuda-bf16-buckets":
        return {"one_shape": False}
    if device == "cpu" or graphs:
        return {}
    return {"fixed_steps": True, "one_shape": False} if lean else {"static_shapes": False}


@contextlib.contextmanager
def variant_switch(name: str):
    """Build runners as variant `name` does: the lean forward and CUDA graphs on or off."""
    _, lean, _, graphs = VARIANTS[name]
    with switched_off(NO_LEAN_ENV, not lean), switched_off(NO_GRAPHS_ENV, not graphs), \
            switched_off(NO_DRAFT_GRAPHS_ENV, name == "cuda-bf16-draft-eager"):
        yield


@torch.inference_mode()
def bench_forwards(targets: dict, args) -> list[dict]:
    runners = {}
    for name, target in targets.items():
        with variant_switch(name):  # the target runner of the variant's plain engine (its step shapes included)
            runners[name] = SpeculativeEngine(target.model, None, target.eos_token_ids, **engine_options(name)).target
    context = list(range(100, 100 + args.context))
    table = []
    for rows in args.rows:
        times = {name: [] for name in runners}
        for rep in range(args.warmup + args.reps):  # the first reps warm up (kernels are built per shape)
            for name in runners if rep % 2 == 0 else list(runners)[::-1]:
                times[name].append(time_forward(runners[name], context, rows))
        table.append({"rows": rows, **{f"{name}_ms": 1000 * statistics.median(t[args.warmup:])
                                       for name, t in times.items()}})
    return table


def time_forward(runner, context: list[int], rows: int) -> float:
    """Seconds of one forward of `rows` new tokens (logits for every row, as verification needs) after `context`."""
    runner.start(len(context) + rows + 1)
    runner.forward(context, logits_rows=slice(len(context) - 1, len(context)))
    runner.cache.advance(len(context))
    start = synchronized_clock(runner.device)
    runner.forward(list(range(1000, 1000 + rows)))
    return synchronized_clock(runner.device) - start


def engine_runs(targets: dict, drafters: list[str], plain_only=(), fixed_depth: bool = False) -> dict:
    """{method: (variant, generate(prompt_ids, n) -> (tokens, seconds))}: plain and each drafter per variant."""
    runs = {}
    for name, target in targets.items():
        with variant_switch(name):
            plain = SpeculativeEngine(target.model, None, target.eos_token_ids, **engine_options(name))
            runs[f"{name} plain"] = (name, plain)
            for spec in ([] if name in plain_only else drafters):
                drafter = load_drafter(spec, target)
                proposer = build_proposer(drafter, target.model, eos_token_ids=target.eos_token_ids)
                runs[f"{name} {spec}"] = (name, SpeculativeEngine(target.model, proposer, target.eos_token_ids,
                                                                  adaptive=not fixed_depth, **engine_options(name)))
    return runs


def hf_generate(target, prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=sorted(target.eos_token_ids) or None,
                                pad_token_id=target.tokenizer.eos_token_id)
    tokens = out[0, len(prompt_ids):].tolist()
    eos = next((i for i, t in enumerate(tokens) if t in target.eos_token_ids), None)
    return tokens if eos is None else tokens[:eos + 1]


def bench_generations(targets: dict, prompts: list[list[int]], args, drafters: list[str]) -> dict:
    runs = engine_runs(targets, drafters, args.plain_only, args.fixed_depth)
    # per engine method over the timed generations: target forwards (tau = tokens / forwards), drafting and
    # verification seconds (RequestStats)
    forwards = {name: [0, 0.0, 0.0] for name in runs}

    def engine_method(name, engine):
        def generate(prompt):
            out = engine.generate(prompt, args.max_new_tokens)
            counts = forwards[name]
            counts[0] += out.stats.target_forwards
            counts[1] += out.stats.draft_time_s
            counts[2] += out.stats.verify_time_s
            return out.tokens
        return generate

    methods = {name: engine_method(name, engine) for name, (_, engine) in runs.items()}
    fp32 = targets[REFERENCE]
    if not args.no_hf:
        methods[f"transformers generate {REFERENCE}"] = lambda p: hf_generate(fp32, p, args.max_new_tokens)
    stop = sorted(fp32.eos_token_ids)
    workers = {}
    for dtype in args.vllm_dtypes:
        worker = start_vllm(fp32, args, dtype)
        if worker is not None:
            workers[dtype] = worker
            methods[f"vLLM plain {dtype}"] = functools.partial(vllm_generate, worker, n=args.max_new_tokens, stop=stop)
    with torch.inference_mode():
        for method in methods.values():  # warm up: kernels, caches, the adaptive controller's first costs
            method(prompts[0][:64])
    forwards.update({name: [0, 0.0, 0.0] for name in runs})
    outputs = {name: [] for name in methods}
    seconds = {name: 0.0 for name in methods}
    for prompt in prompts:  # prompt by prompt, every method in turn: noise hits all alike
        for name, method in methods.items():
            start = time.perf_counter()
            with torch.inference_mode():
                tokens = method(prompt)
            seconds[name] += time.perf_counter() - start
            outputs[name].append(tokens)
    for worker in workers.values():
        worker.close()
    rows = {}
    for name in methods:
        variant = runs[name][0] if name in runs else REFERENCE
        plain = f"{variant} plain"
        tokens = sum(len(t) for t in outputs[name])
        rows[name] = {"tokens": tokens, "seconds": seconds[name], "tok_s": tokens / seconds[name],
                      "speedup_over_own_plain": (tokens / seconds[name]) / (sum(len(t) for t in outputs[plain])
                                                                           / seconds[plain]),
                      "mismatches_vs_own_plain": sum(a != b for a, b in zip(outputs[name], outputs[plain]))}
        if name in runs:
            steps, draft_s, verify_s = forwards[name]
            rows[name].update(tau=tokens / steps, draft_ms_per_step=1000 * draft_s / steps,
                              verify_ms_per_step=1000 * verify_s / steps)
    reference = outputs.get(f"{REFERENCE} plain")
    agreement = {}
    if reference is not None:
        for variant in targets:
            agreement[variant] = [first_difference(a, b) for a, b in zip(reference, outputs[f"{variant} plain"])]
    return {"methods": rows, "first_divergence_vs_reference": agreement}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where the two token lists differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def start_vllm(target, args, dtype: str):
    """A vLLM worker for plain decoding of the same target in `dtype` (decode.vllm_peer), or None with the reason
    kept for the report (VLLM_STATUS[dtype])."""
    status = VLLM_STATUS.setdefault(dtype, {})
    if args.no_vllm or args.device != "cpu":
        status["status"] = "not run: " + ("--no-vllm" if args.no_vllm else "the vLLM peer runs on the CPU only")
        return None
    reason = unavailable_reason(target)
    if reason:
        status["status"] = f"not run: {reason}"
        return None
    try:
        worker = VllmWorker(target_directory(target), dtype, None, torch.get_num_threads())
    except (RuntimeError, OSError) as err:
        status["status"] = f"not run: {err}"
        return None
    status.update(status="ran", vllm=worker.info.get("vllm"), startup_s=worker.info.get("startup_s"))
    return worker


VLLM_STATUS: dict[str, dict] = {}  # dtype: how its engine fared


def vllm_generate(worker, prompt_ids: list[int], n: int, stop: list[int]) -> list[int]:
    reply = worker.generate(prompt_ids, n, stop)
    if "error" in reply:
        raise RuntimeError(f"vLLM: {reply['error']}")
    return reply["tokens"]


def print_report(report: dict, args) -> None:
    names = [v for v in args.variants]
    print(f"machine: {report['machine']['cpu']}, {report['machine']['torch_threads']} torch threads"
          f"{'; ' + report['machine']['gpu'] if report['machine']['gpu'] else ''}; plain decoding of the target "
          f"(our engine, {report['reference']}): {report['plain_tok_s']:.1f} tok/s")
    print(f"\ntarget forward of N rows after {args.context} cached (median of {args.reps}, ms):")
    print("| N | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in report["forwards"]:
        print(f"| {row['rows']} | " + " | ".join(f"{row[n + '_ms']:.1f}" for n in names) + " |")
    gen = report["generations"]
    print(f"\ngreedy generations, first turns of {args.limit} MT-bench questions, {args.max_new_tokens} new tokens:")
    first = args.variants[0]
    print(f"| method | tok/s | tau | draft / verify ms per step | speedup over its own plain | "
          f"mismatches vs its own plain | x {first} plain |")
    print("|---|---|---|---|---|---|---|")
    base = gen["methods"].get(f"{first} plain", {}).get("tok_s")
    for name, row in gen["methods"].items():
        rel = f"{row['tok_s'] / base:.2f}x" if base else "-"
        tau = f"{row['tau']:.2f}" if "tau" in row else "-"
        split = f"{row['draft_ms_per_step']:.2f} / {row['verify_ms_per_step']:.2f}" if "tau" in row else "-"
        print(f"| {name} | {row['tok_s']:.1f} | {tau} | {split} | {row['speedup_over_own_plain']:.2f}x | "
              f"{row['mismatches_vs_own_plain']} | {rel} |")
    for dtype, status in report["vllm"].items():
        if status["status"] != "ran":
            print(f"| vLLM plain {dtype} | {status['status']} | | | | | |")
    for variant, firsts in gen["first_divergence_vs_reference"].items():
        print(f"first token differing from {report['reference']} plain, {variant}: {firsts}")


def main(argv=None) -> dict:
    global REFERENCE
    args = parse_args(argv)
    drafters = args.drafter if args.drafter is not None else ["prompt_lookup"]
    REFERENCE = REFERENCES[args.device]
    args.variants = args.variants or DEFAULT_VARIANTS[args.device]
    if REFERENCE not in args.variants:
        args.variants = [REFERENCE, *args.variants]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    targets = {name: load_target(args.target, device=VARIANTS[name][2], dtype=VARIANTS[name][0])
               for name in args.variants}
    questions = load_questions(args.questions, args.limit)
    reference = targets[REFERENCE]
    prompts = [reference.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
    machine = {**fingerprint(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    report = {"machine": machine,
              "variants": {n: {"precision": targets[n].precision, "lean": VARIANTS[n][1]} for n in args.variants},
              "forwards": bench_forwards(targets, args),
              "generations": bench_generations(targets, prompts, args, drafters),
              "vllm": VLLM_STATUS}
    report["reference"] = REFERENCE
    report["plain_tok_s"] = report["generations"]["methods"][f"{REFERENCE} plain"]["tok_s"]
    print_report(report, args)
    write_report(args.out, "engine", report, args, machine)
    return report


if __name__ == "__main__":
    main()
