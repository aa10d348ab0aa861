"""Collective boost-tuning (method `colbt`; SpecInfer, Miao et al. 2023): k drafters trained one after
another on the target's teacher data, drafter i weighted toward the positions that drafters 0..i-1 fail
to propose, saved together as one drafter directory of kind `ensemble`.

    train_colbt(cfg, accelerator, target, records, eval_prompts) -> the ensemble directory

Reads top to bottom: hold out some prompts' records for measuring coverage; for each member spec,
weight the training records by what the earlier members miss (distill.boosting), train it with the
weighted token-level CE, measure its coverage (teacher-forced, on the training records for the next
member's weights and on the held-out ones for the log), save it as `member-i/`; measure the members
and the merged ensemble with the engine on `eval_prompts`; publish the directory with its manifest.
With `colbt.strength: 0` every weight is 1 and each member trains exactly as it would alone: the
baseline that makes the effect of boosting measurable.

Config: the `colbt:` section (ColbtConfig), besides the Seq-KD ones of train.distill_config.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.metrics import aggregate_stats
from specdistill.decode.proposers import DraftModelProposer
from specdistill.decode.proposers.ensemble import EnsembleProposer
from specdistill.distill.boosting import (
    boost_weights,
    collate_weighted,
    coverage_report,
    teacher_forced_coverage,
    weighted_token_ce,
)
from specdistill.distill.generation import pad_token_id
from specdistill.distill.vocab import inverse_map
from specdistill.models.cache import make_temp_sibling, publish_dir
from specdistill.models.drafters import MANIFEST, build_manifest, save_drafter
from specdistill.train import distill_steps as steps
from specdistill.train.acceptance import measure_acceptance
from specdistill.train.checkpoints import TrainState
from specdistill.train.config import ConfigError, check_choice, option, to_dict
from specdistill.train.methods import Method, register_method

log = logging.getLogger("specdistill.colbt")

MEMBER_DIR = "member-{}"


@dataclass
class ColbtConfig:
    """Method colbt: collective boost-tuning of several drafters, saved as one ensemble."""

    members: list[str] = option(["truncated:2", "truncated:3", "small:layers=2,hidden=256"],
                                "the member drafters, trained in this order (specs as in `drafter`)")
    rule: str = option("top1", "a member covers a target token when it is its argmax (top1) or in its top-m (topm)")
    m: int = option(4, "m of the topm coverage rule")
    strength: float = option(1.0, "boosting strength; 0 trains every member independently (no boosting)")
    scheme: str = option("linear", "weight = 1 + strength * missed_by_all (linear) or exp(strength * misses) (exp)")
    holdout: int = option(8, "prompts whose teacher records are held out to measure coverage")
    max_tree_nodes: int = option(16, "cap on the merged token tree's nodes (root included) when the ensemble decodes")
    branches: int = option(1, "greedy decoding offers each member's top-b tokens at every depth of its chain; the "
                              "tree keeps the most probable up to max_tree_nodes (1: chains only)")

    def __post_init__(self):
        if not self.members:
            raise ConfigError("colbt.members: at least one member drafter spec is needed")
        check_choice("colbt.rule", self.rule, ("top1", "topm"))
        check_choice("colbt.scheme", self.scheme, ("linear", "exp"))
        if self.m < 1:
            raise ConfigError(f"colbt.m: must be >= 1, got {self.m}")
        if self.strength < 0:
            raise ConfigError(f"colbt.strength: must be >= 0, got {self.strength}")
        if self.holdout < 1:
            raise ConfigError(f"colbt.holdout: must be >= 1 (coverage is measured on held-out prompts), "
                              f"got {self.holdout}")
        if self.branches < 1:
            raise ConfigError(f"colbt.branches: must be >= 1 (1: each member's chain only), got {self.branches}")
        if self.max_tree_nodes < 2:
            raise ConfigError(f"colbt.max_tree_nodes: must be >= 2 (the root and one draft), got {self.max_tree_nodes}")


def check_job(cfg) -> None:
    """The common fields a colbt job needs as they are."""
    if cfg.loss != "ce":
        raise ConfigError(f"loss: colbt trains each member with weighted ce on the target's tokens, got {cfg.loss!r}")


def train_colbt(cfg, accelerator, target, records: list[dict], eval_prompts: list[list[int]] | None = None) -> Path:
    train_records, held_out = split_held_out(records, cfg.colbt.holdout, cfg.seed)
    log.info("colbt: %d members, %d training records, %d held-out records, rule %s, strength %g (%s)",
             len(cfg.colbt.members), len(train_records), len(held_out), cfg.colbt.rule, cfg.colbt.strength,
             cfg.colbt.scheme)
    out = Path(cfg.output_dir).expanduser().absolute()
    tmp = make_temp_sibling(out) if accelerator.is_main_process else None
    covered_train: list[list[list[bool]]] = []  # [member][record][position]
    covered_held: list[list[list[bool]]] = []
    members, summaries = [], []
    for i, spec in enumerate(cfg.colbt.members):
        member_cfg = member_config(cfg, spec)
        weighted = with_boost_weights(train_records, covered_train, cfg)
        model, vocab_map, losses = train_member(member_cfg, accelerator, target, weighted, name=f"member {i}")
        covered_held.append(coverage_of(cfg, model, vocab_map, held_out, target))
        if i + 1 < len(cfg.colbt.members) and cfg.colbt.strength > 0:
            covered_train.append(coverage_of(cfg, model, vocab_map, train_records, target))
        summaries.append(member_summary(i, spec, weighted, covered_held, losses))
        log_coverage(accelerator, summaries[-1])
        members.append((model, vocab_map))
        if accelerator.is_main_process:
            save_drafter(tmp / MEMBER_DIR.format(i), model, target, "draft_model", config=to_dict(member_cfg),
                         vocab_map=vocab_map, extra={"colbt": summaries[-1]})
        accelerator.wait_for_everyone()
    acceptance = measure_all(cfg, target, members, eval_prompts) if accelerator.is_main_process and eval_prompts else {}
    if accelerator.is_main_process:
        write_manifest(tmp, cfg, target, summaries, acceptance)
        publish_dir(tmp, out)
        log.info("ensemble of %d members written to %s", len(members), out)
    accelerator.wait_for_everyone()
    return out


# ---- configuration and data -----------------------------------------------------------------------

def member_config(cfg, spec: str):
    """The job's config with `drafter` set to this member (a copy: the caller's config is not changed)."""
    member = copy.copy(cfg)
    member.drafter = spec
    return member


def split_held_out(records: list[dict], n_prompts: int, seed: int,
                   key: str = "colbt.holdout") -> tuple[list[dict], list[dict]]:
    """(training, held-out) records; every record of a held-out prompt is held out (seeded choice).
    key: the config key that asked for n_prompts, named in the error when they leave none to train on."""
    prompt_of = [r.get("prompt_id", str(i)) for i, r in enumerate(records)]
    prompts = sorted(set(prompt_of))
    if n_prompts >= len(prompts):
        raise ValueError(f"{key}: {n_prompts} held-out prompts leave none of the {len(prompts)} to train on")
    held = set(random.Random(seed).sample(prompts, n_prompts))
    return ([r for r, p in zip(records, prompt_of) if p not in held],
            [r for r, p in zip(records, prompt_of) if p in held])


def with_boost_weights(records: list[dict], covered: list[list[list[bool]]], cfg) -> list[dict]:
    """Copies of the records with per-token "weights" from the earlier members' coverage (none: all 1)."""
    if not covered or cfg.colbt.strength == 0:
        return [dict(r, weights=None) for r in records]
    lengths = [len(row) for row in covered[0]]
    flat = torch.tensor([[hit for row in member for hit in row] for member in covered], dtype=torch.bool)  # [K, N]
    weights = boost_weights(flat, cfg.colbt.strength, cfg.colbt.scheme).tolist()  # [N], mean 1
    out, start = [], 0
    for record, n in zip(records, lengths):
        out.append(dict(record, weights=weights[start:start + n]))
        start += n
    return out


