"""Train a drafter toward a target, then keep the one the engine measures best.

    accelerate launch train/distill.py --config configs/distill/<job>.yaml [--field value ...]

Reads top to bottom: parse the config, load the target, have it write the teacher data, build the
drafter, train (measuring acceptance with the real engine every `eval_every` steps), save the
best drafter by measured tau as a drafter directory at `output_dir`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run by path, this file's folder (train/) is sys.path[0], where this very file would shadow
    # the `distill` package. Put the repository root there instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

import importlib.util  # noqa: E402
import logging  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from train.colbt import train_colbt  # noqa: E402
from train.eagle3 import feature_staging, train_eagle3  # noqa: E402
from train.lookahead import train_lookahead  # noqa: E402
from train.medusa import train_medusa  # noqa: E402
from train.checkpoints import resume_or_start, save_checkpoint  # noqa: E402
from train.config import ConfigError, load_config  # noqa: E402
from train.distill_config import DistillConfig  # noqa: E402
from train import distill_steps as steps  # noqa: E402
from train.step_budget import start_job_clock  # noqa: E402

log = logging.getLogger("specdistill.distill")

# Methods with a training loop of their own: train(cfg, accelerator, target, records, eval_prompts) ->
# the drafter directory, or None when stopped early (stop_at_step); and whether it measures held-out
# prompts with the engine (building them costs target generation for self:N). seqkd and kd run the loop below.
OWN_LOOP_METHODS = {
    "colbt": (train_colbt, True),  # several drafters, boost-tuned in sequence, saved as one ensemble
    "medusa": (lambda cfg, accelerator, target, records, _: train_medusa(cfg, accelerator, target, records),
               False),  # heads on the frozen target's hidden states, with a calibrated tree
    "lookahead": (train_lookahead, True),  # [LA] embeddings for the frozen target
    "eagle3": (train_eagle3, True),  # one decoder layer over the frozen target's hidden states
}
# Methods that read the target's hidden states: (cfg, target) -> the distill.feature_capture.FeatureStaging the
# teacher generation stages them in as it computes them (no second pass of the target over the teacher data)
TEACHER_STAGING = {"eagle3": feature_staging}


def main(argv: list[str] | None = None) -> Path | None:
    start_job_clock()  # max_minutes counts the whole job: the teacher data and the target's states too
    cfg = load_config(DistillConfig, argv)
    asked = cfg.mixed_precision
    # what runs, not "auto", in every record of the run (the drafter's manifest, the summary, the tracker)
    cfg = replace(cfg, mixed_precision=resolve_mixed_precision(asked, cfg.method, deepspeed_launch()))
    accelerator = make_accelerator(cfg, asked)
    set_seed(cfg.seed)
    target = steps.load_target_for(cfg, accelerator)
    staging = TEACHER_STAGING[cfg.method](cfg, target) if cfg.method in TEACHER_STAGING else None
    records = steps.teacher_records(cfg, target, accelerator, staging)
    if cfg.method in OWN_LOOP_METHODS:
        trainer, measures = OWN_LOOP_METHODS[cfg.method]
        eval_prompts = steps.eval_prompt_ids(cfg, target) if measures and accelerator.is_main_process else []
        out = trainer(cfg, accelerator, target, records, eval_prompts)
        steps.end_run(accelerator)
        return out
    with steps.unpartitioned(accelerator):
        drafter, vocab_map = steps.build_drafter(cfg, target, records)
    whole = steps.WholeDrafter(accelerator, drafter)
    loader = steps.make_loader(cfg, records, target, vocab_map)
    total = steps.total_steps(cfg, len(loader), accelerator.num_processes)
    optimizer, scheduler = steps.make_optimizer(cfg, drafter, total)
    drafter, optimizer, loader, scheduler = accelerator.prepare(drafter, optimizer, loader, scheduler)
    state = resume_or_start(cfg, accelerator)
    eval_prompts = steps.eval_prompt_ids(cfg, target) if accelerator.is_main_process else []

    finished = train(cfg, accelerator, target, drafter, vocab_map, loader, optimizer, scheduler, state,
                     eval_prompts, total, whole)
    out = steps.publish_best(cfg, accelerator, target, vocab_map, state) if finished else None
    steps.write_summary(cfg, accelerator, drafter, state, finished, whole)
    steps.end_run(accelerator)
    return out


def make_accelerator(cfg: DistillConfig, asked: str) -> Accelerator:
    """The run's accelerator in cfg.mixed_precision, already resolved (main); `asked`: what the config gave."""
    if cfg.tracker == "wandb":
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("tracker: wandb is not installed; pip install '.[track]' or set tracker: none")
        os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
    # cpu=True on a machine without CUDA makes processes started by torchrun (accelerate's
    # multi-process launcher) form a gloo process group instead of running as independent copies; but under a
    # DeepSpeed launch it would silently turn DeepSpeed into plain DDP, so there DeepSpeed's CPU accelerator
    # (gloo without oneCCL) takes the device instead
    deepspeed = deepspeed_launch()
    # without CUDA, accelerate finds no backend for DeepSpeed and would count one process per rank: name gloo
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and not torch.cuda.is_available() else None
    accelerator = Accelerator(cpu=not torch.cuda.is_available() and not deepspeed, kwargs_handlers=handlers,
                              gradient_accumulation_steps=cfg.grad_accum, mixed_precision=cfg.mixed_precision,
                              log_with=None if cfg.tracker == "none" else cfg.tracker,
                              project_dir=cfg.work_dir,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                        data_seed=cfg.seed))
    if deepspeed:
        check_deepspeed(cfg, accelerator)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    log.info("mixed precision: %s%s", cfg.mixed_precision, " (auto)" if asked == "auto" else "")
    if accelerator.device.type == "cpu":
        threads = cpu_threads(cfg.threads, accelerator.num_processes)
        torch.set_num_threads(threads)
        log.info("torch threads per process: %d", threads)
    if cfg.tracker != "none":
        accelerator.init_trackers("specdistill", config=asdict(cfg))
    return accelerator


