"""The configuration of `train/distill.py`: one typed dataclass, every field with help text.

The common fields (what to train toward, the teacher data, the loss, optimisation, measurement, bookkeeping) sit
at the top level; each training method's own fields are its section, a dataclass beside its `run` in its module
(train/eagle3.py's Eagle3Config, ...), registered in train.methods. In YAML:

    method: eagle3
    lr: 0.001
    eagle3: {steps: 4, decay: 0.8}

and on the command line `--eagle3.steps 4`. The flat keys of before (`eagle3_steps`, `max_tree_nodes`) are
refused with their new spelling. Only the job's method's section may be given; it is filled with its defaults
when absent, and the other sections stay None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from specdistill.train import kd  # noqa: F401  (registers seqkd and kd, which have no section)
from specdistill.train.colbt import ColbtConfig
from specdistill.train.config import ConfigError, as_section, check_choice, sections
from specdistill.train.config import option as _f
from specdistill.train.dflash import DFlashConfig
from specdistill.train.eagle3 import Eagle3Config
from specdistill.train.lookahead import LookaheadConfig
from specdistill.train.medusa import MedusaConfig
from specdistill.train.methods import method_named, method_names, methods

METHODS = method_names()
LOSSES = ("ce", "fkl", "rkl", "jsd", "tvd")
TARGET_DTYPES = ("auto", "float32", "bfloat16")
TEACHER_BACKENDS = ("builtin", "vllm")  # distill.teacher_vllm.BACKENDS (not imported: it would import vLLM's glue)
TRACKERS = ("none", "wandb")


@dataclass
class DistillConfig:
    """Train a drafter toward a target: seqkd, kd, or a method of train.methods with its own section."""

    RENAMED: ClassVar[dict[str, str]] = {"max_tree_nodes": "colbt.max_tree_nodes"}  # besides <section>_<field>

    method: str = _f("seqkd", f"training method, one of {METHODS}")
    target: str = _f("smollm2-135m", "target: the embedded default, an HF directory or hub id, or a .gguf file")
    drafter: str = _f("truncated:4", "initial drafter: truncated:N, small:layers=L,hidden=H, or an HF directory")
    draft_vocab: int = _f(0, "reduced draft head size (the most frequent target tokens; for medusa, the tokens the "
                          "heads may propose at decoding); 0 keeps the full vocabulary")
    lora_r: int = _f(0, "LoRA rank on the drafter (peft); 0 trains all its weights")
    output_dir: str = _f("runs/drafter", "where the trained drafter directory is written")
    work_dir: str = _f("", "checkpoints, teacher data and logs; default: <output_dir>.work")

    # teacher data
    prompts: list[str] = _f(["self:64"], "prompt sources: jsonl:PATH, hf:NAME[:SPLIT], self:N (see distill.prompts)")
    exclude_prompts: list[str] = _f([], "prompt sources never trained on (the evaluation questions)")
    max_prompts: int = _f(0, "cap on the number of prompts; 0 = all")
    max_new_tokens: int = _f(128, "response length the target writes per prompt")
    samples_per_prompt: int = _f(1, "responses per prompt (greedy uses 1)")
    gen_temperature: float = _f(0.0, "teacher sampling temperature; 0 = greedy")
    gen_top_p: float = _f(1.0, "teacher nucleus sampling")
    gen_batch_size: int = _f(16, "prompts per batched target generation")
    gen_keep_greedy: bool = _f(False, "with gen_temperature > 0: store the greedy answer too, beside the samples")
    gen_shard_size: int = _f(64, "prompts per teacher-data shard (the unit of resuming; bounds a generate "
                                 "batch: a GPU wants it at least gen_batch_size / responses per prompt)")
    topk: int = _f(0, "store the target's top-k log-probs per response token (needed by kd); 0 = none")
    follow_up_share: float = _f(0.0, "share of the training prompts whose first answer (the greedy one, else the "
                                      "first sample) gets a second user turn "
                                      "asking to rework it, answered by the target too (distill.followups: "
                                      "multi-turn records, where an answer reuses the context); 0 = none")
    follow_ups: str = _f("", "follow_up_share's requests: a text file, one per line; '' = distill.followups.FOLLOW_UPS")
    teacher_backend: str = _f("builtin", "who writes the teacher data: builtin (the target here) or vllm (vLLM's "
                                         "batched generation, from `make vllm`; the same cache format)")

    # one section per method, the job's own (train.methods; the others stay None)
    colbt: ColbtConfig | None = _f(None, "method colbt's section (train/colbt.py)")
    medusa: MedusaConfig | None = _f(None, "method medusa's section (train/medusa.py)")
    lookahead: LookaheadConfig | None = _f(None, "method lookahead's section (train/lookahead.py)")
    eagle3: Eagle3Config | None = _f(None, "method eagle3's section (train/eagle3.py)")
    dflash: DFlashConfig | None = _f(None, "method dflash's section (train/dflash.py)")

    # loss
    loss: str = _f("ce", f"loss, one of {LOSSES}; seqkd uses ce on the target's tokens")
    jsd_beta: float = _f(0.5, "beta of the generalized JSD (0 = forward KL, 1 = reverse KL)")
    kd_temperature: float = _f(1.0, "softening temperature of token-level KD")
    on_policy_lambda: float = _f(0.0, "kd: probability that a batch's responses are written by the drafter and "
                                      "scored live by the target")

    # optimization
    lr: float = _f(5e-4, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(20, "linear warm-up steps")
    batch_size: int = _f(8, "sequences per micro-batch per process")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    epochs: int = _f(1, "passes over the teacher data (max_steps wins when set)")
    max_steps: int = _f(0, "optimizer steps; 0 = run the epochs")
    max_minutes: float = _f(0.0, "the methods registered budgeted (eagle3, medusa, seqkd, kd, ...): the whole job's "
                                 "wall-clock budget in minutes (0: none): "
                                 "after the warm-up and 50 timed steps the step count is set to what fits the time "
                                 "left, each step priced by the steps timed (eagle3: by its batch's counted "
                                 "positions) and each evaluation at the slowest measured, at most max_steps (or the "
                                 "epochs' steps), and training stops early should the job still be about to overrun "
                                 "(train.step_budget)")
    max_seq_len: int = _f(384, "prompt + response tokens per sequence (the prompt is cut from the left)")
    seed: int = _f(0, "seed for data order, teacher sampling and initialization")
    mixed_precision: str = _f("auto", "no, bf16, fp16, or auto (bf16 on CUDA, and for eagle3 on CPUs with native "
                                       "bf16 GEMMs, AVX512-BF16 or AMX; no elsewhere)")
    threads: int = _f(0, "torch threads per process on the CPU; 0 = the machine's cores shared among the processes "
                         "(accelerate launch would leave one per process)")
    malloc_trim_seconds: float = _f(5.0, "hand glibc's free heap pages back to the system this often, so that the "
                                         "job's resident set stays what it uses (train.malloc); 0 = never")
    target_dtype: str = _f("auto", "the frozen target's weights: float32, bfloat16, or auto (bf16 on CUDA, fp32 on "
                                   "CPU); float32 on a GPU makes teacher data and hidden states those of the fp32 "
                                   "target a CPU evaluates")

    # acceptance measured in the loop
    eval_every: int = _f(50, "measure tau/alpha with the engine every N optimizer steps; 0 = only at the end")
    eval_prompts: str = _f("self:4", "held-out prompts for the in-loop measurement")
    eval_max_new_tokens: int = _f(64, "tokens generated per held-out prompt")
    eval_gamma: int = _f(5, "draft length of the in-loop measurement")

    # bookkeeping
    checkpoint_every: int = _f(50, "save full training state every N optimizer steps; 0 = never")
    resume: bool = _f(False, "continue from the latest checkpoint in work_dir")
    stop_at_step: int = _f(0, "checkpoint and stop after this optimizer step, as a preempted job would (continue "
                              "with resume); 0 = run to the end")
    tracker: str = _f("none", f"experiment tracker, one of {TRACKERS} (wandb runs offline without a key)")
    log_every: int = _f(10, "log a line every N optimizer steps")

    def __post_init__(self):
        check_choice("method", self.method, METHODS)
        self.check_sections()
        check_choice("loss", self.loss, LOSSES)
        check_choice("tracker", self.tracker, TRACKERS)
        check_choice("mixed_precision", self.mixed_precision, ("auto", "no", "bf16", "fp16"))
        check_choice("target_dtype", self.target_dtype, TARGET_DTYPES)
        check_choice("teacher_backend", self.teacher_backend, TEACHER_BACKENDS)
        self.check_counts()
        self.check_ranges()
        self.check_teacher_data()
        method = method_named(self.method)
        if self.max_minutes and not method.budgeted:
            budgeted = [m.name for m in methods() if m.budgeted]
            raise ConfigError(f"max_minutes: method {self.method} trains a fixed number of steps; only "
                              f"{', '.join(budgeted)} sizes its steps to a time budget")
        if method.check is not None:
            method.check(self)
        if not self.work_dir:
            self.work_dir = self.output_dir.rstrip("/") + ".work"

    def check_sections(self) -> None:
        """The job's method's section built (its defaults when absent); another method's section is an error."""
        for name, kind in sections(type(self)).items():
            value = as_section(name, kind, getattr(self, name))
            if name == self.method and value is None:
                value = kind()
            if name != self.method and value is not None:
                raise ConfigError(f"{name}: a section of method {name}, but this job's method is {self.method}")
            setattr(self, name, value)

    def check_counts(self) -> None:
        for name in ("max_new_tokens", "gen_batch_size", "batch_size", "grad_accum", "epochs",
                     "max_seq_len", "samples_per_prompt", "eval_max_new_tokens", "eval_gamma", "gen_shard_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("draft_vocab", "lora_r", "max_prompts", "max_steps", "topk", "warmup_steps", "threads",
                     "eval_every", "checkpoint_every", "stop_at_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")

    def check_ranges(self) -> None:
        if self.max_minutes < 0:
            raise ConfigError(f"max_minutes: must be >= 0, got {self.max_minutes}")
        if self.malloc_trim_seconds < 0:
            raise ConfigError(f"malloc_trim_seconds: must be >= 0 (0: never), got {self.malloc_trim_seconds}")
        if not 0.0 <= self.on_policy_lambda <= 1.0:
            raise ConfigError(f"on_policy_lambda: must be in [0, 1], got {self.on_policy_lambda}")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ConfigError(f"jsd_beta: must be in [0, 1], got {self.jsd_beta}")
        if self.lr <= 0 or self.kd_temperature <= 0:
            raise ConfigError("lr and kd_temperature must be > 0")

    def check_teacher_data(self) -> None:
        if not self.prompts:
            raise ConfigError("prompts: at least one prompt source is needed")
        if not 0.0 <= self.follow_up_share <= 1.0:
            raise ConfigError(f"follow_up_share: must be in [0, 1], got {self.follow_up_share}")
        if self.follow_ups and not Path(self.follow_ups).expanduser().is_file():
            raise ConfigError(f"follow_ups: no such file {self.follow_ups}")
        if self.follow_ups and not self.follow_up_share:
            raise ConfigError("follow_ups: a file of requests is read only with follow_up_share > 0")
        if self.gen_keep_greedy and self.gen_temperature == 0:
            raise ConfigError("gen_keep_greedy: needs gen_temperature > 0 (at 0 the greedy answer is all there is)")
        if self.samples_per_prompt > 1 and self.gen_temperature == 0:
            raise ConfigError("samples_per_prompt: several samples per prompt need gen_temperature > 0")
