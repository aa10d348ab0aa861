"""Teacher data: the target answers the training prompts, and its answers (and top-k log-probs) are stored.

Layout of a teacher-data directory (default `<cache_root>/teacher/<key>`):

    settings.json                 the cache key and what it was computed from (target, settings, counts)
    shards/shard-00000/ ...       one `datasets` Arrow dataset per `shard_size` prompts, written atomically

Rows: prompt_id (str), sample_idx (int: 0 is the greedy answer when settings.greedy, then the samples),
prompt_ids (the chat-templated prompt, unpadded), response_ids (new tokens up to and including the first
EOS; no EOS when cut by max_new_tokens), and with settings.topk > 0 topk_ids / topk_logprobs [R][K]: at
response position j, the target's K most likely next tokens and their full-vocabulary log-softmax at
temperature 1, for the distribution that produced response_ids[j] (teacher-forced after generation).

Work splits across processes by shard: process i makes shards i, i+P, i+2P, ... Finished shards are never
redone, so an interrupted run resumes. Each shard's sampling is seeded from (seed, shard index), so the
result does not depend on the number of processes or on resuming.

Data grows without regenerating: settings.json names each shard by a key over what decides its rows (the target,
the settings, the shard's index and its prompts: `shard_keys`), and a shard another directory of the cache
(`teacher_data_dir`) already holds under the same key is copied, not generated. Prompts appended to a job's list
change its directory's key but not its earlier shards' keys: only the new prompts (and the last shard, if it was
short) are answered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdistill.distill.feature_capture import FeatureStaging
from specdistill.distill.generation import generate_batch, pad_token_id
from specdistill.distill.prompts import Prompt
from specdistill.distill.teacher_vllm import BACKENDS, VllmTeacher, sample_seed
from specdistill.models.cache import cache_root

__all__ = [
    "TeacherDataSettings", "generate_teacher_data", "load_teacher_data", "teacher_data_key", "teacher_data_dir",
    "generate_shard", "teacher_forced_topk", "default_cache_root",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
GREEDY_GENERATORS = ("generate", "engine")
# decode.batch_generation.generate_greedy_together's signature: (model, prompts, *, max_new_tokens, eos_token_ids,
# max_batch, staging) -> answers
GreedyAnswers = Callable[..., list[list[int]]]


@dataclass
class TeacherDataSettings:
    max_new_tokens: int = 256       # longest answer, in tokens
    greedy: bool = True             # store the target's greedy answer as sample_idx 0
    num_samples: int = 0            # sampled answers per prompt, in addition to the greedy one
    temperature: float = 1.0        # sampling temperature of those samples
    top_p: float = 1.0              # nucleus sampling of those samples (1.0 = off)
    topk: int = 0                   # store the target's top-k log-probs per response token (0 = off)
    batch_size: int = 8             # sequences per generate call (part of the key: it changes the samples)
    shard_size: int = 64            # prompts per shard, the unit of resuming and of splitting across processes
    seed: int = 0
    max_prompt_tokens: int | None = None   # skip prompts longer than this (None = keep all)
    backend: str = "builtin"        # who generates the answers: "builtin" (the target here) or "vllm" (teacher_vllm)
    # who writes the built-in backend's greedy answers: "generate" (transformers', distill.generation) or "engine"
    # (the decoding engine's batched loop, decode.batch_generation, handed to generate_teacher_data as greedy_answers)
    greedy_generator: str = "generate"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"teacher backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.greedy_generator not in GREEDY_GENERATORS:
            raise ValueError(f"greedy_generator {self.greedy_generator!r}: choose one of "
                             f"{', '.join(GREEDY_GENERATORS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and self.num_samples < 1:
            raise ValueError("teacher data needs greedy=True or num_samples >= 1")
        if self.num_samples < 0 or self.topk < 0:
            raise ValueError(f"num_samples and topk must be >= 0, got {self.num_samples}, {self.topk}")
        if self.num_samples and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.batch_size < 1 or self.shard_size < 1:
            raise ValueError(f"batch_size and shard_size must be >= 1, got {self.batch_size}, {self.shard_size}")

    @property
    def sample_indices(self) -> list[int]:
        first = 1 if self.greedy else 0
        return ([0] if self.greedy else []) + list(range(first, first + self.num_samples))


# ---- the entry points ---------------------------------------------------------------------------------

def generate_teacher_data(target, prompts: Sequence[Prompt], settings: TeacherDataSettings,
                          out_dir: str | Path | None = None, process_index: int = 0, num_processes: int = 1,
                          cache_root: str | Path | None = None, staging: FeatureStaging | None = None,
                          greedy_answers: GreedyAnswers | None = None) -> datasets.Dataset:
    """Make (or finish) the teacher data of `prompts`; return the rows of the shards this process owns,
    in order (all of them when num_processes == 1). With several processes, wait for all of them, then
    `load_teacher_data(out_dir)` gives the whole dataset. `target` is a models.target.Target.
    staging: the built-in generator also stages the hidden states of every row it generates here
    (distill.feature_capture; EAGLE-3's feature cache takes them instead of a second pass).
    greedy_answers: with settings.greedy_generator "engine", the engine's batched greedy decoding
    (decode.batch_generation.generate_greedy_together; train/ hands it in)."""
    if not prompts:
        raise ValueError("no prompts to make teacher data from")
    if settings.backend == "builtin" and settings.greedy_generator == "engine" and greedy_answers is None:
        raise ValueError("greedy_generator 'engine': pass greedy_answers (decode.batch_generation."
                         "generate_greedy_together)")
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} is not in [0, {num_processes})")
    key = teacher_data_key(target, prompts, settings)
    out = Path(out_dir) if out_dir is not None else teacher_data_dir(key, cache_root)
    keys = shard_keys(target, prompts, settings)
    write_settings_file(out, key, target, settings, len(prompts), keys)
    mine = list(range(process_index, len(keys), num_processes))
    todo = [k for k in mine if not shard_path(out, k).exists()]
    if len(todo) < len(mine):
        log.info("teacher data %s: %d of %d shards already done", out, len(mine) - len(todo), len(mine))
    if todo and out.parent == teacher_data_dir(key, cache_root).parent:  # a directory of its own shares nothing
        earlier = shards_beside(out)
        copied = [k for k in todo if keys[k] in earlier]
        for k in copied:
            copy_shard(earlier[keys[k]], out, k)
        if copied:
            log.info("teacher data %s: %d shards copied from earlier data with the same prompts and settings", out,
                     len(copied))
        todo = [k for k in todo if k not in copied]
    teacher = VllmTeacher(target) if settings.backend == "vllm" and todo else None
    if teacher is not None and staging is not None:
        log.info("teacher data %s: the vLLM backend gives no hidden states; the feature pass computes them", out)
    try:
        for shard in tqdm(todo, desc="teacher data", unit="shard", disable=process_index != 0):
            chunk = prompts[shard * settings.shard_size:(shard + 1) * settings.shard_size]
            write_shard(generate_shard(target, chunk, settings, shard, teacher, staging, greedy_answers), out, shard,
                        settings.topk > 0)
    finally:
        if teacher is not None:
            teacher.close()
    return concatenate_shards(out, mine)


def load_teacher_data(out_dir: str | Path) -> datasets.Dataset:
    """All shards of a finished teacher-data directory, in prompt order."""
    out = Path(out_dir)
    meta = read_settings_file(out)
    if meta is None:
        raise FileNotFoundError(f"no teacher data in {out} (settings.json missing)")
    missing = [k for k in range(meta["num_shards"]) if not shard_path(out, k).exists()]
    if missing:
        raise FileNotFoundError(f"teacher data in {out} is unfinished: shards {missing} missing")
    return concatenate_shards(out, range(meta["num_shards"]))


def teacher_data_key(target, prompts: Sequence[Prompt], settings: TeacherDataSettings) -> str:
    """sha256 over everything that decides the rows: the target (weights+vocab fingerprint, chat template,
    EOS ids), the prompts (ids and messages, in order) and the settings (the backend only when it is not the
    built-in one, so the built-in backend's caches keep their keys)."""
    return sha256_of(key_payload(target, prompts, settings))


def shard_keys(target, prompts: Sequence[Prompt], settings: TeacherDataSettings) -> list[str]:
    """Per shard, the sha256 of what decides its rows: teacher_data_key's payload with the shard's prompts for all of
    them, and the shard's index (its sampling seed). Equal keys, equal rows, whichever list the shard came from."""
    size = settings.shard_size
    return [sha256_of({**key_payload(target, prompts[start:start + size], settings), "shard": start // size})
            for start in range(0, len(prompts), size)]


def sha256_of(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def key_payload(target, prompts: Sequence[Prompt], settings: TeacherDataSettings) -> dict:
    recorded = asdict(settings)
    if settings.backend == "builtin":
        del recorded["backend"]
    if recorded["greedy_generator"] == "generate" or not settings.greedy:
        del recorded["greedy_generator"]  # caches of transformers' greedy answers keep their keys
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": target.fingerprint,
        "chat_template": getattr(target.tokenizer, "chat_template", None),
        "eos_token_ids": sorted(target.eos_token_ids),
        "prompts": [[p.id, p.messages] for p in prompts],
        "settings": recorded,
    }


def default_cache_root() -> Path:
    return cache_root()  # $SPECDISTILL_CACHE, or ~/.cache/specdistill


def teacher_data_dir(key: str, cache_root: str | Path | None = None) -> Path:
    return Path(cache_root or default_cache_root()) / "teacher" / key


# ---- one shard ----------------------------------------------------------------------------------------

def shard_seed(seed: int, shard: int) -> int:
    # a large odd multiplier so that (seed, shard) pairs do not collide the way seed + shard would
    return (seed * 1_000_003 + shard) % (2**63)


def generate_shard(target, prompts: Sequence[Prompt], settings: TeacherDataSettings, shard: int,
                   teacher: VllmTeacher | None = None, staging: FeatureStaging | None = None,
                   greedy_answers: GreedyAnswers | None = None) -> list[dict]:
    """Rows of one shard, sorted by (prompt order, sample_idx); deterministic under (settings.seed, shard).
    teacher: the vLLM worker of a `backend: vllm` job (started here for this shard when None).
    staging, greedy_answers: as generate_teacher_data's."""
    tokenizer, model = target.tokenizer, target.model
    eos_ids = set(target.eos_token_ids)
    pad_id = pad_token_id(tokenizer, eos_ids)
    encoded = [list(target.encode_chat(p.messages)) for p in prompts]
    keep = [i for i, ids in enumerate(encoded)
            if settings.max_prompt_tokens is None or len(ids) <= settings.max_prompt_tokens]
    if len(keep) < len(prompts):
        log.info("shard %d: skipped %d prompts longer than %d tokens", shard, len(prompts) - len(keep),
                 settings.max_prompt_tokens)
    jobs = [(i, s) for i in keep for s in settings.sample_indices]
    if settings.backend == "vllm":
        if teacher is None:
            with VllmTeacher(target) as own:
                responses = vllm_responses(own, encoded, jobs, settings, shard)
        else:
            responses = vllm_responses(teacher, encoded, jobs, settings, shard)
    else:
        responses = builtin_responses(model, encoded, jobs, settings, shard, pad_id, eos_ids, staging, greedy_answers)
    rows = [{"prompt_id": prompts[i].id, "sample_idx": s, "prompt_ids": encoded[i], "response_ids": responses[(i, s)]}
            for i, s in sorted(responses)]
    if settings.topk:
        add_topk(model, rows, settings.topk, settings.batch_size, pad_id)
    return rows


def builtin_responses(model, encoded: list[list[int]], jobs: list[tuple[int, int]], settings: TeacherDataSettings,
                      shard: int, pad_id: int, eos_ids: set[int],
                      staging: FeatureStaging | None = None,
                      greedy_answers: GreedyAnswers | None = None) -> dict[tuple[int, int], list[int]]:
    """{(prompt index, sample_idx): answer} from the target itself: with greedy_generator "engine" the greedy answers
    from `greedy_answers` (the engine's plain decodes, batch_size prompts side by side, no padding), the samples (and
    otherwise the greedy answers too) from transformers' generate (distill.generation)."""
    # longest prompts first so each batch pads little; a stable sort keeps the order deterministic
    jobs = sorted(jobs, key=lambda job: -len(encoded[job[0]]))
    responses: dict[tuple[int, int], list[int]] = {}
    greedy_jobs = [job for job in jobs if job[1] == 0 and settings.greedy]
    if greedy_jobs and settings.greedy_generator == "engine":
        outs = greedy_answers(model, [encoded[i] for i, _ in greedy_jobs], max_new_tokens=settings.max_new_tokens,
                              eos_token_ids=eos_ids, max_batch=settings.batch_size, staging=staging)
        responses.update(zip(greedy_jobs, outs))
        jobs = [job for job in jobs if job not in responses]
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(shard_seed(settings.seed, shard))
        for greedy in (True, False):
            batch_jobs = [job for job in jobs if (job[1] == 0 and settings.greedy) == greedy]
            for start in range(0, len(batch_jobs), settings.batch_size):
                batch = batch_jobs[start:start + settings.batch_size]
                outs = generate_batch(model, [encoded[i] for i, _ in batch], max_new_tokens=settings.max_new_tokens,
                                      pad_id=pad_id, eos_token_ids=eos_ids, do_sample=not greedy,
                                      temperature=settings.temperature, top_p=settings.top_p, staging=staging)
                responses.update(zip(batch, outs))
    return responses


def vllm_responses(teacher: VllmTeacher, encoded: list[list[int]], jobs: list[tuple[int, int]],
                   settings: TeacherDataSettings, shard: int) -> dict[tuple[int, int], list[int]]:
    """The same answers from vLLM (distill.teacher_vllm): the whole shard in one batched call."""
    base = shard_seed(settings.seed, shard)
    samples = [(s == 0 and settings.greedy, sample_seed(base, i, s)) for i, s in jobs]
    outs = teacher.responses([encoded[i] for i, _ in jobs], samples, settings.max_new_tokens, settings.temperature,
                             settings.top_p)
    return dict(zip(jobs, outs))


def add_topk(model, rows: list[dict], k: int, batch_size: int, pad_id: int) -> None:
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        topk = teacher_forced_topk(model, [r["prompt_ids"] for r in batch], [r["response_ids"] for r in batch],
                                   k, pad_id)
        for row, (ids, logprobs) in zip(batch, topk):
            row["topk_ids"], row["topk_logprobs"] = ids, logprobs


@torch.inference_mode()
def teacher_forced_topk(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], k: int,
                        pad_id: int) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Per row, ([R][K] ids, [R][K] log-probs) of the target's next-token distribution at each response
    position, from one left-padded forward over prompt + response[:-1] (the last token predicts nothing)."""
    device = next(model.parameters()).device
    seqs = [list(p) + list(r[:-1]) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(seqs):
        input_ids[row, width - len(seq):] = torch.tensor(seq)
        attention_mask[row, width - len(seq):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)           # left padding: count real tokens
    longest = max(len(r) for r in responses)
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                   position_ids=position_ids.to(device), logits_to_keep=longest).logits   # [B, R_max, V]
    values, ids = F.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)  # [B, R_max, K]
    out = []
    for row, response in enumerate(responses):
        n = len(response)           # this row's response positions are the last n of the window
        out.append((ids[row, longest - n:].tolist(), values[row, longest - n:].tolist()))
    return out


# ---- storage ------------------------------------------------------------------------------------------

def features(with_topk: bool) -> datasets.Features:
    columns = {
        "prompt_id": datasets.Value("string"),
        "sample_idx": datasets.Value("int32"),
        "prompt_ids": datasets.List(datasets.Value("int32")),
        "response_ids": datasets.List(datasets.Value("int32")),
    }
    if with_topk:
        columns["topk_ids"] = datasets.List(datasets.List(datasets.Value("int32")))
        columns["topk_logprobs"] = datasets.List(datasets.List(datasets.Value("float32")))
    return datasets.Features(columns)


def shard_path(out: Path, shard: int) -> Path:
    return out / "shards" / f"shard-{shard:05d}"


def write_shard(rows: list[dict], out: Path, shard: int, with_topk: bool) -> Path:
    """Save to a temporary directory, then rename: a shard directory exists only when complete."""
    final = shard_path(out, shard)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):    # left by an interrupted run of this shard
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    columns = {name: [row[name] for row in rows] for name in features(with_topk)}
    with quiet_datasets():
        datasets.Dataset.from_dict(columns, features=features(with_topk)).save_to_disk(str(tmp))
    os.rename(tmp, final)
    return final


@contextmanager
def quiet_datasets():
    """No per-shard "Saving the dataset" bars under our own shard progress bar."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def shards_beside(out: Path) -> dict[str, Path]:
    """{shard key: its directory} over the finished shards of the directories beside `out` (their settings.json list
    their shards' keys)."""
    found: dict[str, Path] = {}
    for sibling in sorted(out.parent.iterdir()) if out.parent.is_dir() else []:
        meta = read_settings_file(sibling) if sibling != out and sibling.is_dir() else None
        for k, key in enumerate((meta or {}).get("shard_keys") or []):
            if shard_path(sibling, k).is_dir():
                found.setdefault(key, shard_path(sibling, k))
    return found


def copy_shard(source: Path, out: Path, shard: int) -> None:
    """`source` (a finished shard directory) as shard `shard` of `out`: copied under a temporary name and renamed, as
    a written shard is."""
    final = shard_path(out, shard)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(source, tmp)
    os.rename(tmp, final)


def concatenate_shards(out: Path, shards) -> datasets.Dataset:
    with quiet_datasets():
        parts = [datasets.load_from_disk(str(shard_path(out, k))) for k in shards]
    if not parts:
        return datasets.Dataset.from_dict({name: [] for name in features(False)}, features=features(False))
    return datasets.concatenate_datasets(parts)


def read_settings_file(out: Path) -> dict | None:
    path = out / "settings.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_settings_file(out: Path, key: str, target, settings: TeacherDataSettings, num_prompts: int,
                        keys: list[str]) -> None:
    """Record what the directory holds, each shard's key with it (`keys`, shard_keys: what lets later data copy
    them); refuse a directory made for other prompts, settings or target."""
    existing = read_settings_file(out)
    if existing is not None:
        if existing.get("key") != key:
            raise ValueError(f"teacher data directory {out} was made with key {existing.get('key')} "
                             f"(other target, prompts or settings) but this run's key is {key}; "
                             "choose another out_dir or delete it")
        if existing.get("shard_keys") == keys:
            return
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": FORMAT_VERSION, "key": key, "target": {"name": getattr(target, "name", None),
            "fingerprint": target.fingerprint}, "settings": asdict(settings), "num_prompts": num_prompts,
            "num_shards": len(keys), "shard_keys": keys}
    tmp = out / f".settings-{uuid.uuid4().hex[:8]}.json"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, out / "settings.json")     # several processes may race here; they write the same

