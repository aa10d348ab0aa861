"""The evaluation command: a drafter's speculative decoding against plain decoding of the same target.

    python -m decode.evaluate --drafter truncated:4 --questions question.jsonl [--target T] [--peers hf]

Spec-Bench's protocol: greedy by default, batch size 1, every method in one process on the same
prompts after its own warm-up, methods interleaved per question (so the machine's noise hits them
alike), multi-turn questions with turn k+1 conditioned on the method's own answer to turn k, speedup
per category and overall, losslessness checked token for token against the baseline: a method bound to it
(decode.peers.Method.lossless) whose greedy output differs makes the command exit EXIT_MISMATCH, after the report
is written.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from specdistill.decode.peers import (
    HF_PROMPT_LOOKUP_NUM_TOKENS,
    Method,
    assistant_model_of,
    assisted_skip_reason,
    divergences,
    engine_method,
    format_divergences,
    hf_method,
)
from specdistill.decode.proposers import build_proposer
from specdistill.decode.questions import Question, QuestionFileError, load_questions
from specdistill.decode.report import BASELINE, TurnResult, format_tables, lossless_failures, summarize, write_report
from specdistill.decode.runtime_facts import runtime_facts
from specdistill.decode.sampling import SamplingConfig
from specdistill.models.packed_linear import DRAFTING_WEIGHTS
from specdistill.models.target import PRECISIONS

log = logging.getLogger(__name__)

PEERS = ("none", "hf", "vllm", "llamacpp")
EXIT_MISMATCH = 3  # a lossless method's greedy output differed from the baseline's (2 is argparse's bad argument)


@dataclass
class EvalConfig:
    drafters: tuple[str, ...]  # drafter specs (models.drafters.load_drafter); one "speculative" method each
    questions: str  # the question file, recorded in the report
    target: str | None = None  # target spec (models.target.load_target); None = the embedded default
    limit: int | None = None  # the first N questions; None = all
    per_category: int | None = None  # only the first N questions of each category; None = all
    max_new_tokens: int = 256  # per turn
    temperature: float = 0.0  # 0 = greedy (the protocol); > 0 = speculative sampling, no mismatch check
    gamma: int = 5  # draft length of draft-model proposers
    fixed_depth: bool = False  # draft the full depth every step instead of the cost-aware adaptive depth
    prompt_vocab: bool | None = None  # reduced draft heads also draft the prompt's tokens; None = the manifest's
    # "hf": also transformers' generate, assisted generation and prompt lookup; "vllm": vLLM's plain decoding and
    # n-gram speculation (decode.vllm_peer); "llamacpp": llama.cpp's server on the target's GGUF, plain, with n-gram,
    # with draft-model speculation and with each eagle3 drafter converted to GGUF (decode.llamacpp_peer); several: a
    # tuple, or a comma-separated string
    peers: tuple[str, ...] | str = "none"
    # the llamacpp+draft method's draft model: a GGUF file or a name (models.real_targets); None = no such method
    llamacpp_draft: str | None = None
    warmup: int = 2  # untimed generations per method before measuring
    device: str = "cpu"
    dtype: str | None = None  # the target's precision (models.target.PRECISIONS); None = the device's default
    # the drafters' packed weights on the CPU (models.packed_linear.drafting_weights): auto = fp16 where FBGEMM runs
    drafter_weights: str = "auto"
    # DIR+prompt_lookup (decode.proposers.WithPromptLookup): a match of this many tokens drafts the lookup chain
    # alone (0: never); a shorter match puts at most lookup_weak_chain lookup tokens beside the tree (None: all)
    lookup_first: int = 2
    lookup_weak_chain: int | None = None
    seed: int = 0  # for sampling
    out: str | None = None  # output directory; None = runs/evaluate/<time>
    # exit 0 even when a lossless method's greedy output differs from the baseline's (investigations)
    allow_mismatches: bool = False

    def __post_init__(self):
        self.drafters = tuple(self.drafters)
        names = self.peers.split(",") if isinstance(self.peers, str) else list(self.peers)
        self.peers = tuple(dict.fromkeys(p.strip() for p in names if p.strip() not in ("", "none")))
        if not self.drafters:
            raise ValueError("drafters: at least one drafter spec is needed")
        if self.llamacpp_draft is not None and "llamacpp" not in self.peers:
            raise ValueError("llamacpp_draft: a draft model for llama.cpp needs the llama.cpp peers (--peers llamacpp)")
        checks = {"limit": self.limit is None or self.limit >= 1,
                  "per_category": self.per_category is None or self.per_category >= 1,
                  "max_new_tokens": self.max_new_tokens >= 1,
                  "temperature": self.temperature >= 0, "gamma": self.gamma >= 1, "warmup": self.warmup >= 0,
                  "peers": all(p in PEERS for p in self.peers), "dtype": self.dtype is None or self.dtype in PRECISIONS,
                  "drafter_weights": self.drafter_weights in DRAFTING_WEIGHTS, "lookup_first": self.lookup_first >= 0,
                  "lookup_weak_chain": self.lookup_weak_chain is None or self.lookup_weak_chain >= 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, seed=self.seed)


@dataclass
class EvalResult:
    config: dict  # the run's configuration, target fingerprint, drafter manifests, machine
    summary: dict  # decode.report.summarize
    results: list[TurnResult]
    skipped: dict[str, str]  # method -> why it did not run
    runtime: dict  # what ran, resolved (decode.runtime_facts)


# ---- the protocol ----------------------------------------------------------------------------------

def conversation_for_turn(turns: Sequence[str], answers: Sequence[str], k: int) -> list[dict]:
    """The messages that turn k is generated from: every earlier user turn followed by the method's
    own answer to it, then user turn k."""
    if len(answers) < k:
        raise ValueError(f"turn {k} needs the answers to the {k} turns before it, got {len(answers)}")
    messages = []
    for i in range(k):
        messages += [{"role": "user", "content": turns[i]}, {"role": "assistant", "content": answers[i]}]
    return messages + [{"role": "user", "content": turns[k]}]


def decode_answer(tokenizer, tokens: list[int]) -> str:
    """The answer as the next turn's conversation carries it (special tokens such as EOS dropped)."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def run_question(method: Method, question: Question, target) -> list[TurnResult]:
    """Every turn of one question with one method, each turn conditioned on the method's own answers."""
    answers, results = [], []
    for k in range(len(question.turns)):
        prompt_ids = target.encode_chat(conversation_for_turn(question.turns, answers, k))
        out = method.run(prompt_ids)
        answers.append(decode_answer(target.tokenizer, out.tokens))
        results.append(TurnResult(question.question_id, question.category, k, method.name, len(prompt_ids),
                                  out.tokens, answers[-1], out.wall_s, out.stats))
    return results