def coverage_of(cfg, model, vocab_map, records: list[dict], target) -> list[list[bool]]:
    return teacher_forced_coverage(model, records, cfg.colbt.rule, cfg.colbt.m, vocab_map, pad_id_of(target),
                                   cfg.max_seq_len, batch_size=cfg.batch_size)


def pad_id_of(target) -> int:
    return pad_token_id(target.tokenizer, target.eos_token_ids)


# ---- training one member ---------------------------------------------------------------------------

def train_member(cfg, accelerator, target, records: list[dict], name: str):
    """Build the member, train it with the weighted CE for the configured epochs/steps, return
    (plain model in eval mode, vocab_map, logged losses)."""
    model, vocab_map = steps.build_drafter(cfg, target, records)
    loader = make_weighted_loader(cfg, records, target, vocab_map)
    total = steps.total_steps(cfg, len(loader), accelerator.num_processes)
    optimizer, scheduler = steps.make_optimizer(cfg, model, total)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state, losses = TrainState(), []
    model.train()
    while state.step < total:
        for window in steps.accumulation_windows(steps.epoch_batches(accelerator, loader, state), cfg.grad_accum):
            loss = train_weighted_window(accelerator, model, window, optimizer, scheduler)
            state.step += 1
            if state.step % cfg.log_every == 0 or state.step == total:
                log.info("%s step %d/%d weighted loss %.4f", name, state.step, total, loss)
                losses.append({"step": state.step, "loss": loss})
            if state.step >= total:
                break
        state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    plain = steps.plain_model(accelerator.unwrap_model(model)).eval()
    accelerator.free_memory()  # drop accelerate's references before the next member
    return plain, vocab_map, losses