# Methods that "auto" trains under bf16 autocast on a CPU with native bf16 GEMMs: those measured there. EAGLE-3:
# a step 1.5x faster and drafters as fast as fp32's (BENCHMARKS.md, "EAGLE-3 training in bf16 on the CPU"). The
# others stay fp32 on the CPU until measured (a tiny on-policy reverse-KL run learned less under bf16).
CPU_BF16_METHODS = frozenset({"eagle3"})


def resolve_mixed_precision(choice: str, method: str, deepspeed: bool = False) -> str:
    """"auto": bf16 on CUDA, and for CPU_BF16_METHODS on a CPU whose oneDNN has native bf16 GEMMs (AVX512-BF16
    or AMX: twice fp32's throughput, measured 390-416 against 158-201 GFLOP/s on the 2-core AVX-512 host) outside
    DeepSpeed (whose bf16 keeps bf16 weights, not autocast: on a CPU DeepSpeed is for checking sharding against
    DDP); else no (AVX2 hosts emulate bf16, slower than fp32). Any other choice stands as given."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if method in CPU_BF16_METHODS and native_bf16_cpu() and not deepspeed else "no"


def native_bf16_cpu() -> bool:
    """This CPU has bf16 GEMM instructions (AVX512-BF16 or AMX) and oneDNN to run them. (oneDNN's own
    `_is_mkldnn_bf16_supported` also says yes on plain AVX-512, where it emulates bf16.)"""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    except (AttributeError, RuntimeError):
        return False


def cpu_threads(requested: int, num_processes: int) -> int:
    """Torch threads per process on the CPU: `requested`, else this machine's usable cores shared among the
    processes. `accelerate launch` sets OMP_NUM_THREADS=1 unless told otherwise, so without this a single CPU
    process trains on one core of however many there are (measured: 97% of one core of two)."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, num_processes))


