"""A vLLM engine behind a pipe, for the `--peers vllm` methods (decode/vllm_peer.py) and the vLLM teacher-data
backend (distill/teacher_vllm.py), both through its client in models/vllm_env.py. Runs inside the vLLM
environment (`make vllm`: .venv-vllm, its own transformers pin), never in the project's, and is started by its
file path (models.vllm_env.WORKER); it imports nothing from the project, which is not installed there.

    .venv-vllm/bin/python models/vllm_worker.py --model DIR [--dtype float32] [--speculative JSON]
        [--max-model-len N] [--threads N]

Protocol, one JSON object a line: on start it builds the engine, generates once to warm it up, and writes
{"ready": true, "startup_s": ..., "vllm": version}; then for each request line {"prompt_ids": [...],
"max_tokens": N, "stop_token_ids": [...]} it generates greedily (batch size 1) and writes {"tokens": [...],
"wall_s": ..., "finish_reason": ..., "spec": {"drafts", "draft_tokens", "accepted", "accepted_per_position"}}
(the spec counters are vLLM's own metrics, the difference across this request; zeros without speculation).
A batch request {"batch": [{"prompt_ids": [...], "temperature": T, "top_p": P, "seed": S}, ...], "max_tokens": N,
"stop_token_ids": [...]} runs every sequence in one `LLM.generate` call (vLLM batches them itself; temperature 0 is
greedy) and writes {"batch": [{"tokens": [...], "finish_reason": ...}, ...], "wall_s": ...}: the teacher-data
backend (distill/teacher_vllm.py). A request that fails is answered {"error": "..."} and the worker goes on; end
of input ends it. Replies go to the
original standard output only; everything vLLM prints goes to standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Run by path, Python puts this file's folder first on sys.path, where the package's own modules (kernels/, cache.py,
# export.py, ...) would shadow same-named modules of vLLM's environment: drop it (spawned engine processes inherit
# the path as left here).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF model directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--speculative", default="", help="vLLM's speculative_config as JSON ('' for none)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    return p.parse_args(argv)


def cpu_environment(threads: int, kv_cache_gib: int) -> None:
    """vLLM's CPU defaults bind its worker to one core of two and one thread, and reserve a core: use them all."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    # vLLM 0.32's compile cache: an EAGLE-3 engine started a second time failed to load its cached graph, compiled
    # again and died of a Python stack overflow ("Engine core initialization failed"); compiling afresh at every
    # start (about 3 minutes here, what a start took with the cache anyway) avoids it
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")


def replies_channel():
    """A writer on the original standard output; fd 1 then points at standard error, so that nothing vLLM
    or its libraries print can enter the protocol."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (zeros where it does not speculate)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += int(metric.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            current = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(values, current + [0] * len(values))]
    return out


def difference(after: dict, before: dict) -> dict:
    per_position = [a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"]) else 0)
                    for i, a in enumerate(after["accepted_per_position"])]
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
            "accepted_per_position": per_position}


def with_stop_token(output, stop: list[int]) -> list[int]:
    """The answer's tokens, ending with the stop token that ended it (vLLM leaves it out; our answers keep it)."""
    tokens = list(output.token_ids)
    if output.finish_reason == "stop" and (not tokens or tokens[-1] not in stop):
        tokens.append(output.stop_reason if isinstance(output.stop_reason, int) else stop[0])
    return tokens


def generate_batch(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stop = [int(t) for t in request.get("stop_token_ids", [])]
    prompts, params = [], []
    for item in request["batch"]:
        prompts.append(TokensPrompt(prompt_token_ids=[int(t) for t in item["prompt_ids"]]))
        params.append(SamplingParams(temperature=float(item.get("temperature", 0.0)),
                                     top_p=float(item.get("top_p", 1.0)),
                                     seed=item.get("seed"), max_tokens=int(request["max_tokens"]),
                                     stop_token_ids=stop or None, detokenize=False))
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"batch": [{"tokens": with_stop_token(r.outputs[0], stop), "finish_reason": r.outputs[0].finish_reason}
                      for r in results], "wall_s": wall}


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if "batch" in request:
        return generate_batch(llm, request)
    stop = [int(t) for t in request.get("stop_token_ids", [])]
    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), stop_token_ids=stop or None,
                            detokenize=False)
    before = spec_counters(llm)
    start = time.perf_counter()
    result = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in request["prompt_ids"]])], params,
                          use_tqdm=False)
    wall = time.perf_counter() - start
    output = result[0].outputs[0]
    tokens = with_stop_token(output, stop)
    return {"tokens": tokens, "wall_s": wall, "finish_reason": output.finish_reason,
            "spec": difference(spec_counters(llm), before)}


def main(argv=None) -> int:
    args = parse_args(argv)
    cpu_environment(args.threads, args.kv_cache_gib)
    channel = replies_channel()
    start = time.perf_counter()
    import vllm
    from vllm import LLM

    speculative = json.loads(args.speculative) if args.speculative else None
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              disable_log_stats=False, speculative_config=speculative)
    generate(llm, {"prompt_ids": [1, 2, 3, 4], "max_tokens": 8})  # warm-up
    channel.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - start,
                              "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = generate(llm, json.loads(line))
        except Exception as err:  # noqa: BLE001  (one bad request must not take the worker down)
            reply = {"error": f"{type(err).__name__}: {err}"}
        channel.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":  # vLLM's engine core starts by spawn: the guard is required
    sys.exit(main())
