"""The components `train/distill.py` builds and the steps it runs, each a small function.

The maths (losses, batching, vocabulary reduction, on-policy sampling) lives in `distill/`; this
module wires it to accelerate, the engine and the drafter directory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import random
import resource
import shutil
import sys
from itertools import islice
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import DataLoader

from specdistill.decode.batch_generation import batch_generation_unavailable, generate_greedy_together
from specdistill.decode.target_states import EngineStates
from specdistill.distill.batching import Batch, collate, with_absent_column
from specdistill.distill.feature_cache import FeatureCache, open_or_build
from specdistill.distill.feature_capture import FeatureStaging
from specdistill.distill.followups import FOLLOW_UPS, follow_up_prompts, load_follow_ups
from specdistill.distill.generation import pad_token_id
from specdistill.distill.losses import TopK, distill_loss
from specdistill.distill.onpolicy import sample_draft_responses, target_topk_over_draft_head
from specdistill.distill.prompts import exclusion_texts, load_prompt_sources
from specdistill.distill.teacher_data import (
    TeacherDataSettings,
    generate_teacher_data,
    load_teacher_data,
    teacher_data_dir,
    teacher_data_key,
)
from specdistill.distill.vocab import count_response_tokens, coverage, inverse_map, select_draft_vocab
from specdistill.models.draft_models import apply_lora, drop_gguf_blocks, reduce_head
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.fingerprint import weights_fingerprint
from specdistill.models.real_targets import REAL_TARGETS
from specdistill.models.target import load_target
from specdistill.train.acceptance import measure_acceptance
from specdistill.train.config import to_dict
from specdistill.train.phases import phase

log = logging.getLogger("specdistill.distill")


# ---- components ---------------------------------------------------------------------------------------

def end_run(accelerator) -> None:
    """Close the trackers; in a multi-process run, once every process is here, exit at once.

    Why exit here: freeing the DDP-wrapped model when main() returns can deadlock in gloo. The DDP
    reducer's destructor joins gloo's worker thread while holding the GIL, and that thread waits for
    the GIL to free the tensors of the last collective (py-spy stacks of 2-process CPU runs that had
    written everything and never exited, 1 run in 4 to 8 under load). Destroying the process group
    first (as `end_training` does) makes it no better: the reducer then holds its last reference.
    Everything is written by the time this is called, so the process skips destructors (os._exit
    after flushing)."""
    distributed = accelerator.num_processes > 1
    if distributed:
        accelerator.wait_for_everyone()  # before end_training, which destroys the process group
    accelerator.end_training()
    if distributed:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def deepspeed(accelerator) -> bool:
    return accelerator.state.deepspeed_plugin is not None


def declare_micro_batch(accelerator, batch_size: int) -> None:
    """Tell DeepSpeed the per-process batch size where `prepare` gets no dataloader to read it from (the methods
    with a loop of their own); it refuses to start without one."""
    if deepspeed(accelerator):
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size


def zero3(accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


@contextlib.contextmanager
def unpartitioned(accelerator):
    """A context in which models are built whole: under ZeRO-3, transformers' from_pretrained/from_config would
    otherwise partition them at construction (zero.Init) — the frozen target too, which must stay whole, and a
    drafter before its weights are copied in. The drafter is partitioned later, by `prepare`."""
    if not zero3(accelerator):
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # what transformers reads to decide on zero.Init
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


class WholeDrafter:
    """The trained drafter as one plain module, for measuring and saving on the main process. Under ZeRO-3 its
    parameters are partitioned across processes: `of` gathers them (every process must call it) into a plain copy
    made before `prepare`; otherwise it is the unwrapped module itself."""

    def __init__(self, accelerator, drafter_before_prepare: torch.nn.Module):
        self.accelerator = accelerator
        self.gathers = zero3(accelerator)
        # only the main process measures and saves: the others keep no copy
        self.copy = copy.deepcopy(drafter_before_prepare) if self.gathers and accelerator.is_main_process else None

    def of(self, drafter) -> torch.nn.Module | None:
        """The whole drafter on the main process (None on the others under ZeRO-3)."""
        if not self.gathers:
            return self.accelerator.unwrap_model(drafter)
        state = self.accelerator.get_state_dict(drafter)  # collective; the whole weights on the main process
        if self.accelerator.is_main_process:
            self.copy.load_state_dict(state)
        return self.copy


def load_target_for(cfg, accelerator):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.target_dtype)
    if dtype is None:  # auto
        dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32
    with unpartitioned(accelerator), phase("target"):
        return load_target(cfg.target, device=str(accelerator.device), dtype=dtype)


def teacher_settings(cfg, target=None) -> TeacherDataSettings:
    """The generation settings of cfg's teacher data; with `target`, its greedy answers from the engine's batched
    loop where the engine runs it (decode.batch_generation), else from transformers' generate."""
    sampled = cfg.gen_temperature > 0
    return TeacherDataSettings(max_new_tokens=cfg.max_new_tokens, greedy=not sampled or cfg.gen_keep_greedy,
                               num_samples=cfg.samples_per_prompt if sampled else 0,
                               temperature=cfg.gen_temperature if sampled else 1.0, top_p=cfg.gen_top_p,
                               topk=cfg.topk, batch_size=cfg.gen_batch_size, seed=cfg.seed,
                               shard_size=cfg.gen_shard_size,
                               # a prompt longer than the training window would be cut to its end anyway
                               max_prompt_tokens=cfg.max_seq_len, backend=cfg.teacher_backend,
                               greedy_generator=greedy_generator(target) if target is not None else "generate")


