"""The configuration of `train/distill.py`: one typed dataclass, every field with help text."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from train.config import ConfigError, check_choice

METHODS = ("seqkd", "kd", "colbt", "medusa", "lookahead", "eagle3")
BUDGETED_METHODS = ("eagle3",)  # methods whose loop sizes its steps to max_minutes (train.step_budget)
LOSSES = ("ce", "fkl", "rkl", "jsd", "tvd")
TARGET_DTYPES = ("auto", "float32", "bfloat16")
TEACHER_BACKENDS = ("builtin", "vllm")  # distill.teacher_vllm.BACKENDS (kept here: configs load without torch)
TRACKERS = ("none", "wandb")


def _f(default, help_text: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_text})
    return field(default=default, metadata={"help": help_text})


@dataclass
class DistillConfig:
    """Train a drafter toward a target: sequence-level (seqkd) or token-level (kd) distillation."""

    method: str = _f("seqkd", f"training method, one of {METHODS}")
    target: str = _f("smollm2-135m", "target: the embedded default, an HF directory or hub id, or a .gguf file")
    drafter: str = _f("truncated:4", "initial drafter: truncated:N, small:layers=L,hidden=H, or an HF directory")
    draft_vocab: int = _f(0, "reduced draft head size (the most frequent target tokens; for medusa, the tokens the heads "
                          "may propose at decoding); 0 keeps the full vocabulary")
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

    # colbt: collective boost-tuning of several drafters (train/colbt.py)
    colbt_members: list[str] = _f(["truncated:2", "truncated:3", "small:layers=2,hidden=256"],
                                  "colbt: the member drafters, trained in this order (specs as in `drafter`)")
    colbt_rule: str = _f("top1", "colbt: a member covers a target token when it is its argmax (top1) or in its top-m (topm)")
    colbt_m: int = _f(4, "colbt: m of the topm coverage rule")
    colbt_strength: float = _f(1.0, "colbt: boosting strength; 0 trains every member independently (no boosting)")
    colbt_scheme: str = _f("linear", "colbt: weight = 1 + strength * missed_by_all (linear) or exp(strength * misses) (exp)")
    colbt_holdout: int = _f(8, "colbt: prompts whose teacher records are held out to measure coverage")
    max_tree_nodes: int = _f(16, "colbt: cap on the merged token tree's nodes (root included) when the ensemble decodes")
    colbt_branches: int = _f(1, "colbt: greedy decoding offers each member's top-b tokens at every depth of its "
                                 "chain; the tree keeps the most probable up to max_tree_nodes (1: chains only)")

    # medusa: K heads on the frozen target's hidden state (train/medusa.py)
    medusa_heads: int = _f(4, "medusa: number of heads; head k predicts the token k+1 positions ahead")
    medusa_layers: int = _f(1, "medusa: residual blocks per head")
    medusa_sequential: bool = _f(False, "medusa: sequential (Hydra-style) heads that also read the tree's tokens "
                                        "before their own")
    medusa_prefix_layer: bool = _f(False, "medusa: a causal decoder layer over the target's states under the heads "
                                           "(Hydra++'s prefix attention), trained with them")
    medusa_decay: float = _f(0.8, "medusa: head k's loss weight is decay**(k-1)")
    medusa_kl_weight: float = _f(1.0, "medusa: weight of KL(target || head) beside the CE on the target's tokens")
    medusa_tree_nodes: int = _f(24, "medusa: draft nodes of the calibrated sparse tree (root excluded)")
    medusa_topk: int = _f(8, "medusa: ranks per head measured in calibration (the tree's widest branching)")
    medusa_calibration: int = _f(16, "medusa: prompts held out to measure per-head top-k accuracy")
    medusa_untrained_dir: str = _f("", "medusa: also write the heads as initialised (calibrated on the same held-out "
                                       "prompts) here, the starting point a run's gain is measured against; '' = no")

    # lookahead: [LA] embeddings for the frozen target, PaSS (train/lookahead.py)
    lookahead_tokens: int = _f(4, "lookahead: number k of [LA] embeddings; LA_j predicts the token j+1 after the last real one")
    lookahead_insertions: int = _f(16, "lookahead: insertion points per training sequence, each a group of k [LA] rows in one forward")
    lookahead_decay: float = _f(0.8, "lookahead: LA_j's loss weight is decay**(j-1)")
    lookahead_kl_weight: float = _f(1.0, "lookahead: weight of KL(target || LA) beside the CE on the target's tokens")
    lookahead_chains: int = _f(2, "lookahead: when decoding, the shallowest tree nodes that get an [LA] chain in each verification forward (stored in the drafter)")
    lookahead_branches: int = _f(1, "lookahead: when decoding, the first draft's b most likely tokens go into the tree as siblings (1: a chain; stored in the drafter)")
    lookahead_init_noise: float = _f(0.1, "lookahead: initial noise around the mean token embedding, in units of its per-dimension std")

    # eagle3: one decoder layer over the frozen target's hidden states at three layers (train/eagle3.py)
    eagle3_layers: list[int] = _f([], "eagle3: the three target layers whose inputs are fused (low, middle, high); "
                                      "empty: EAGLE-3's choice, 2, L // 2 and L - 3 of an L-layer target")
    eagle3_steps: int = _f(7, "eagle3: drafting steps unrolled per position in training (the training-time test)")
    eagle3_decay: float = _f(0.8, "eagle3: step j's loss weight is decay**j")
    eagle3_prompt_weight: float = _f(0.0, "eagle3: loss weight of positions whose next token is a prompt token "
                                          "(the target's distribution there is as real; 0: response positions only)")
    eagle3_copy_weight: float = _f(1.0, "eagle3: loss weight, times the position's, where the target's next token "
                                        "continues an earlier occurrence of the last two tokens (it copies from its "
                                        "context; 1: as any other position)")
    eagle3_feature_noise: float = _f(0.0, "eagle3: std of the Gaussian noise added to the target's features in training, "
                                          "as a share of each dimension's median |value| (0: none; EAGLE trains on noised features)")
    eagle3_init: str = _f("target_layer", "eagle3: how the layer and fc start: target_layer (the target's high layer "
                                          "over its own high feature) or random (Llama's init)")
    eagle3_intermediate_size: int = _f(0, "eagle3: the drafter layer's MLP width (0: the target's); a wider one "
                                          "starts as the target's layer with the new units' outputs at zero")
    eagle3_depth: int = _f(0, "eagle3: decoding's deepest draft (stored in the drafter); 0: the per-device default")
    eagle3_topk: int = _f(0, "eagle3: decoding's top-k per expanded node and nodes expanded per depth; 0: default")
    eagle3_tree_nodes: int = _f(0, "eagle3: decoding's tree size (nodes besides the root); 0: the per-device default")

    # loss
    loss: str = _f("ce", f"loss, one of {LOSSES}; seqkd uses ce on the target's tokens")
    jsd_beta: float = _f(0.5, "beta of the generalized JSD (0 = forward KL, 1 = reverse KL)")
    kd_temperature: float = _f(1.0, "softening temperature of token-level KD")
    on_policy_lambda: float = _f(0.0, "kd: probability that a batch's responses are written by the drafter and scored live by the target")

    # optimization
    lr: float = _f(5e-4, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(20, "linear warm-up steps")
    batch_size: int = _f(8, "sequences per micro-batch per process")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    epochs: int = _f(1, "passes over the teacher data (max_steps wins when set)")
    max_steps: int = _f(0, "optimizer steps; 0 = run the epochs")
    max_minutes: float = _f(0.0, "eagle3: the whole job's wall-clock budget in minutes (0: none): after the warm-up "
                                 "and 50 timed steps the step count is set to what fits the time left, each step "
                                 "priced by its batch's counted positions and each evaluation at the slowest "
                                 "measured, at most max_steps, and training stops early should the job still be "
                                 "about to overrun (train.step_budget)")
    max_seq_len: int = _f(384, "prompt + response tokens per sequence (the prompt is cut from the left)")
    seed: int = _f(0, "seed for data order, teacher sampling and initialization")
    mixed_precision: str = _f("auto", "no, bf16, fp16, or auto (bf16 on CUDA, and for eagle3 on CPUs with native "
                                       "bf16 GEMMs, AVX512-BF16 or AMX; no elsewhere)")
    threads: int = _f(0, "torch threads per process on the CPU; 0 = the machine's cores shared among the processes "
                         "(accelerate launch would leave one per process)")
    target_dtype: str = _f("auto", "the frozen target's weights: float32, bfloat16, or auto (bf16 on CUDA, fp32 on CPU); "
                                   "float32 on a GPU makes teacher data and hidden states those of the fp32 target a CPU evaluates")

    # acceptance measured in the loop
    eval_every: int = _f(50, "measure tau/alpha with the engine every N optimizer steps; 0 = only at the end")
    eval_prompts: str = _f("self:4", "held-out prompts for the in-loop measurement")
    eval_max_new_tokens: int = _f(64, "tokens generated per held-out prompt")
    eval_gamma: int = _f(5, "draft length of the in-loop measurement")

    # bookkeeping
    checkpoint_every: int = _f(50, "save full training state every N optimizer steps; 0 = never")
    resume: bool = _f(False, "continue from the latest checkpoint in work_dir")
    stop_at_step: int = _f(0, "checkpoint and stop after this optimizer step, as a preempted job would (continue with resume); 0 = run to the end")
    tracker: str = _f("none", f"experiment tracker, one of {TRACKERS} (wandb runs offline without a key)")
    log_every: int = _f(10, "log a line every N optimizer steps")

    def __post_init__(self):
        check_choice("method", self.method, METHODS)
        check_choice("loss", self.loss, LOSSES)
        check_choice("tracker", self.tracker, TRACKERS)
        check_choice("mixed_precision", self.mixed_precision, ("auto", "no", "bf16", "fp16"))
        check_choice("target_dtype", self.target_dtype, TARGET_DTYPES)
        check_choice("teacher_backend", self.teacher_backend, TEACHER_BACKENDS)
        if self.method == "seqkd" and self.loss != "ce":
            raise ConfigError(f"loss: seqkd trains with ce on the target's tokens, got {self.loss!r} (use method: kd)")
        if self.method == "kd" and self.loss == "ce":
            raise ConfigError("loss: kd needs a divergence (fkl, rkl, jsd or tvd), got 'ce' (use method: seqkd)")
        if self.method == "kd" and self.topk <= 0 and self.on_policy_lambda < 1.0:
            raise ConfigError("topk: kd on teacher data needs the target's stored top-k log-probs (topk > 0)")
        for name in ("max_new_tokens", "gen_batch_size", "batch_size", "grad_accum", "epochs",
                     "max_seq_len", "samples_per_prompt", "eval_max_new_tokens", "eval_gamma", "gen_shard_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("draft_vocab", "lora_r", "max_prompts", "max_steps", "topk", "warmup_steps", "threads",
                     "eval_every", "checkpoint_every", "stop_at_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_minutes < 0:
            raise ConfigError(f"max_minutes: must be >= 0, got {self.max_minutes}")
        if self.max_minutes and self.method not in BUDGETED_METHODS:
            raise ConfigError(f"max_minutes: method {self.method} trains a fixed number of steps; only "
                              f"{', '.join(BUDGETED_METHODS)} sizes its steps to a time budget")
        if not 0.0 <= self.on_policy_lambda <= 1.0:
            raise ConfigError(f"on_policy_lambda: must be in [0, 1], got {self.on_policy_lambda}")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ConfigError(f"jsd_beta: must be in [0, 1], got {self.jsd_beta}")
        if self.lr <= 0 or self.kd_temperature <= 0:
            raise ConfigError("lr and kd_temperature must be > 0")
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
        if self.method == "colbt":
            from train.colbt import check_colbt_config  # the checks live beside the method

            try:
                check_colbt_config(self)
            except ValueError as err:
                raise ConfigError(str(err)) from err
        if self.method == "medusa":
            self.check_medusa()
        if self.method == "lookahead":
            self.check_lookahead()
        if self.method == "eagle3":
            self.check_eagle3()
        if not self.work_dir:
            self.work_dir = self.output_dir.rstrip("/") + ".work"

    def check_medusa(self) -> None:
        for name in ("medusa_heads", "medusa_tree_nodes", "medusa_topk", "medusa_calibration"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.medusa_layers < 0:
            raise ConfigError(f"medusa_layers: must be >= 0, got {self.medusa_layers}")
        if not 0 < self.medusa_decay <= 1:
            raise ConfigError(f"medusa_decay: must be in (0, 1], got {self.medusa_decay}")
        if self.medusa_kl_weight < 0:
            raise ConfigError(f"medusa_kl_weight: must be >= 0, got {self.medusa_kl_weight}")
        if self.loss != "ce":
            raise ConfigError(f"loss: medusa trains with ce + medusa_kl_weight * KL, got {self.loss!r}")
        if self.lora_r:
            raise ConfigError("lora_r: Medusa-2 (LoRA on the target) is not implemented; set lora_r: 0")
        if self.medusa_untrained_dir and Path(self.medusa_untrained_dir).resolve() == Path(self.output_dir).resolve():
            raise ConfigError(f"medusa_untrained_dir: must differ from output_dir ({self.output_dir})")

    def check_lookahead(self) -> None:
        for name in ("lookahead_tokens", "lookahead_insertions", "lookahead_chains", "lookahead_branches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lookahead_decay <= 1:
            raise ConfigError(f"lookahead_decay: must be in (0, 1], got {self.lookahead_decay}")
        if self.lookahead_kl_weight < 0 or self.lookahead_init_noise < 0:
            raise ConfigError("lookahead_kl_weight and lookahead_init_noise: must be >= 0, got "
                              f"{self.lookahead_kl_weight}, {self.lookahead_init_noise}")
        if self.loss != "ce":
            raise ConfigError(f"loss: lookahead trains with ce + lookahead_kl_weight * KL, got {self.loss!r}")
        if self.lora_r:
            raise ConfigError("lora_r: lookahead trains only the [LA] embeddings, the target stays frozen; set lora_r: 0")

    def check_eagle3(self) -> None:
        if self.eagle3_layers and len(self.eagle3_layers) != 3:
            raise ConfigError(f"eagle3_layers: three target layers (low, middle, high) or none, got {self.eagle3_layers}")
        if any(int(i) < 0 for i in self.eagle3_layers):
            raise ConfigError(f"eagle3_layers: layer indices must be >= 0, got {self.eagle3_layers}")
        if self.eagle3_steps < 1:
            raise ConfigError(f"eagle3_steps: must be >= 1, got {self.eagle3_steps}")
        if not 0 < self.eagle3_decay <= 1:
            raise ConfigError(f"eagle3_decay: must be in (0, 1], got {self.eagle3_decay}")
        if not 0 <= self.eagle3_prompt_weight <= 1:
            raise ConfigError(f"eagle3_prompt_weight: must be in [0, 1], got {self.eagle3_prompt_weight}")
        if not 0 < self.eagle3_copy_weight <= 100:
            raise ConfigError(f"eagle3_copy_weight: must be in (0, 100], got {self.eagle3_copy_weight}")
        if not 0 <= self.eagle3_feature_noise < 1:
            raise ConfigError(f"eagle3_feature_noise: must be in [0, 1), got {self.eagle3_feature_noise}")
        check_choice("eagle3_init", self.eagle3_init, ("target_layer", "random"))  # models.eagle3.EAGLE3_INITS
        if self.eagle3_intermediate_size < 0:
            raise ConfigError(f"eagle3_intermediate_size: must be >= 0 (0: the target's), got "
                              f"{self.eagle3_intermediate_size}")
        for name in ("eagle3_depth", "eagle3_topk", "eagle3_tree_nodes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: the default), got {getattr(self, name)}")
        if self.loss != "ce":
            raise ConfigError(f"loss: eagle3 trains with ce against the target's distribution, got {self.loss!r}")
        if self.lora_r:
            raise ConfigError("lora_r: eagle3 trains its own layer fully, the target stays frozen; set lora_r: 0")
