"""The configuration of `train/online.py`: one typed dataclass, every field with help text."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdistill.train.config import ConfigError, check_choice
from specdistill.train.online_learn import KD_LOSSES

TRACKERS = ("none", "wandb")
TEACHER_BACKENDS = ("target", "openai")
PROMPT_VOCAB = ("manifest", "on", "off")


def _f(default, help_text: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_text})
    return field(default=default, metadata={"help": help_text})


@dataclass
class OnlineConfig:
    """Online distillation: tail a server's request log and keep aligning the drafter to live traffic."""

    target: str = _f("smollm2-135m", "the target the server verifies with (the embedded default, a dir, a .gguf)")
    log_dir: str = _f("", "the server's --log-dir (request log segments)")
    store: str = _f("", "the drafter store the server follows (--drafter STORE); versions are published here")
    init_drafter: str = _f("", "drafter directory that becomes version 0 when the store is empty")
    work_dir: str = _f("", "state, replay buffer, dead letters and metrics (must survive restarts)")

    # when to update
    update_every_requests: int = _f(50, "run an update after this many newly ingested requests")
    update_every_seconds: float = _f(0.0, "also update after this many seconds with new requests; 0 = off")
    min_buffer: int = _f(16, "training requests needed before the first update")
    poll_seconds: float = _f(1.0, "sleep between reads when the log has nothing new")
    read_batch: int = _f(32, "log lines read, scored and committed together")
    stop_after_requests: int = _f(0, "exit once this many requests are ingested and updated on; 0 = run forever")
    stop_when_idle_seconds: float = _f(0.0, "exit after the log has been idle this long (a final update runs "
                                            "first); 0 = never")

    # the buffer
    buffer_requests: int = _f(2000, "training requests kept (oldest evicted first)")
    holdout_every: int = _f(8, "hold out every N-th request (by id hash) for judging candidates; never trained on")
    holdout_window: int = _f(48, "newest held-out requests a candidate is judged on")
    topk: int = _f(16, "target top-k stored per position")
    max_line_bytes: int = _f(4_000_000, "log lines longer than this go to the dead letters")

    # the update
    loss: str = _f("fkl", f"KD loss on the target's top-k, one of {KD_LOSSES} (ce: cross-entropy on its top-1)")
    mix_weight: float = _f(0.5, "for loss: mix, the forward-KL weight (reverse KL gets 1 - this)")
    right_weight: float = _f(0.25, "loss weight of positions the drafter already gets right (wrong ones weigh 1)")
    prompt_weight: float = _f(0.0, "loss weight of the logged prompts' own positions (the target's distribution "
                                   "over each prompt token, scored in the same forward): in-domain text the "
                                   "server saw; 0 = outputs only")
    samples_per_request: int = _f(0, "the target's own sampled answers generated per training request's prompt and "
                                     "trained on beside its logged output (sequence-level KD on live prompts: "
                                     "more in-domain text per request, for k target generations each); 0 = off")
    sample_temperature: float = _f(0.8, "temperature of those sampled answers")
    lr: float = _f(2e-4, "AdamW learning rate of each update")
    steps_per_update: int = _f(30, "optimizer steps per update")
    batch_size: int = _f(8, "requests per step")
    max_seq_len: int = _f(384, "prompt + output tokens per training row (prompt cut from the left)")
    anchor_data: str = _f("", "teacher-data directory of general-domain target generations (distill.teacher_data) "
                              "rehearsed in every step and used as the general-domain guard; empty = none")
    rehearsal_data: list[str] = _f([], "more teacher-data directories rehearsed with the anchor but never used as "
                                       "the guard (e.g. the drafter's own training data: replaying it keeps what "
                                       "it knew; judging by it would measure memorisation)")
    anchor_weight: float = _f(0.5, "weight of the anchor cross-entropy in each step")
    anchor_batch_size: int = _f(4, "anchor rows per step")
    anchor_guard: int = _f(48, "anchor records held out as the general-domain guard (never rehearsed)")
    max_general_drop: float = _f(0.01, "reject a candidate whose alpha on the general guard is more than this below "
                                       "the first served version's (a bound on the total drift, not per update)")
    min_gain: float = _f(0.0, "publish only if the candidate's held-out alpha beats the served one by this")
    gamma: int = _f(5, "draft depth at which acceptance is measured")
    prompt_vocab: str = _f("manifest", f"one of {PROMPT_VOCAB}: train and judge a reduced head extended per request by "
                                       "its prompt's own tokens, as the engine drafts with prompt_vocab (copying "
                                       "from the prompt is then learnable); manifest = as the served drafter's "
                                       "extra.prompt_vocab, which the server follows and published versions keep")
    vocab_growth: int = _f(0, "reduced draft heads only: each update may add up to this many head rows for the "
                              "traffic's most frequent target tokens the head lacks; 0 = the head stays fixed")
    vocab_growth_min_count: int = _f(3, "a token joins the head only once the training buffer holds it this often")

    # serving through vLLM (train.engine_swap)
    export_vllm: bool = _f(False, "also write each published version (and the first) in vLLM's format to "
                                  "STORE/vllm/VERSION (models.export --format vllm), which train.engine_swap serves")
    teacher_backend: str = _f("target", f"one of {TEACHER_BACKENDS}: who gives the target's top-k along logged "
                                        "requests: the daemon's own copy of the target, or the server that serves "
                                        "it (vLLM's prompt_logprobs at teacher_url; distill.teacher_openai)")
    teacher_url: str = _f("", "teacher_backend openai: the server's URL (an engine, or the logging front); its key "
                              "is read from $SPECDISTILL_UPSTREAM_API_KEY")
    teacher_model: str = _f("", "teacher_backend openai: the model name the server serves the target under")
    engine_metrics_url: str = _f("", "an engine's Prometheus /metrics (vLLM's, or the logging front's, which is the "
                                     "served engine's): its spec-decode counters give the live alpha in "
                                     "metrics.jsonl; empty = the log records' own stats only")

    tracker: str = _f("none", f"experiment tracker, one of {TRACKERS}")
    seed: int = _f(0, "training randomness")
    device: str = _f("", "cpu or cuda; empty = cuda when available")
    threads: int = _f(0, "CPU threads for torch; 0 = torch's default (leave cores to a server on the same machine)")
    malloc_trim_seconds: float = _f(5.0, "hand glibc's free heap pages back to the system this often, so that a "
                                         "daemon's resident set stays what it uses (train.malloc); 0 = never")

    def __post_init__(self):
        for name in ("log_dir", "store", "work_dir"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: required (see configs/online/README or --help)")
        check_choice("loss", self.loss, KD_LOSSES)
        check_choice("tracker", self.tracker, TRACKERS)
        check_choice("prompt_vocab", self.prompt_vocab, PROMPT_VOCAB)
        positive = ("update_every_requests", "read_batch", "buffer_requests", "topk", "steps_per_update",
                    "batch_size", "max_seq_len", "gamma", "min_buffer", "max_line_bytes")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.mix_weight <= 1.0:
            raise ConfigError(f"mix_weight: must be in [0, 1], got {self.mix_weight}")
        if not 0.0 <= self.right_weight <= 1.0:
            raise ConfigError(f"right_weight: must be in [0, 1], got {self.right_weight}")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr}")
        if self.samples_per_request < 0:
            raise ConfigError(f"samples_per_request: must be >= 0, got {self.samples_per_request}")
        if self.sample_temperature <= 0:
            raise ConfigError(f"sample_temperature: must be > 0 (greedy would repeat the logged output), "
                              f"got {self.sample_temperature}")
        if self.prompt_weight < 0:
            raise ConfigError(f"prompt_weight: must be >= 0, got {self.prompt_weight}")
        if self.malloc_trim_seconds < 0:
            raise ConfigError(f"malloc_trim_seconds: must be >= 0 (0: never), got {self.malloc_trim_seconds}")
        if self.vocab_growth < 0:
            raise ConfigError(f"vocab_growth: must be >= 0, got {self.vocab_growth}")
        if self.vocab_growth_min_count < 1:
            raise ConfigError(f"vocab_growth_min_count: must be >= 1, got {self.vocab_growth_min_count}")
        check_choice("teacher_backend", self.teacher_backend, TEACHER_BACKENDS)
        if self.teacher_backend == "openai":
            if not self.teacher_url.startswith(("http://", "https://")) or not self.teacher_model:
                raise ConfigError("teacher_backend: openai needs teacher_url (an http(s) URL) and teacher_model")
            if self.samples_per_request:
                raise ConfigError("samples_per_request: the target's sampled answers are generated by the daemon's "
                                  "own target; with teacher_backend: openai set it to 0")
        if self.engine_metrics_url and not self.engine_metrics_url.startswith(("http://", "https://")):
            raise ConfigError(f"engine_metrics_url: must be an http(s) URL, got {self.engine_metrics_url!r}")
        if self.holdout_every == 1:
            raise ConfigError("holdout_every: 1 would hold out every request and train on none")