def greedy_generator(target) -> str:
    """"engine" where decode.batch_generation runs the target (a Llama-family target on the kernel library), else
    "generate" (logged with the reason)."""
    reason = batch_generation_unavailable(target.model)
    if reason is not None:
        log.info("teacher data: greedy answers from transformers' generate (%s)", reason)
        return "generate"
    return "engine"


def teacher_data_plan(cfg, target) -> tuple[list, TeacherDataSettings, Path]:
    """The job's training prompts, generation settings and content-addressed teacher-data directory
    (target fingerprint, prompts, settings: jobs with the same data share it)."""
    excluded = exclusion_texts(cfg.exclude_prompts) if cfg.exclude_prompts else set()
    prompts = load_prompt_sources(cfg.prompts, target=target, exclude=excluded, seed=cfg.seed)
    if cfg.max_prompts:
        prompts = prompts[: cfg.max_prompts]
    if not prompts:
        raise ValueError(f"prompts: the sources {cfg.prompts} gave no prompts (after exclusions)")
    settings = teacher_settings(cfg, target)
    return prompts, settings, teacher_data_dir(teacher_data_key(target, prompts, settings))


def teacher_records(cfg, target, accelerator, staging: FeatureStaging | None = None) -> list[dict]:
    """The target's responses to the training prompts, generated once (split across processes,
    resumable, cached by content) and read back whole by every process. staging: where the generator also
    stages the hidden states of what it generates (EAGLE-3: distill.feature_capture)."""
    prompts, settings, out_dir = teacher_data_plan(cfg, target)
    with phase("teacher data"):
        records = answered(target, prompts, settings, out_dir, accelerator, staging)
    if cfg.follow_up_share > 0:  # second turns over the target's own first answers (distill.followups)
        requests = load_follow_ups(cfg.follow_ups) if cfg.follow_ups else FOLLOW_UPS
        second = follow_up_prompts(prompts, records, target.tokenizer, target.eos_token_ids, requests,
                                   cfg.follow_up_share, cfg.seed)
        if second:
            # the first answer is in the prompt, so a second turn may outgrow the window: training keeps its end
            wide = dataclasses.replace(settings, max_prompt_tokens=None)
            with phase("second turns"):
                records += answered(target, second, wide, teacher_data_dir(teacher_data_key(target, second, wide)),
                                    accelerator, staging)
    return records


def answered(target, prompts, settings: TeacherDataSettings, out_dir: Path, accelerator,
             staging: FeatureStaging | None = None) -> list[dict]:
    """The teacher data of `prompts` under `settings` (made, or finished, here), read back by every process."""
    engine = generate_greedy_together if settings.greedy_generator == "engine" else None
    generate_teacher_data(target, prompts, settings, out_dir=out_dir, process_index=accelerator.process_index,
                          num_processes=accelerator.num_processes, staging=staging, greedy_answers=engine)
    accelerator.wait_for_everyone()
    records = [dict(r) for r in load_teacher_data(out_dir)]
    tokens = sum(len(r["response_ids"]) for r in records)
    log.info("teacher data %s: %d prompts, %d responses, %d response tokens", out_dir, len(prompts), len(records),
             tokens)
    return records