def warm_up(methods: list[Method], questions: list[Question], target, n: int,
            failed: dict[str, str] | None = None) -> None:
    """n untimed generations per method (first turns of the first questions, round robin): allocator,
    thread pools and the engine's adaptive draft length settle before anything is measured."""
    prompts = [target.encode_chat(conversation_for_turn(q.turns, [], 0)) for q in questions[:n]]
    for i in range(n):
        for method in list(methods):
            survive(method, methods, failed, lambda method=method, i=i: method.run(prompts[i % len(prompts)]))


def run_methods(methods: list[Method], questions: list[Question], target, warmup: int = 2,
                progress: bool = True, failed: dict[str, str] | None = None) -> list[TurnResult]:
    """Warm up, then for each question run every method (interleaved), in the given order. A fallible
    method (a vLLM worker) that fails is dropped with all its turns, and `failed[name]` says why; any
    other method's error ends the run."""
    active = list(methods)
    warm_up(active, questions, target, warmup, failed)
    results = []
    for question in tqdm(questions, desc="questions", unit="q", disable=not progress):
        for method in list(active):
            results += survive(method, active, failed,
                               lambda method=method, question=question: run_question(method, question, target)) or []
    dropped = {m.name for m in methods} - {m.name for m in active}
    return [r for r in results if r.method not in dropped]


