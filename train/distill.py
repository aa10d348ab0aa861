"""Train a drafter toward a target, then keep the one the engine measures best.

    accelerate launch train/distill.py --config configs/distill/<job>.yaml [--field value] [--method.field value]

Reads top to bottom: parse the config, load the target, have it write the teacher data, build the
drafter, train (measuring acceptance with the real engine every `eval_every` steps), save the
best drafter by measured tau as a drafter directory at `output_dir`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed

from specdistill.train import distill_steps as steps
from specdistill.train.config import ConfigError, load_config, to_dict
from specdistill.train.distill_config import DistillConfig  # (imports every method, registering it)
from specdistill.train.malloc import start_trimming
from specdistill.train.methods import method_named
from specdistill.train.phases import phase, write_phases
from specdistill.train.step_budget import start_job_clock

log = logging.getLogger("specdistill.distill")


def main(argv: list[str] | None = None) -> Path | None:
    start_job_clock()  # max_minutes counts the whole job: the teacher data and the target's states too
    cfg = load_config(DistillConfig, argv)
    start_trimming(cfg.malloc_trim_seconds, log)
    method = method_named(cfg.method)
    asked = cfg.mixed_precision
    # what runs, not "auto", in every record of the run (the drafter's manifest, the summary, the tracker)
    cfg = replace(cfg, mixed_precision=resolve_mixed_precision(asked, cfg.method, deepspeed_launch()))
    accelerator = make_accelerator(cfg, asked)
    set_seed(cfg.seed)
    target = steps.load_target_for(cfg, accelerator)
    staging = method.staging(cfg, target) if method.staging is not None else None
    records = steps.teacher_records(cfg, target, accelerator, staging)
    measured = method.measures and accelerator.is_main_process
    eval_prompts = steps.eval_prompt_ids(cfg, target) if measured else []
    with phase("drafter training"):  # the target's states at the drafter's layers too, where the method reads them
        out = method.run(cfg, accelerator, target, records, eval_prompts)
    if accelerator.is_main_process:
        write_phases(Path(cfg.work_dir) / "phases.json")
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
        accelerator.init_trackers("specdistill", config=to_dict(cfg))
    return accelerator


def resolve_mixed_precision(choice: str, method: str, deepspeed: bool = False) -> str:
    """"auto": bf16 on CUDA, and for a method registered cpu_bf16 (those measured there: EAGLE-3; the others
    stay fp32 on the CPU until measured, a tiny on-policy reverse-KL run learned less under bf16) on a CPU whose
    oneDNN has native bf16 GEMMs (AVX512-BF16 or AMX: twice fp32's throughput, measured 390-416 against 158-201
    GFLOP/s on the 2-core AVX-512 host) outside
    DeepSpeed (whose bf16 keeps bf16 weights, not autocast: on a CPU DeepSpeed is for checking sharding against
    DDP); else no (AVX2 hosts emulate bf16, slower than fp32). Any other choice stands as given."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if method_named(method).cpu_bf16 and native_bf16_cpu() and not deepspeed else "no"


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
    supported = method_named(cfg.method).deepspeed_stages
    if stage not in supported:
        raise ConfigError(f"method {cfg.method} does not run under DeepSpeed ZeRO stage {stage} "
                          f"(supported: {supported or 'none'}); use DDP "
                          "(configs/accelerate/cpu_ddp_2proc.yaml or gpu_ddp.yaml) or another stage")


if __name__ == "__main__":
    main()