def target_states(cfg, accelerator, target, records: list[dict], layers: list[int],
                  staging: FeatureStaging | None = None) -> FeatureCache:
    """The feature cache of the target's states at `layers` over these records (distill.feature_cache: built first
    where absent, from what `staging` holds where the generator staged it, the rest computed: on the CPU by the
    decoding engine's forward, decode.target_states), timed as the job's phase "target states"."""
    pad_id = pad_token_id(target.tokenizer, target.eos_token_ids)
    with phase("target states"):
        return open_or_build(target, records, layers, cfg.max_seq_len, cfg.gen_batch_size, pad_id, accelerator,
                             staging=staging, states=states_maker(target, layers))


def states_maker(target, layers: list[int]) -> EngineStates | None:
    """What computes the states the generator did not stage: on the CPU the engine's forward (its kernels, one
    sequence at a time: the numbers decoding reads); on a GPU None, transformers' batched forward, whose GEMMs
    there are the engine's own."""
    return EngineStates(target.model, layers) if target.device.type == "cpu" else None


def build_drafter(cfg, target, records: list[dict]) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """The initial drafter, its head optionally reduced to the teacher data's most used tokens."""
    model = load_drafter(cfg.drafter, target).model
    if model is None:
        raise ValueError(f"drafter: {cfg.drafter!r} has no weights to train")
    model = model.to(target.model.device).float()
    if drop_gguf_blocks(model):  # a named real target's K-quant blocks: stale once its weights train
        log.info("drafter %s: trains its fp32 weights (its GGUF blocks set aside)", cfg.drafter)
    vocab_map = None
    if cfg.draft_vocab:
        counts = count_response_tokens(records)
        v_target = target.model.get_output_embeddings().weight.shape[0]
        vocab_map = select_draft_vocab(counts, cfg.draft_vocab, v_target, always=target.eos_token_ids)
        reduce_head(model, vocab_map)
        log.info("draft head reduced to %d tokens, covering %.1f%% of teacher tokens",
                 cfg.draft_vocab, 100 * coverage(counts, vocab_map))
    if cfg.lora_r:
        model = apply_lora(model, r=cfg.lora_r)
    if not cfg.lora_r:
        model.requires_grad_(True)
    return model, vocab_map


def make_loader(cfg, records: list[dict], target, vocab_map) -> DataLoader:
    pad_id = pad_token_id(target.tokenizer, target.eos_token_ids)
    v_target = target.model.get_output_embeddings().weight.shape[0]
    t2d = None if vocab_map is None else inverse_map(vocab_map, v_target)
    # shuffled by accelerate's seedable sampler (seed + epoch): the same order on resume
    return DataLoader(records, batch_size=cfg.batch_size, shuffle=True, drop_last=False,
                      collate_fn=lambda rows: collate(rows, pad_id, cfg.max_seq_len, t2d))