def deepspeed_launch() -> bool:
    """Whether `accelerate launch` was asked for DeepSpeed (a deepspeed_zero*.yaml config or --use_deepspeed)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_deepspeed(cfg: DistillConfig, accelerator: Accelerator) -> None:
    """DeepSpeed really in use, with the job's gradient accumulation, for a method that supports its stage."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise ConfigError(f"the launch asked for DeepSpeed but accelerate set up {accelerator.distributed_type}; "
                          "is deepspeed installed (pip install '.[deepspeed]')?")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if accelerator.num_processes != world:
        raise ConfigError(f"DeepSpeed runs {world} processes but accelerate counts {accelerator.num_processes}")
    plugin = accelerator.state.deepspeed_plugin
    steps_in_plugin = plugin.deepspeed_config.get("gradient_accumulation_steps")
    if steps_in_plugin not in (None, "auto", cfg.grad_accum):
        raise ConfigError(f"grad_accum: the job accumulates {cfg.grad_accum} micro-batches but the DeepSpeed config "
                          f"says gradient_accumulation_steps {steps_in_plugin}; make them equal")
    stage = plugin.zero_stage
    if stage not in DEEPSPEED_STAGES.get(cfg.method, ()):
        raise ConfigError(f"method {cfg.method} does not run under DeepSpeed ZeRO stage {stage} "
                          f"(supported: {DEEPSPEED_STAGES.get(cfg.method) or 'none'}); use DDP "
                          "(configs/accelerate/cpu_ddp_2proc.yaml or gpu_ddp.yaml) or another stage")


# the ZeRO stages each training method runs under (checked at start: nothing else is silently run instead)
DEEPSPEED_STAGES: dict[str, tuple[int, ...]] = {"seqkd": (2, 3), "kd": (2, 3), "eagle3": (2, 3)}


def train(cfg, accelerator, target, drafter, vocab_map, loader, optimizer, scheduler, state, eval_prompts,
          total: int, whole: steps.WholeDrafter) -> bool:
    """Train to `total` steps; False when stopped early at `stop_at_step` (resume to continue)."""
    if cfg.eval_every and state.step == 0:  # the starting point, so the gain is visible
        evaluate(cfg, accelerator, target, whole.of(drafter), vocab_map, state, eval_prompts)
    bar = tqdm(total=total, initial=state.step, desc="distill", disable=not accelerator.is_local_main_process)
    drafter.train()
    while state.step < total:
        batches = steps.epoch_batches(accelerator, loader, state)
        for window in steps.accumulation_windows(batches, cfg.grad_accum):
            loss = steps.train_window(cfg, accelerator, target, drafter, vocab_map, window, optimizer,
                                      scheduler, state)
            state.step += 1
            bar.update(1)
            lr = scheduler.get_last_lr()[0]
            after_step(cfg, accelerator, target, drafter, vocab_map, state, loss, lr, eval_prompts, bar, whole)
            if state.step == cfg.stop_at_step:
                save_checkpoint(accelerator, state, cfg.work_dir)
                log.info("stopped at step %d as asked; continue with --resume", state.step)
                return False
            if state.step >= total:
                break
        else:
            state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    bar.close()
    if not (cfg.eval_every and state.step % cfg.eval_every == 0):  # the last step was not measured yet (the same
        evaluate(cfg, accelerator, target, whole.of(drafter), vocab_map, state, eval_prompts)  # on every rank)
    return True


def after_step(cfg, accelerator, target, drafter, vocab_map, state, loss, lr, eval_prompts, bar,
               whole: steps.WholeDrafter) -> None:
    if state.step % cfg.log_every == 0:
        bar.set_postfix(loss=f"{loss:.4f}")
        log.info("step %d loss %.4f lr %.2e", state.step, loss, lr)
        accelerator.log({"train/loss": loss, "train/lr": lr}, step=state.step)
    if cfg.eval_every and state.step % cfg.eval_every == 0:
        evaluate(cfg, accelerator, target, whole.of(drafter), vocab_map, state, eval_prompts)
    if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
        save_checkpoint(accelerator, state, cfg.work_dir)


def evaluate(cfg, accelerator, target, model, vocab_map, state, eval_prompts) -> None:
    """Measure tau/alpha on held-out prompts (main process) and keep the best drafter so far.
    `model`: the whole drafter (WholeDrafter.of, called by every process)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        result = steps.measure(cfg, target, model, vocab_map, eval_prompts)
        state.history.append({"step": state.step, "tau": result["tau"], "alpha": result["alpha"]})
        log.info("step %d held-out tau %.3f alpha %.3f", state.step, result["tau"], result["alpha"] or 0.0)
        accelerator.log({"eval/tau": result["tau"], "eval/alpha": result["alpha"] or 0.0}, step=state.step)
        if result["tau"] > state.best_tau:
            state.best_tau, state.best_step = result["tau"], state.step
            steps.save_best(cfg, target, model, vocab_map, state)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
