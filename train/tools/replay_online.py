"""Tune the online daemon offline: replay a served stream's request log through its update rule.

    specdistill replay-online --logs runs/online_demo_s13/logs --out runs/replay/base.json \
        [--drafter runs/smollm2_general/drafter] [--config configs/online/smollm2_gsm8k.yaml] \
        [--set lr=5e-4 rehearsal_data=DIR ...] [--steps 150 --every 50]

A demo run takes 90 minutes on 2 cores because serving and learning share them; this takes the requests
such a run logged (scored once by the target, as the daemon scores them), fills the daemon's replay buffer
with all of them at once, and runs `train.online_learn.train_candidate` under the config (plus `--set`
overrides) for `--steps` steps, printing every `--every` steps the drafter's agreement with the target
(first-position acceptance: its greedy token against the target's, teacher-forced) on

- the demo's held-out shifted-domain questions (the same ones specdistill online-demo measures), and
- MT-bench first turns (general prompts, the forgetting the demo's goal bounds),

both answered greedily by the target (cached as teacher data), and on the daemon's general guard. No
publishing, no gate: it shows what the updates can reach and what they cost, settings side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch

from specdistill.distill.generation import pad_token_id
from specdistill.distill.prompts import Prompt
from specdistill.distill.replay import Entry, ReplayBuffer, is_held_out
from specdistill.distill.teacher_data import (
    TeacherDataSettings,
    generate_teacher_data,
    load_teacher_data,
    teacher_data_dir,
    teacher_data_key,
)
from specdistill.distill.vocab import inverse_map
from specdistill.models.drafters import load_drafter
from specdistill.models.target import load_target
from specdistill.train.config import load_config
from specdistill.train.online import load_anchors, resolve_prompt_vocab
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_learn import acceptance, attach_samples, score_requests, train_candidate
from specdistill.train.tools.online_demo import SHARED, read_log, read_questions

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("specdistill.replay_online")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", required=True, help="a server's --log-dir (e.g. DEMO_OUT/logs)")
    p.add_argument("--out", required=True, help="JSON file of the agreement curve")
    p.add_argument("--drafter", default="runs/smollm2_general/drafter")
    p.add_argument("--target", default=None, help="default: the config's target")
    p.add_argument("--config", default=str(ROOT / "configs" / "online" / "smollm2_gsm8k.yaml"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="daemon config overrides")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--stream", default=str(SHARED / "gsm8k" / "train.jsonl"), help="the demo's --stream")
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--general", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--train-eval", type=int, default=0, metavar="N",
                   help="also measure agreement on N of the training requests themselves (fit against held-out: "
                        "whether the drafter is short of data or of capacity)")
    return p.parse_args(argv)


def daemon_config(args) -> OnlineConfig:
    argv = ["--config", args.config, "--log_dir", args.logs, "--store", "-", "--work_dir", "-"]
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        argv += [f"--{key}", *value.split(",")] if key == "rehearsal_data" else [f"--{key}", value]
    if args.target:
        argv += ["--target", args.target]
    return load_config(OnlineConfig, argv)


def target_answers(target, messages: list[list[dict]], max_tokens: int) -> list[Entry]:
    """The target's greedy answers as entries whose top-1 is the answer itself (cached teacher data)."""
    prompts = [Prompt(f"q{i}", m) for i, m in enumerate(messages)]
    settings = TeacherDataSettings(max_new_tokens=max_tokens, greedy=True, batch_size=8)
    out_dir = teacher_data_dir(teacher_data_key(target, prompts, settings))
    generate_teacher_data(target, prompts, settings, out_dir=out_dir)
    return [Entry(f"ref-{i}", list(r["prompt_ids"]), list(r["response_ids"]), [[t] for t in r["response_ids"]],
                  [[0.0] for _ in r["response_ids"]]) for i, r in enumerate(load_teacher_data(out_dir))
            if len(r["response_ids"]) > 1]


def agreement(model, vocab_map, sets: dict[str, list[Entry]], pad_id: int, cfg: OnlineConfig,
              prompt_vocab: bool = False) -> dict:
    return {name: acceptance(model, vocab_map, entries, pad_id, cfg.max_seq_len, cfg.gamma, prompt_vocab)["token_match"]
            for name, entries in sets.items() if entries}


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = daemon_config(args)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_target(cfg.target)
    pad_id = pad_token_id(target.tokenizer, target.eos_token_ids)
    records = read_log(Path(args.logs))
    if not records:
        raise SystemExit(f"{args.logs} holds no logged requests")
    buffer = ReplayBuffer(cfg.buffer_requests, cfg.holdout_window)
    for entry in score_requests(target, records, cfg.topk, pad_id, with_prompt=cfg.prompt_weight > 0):
        buffer.add(entry, is_held_out(entry.id, cfg.holdout_every))
    if cfg.samples_per_request:  # as the daemon's ingest does, for training requests only
        t0 = time.time()
        sampled = attach_samples(target, list(buffer.train.values()), cfg.samples_per_request, cfg.sample_temperature,
                                 cfg.topk, pad_id, cfg.seed)
        log.info("%d sampled answer tokens in %.0f s", sampled, time.time() - t0)
    from specdistill.decode.questions import load_questions

    general = [[{"role": "user", "content": q.turns[0]}]
               for q in load_questions(str(SHARED / "mt_bench" / "question.jsonl"))[:args.general]]
    heldout = [[{"role": "user", "content": q}] for q in read_questions(args.stream, 500, args.heldout)]
    anchors, guard = load_anchors(cfg)
    sets = {"heldout": target_answers(target, heldout, args.max_tokens),
            "mt_bench": target_answers(target, general, args.max_tokens), "guard": guard}
    if args.train_eval:  # the logged answers it trains on (greedy-served: the target's own greedy tokens)
        sets["train"] = sorted(buffer.train.values(), key=lambda e: e.id)[:args.train_eval]
    drafter = load_drafter(args.drafter, target)
    model, vocab_map = drafter.model.eval(), drafter.vocab_map
    prompt_vocab = resolve_prompt_vocab(cfg.prompt_vocab, drafter)  # as the daemon would train and judge
    index = None if vocab_map is None else inverse_map(vocab_map.cpu(), target.vocab_size)
    curve = [{"step": 0, **agreement(model, vocab_map, sets, pad_id, cfg, prompt_vocab)}]
    log.info("%d training requests, %d rehearsal rows; step 0: %s", len(buffer.train), len(anchors), curve[-1])
    cfg.steps_per_update = args.every
    rng = random.Random(cfg.seed)
    model.requires_grad_(True)
    for step in range(args.every, args.steps + 1, args.every):
        t0 = time.time()
        loss = train_candidate(model, index, buffer, anchors, cfg, pad_id, rng, prompt_vocab=prompt_vocab)
        curve.append({"step": step, "loss": loss, "seconds": time.time() - t0,
                      **agreement(model, vocab_map, sets, pad_id, cfg, prompt_vocab)})
        log.info("step %d: %s", step, curve[-1])
    result = {"settings": {"config": args.config, "set": args.set, "drafter": args.drafter, "logs": args.logs,
                           "prompt_vocab": prompt_vocab,
                           "training_requests": len(buffer.train), "rehearsal_rows": len(anchors)},
              "curve": curve}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    names = [n for n in ("heldout", "mt_bench", "guard", "train") if n in curve[0]]
    print("| step | " + " | ".join(names) + " |\n|---" * (len(names) + 1) + "|")
    for row in curve:
        print(f"| {row['step']} | " + " | ".join(f"{row[n]:.3f}" for n in names) + " |")
    return result


if __name__ == "__main__":
    main()