class WarmupCosine:
    """The learning rate's factor at each step: linear warm-up over `warmup` steps, then cosine decay to 10% at
    `total`. A callable object, not a function, so LambdaLR's state_dict carries `total` (a run whose length was
    decided after its warm-up, train.step_budget, resumes with it)."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(cfg, model, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(cfg.warmup_steps, total_steps))


def set_schedule_length(scheduler, total_steps: int) -> None:
    """Make the decay of `make_optimizer`'s schedule end at total_steps (accelerate's wrapper or the bare one);
    steps already taken keep their rates (the warm-up's do not depend on the length)."""
    bare = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it
    for schedule in bare.lr_lambdas:
        schedule.total = total_steps


def budget_after_step(accelerator, budget, scheduler, done: int, total: int, decided: bool) -> tuple[int, bool]:
    """(the run's step count, whether it is decided) after step `done`, whose time `budget` (train.step_budget's
    StepBudget) has observed: decided once calibrated, the schedule's decay then ending there; cut to `done` should
    the job still be about to overrun: a machine that slowed down, or steps so slow (a shared CPU, a 0.5B drafter)
    that the budget would be spent before the steps that calibrate it. The main process's clock decides for all."""
    if not decided and budget.calibrated(done):
        total = main_process_says(accelerator, budget.decide, done)
        set_schedule_length(scheduler, total)
        return total, True
    if done < total and main_process_says(accelerator, budget.out_of_time, done):
        log.warning("max_minutes: stopping at step %d of %d, the budget is spent", done, total)
        return done, True
    return total, decided


def main_process_says(accelerator, question, step: int):
    """question(step) as the main process answers it, the same on every process."""
    return broadcast_object_list([question(step) if accelerator.is_main_process else None], from_process=0)[0]


def total_steps(cfg, num_batches: int, num_processes: int) -> int:
    """Optimizer steps of the run; num_batches counts micro-batches before sharding across processes."""
    if cfg.max_steps:
        return cfg.max_steps
    per_process = math.ceil(num_batches / num_processes)
    return cfg.epochs * math.ceil(per_process / cfg.grad_accum)


def eval_prompt_ids(cfg, target) -> list[list[int]]:
    prompts = load_prompt_sources([cfg.eval_prompts], target=target, seed=cfg.seed + 1)
    return [target.encode_chat(p.messages) for p in prompts]


# ---- one training step ----------------------------------------------------------------------------------

def epoch_batches(accelerator, loader, state):
    """This epoch's micro-batches, the ones a resumed run already consumed skipped."""
    loader.set_epoch(state.epoch)
    if state.batches_in_epoch:
        return iter(accelerator.skip_first_batches(loader, state.batches_in_epoch))
    return iter(loader)


def accumulation_windows(batches, size: int):
    """Groups of `size` micro-batches (the last may be shorter): one optimizer step each."""
    while True:
        window = list(islice(batches, size))
        if not window:
            return
        yield window


def train_window(cfg, accelerator, target, drafter, vocab_map, window: list[Batch], optimizer, scheduler,
                 state) -> float:
    """One optimizer step over an accumulation window, token-normalized across the whole window and
    all processes: every response token weighs the same whatever micro-batch it fell in."""
    rng = random.Random(cfg.seed * 1_000_003 + state.step)  # on-policy coin flips replay on resume
    if cfg.on_policy_lambda and rng.random() < cfg.on_policy_lambda:
        window = [on_policy_batch(cfg, accelerator, target, drafter, vocab_map, b, rng) for b in window]
    local = torch.tensor(float(sum(int(b.loss_mask.sum()) for b in window)), device=accelerator.device)
    global_tokens = accelerator.reduce(local, "sum").clamp_min(1.0)
    # DDP averages gradients over processes and accelerator.backward divides by grad_accum: undo both
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / global_tokens
    total = 0.0
    for batch in window:
        with accelerator.accumulate(drafter):
            loss_sum = micro_batch_loss(cfg, drafter, batch)
            accelerator.backward(loss_sum * scale)
            total += float(loss_sum.detach())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        state.batches_in_epoch += 1
    return float(accelerator.reduce(torch.tensor(total, device=accelerator.device), "sum") / global_tokens)


def micro_batch_loss(cfg, drafter, batch: Batch) -> torch.Tensor:
    """Sum of the per-token loss over the batch's response positions."""
    logits = drafter(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V_d]
    if cfg.loss == "ce":
        return distill_loss("ce", logits, labels=batch.labels, mask=batch.loss_mask, reduction="sum")
    target = TopK(batch.topk_ids, batch.topk_logprobs)
    if int(batch.topk_ids.max()) >= logits.shape[-1]:  # ids outside a reduced head
        logits = with_absent_column(logits)
    return distill_loss(cfg.loss, logits, target=target, mask=batch.loss_mask, beta=cfg.jsd_beta,
                        temperature=cfg.kd_temperature, reduction="sum")


@torch.no_grad()
def on_policy_batch(cfg, accelerator, target, drafter, vocab_map, batch: Batch, rng: random.Random) -> Batch:
    """Replace the batch's responses by the drafter's own samples, scored live by the target."""
    prompts = [ids[: int(start)].tolist() for ids, start in zip(batch.input_ids, first_loss_position(batch))]
    model = accelerator.unwrap_model(drafter)
    pad_id = pad_token_id(target.tokenizer, target.eos_token_ids)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    responses = sample_draft_responses(model, prompts, cfg.max_new_tokens, 1.0, target.eos_token_ids, pad_id,
                                       vocab_map, gen)
    records = [{"prompt_ids": p, "response_ids": r or [next(iter(target.eos_token_ids))]}
               for p, r in zip(prompts, responses)]
    t2d = None if vocab_map is None else inverse_map(vocab_map, target.vocab_size)  # labels in draft indices
    fresh = collate(records, pad_id, cfg.max_seq_len, t2d).to(accelerator.device)
    target_logits = target.model(input_ids=fresh.input_ids, attention_mask=fresh.attention_mask).logits
    live = target_topk_over_draft_head(target_logits, vocab_map)  # already over the draft head's indices
    fresh.topk_ids, fresh.topk_logprobs = live.ids, live.logprobs
    return fresh


def first_loss_position(batch: Batch) -> torch.Tensor:
    """[B] the first position predicting a response token + 1 = the prompt length."""
    return batch.loss_mask.float().argmax(-1) + 1


# ---- measuring and saving -------------------------------------------------------------------------------

def measure(cfg, target, model, vocab_map, prompt_ids) -> dict:
    return measure_acceptance(target, model, vocab_map, prompt_ids, cfg.eval_max_new_tokens, cfg.eval_gamma)


def save_best(cfg, target, model, vocab_map, state) -> Path:
    """The best drafter so far, as a complete drafter directory under work_dir/best."""
    return save_drafter(Path(cfg.work_dir) / "best", plain_model(model), target, "draft_model", config=to_dict(cfg),
                        vocab_map=vocab_map, extra={"step": state.step, "held_out_tau": state.best_tau,
                                                    "history": state.history}, weights=saved_weights(cfg))


def saved_weights(cfg) -> str | None:
    """"q8_0" for a drafter started from a named real target (a K-quant GGUF such as `qwen2.5-coder-0.5b`): its own
    blocks are stale once it trained, and on a CPU it drafts on Q8_0 blocks of its trained weights instead, a
    quarter of fp32's bytes, as its untrained sibling drafts on its file's; None for any other drafter."""
    return "q8_0" if cfg.drafter in REAL_TARGETS else None


def publish_best(cfg, accelerator, target, vocab_map, state) -> Path:
    """Copy the best measured drafter to output_dir (atomically: a copy, then a rename)."""
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(Path(cfg.work_dir) / "best", tmp)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        log.info("drafter written to %s (step %d, held-out tau %.3f)", out, state.best_step, state.best_tau)
    accelerator.wait_for_everyone()
    return out


def write_summary(cfg, accelerator, drafter, state, finished: bool, whole: WholeDrafter | None = None) -> None:
    """work_dir/summary.json: the acceptance history, the best step, the step count max_minutes decided (None
    without it), and a digest of every process's final weights (replicas that disagree are an error: DDP must keep
    them equal; under ZeRO-3 the one gathered drafter's digest stands for every process)."""
    if whole is not None and whole.gathers:
        model = whole.of(drafter)
        digest = weights_fingerprint(model) if accelerator.is_main_process else None
        digests = [gather_object([digest])[0]] * accelerator.num_processes
    else:
        digest = weights_fingerprint(accelerator.unwrap_model(drafter))
        digests = gather_object([digest]) if accelerator.num_processes > 1 else [digest]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    peaks = gather_object([peak]) if accelerator.num_processes > 1 else [peak]
    if accelerator.is_main_process:
        if len(set(digests)) != 1:
            raise RuntimeError(f"processes ended with different drafter weights: {digests}")
        summary = {"finished": finished, "step": state.step, "decided_steps": state.total_steps or None,
                   "best_step": state.best_step,
                   "best_tau": state.best_tau, "history": state.history,
                   "num_processes": accelerator.num_processes, "replica_weight_digests": digests,
                   "distributed_type": accelerator.distributed_type.value,
                   "zero_stage": getattr(accelerator.state.deepspeed_plugin, "zero_stage", None),
                   "peak_rss_mib_per_process": peaks}
        Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.work_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    accelerator.wait_for_everyone()


def plain_model(model):
    """A peft-wrapped model merged into plain weights; anything else as is."""
    if hasattr(model, "merge_and_unload"):
        import copy

        return copy.deepcopy(model).merge_and_unload()
    return model