def survive(method: Method, active: list[Method], failed: dict[str, str] | None, call):
    """call(); if a fallible method raises RuntimeError, remove it from `active`, record why, return None."""
    try:
        return call()
    except RuntimeError as err:
        if not method.fallible or failed is None:
            raise
        failed[method.name] = f"failed during the run, dropped with all its turns: {err}"
        active.remove(method)
        log.warning("dropping %s: %s", method.name, err)
        return None


# ---- building the methods ----------------------------------------------------------------------------

def build_methods(target, drafters: Mapping[str, object], config: EvalConfig,
                  engine_options: Mapping[str, dict] | None = None) -> tuple[list[Method], dict[str, str]]:
    """baseline, one speculative method per drafter, and with peers="hf" transformers' methods.
    engine_options: {drafter spec: SpeculativeEngine keywords} for the engines of those drafters' methods
    (benchmarks.engine_options). Returns the methods and {method: reason} for the ones that cannot run."""
    one = len(drafters) == 1
    sampling = config.sampling
    methods = [engine_method(BASELINE, target, None, config.max_new_tokens, sampling)]
    for spec, drafter in drafters.items():
        proposer = build_proposer(drafter, target.model, gamma=config.gamma, eos_token_ids=target.eos_token_ids,
                                  prompt_vocab=config.prompt_vocab, drafter_weights=config.drafter_weights,
                                  lookup_first=config.lookup_first, lookup_weak_chain=config.lookup_weak_chain)
        methods.append(engine_method(method_name("speculative", spec, one), target, proposer,
                                     config.max_new_tokens, sampling, adaptive=not config.fixed_depth,
                                     **(engine_options or {}).get(spec, {})))
    skipped = {}
    if "hf" in config.peers and target.precision == "float16-weights":
        reason = ("transformers' generate computes the fp32 model, not the float16-weights one this run decodes: "
                  "its outputs and speed are another model's (run --dtype float32 for the hf peers)")
        for name in ["hf_generate", *(method_name("hf_assisted", spec, one) for spec in drafters), "hf_prompt_lookup"]:
            skipped[name] = reason
        log.info("skipping the hf peers: %s", reason)
    elif "hf" in config.peers:
        methods.append(hf_method("hf_generate", target, config.max_new_tokens, sampling))
        for spec, drafter in drafters.items():
            name, reason = method_name("hf_assisted", spec, one), assisted_skip_reason(drafter, target)
            if reason:
                skipped[name] = reason
                log.info("skipping %s: %s", name, reason)
            else:
                methods.append(hf_method(name, target, config.max_new_tokens, sampling,
                                         assistant_model=assistant_model_of(drafter, target)))
        methods.append(hf_method("hf_prompt_lookup", target, config.max_new_tokens, sampling,
                                 generation_options={"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_NUM_TOKENS}))
    if "vllm" in config.peers:
        from specdistill.decode.vllm_peer import vllm_methods

        exports = Path(config.out or "runs/evaluate") / "vllm_exports"
        vllm, vllm_skipped = vllm_methods(target, config.max_new_tokens, config.sampling.greedy,
                                          torch.get_num_threads(), drafters, exports)
        methods += vllm
        skipped.update(vllm_skipped)
    if "llamacpp" in config.peers:
        from specdistill.decode.llamacpp_peer import llamacpp_methods

        logs = Path(config.out or "runs/evaluate") / "llamacpp_logs"
        llamacpp, llamacpp_skipped = llamacpp_methods(target, config.max_new_tokens, config.sampling.greedy,
                                                      torch.get_num_threads(), config.gamma, config.llamacpp_draft,
                                                      logs, drafters)
        methods += llamacpp
        skipped.update(llamacpp_skipped)
    return methods, skipped


def method_name(kind: str, spec: str, only_drafter: bool) -> str:
    return kind if only_drafter else f"{kind}[{spec}]"


def as_drafter_map(drafters) -> dict[str, object]:
    """A single Drafter or {label: Drafter} -> {label: Drafter} (a single one is labelled by its spec)."""
    if isinstance(drafters, Mapping):
        return dict(drafters)
    label = (drafters.manifest.get("config") or {}).get("spec") or drafters.path or drafters.kind
    return {str(label): drafters}


def run_evaluation(target, drafters, questions: list[Question], config: EvalConfig,
                   progress: bool = True) -> EvalResult:
    """Evaluate already-loaded objects: target (models.target.Target), drafters (a models.drafters.Drafter
    or {label: Drafter}) and questions. The CLI wraps this; tests pass tiny models."""
    drafters = as_drafter_map(drafters)
    methods, skipped = build_methods(target, drafters, config)
    return evaluate_methods(methods, skipped, target, drafters, questions, config, progress)


def evaluate_methods(methods: list[Method], skipped: dict[str, str], target, drafters: Mapping[str, object],
                     questions: list[Question], config: EvalConfig, progress: bool = True) -> EvalResult:
    failed: dict[str, str] = {}
    try:
        results = run_methods(methods, questions, target, config.warmup, progress, failed)
    finally:
        for method in methods:
            if method.close is not None:
                method.close()
    # after the run: every fallback the run met is on record (models.kernels.fallbacks)
    runtime = runtime_facts(target, {m.name: m.engine for m in methods if m.engine is not None})
    summary = summarize(results, [m.name for m in methods if m.name not in failed], greedy=config.sampling.greedy)
    for method in methods:
        if method.name in summary:
            summary[method.name]["lossless"] = method.lossless  # bound to the baseline's output: lossless_failures
            if not method.lossless and config.sampling.greedy:  # a peer: where its answers leave the baseline's
                summary[method.name]["first_divergence"] = divergences(results, method.name)
    return EvalResult(describe_run(target, drafters, questions, config), summary, results, {**skipped, **failed},
                      runtime)


def mismatch_message(failures: dict[str, str], out: Path, allowed: bool) -> str:
    named = "; ".join(f"{name}: {count}" for name, count in failures.items())
    ending = ("--allow-mismatches: exiting 0" if allowed
              else f"exit status {EXIT_MISMATCH} (--allow-mismatches exits 0 for investigations)")
    return (f"decode.evaluate: LOSSLESSNESS VIOLATED: greedy output differs from the baseline's in {named}. "
            f"The full report is in {out}; {ending}")


def describe_run(target, drafters: Mapping[str, object], questions: list[Question], config: EvalConfig) -> dict:
    manifests = {spec: drafter.manifest for spec, drafter in drafters.items()}
    return {**asdict(config), "questions_evaluated": len(questions),
            "turns_evaluated": sum(len(q.turns) for q in questions),
            "target_name": target.name, "target_fingerprint": target.fingerprint, "precision": target.precision,
            "drafter_manifest": next(iter(manifests.values())) if len(manifests) == 1 else None,
            "drafter_manifests": manifests, "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_NUM_TOKENS,
            "machine": machine_info(target.device)}


def machine_info(device) -> dict:
    device = torch.device(device)
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()}


# ---- command line ------------------------------------------------------------------------------------

def positive_int(text: str) -> int:
    value = int_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int_arg(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"file not found: {text}")
    return text


def build_parser() -> argparse.ArgumentParser:
    d = EvalConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m decode.evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog=f"exit status: 0 done; 2 a bad argument; {EXIT_MISMATCH} a lossless method (our "
                                       "engine's) gave greedy output that differs from the baseline's, the report "
                                       "written first (see --allow-mismatches)")
    p.add_argument("--target", default=None, help="target: an HF model directory, a .gguf file, a hub id in the "
                   "local HF cache, or nothing for the embedded default (SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", action="append", required=True, help="drafter spec: truncated:N, prompt_lookup, "
                   "a drafter directory, ... (models.drafters); repeat to compare several in one run")
    p.add_argument("--questions", type=existing_file, required=True,
                   help="JSONL question file: MT-bench/Spec-Bench {question_id, category, turns} or {prompt}")
    p.add_argument("--limit", type=positive_int, default=None, help="evaluate the first N questions (default: all)")
    p.add_argument("--per-category", type=positive_int, default=None,
                   help="only the first N questions of each category (MT-bench's first questions are all "
                        "'writing'; --per-category 2 gives 2 of each of its 8 categories)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"].default, help="per turn")
    p.add_argument("--temperature", type=non_negative_float, default=d["temperature"].default,
                   help="0 = greedy (the protocol); > 0 samples (losslessness is then not checked token for token)")
    p.add_argument("--gamma", type=positive_int, default=d["gamma"].default, help="draft length of draft models")
    p.add_argument("--fixed-depth", action="store_true",
                   help="draft the full depth every step (default: the cost-aware adaptive depth); tau then "
                        "measures acceptance alone, and speed what always drafting fully costs")
    p.add_argument("--prompt-vocab", action=argparse.BooleanOptionalAction, default=None,
                   help="a reduced draft head also drafts every token of the request's prompt (rows from the "
                        "drafter's input embeddings); default: the drafter manifest's extra.prompt_vocab")
    p.add_argument("--peers", choices=PEERS, action="append", default=None,
                   help="hf: also run transformers' generate, assisted generation and prompt lookup; vllm: vLLM's "
                        "plain decoding and n-gram speculation (`make vllm` first); llamacpp: llama.cpp's server on "
                        "the target's GGUF, plain, n-gram and draft-model speculation, and each EAGLE-3 --drafter "
                        "converted by llama.cpp's own converter (llamacpp+eagle3, a chain of --gamma tokens) "
                        "(`make llamacpp` first); repeat for several")
    p.add_argument("--llamacpp-draft", default=None, metavar="PATH_OR_NAME",
                   help="with --peers llamacpp: the draft model of the llamacpp+draft method, a .gguf file or a "
                        "named GGUF model such as qwen2.5-coder-0.5b (default: none, that method skipped)")
    p.add_argument("--warmup", type=non_negative_int, default=d["warmup"].default,
                   help="untimed generations per method before measuring")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--dtype", choices=PRECISIONS, default=None,
                   help="what the target computes in (default: float32 on CPU, bfloat16 on CUDA); float16-weights: "
                        "fp16 copies of the linear weights with fp32 activations (CPU, FBGEMM); auto: the fastest "
                        "this machine has. Each is its own model: outputs are compared within one precision")
    p.add_argument("--drafter-weights", choices=DRAFTING_WEIGHTS, default=d["drafter_weights"].default,
                   help="the drafters' linear weights on the CPU: auto = fp16 copies wherever FBGEMM's fp16 GEMM runs "
                        "(half the bytes per draft step; the target still verifies every draft in its own precision), "
                        "float32 = the drafter as trained")
    p.add_argument("--lookup-first", type=non_negative_int, default=d["lookup_first"].default,
                   help="DIR+prompt_lookup: a prompt-lookup match of at least this many tokens drafts the lookup "
                        "chain alone, the drafter skipping the step (0: never; the chain always joins the tree)")
    p.add_argument("--lookup-weak-chain", type=non_negative_int, default=None,
                   help="DIR+prompt_lookup: at most this many lookup tokens beside the drafter's tree on the other "
                        "steps (default: the whole chain)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=non_negative_int, default=d["seed"].default, help="sampling seed")
    p.add_argument("--out", default=None, help="output directory (default: runs/evaluate/<date-time>)")
    p.add_argument("--allow-mismatches", action="store_true",
                   help=f"exit 0 even when a lossless method's greedy output differs from the baseline's (for "
                        f"investigations); without it such a run exits {EXIT_MISMATCH} after writing the full report. "
                        "Peers whose arithmetic differs (transformers, vLLM) are reported and never fail the run")
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or str(Path("runs") / "evaluate" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    return EvalConfig(drafters=tuple(args.drafter), questions=args.questions, target=args.target, limit=args.limit,
                      per_category=args.per_category,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, gamma=args.gamma,
                      fixed_depth=args.fixed_depth, prompt_vocab=args.prompt_vocab, peers=tuple(args.peers or ()),
                      warmup=args.warmup, device=device, dtype=args.dtype, drafter_weights=args.drafter_weights,
                      lookup_first=args.lookup_first, lookup_weak_chain=args.lookup_weak_chain, seed=args.seed, out=out,
                      allow_mismatches=args.allow_mismatches, llamacpp_draft=args.llamacpp_draft)


def check_llamacpp(parser: argparse.ArgumentParser, config: EvalConfig) -> None:
    """--peers llamacpp needs `make llamacpp` and a --llamacpp-draft that is a GGUF model: checked before the target
    loads, a failure is an argparse error (exit 2) that says so."""
    from specdistill.decode.llamacpp_peer import LlamacppNotBuiltError, check_setup

    try:
        check_setup(config.llamacpp_draft)
    except LlamacppNotBuiltError as err:
        parser.error(f"argument --peers: {err}")
    except ValueError as err:
        parser.error(str(err))


def load_inputs(parser: argparse.ArgumentParser, config: EvalConfig):
    """Questions, target and drafters; a bad one is an argparse error naming its argument (exit 2)."""
    from specdistill.models.drafters import load_drafter  # decode may import models; deferred so --help stays fast
    from specdistill.models.target import load_target

    try:
        questions = load_questions(config.questions, config.limit, config.per_category)
    except (QuestionFileError, OSError) as err:
        parser.error(f"argument --questions: {err}")
    try:
        target = load_target(config.target, device=config.device, dtype=config.dtype)
    except (ValueError, OSError) as err:
        parser.error(f"argument --target: {err}")
    if not getattr(target.tokenizer, "chat_template", None):
        parser.error(f"argument --target: the tokenizer of {target.name!r} has no chat template; "
                     "the protocol formats every turn as a chat")
    drafters = {}
    for spec in config.drafters:
        try:
            drafters[spec] = load_drafter(spec, target, device=config.device)
        except (ValueError, OSError) as err:
            parser.error(f"argument --drafter: {err}")
    return questions, target, drafters


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = config_from_args(args)
    except ValueError as err:  # e.g. --llamacpp-draft without --peers llamacpp
        parser.error(str(err))
    if "llamacpp" in config.peers:
        check_llamacpp(parser, config)
    questions, target, drafters = load_inputs(parser, config)
    try:
        methods, skipped = build_methods(target, drafters, config)
    except ValueError as err:  # e.g. a drafter kind without a proposer, or a vocabulary mismatch
        parser.error(f"argument --drafter: {err}")
    with logging_redirect_tqdm():
        result = evaluate_methods(methods, skipped, target, drafters, questions, config)
    return report_result(result, config)


def report_result(result: EvalResult, config: EvalConfig) -> int:
    """Write the report under config.out, print its tables (and where peers' answers left ours); the exit status:
    EXIT_MISMATCH where a method of ours left plain decoding's greedy output, unless --allow-mismatches."""
    out = write_report(config.out, result.config, result.summary, result.results, result.skipped, result.runtime)
    sys.stdout.write(format_tables(result.summary) + "\n")
    if divergence := format_divergences(result.summary):
        sys.stdout.write("\n" + divergence + "\n")
    log.info("wrote %s", out / "report.json")
    failures = lossless_failures(result.summary)
    if failures:
        sys.stderr.write(mismatch_message(failures, out, config.allow_mismatches) + "\n")
        if not config.allow_mismatches:
            return EXIT_MISMATCH
    return 0


if __name__ == "__main__":
    sys.exit(main())
