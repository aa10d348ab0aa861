"""Online distillation: tail a server's request log and keep aligning the drafter to live traffic.

    accelerate launch train/online.py --config configs/online/smollm2_gsm8k.yaml
    python train/online.py --config ... [--key value ...]

The loop (after Online Speculative Decoding, Liu et al. 2023):
  1. read new log lines from the committed position (decode.request_log), send unusable ones to the
     dead letters with the reason, score the good ones with the target (top-k per output position),
     optionally let the target sample more answers to the training requests' prompts
     (`samples_per_request`), and commit them into the replay buffer together with the new position
     (train.online_state);
  2. every `update_every_requests` new requests (or `update_every_seconds`), train a copy of the served
     drafter on priority-sampled buffer batches (KD weighted toward the positions it gets wrong, plus an
     optional general-domain rehearsal), judge it against the served drafter on the newest held-out
     requests (and the general guard), and publish it as a new store version only if acceptance did not
     fall; otherwise keep the served one and record why (a rollback);
  3. record the server's live alpha and the held-out alpha to WORK/metrics.jsonl (and wandb): the log records'
     own (the built-in server's), or with `engine_metrics_url` the engine's spec-decode counters (vLLM's /metrics);
  4. serving through vLLM (train.engine_swap), with `export_vllm`: write each published version in vLLM's format
     beside the store's (train.online_vllm), and copy the swap supervisor's rollbacks, with the engine's error,
     into the metrics.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specdistill.decode.request_log import BadRecord, LogLine, parse_record, position_after, read_lines
from specdistill.distill.generation import pad_token_id
from specdistill.distill.replay import Entry, ReplayBuffer, is_held_out
from specdistill.distill.teacher_data import load_teacher_data
from specdistill.distill.teacher_openai import OpenAIScorer, TeacherUnavailable
from specdistill.distill.vocab import count_response_tokens, inverse_map, tokens_to_add
from specdistill.models.draft_models import grow_head
from specdistill.models.drafter_store import current_path, current_version, init_store, is_store, publish_version
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target
from specdistill.train.config import ConfigError, load_config
from specdistill.train.distill_steps import end_run
from specdistill.train.malloc import start_trimming
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_learn import acceptance, attach_samples, score_requests, train_candidate
from specdistill.train.online_state import METRICS, OnlineState
from specdistill.train.online_vllm import LiveAcceptance, export_version_for_vllm, read_engine_events, scrape

log = logging.getLogger("specdistill.online")


class OnlineDaemon:
    def __init__(self, cfg: OnlineConfig, accelerator=None):
        self.cfg = cfg
        self.accelerator = accelerator
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.target = load_target(cfg.target, device=device)
        self.pad_id = pad_token_id(self.target.tokenizer, self.target.eos_token_ids)
        prepare_store(cfg)
        self.state = OnlineState(cfg.work_dir, ReplayBuffer(cfg.buffer_requests, cfg.holdout_window))
        self.version, self.model, self.vocab_map = self.load_served()
        self.anchors, self.guard = load_anchors(cfg)
        self.rng = random.Random(cfg.seed * 1_000_003 + self.state.counters.updates)
        self.engine_acceptance = LiveAcceptance()
        self.teacher = make_teacher(cfg)
        if cfg.export_vllm:
            self.export_for_vllm(self.version)
        log.info("online daemon: store %s at %s, %d requests in the buffer, %d held out, position %s",
                 cfg.store, self.version, len(self.state.buffer), len(self.state.buffer.holdout),
                 self.state.position)

    # ---- the loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        idle_since = time.monotonic()
        while True:
            lines = read_lines(self.cfg.log_dir, self.state.position, self.cfg.read_batch)
            if lines:
                try:
                    self.ingest(lines)
                except TeacherUnavailable as e:  # nothing was committed: the same lines are read again
                    log.warning("the scoring server is unavailable (%s); retrying in %.0f s", e, self.cfg.poll_seconds)
                    time.sleep(self.cfg.poll_seconds)
                    continue
                idle_since = time.monotonic()
            if self.update_due():
                self.update()
            if self.should_stop(time.monotonic() - idle_since if not lines else 0.0):
                return
            if not lines:
                time.sleep(self.cfg.poll_seconds)

    def update_due(self, final: bool = False) -> bool:
        c = self.state.counters
        if c.since_update == 0 or len(self.state.buffer) < self.cfg.min_buffer:
            return False
        by_time = (self.cfg.update_every_seconds > 0
                   and time.time() - c.last_update_time >= self.cfg.update_every_seconds)
        return final or by_time or c.since_update >= self.cfg.update_every_requests

    def should_stop(self, idle_s: float) -> bool:
        """idle_s: how long the log has had nothing new, 0 while the last read found lines."""
        cfg, c = self.cfg, self.state.counters
        done = cfg.stop_after_requests and c.ingested >= cfg.stop_after_requests
        if done or (cfg.stop_when_idle_seconds and idle_s >= cfg.stop_when_idle_seconds):
            if self.update_due(final=True):
                self.update()
            return True
        return False

    # ---- ingesting --------------------------------------------------------------------------------------

    def ingest(self, lines: list[LogLine]) -> None:
        good, dead = self.parse(lines)
        entries = (score_requests(self.target, good, self.cfg.topk, self.pad_id,
                                  with_prompt=self.cfg.prompt_weight > 0, teacher=self.teacher) if good else [])
        scored = acceptance(self.model, self.vocab_map, entries, self.pad_id, self.cfg.max_seq_len, self.cfg.gamma,
                            self.prompt_vocab)
        for entry in entries:
            entry.priority = scored["priorities"][entry.id]
        split = [(e, is_held_out(e.id, self.cfg.holdout_every)) for e in entries]
        if self.cfg.samples_per_request:  # training requests only: held-out ones judge the logged output
            attach_samples(self.target, [e for e, held_out in split if not held_out], self.cfg.samples_per_request,
                           self.cfg.sample_temperature, self.cfg.topk, self.pad_id, self.cfg.seed)
        self.state.ingest(split, dead, position_after(lines, self.state.position))
        self.copy_engine_events()
        if good:
            self.record("ingest", {**live_window(good), **self.engine_window()})

    def parse(self, lines: list[LogLine]) -> tuple[list[dict], list[dict]]:
        good, dead, ids = [], [], set()
        for line in lines:
            try:
                rec = parse_record(line, self.target.tokenizer_fingerprint, self.target.vocab_size,
                                   self.cfg.max_line_bytes)
                if rec["id"] in self.state.seen or rec["id"] in ids:
                    raise BadRecord(f"duplicate: request id {rec['id']} was already used")
                if not rec["output_ids"]:
                    raise BadRecord("output_ids is empty: nothing to learn from")
            except BadRecord as e:
                dead.append(dead_letter(line, str(e)))
                continue
            ids.add(rec["id"])
            good.append(rec)
        return good, dead

    # ---- updating ---------------------------------------------------------------------------------------

    def update(self) -> None:
        cfg, state = self.cfg, self.state
        self.copy_engine_events()  # a rollback moved `current` back: follow_store then loads what is served
        self.follow_store()
        holdout = list(state.buffer.holdout)
        served = self.judge(self.model, holdout)
        if state.counters.general_reference is None:
            state.counters.general_reference = served.get("general_alpha")
        served["general_reference"] = state.counters.general_reference
        candidate = copy.deepcopy(self.model)
        candidate_map, grown = self.grown_head(candidate)
        candidate.requires_grad_(True)
        loss = train_candidate(candidate, self.draft_index(candidate_map), state.buffer, self.anchors, cfg,
                               self.pad_id, self.rng, prompt_vocab=self.prompt_vocab)
        candidate.requires_grad_(False)
        trial = self.judge(candidate, holdout, candidate_map)
        ok, reason = decide(served, trial, cfg)
        event = {"loss": loss, "served_version": self.version, "heldout_alpha_served": served["alpha"],
                 "heldout_alpha_candidate": trial["alpha"], "general_alpha_served": served.get("general_alpha"),
                 "general_alpha_candidate": trial.get("general_alpha"),
                 "general_alpha_reference": served["general_reference"], "holdout_requests": len(holdout),
                 "head_rows_added": grown, "published": ok, "reason": reason}
        if ok:
            self.version = publish_version(cfg.store, candidate, self.target, config=asdict(cfg),
                                           vocab_map=candidate_map,
                                           extra={"parent": self.version, "prompt_vocab": self.prompt_vocab,
                                                  "heldout_alpha": trial["alpha"],
                                                  "general_alpha": trial.get("general_alpha"),
                                                  "requests_ingested": state.counters.ingested})
            self.model, self.vocab_map = candidate, candidate_map
            state.counters.published += 1
            if cfg.export_vllm:
                event["vllm_export_error"] = self.export_for_vllm(self.version)
            log.info("published %s: held-out alpha %.3f -> %.3f", self.version, served["alpha"] or 0,
                     trial["alpha"] or 0)
        else:
            state.counters.rollbacks += 1
            log.info("kept %s: %s", self.version, reason)
        event["version"] = self.version
        self.refresh_priorities()
        state.counters.since_update = 0
        state.counters.updates += 1
        state.counters.last_update_time = time.time()
        self.record("update", event)
        state.commit()

    def grown_head(self, candidate) -> tuple[torch.Tensor | None, int]:
        """The candidate's vocab_map after `vocab_growth`: the buffer's most frequent target tokens that the
        reduced head lacks get rows (models.draft_models.grow_head). Returns (map, rows added)."""
        cfg, vocab_map = self.cfg, self.vocab_map
        if not cfg.vocab_growth or vocab_map is None:
            return vocab_map, 0
        counts = count_response_tokens(e.record() for e in self.state.buffer.train.values())
        new_ids = tokens_to_add(counts, vocab_map.cpu(), cfg.vocab_growth, cfg.vocab_growth_min_count)
        return grow_head(candidate, vocab_map.cpu(), new_ids).to(vocab_map.device), int(new_ids.numel())

    def draft_index(self, vocab_map: torch.Tensor | None) -> torch.Tensor | None:
        """[V] draft index of each target id (-1 where the head has none), None for a full head."""
        return None if vocab_map is None else inverse_map(vocab_map.cpu(), self.target.vocab_size)

    def judge(self, model, holdout: list[Entry], vocab_map: torch.Tensor | None = None) -> dict:
        cfg = self.cfg
        vocab_map = self.vocab_map if vocab_map is None else vocab_map
        out = acceptance(model, vocab_map, holdout, self.pad_id, cfg.max_seq_len, cfg.gamma, self.prompt_vocab)
        out.pop("priorities")
        if self.guard:
            general = acceptance(model, vocab_map, self.guard, self.pad_id, cfg.max_seq_len, cfg.gamma,
                                 self.prompt_vocab)
            out["general_alpha"] = general["alpha"]
        return out

    def refresh_priorities(self) -> None:
        entries = list(self.state.buffer.train.values())
        scored = acceptance(self.model, self.vocab_map, entries, self.pad_id, self.cfg.max_seq_len, self.cfg.gamma,
                            self.prompt_vocab)
        for entry in entries:
            entry.priority = scored["priorities"][entry.id]
        self.state.set_priorities(scored["priorities"])

    def follow_store(self) -> None:
        """Someone else (an operator's rollback) may have moved `current`: train from what is served."""
        if current_version(self.cfg.store) != self.version:
            self.version, self.model, self.vocab_map = self.load_served()

    def load_served(self):
        drafter = load_drafter(str(current_path(self.cfg.store)), self.target, device=str(self.target.device))
        if drafter.kind != "draft_model" or drafter.model is None:
            raise ConfigError(f"the online daemon trains drafters of kind draft_model; the store's current "
                              f"version is a {drafter.kind!r} drafter, which has no weights to train")
        self.prompt_vocab = resolve_prompt_vocab(self.cfg.prompt_vocab, drafter)
        return current_version(self.cfg.store), drafter.model.eval(), drafter.vocab_map

    # ---- serving through vLLM ----------------------------------------------------------------------------

    def export_for_vllm(self, version: str) -> str | None:
        """Write `version` in vLLM's format for the swap supervisor; None, or why it failed (the version stays
        published for the built-in server; the supervisor rolls back a version with no export, naming it)."""
        try:
            export_version_for_vllm(self.cfg.store, version, self.target, self.cfg.gamma)
        except (OSError, ValueError, RuntimeError) as e:
            log.error("could not export %s for vLLM: %s", version, e)
            return f"{type(e).__name__}: {e}"
        return None

    def engine_window(self) -> dict:
        """The engine's own acceptance since the last read, when its /metrics is configured and answers."""
        if not self.cfg.engine_metrics_url:
            return {}
        counters = scrape(self.cfg.engine_metrics_url)
        return {} if counters is None else self.engine_acceptance.window(counters)

    def copy_engine_events(self) -> None:
        """The swap supervisor's new journal lines (swaps; rollbacks with the engine's error) as metrics rows, each
        once: the count copied is committed with the daemon's state."""
        events = read_engine_events(self.cfg.store, self.state.counters.engine_events)
        for event in events:
            self.record(f"engine_{event.pop('event')}", {"engine_time": event.pop("time", None), **event})
        if events:
            self.state.counters.engine_events += len(events)
            self.state.commit()

    # ---- metrics ----------------------------------------------------------------------------------------

    def record(self, event: str, fields: dict) -> None:
        c = self.state.counters
        row = {"event": event, "time": time.time(), "requests_ingested": c.ingested, "dead_letters": c.dead_letters,
               "published": c.published, "rollbacks": c.rollbacks, **fields}
        self.state.journal(METRICS, row)
        if self.accelerator is not None and self.cfg.tracker != "none":
            numbers = {f"{event}/{k}": v for k, v in row.items() if isinstance(v, (int, float)) and v is not None}
            self.accelerator.log(numbers, step=c.ingested)


def make_teacher(cfg: OnlineConfig):
    """None (score with the daemon's own target) or the serving engine's scorer (teacher_backend: openai)."""
    if cfg.teacher_backend != "openai":
        return None
    return OpenAIScorer(cfg.teacher_url, cfg.teacher_model, os.environ.get("SPECDISTILL_UPSTREAM_API_KEY"))


def decide(served: dict, trial: dict, cfg: OnlineConfig) -> tuple[bool, str]:
    """Publish only a candidate whose held-out acceptance did not fall (and whose general acceptance
    did not fall more than allowed). Returns (publish?, why)."""
    if served["alpha"] is None or trial["alpha"] is None:
        return False, "no held-out requests to judge the candidate on yet"
    if trial["alpha"] < served["alpha"] + cfg.min_gain:
        return False, f"held-out alpha {trial['alpha']:.4f} < served {served['alpha']:.4f} + min_gain {cfg.min_gain}"
    g_ref, g_trial = served.get("general_reference"), trial.get("general_alpha")
    if g_ref is not None and g_trial is not None and g_trial < g_ref - cfg.max_general_drop:
        return False, (f"general alpha {g_trial:.4f} fell more than {cfg.max_general_drop} below the first "
                       f"version's {g_ref:.4f}")
    return True, f"held-out alpha {served['alpha']:.4f} -> {trial['alpha']:.4f}"


def resolve_prompt_vocab(setting: str, drafter) -> bool:
    """Whether the served drafter drafts with its head extended by each prompt (`prompt_vocab`): `on`/`off`,
    or `manifest`: as its manifest's extra.prompt_vocab says, which is what the server follows."""
    wanted = setting == "on" or (setting == "manifest" and
                                 bool((drafter.manifest.get("extra") or {}).get("prompt_vocab", False)))
    if wanted and drafter.vocab_map is None:
        if setting == "on":
            raise ConfigError("prompt_vocab: on needs a reduced draft head; the served drafter has the full vocabulary")
        return False  # the engine ignores it for a full head as well
    return wanted


def live_window(records: list[dict]) -> dict:
    """The server's own acceptance on these requests, as it logged them."""
    drafted = sum(int(r["stats"].get("drafted", 0)) for r in records)
    accepted = sum(int(r["stats"].get("accepted", 0)) for r in records)
    versions = sorted({r["drafter_version"] for r in records})
    return {"live_alpha": accepted / drafted if drafted else None, "live_requests": len(records),
            "live_versions": versions}


def dead_letter(line: LogLine, reason: str, keep_bytes: int = 2000) -> dict:
    return {"time": time.time(), "segment": line.segment, "offset": line.offset, "reason": reason,
            "bytes": len(line.raw), "line": line.raw[:keep_bytes].decode("utf-8", errors="replace")}


def prepare_store(cfg: OnlineConfig) -> None:
    if is_store(cfg.store) and (Path(cfg.store) / "current").is_symlink():
        return
    if not cfg.init_drafter:
        raise ConfigError(f"store: {cfg.store} has no current version; set init_drafter to a drafter directory")
    init_store(cfg.store, cfg.init_drafter)


def load_anchors(cfg: OnlineConfig) -> tuple[list[dict], list[Entry]]:
    """General-domain target generations: most are rehearsed, the last `anchor_guard` judge forgetting;
    every `rehearsal_data` row is rehearsed. The guard's target tokens are the greedy generations
    themselves (top-1 = the token)."""
    if cfg.rehearsal_data and not cfg.anchor_data:
        raise ConfigError("rehearsal_data: needs anchor_data too (the guard that judges forgetting comes from it)")
    if not cfg.anchor_data:
        return [], []
    rows = teacher_rows(cfg.anchor_data)
    random.Random(cfg.seed).shuffle(rows)
    guard_rows, rehearse = rows[:cfg.anchor_guard], rows[cfg.anchor_guard:]
    for path in cfg.rehearsal_data:
        rehearse += teacher_rows(path)
    guard = [Entry(f"anchor-{i}", r["prompt_ids"], r["response_ids"], [[t] for t in r["response_ids"]],
                   [[0.0] for _ in r["response_ids"]]) for i, r in enumerate(guard_rows)]
    return rehearse, guard


def teacher_rows(path: str) -> list[dict]:
    """Prompt and response ids of a teacher-data directory's rows with more than one response token."""
    return [{"prompt_ids": list(r["prompt_ids"]), "response_ids": list(r["response_ids"])}
            for r in load_teacher_data(path) if len(r["response_ids"]) > 1]


def make_accelerator(cfg: OnlineConfig):
    from accelerate import Accelerator

    if cfg.tracker == "wandb":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("tracker: wandb is not installed; pip install '.[track]' or set tracker: none")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              log_with=None if cfg.tracker == "none" else cfg.tracker)
    if accelerator.num_processes > 1:
        raise ConfigError(f"the online daemon tails one log as one process; launched with "
                          f"{accelerator.num_processes} (use --num_processes 1)")
    if cfg.tracker != "none":
        accelerator.init_trackers("specdistill-online", config=asdict(cfg))
    return accelerator


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(OnlineConfig, argv, description=__doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start_trimming(cfg.malloc_trim_seconds, log)
    accelerator = make_accelerator(cfg)
    OnlineDaemon(cfg, accelerator).run()
    end_run(accelerator)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:  # a bad config is the user's to fix: say what, without a traceback
        print(f"train/online.py: config error: {err}", file=sys.stderr)
        sys.exit(2)