def make_weighted_loader(cfg, records: list[dict], target, vocab_map) -> DataLoader:
    """steps.make_loader's batches, each with its [B, T] boost weights."""
    v_target = target.model.get_output_embeddings().weight.shape[0]
    t2d = None if vocab_map is None else inverse_map(vocab_map, v_target)
    pad_id = pad_id_of(target)
    return DataLoader(records, batch_size=cfg.batch_size, shuffle=True, drop_last=False,
                      collate_fn=lambda rows: collate_weighted(rows, pad_id, cfg.max_seq_len, t2d))


def train_weighted_window(accelerator, drafter, window, optimizer, scheduler) -> float:
    """One optimizer step: sum(w * ce) over the window's response tokens / their number (all processes).
    The weights have mean 1 over the whole training set, so this has the scale of the plain CE."""
    local = torch.tensor(float(sum(int(b.loss_mask.sum()) for b, _ in window)), device=accelerator.device)
    global_tokens = accelerator.reduce(local, "sum").clamp_min(1.0)
    # DDP averages gradients over processes and accelerator.backward divides by grad_accum: undo both
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / global_tokens
    total = 0.0
    for batch, weights in window:
        with accelerator.accumulate(drafter):
            logits = drafter(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V_d]
            loss_sum = weighted_token_ce(logits, batch.labels, batch.loss_mask, weights)
            accelerator.backward(loss_sum * scale)
            total += float(loss_sum.detach())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return float(accelerator.reduce(torch.tensor(total, device=accelerator.device), "sum") / global_tokens)


# ---- measuring and saving --------------------------------------------------------------------------

def member_summary(i: int, spec: str, weighted: list[dict], covered_held, losses: list[dict]) -> dict:
    """What the manifest and the log say about member i: its training weights and held-out coverage."""
    flat = torch.tensor([[hit for row in member for hit in row] for member in covered_held], dtype=torch.bool)
    report = coverage_report(flat)  # [i+1, N_held]
    weights = [w for r in weighted if r["weights"] is not None for w in r["weights"]]
    return {"member": i, "spec": spec, "held_out_coverage": report["per_drafter"][-1],
            "cumulative_coverage": report["cumulative"][-1], "held_out_positions": report["positions"],
            "boosted_fraction": sum(w > 1.0 + 1e-6 for w in weights) / max(1, len(weights)) if weights else 0.0,
            "max_weight": max(weights, default=1.0), "losses": losses}


def log_coverage(accelerator, summary: dict) -> None:
    i = summary["member"]
    log.info("member %d (%s): held-out coverage %.3f, members 0..%d together %.3f (%d positions; "
             "%.1f%% of its training positions boosted, max weight %.2f)", i, summary["spec"],
             summary["held_out_coverage"], i, summary["cumulative_coverage"], summary["held_out_positions"],
             100 * summary["boosted_fraction"], summary["max_weight"])
    accelerator.log({f"colbt/coverage/member_{i}": summary["held_out_coverage"],
                     "colbt/cumulative_coverage": summary["cumulative_coverage"]}, step=i)


@torch.no_grad()
def measure_all(cfg, target, members, prompts: list[list[int]]) -> dict:
    """Greedy tau/alpha of each member alone and of the merged ensemble, at a fixed draft length."""
    result = {}
    for i, (model, vocab_map) in enumerate(members):
        result[MEMBER_DIR.format(i)] = brief(measure_acceptance(target, model, vocab_map, prompts,
                                                                cfg.eval_max_new_tokens, cfg.eval_gamma))
    v_target = target.model.get_output_embeddings().weight.shape[0]
    proposer = EnsembleProposer([DraftModelProposer(m, cfg.eval_gamma, vm, target.eos_token_ids, v_target)
                                 for m, vm in members], cfg.colbt.max_tree_nodes, cfg.colbt.branches)
    engine = SpeculativeEngine(target.model, proposer, target.eos_token_ids,
                               max_tree_nodes=max(64, cfg.colbt.max_tree_nodes), adaptive=False)
    result["ensemble"] = brief(aggregate_stats([engine.generate(p, cfg.eval_max_new_tokens).stats for p in prompts]))
    log.info("held-out tau: %s", ", ".join(f"{k} {v['tau']:.3f}" for k, v in result.items()))
    return result


def brief(stats: dict) -> dict:
    return {"tau": stats["tau"], "alpha": stats["alpha"], "new_tokens": stats["new_tokens"]}


def write_manifest(directory: Path, cfg, target, summaries: list[dict], acceptance: dict) -> None:
    """manifest.json of kind ensemble: the members (paths relative to the directory, in source order),
    the target, the resolved config, the tree cap, and the coverage/acceptance measured here."""
    manifest = build_manifest(target, "ensemble", to_dict(cfg), has_vocab_map=False, has_model=False,
                              extra={"coverage": [{k: v for k, v in s.items() if k != "losses"} for s in summaries],
                                     "held_out_tau": acceptance})
    manifest["members"] = [MEMBER_DIR.format(i) for i in range(len(summaries))]
    manifest["max_tree_nodes"] = cfg.colbt.max_tree_nodes
    manifest["branches"] = cfg.colbt.branches
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


register_method(Method("colbt", train_colbt, ColbtConfig, check=check_job))
