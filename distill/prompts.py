"""Prompt sources -> conversations with stable ids, ready for the target to answer.

A source is named by a spec string:

    jsonl:PATH[?OPTIONS]          a .jsonl or .jsonl.gz file (a bare PATH ending in .jsonl(.gz) also works)
    hf:NAME[:SPLIT][?OPTIONS]     datasets.load_dataset(NAME, split=SPLIT), or load_from_disk for a saved
                                  dataset directory; SPLIT defaults to "train"
    self:N[?OPTIONS]              N user prompts sampled by the target from its own chat distribution

OPTIONS are `key=value` pairs joined by `&`: `field` (the record key holding the prompt), `skip` (leave
out the file's first N records: `skip=300&limit=8` is records 300.. of a file whose first 300 train) and
`limit`.
Without `field` the prompt is found by the formats of ../shared/data: MT-bench/Spec-Bench `turns`
(turn 1 only: turn 2 refers to the model's own answer), Arena-Hard `prompt`, GSM8K `question`,
Self-Instruct `instruction` (+ `instances[0].input`), HumanEval `prompt`, chat `messages`, plain `text`.

Ids are `<source>:<native id>` (question_id, uid, task_id, id) or `<source>:<sha1 of the text>` and do
not depend on `limit` or on the order of sources. Within a call, prompts are deduplicated by text, and
`exclude` drops prompts whose text (whitespace-normalized) is in the set: a drafter must never be trained
on the prompts it is evaluated on (see `exclusion_texts`).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import math
import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

import torch

from specdistill.distill.generation import generate_batch, pad_token_id
from specdistill.models.cache import cache_root

__all__ = [
    "Prompt", "PromptSpec", "parse_prompt_spec", "load_prompts", "load_prompt_sources", "exclusion_texts",
    "normalize_text", "record_to_messages", "sample_self_prompts",
]

log = logging.getLogger(__name__)

ID_FIELDS = ("question_id", "uid", "task_id", "id")
SPEC_OPTIONS = ("field", "skip", "limit", "batch")
SPEC_GRAMMAR = ("jsonl:PATH, hf:NAME[:SPLIT] or self:N, optionally followed by ?field=KEY&skip=N&limit=N "
                "(self:N also ?batch=N: prompts sampled per generate call, 16 by default; a GPU wants 256)")
SELF_PROMPT_BATCH = 16


@dataclass
class Prompt:
    id: str
    messages: list[dict]   # the conversation up to and including the user turn to answer

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


@dataclass
class PromptSpec:
    kind: str               # "jsonl" | "hf" | "self"
    location: str           # path, dataset name, or the count for "self"
    split: str | None = None
    options: dict = field(default_factory=dict)


# ---- specs --------------------------------------------------------------------------------------------

def parse_prompt_spec(spec: str) -> PromptSpec:
    """Split a spec string into its parts; a malformed spec is a ValueError that names it."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty prompt source spec {spec!r}; expected {SPEC_GRAMMAR}")
    body, options = split_options(spec)
    kind, sep, rest = body.partition(":")
    if not sep or kind not in ("jsonl", "hf", "self"):
        if body.endswith((".jsonl", ".jsonl.gz")):
            return PromptSpec("jsonl", body, options=options)
        raise ValueError(f"unknown prompt source spec {spec!r}; expected {SPEC_GRAMMAR}")
    if not rest:
        raise ValueError(f"prompt source spec {spec!r} names no {'path' if kind != 'self' else 'count'}")
    if kind == "self" and not (rest.isdigit() and int(rest) > 0):
        raise ValueError(f"prompt source spec {spec!r}: self:N needs a positive integer N")
    if kind == "hf":
        name, colon, split = rest.rpartition(":")
        if colon and name and "/" not in split:
            return PromptSpec("hf", name, split=split, options=options)
    return PromptSpec(kind, rest, options=options)


def split_options(spec: str) -> tuple[str, dict]:
    body, question, query = spec.partition("?")
    if not question:
        return spec, {}
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    unknown = set(options) - set(SPEC_OPTIONS)
    if unknown or not options:
        raise ValueError(f"prompt source spec {spec!r}: unknown option(s) {sorted(unknown) or query!r}; "
                         f"known: {SPEC_OPTIONS}")
    for name in ("skip", "limit"):
        if name in options:
            if not options[name].isdigit():
                raise ValueError(f"prompt source spec {spec!r}: {name} must be a non-negative integer")
            options[name] = int(options[name])
    if "skip" in options and body.startswith("self:"):
        raise ValueError(f"prompt source spec {spec!r}: skip is an option of files (jsonl:, hf:), not self:N")
    if "batch" in options:
        if not body.startswith("self:"):
            raise ValueError(f"prompt source spec {spec!r}: batch is an option of self:N only")
        if not (options["batch"].isdigit() and int(options["batch"]) > 0):
            raise ValueError(f"prompt source spec {spec!r}: batch must be a positive integer")
        options["batch"] = int(options["batch"])
    return body, options


# ---- loading ------------------------------------------------------------------------------------------

def load_prompt_sources(specs: Sequence[str] | str, *, target=None, limit: int | None = None,
                        exclude: Collection[str] = (), min_chars: int = 1, seed: int = 0) -> list[Prompt]:
    """Prompts of several sources in order, deduplicated by text across them; `limit` is per source."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    seen = {normalize_text(t) for t in exclude}
    prompts: list[Prompt] = []
    for spec in specs:
        batch = load_prompts(spec, target=target, limit=limit, exclude=seen, min_chars=min_chars, seed=seed)
        seen.update(normalize_text(p.text) for p in batch)
        prompts.extend(batch)
    return prompts


def load_prompts(spec: str, *, target=None, field: str | None = None, limit: int | None = None,
                 exclude: Collection[str] = (), min_chars: int = 1, seed: int = 0) -> list[Prompt]:
    """Prompts of one source spec. Options written in the spec override the keyword arguments.
    `target` (a models.target.Target) is needed only by `self:N`; `seed` only matters there."""
    parsed = parse_prompt_spec(spec)
    field = parsed.options.get("field", field)
    limit = parsed.options.get("limit", limit)
    excluded = {normalize_text(t) for t in exclude}
    if parsed.kind == "self":
        if target is None:
            raise ValueError(f"prompt source {spec!r} samples prompts from the target, but no target was given")
        return cached_self_prompts(target, int(parsed.location), seed=seed, exclude=excluded,
                                   min_chars=max(min_chars, 8),
                                   batch_size=parsed.options.get("batch", SELF_PROMPT_BATCH))[:limit]
    label, records = open_records(parsed, spec)
    records = itertools.islice(records, parsed.options.get("skip", 0), None)  # the file's first `skip` left out
    candidates = (record_to_prompt(r, i, label, field, spec) for i, r in records)
    return list(keep_prompts(candidates, excluded, min_chars, limit))


def keep_prompts(prompts: Iterable[Prompt], excluded: set[str], min_chars: int,
                 limit: int | None) -> Iterator[Prompt]:
    """Drop excluded, too short and repeated prompts; stop after `limit`."""
    seen: set[str] = set()
    kept = 0
    for prompt in prompts:
        if limit is not None and kept >= limit:
            return
        key = normalize_text(prompt.text)
        if len(key) < min_chars or key in excluded or key in seen:
            continue
        seen.add(key)
        kept += 1
        yield prompt


def open_records(parsed: PromptSpec, spec: str) -> tuple[str, Iterable[tuple[int, dict]]]:
    """(source label for ids, (index, record) pairs) of a jsonl or hf source."""
    if parsed.kind == "jsonl":
        path = Path(parsed.location).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path} (from spec {spec!r})")
        return jsonl_label(path), enumerate(read_jsonl(path))
    dataset = load_hf_dataset(parsed.location, parsed.split or "train", spec)
    label = parsed.location.rstrip("/").split("/")[-1] + (f":{parsed.split}" if parsed.split else "")
    return label, enumerate(dataset)


def jsonl_label(path: Path) -> str:
    stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return f"{path.parent.name}/{stem}" if path.parent.name else stem


def read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON line ({e})") from None


def load_hf_dataset(name: str, split: str, spec: str):
    import datasets

    path = Path(name).expanduser()
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"prompt source {spec!r}: no split {split!r} in {path} (has {list(loaded)})")
            loaded = loaded[split]
        return loaded
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ConnectionError)
        raise ValueError(f"prompt source {spec!r}: cannot load dataset {name!r} split {split!r}: {e}") from e


# ---- records -> prompts ------------------------------------------------------------------------------

def record_to_prompt(record: dict, index: int, label: str, field: str | None, spec: str) -> Prompt:
    messages = record_to_messages(record, field, where=f"{spec} record {index}")
    native = next((record[k] for k in ID_FIELDS if record.get(k) not in (None, "")), None)
    suffix = str(native) if native is not None else text_digest(messages[-1]["content"])
    return Prompt(id=f"{label}:{suffix}", messages=messages)


def record_to_messages(record: dict, field: str | None = None, where: str = "record") -> list[dict]:
    """The conversation to answer: [system?, user]. `field` names the key; otherwise known formats."""
    if field is not None:
        if field not in record:
            raise ValueError(f"{where}: no field {field!r} (keys: {sorted(record)})")
        return value_to_messages(record[field], where)
    for key in ("turns", "messages", "conversations"):
        if key in record:
            return value_to_messages(record[key], where)
    if "instruction" in record:
        return [user(instruction_text(record))]
    for key in ("prompt", "question", "text"):
        if key in record:
            return value_to_messages(record[key], where)
    raise ValueError(f"{where}: no prompt field found (keys: {sorted(record)}); name one with field=KEY")


def value_to_messages(value, where: str) -> list[dict]:
    """A string, a list of turns (first only), or chat messages (up to the first user turn)."""
    if isinstance(value, str):
        return [user(value)]
    if isinstance(value, list) and value and isinstance(value[0], str):
        return [user(value[0])]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return chat_to_messages(value, where)
    raise ValueError(f"{where}: cannot read a prompt from a {type(value).__name__} value {str(value)[:80]!r}")


def chat_to_messages(chat: list[dict], where: str) -> list[dict]:
    out = []
    for message in chat:
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        if role == "system":
            out.append({"role": "system", "content": content})
        elif role == "user":
            return out + [user(content)]
    raise ValueError(f"{where}: chat messages have no user turn")


def instruction_text(record: dict) -> str:
    """Self-Instruct `instruction` + `instances[0].input`; Alpaca's top-level `input` likewise."""
    extra = record.get("input") or ""
    instances = record.get("instances") or []
    if instances and isinstance(instances[0], dict):
        extra = instances[0].get("input") or extra
    return f"{record['instruction']}\n\n{extra}" if extra.strip() else record["instruction"]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def normalize_text(text: str) -> str:
    return " ".join(str(text).split())


def text_digest(text: str) -> str:
    return hashlib.sha1(normalize_text(text).encode("utf-8")).hexdigest()[:12]


def exclusion_texts(specs: Sequence[str] | str) -> set[str]:
    """Normalized texts of every user turn of every record of the sources (e.g. an evaluation question
    file: both MT-bench turns), for `exclude=`. A source's `limit=N` takes its first N records only (so
    `question_v0.1.jsonl?limit=3` excludes 3 questions, not the file), after its first `skip=N`."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    texts: set[str] = set()
    for spec in specs:
        parsed = parse_prompt_spec(spec)
        if parsed.kind == "self":
            raise ValueError(f"exclusion source {spec!r} must be a file or dataset, not self-prompts")
        records = (record for _, record in open_records(parsed, spec)[1])
        skip, limit = parsed.options.get("skip", 0), parsed.options.get("limit")
        for record in itertools.islice(records, skip, None if limit is None else skip + limit):
            turns = record.get("turns") if isinstance(record.get("turns"), list) else None
            if turns is not None:
                texts.update(normalize_text(t) for t in turns if isinstance(t, str))
            else:
                texts.add(normalize_text(record_to_messages(record, parsed.options.get("field"))[-1]["content"]))
    return texts


# ---- self-prompting ----------------------------------------------------------------------------------

SENTINEL = "PROMPTSENTINEL7"


def user_turn_prefix(tokenizer) -> tuple[list[int], set[int]]:
    """(token ids of the chat up to where a user's text starts, the end-of-user-turn token ids if any):
    render the template around a sentinel user message and cut at the sentinel."""
    text = tokenizer.apply_chat_template([user(SENTINEL)], tokenize=False, add_generation_prompt=False)
    start = text.find(SENTINEL)
    if start < 0:
        raise ValueError("the target's chat template does not echo the user's text; cannot self-prompt")
    prefix_ids = tokenizer(text[:start], add_special_tokens=False)["input_ids"]
    suffix_ids = tokenizer(text[start + len(SENTINEL):], add_special_tokens=False)["input_ids"]
    # the turn ends at the suffix's first token only if it is a special token (e.g. <|im_end|>), not "\n"
    special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(tokenizer.all_special_ids)
    end_ids = {suffix_ids[0]} if suffix_ids and suffix_ids[0] in special else set()
    return prefix_ids, end_ids


SELF_PROMPT_CACHE_VERSION = 1


def cached_self_prompts(target, n: int, *, seed: int, exclude: Collection[str], min_chars: int,
                        batch_size: int = SELF_PROMPT_BATCH) -> list[Prompt]:
    """sample_self_prompts, cached under $SPECDISTILL_CACHE/self_prompts/ by a key of the target's
    fingerprint, n, the seed, min_chars, the excluded texts and the batch size (it changes the samples; the
    default one stays out of the key, so caches written before it was an option keep theirs): self-prompting
    takes minutes of target generation, and every job over the same target and settings asks for the same prompts."""
    excluded = sorted({normalize_text(t) for t in exclude})
    parts = [SELF_PROMPT_CACHE_VERSION, target.fingerprint, n, seed, min_chars, excluded]
    if batch_size != SELF_PROMPT_BATCH:
        parts.append(batch_size)
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
    file = cache_root() / "self_prompts" / f"{key}.json"
    if file.exists():
        return [Prompt(id=row["id"], messages=row["messages"]) for row in json.loads(file.read_text())]
    prompts = sample_self_prompts(target, n, seed=seed, exclude=excluded, min_chars=min_chars, batch_size=batch_size)
    write_json_atomically(file, [{"id": p.id, "messages": p.messages} for p in prompts])
    return prompts


def write_json_atomically(file: Path, value) -> None:
    """A reader sees no file or the complete one (a temp sibling renamed into place)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, file)


def sample_self_prompts(target, n: int, *, seed: int = 0, temperature: float = 1.0, max_prompt_tokens: int = 128,
                        min_chars: int = 8, batch_size: int = SELF_PROMPT_BATCH, exclude: Collection[str] = (),
                        max_rounds: int | None = None) -> list[Prompt]:
    """n distinct user prompts sampled by the target after its own user-turn prefix, each a finished
    turn (stopped at end-of-turn, not cut by max_prompt_tokens), deduplicated, at least min_chars long."""
    tokenizer, model = target.tokenizer, target.model
    prefix_ids, end_ids = user_turn_prefix(tokenizer)
    stop_ids = end_ids | set(target.eos_token_ids)
    pad_id = pad_token_id(tokenizer, target.eos_token_ids)
    max_rounds = max_rounds or 4 * math.ceil(n / batch_size) + 2
    excluded = {normalize_text(t) for t in exclude}
    found: dict[str, Prompt] = {}
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for _ in range(max_rounds):
            rows = generate_batch(model, [prefix_ids] * batch_size, max_new_tokens=max_prompt_tokens,
                                  pad_id=pad_id, eos_token_ids=stop_ids, do_sample=True,
                                  temperature=temperature, top_p=1.0)
            for row in rows:
                if not row or row[-1] not in stop_ids:
                    continue            # ran out of tokens mid-prompt
                text = tokenizer.decode(row[:-1], skip_special_tokens=True).strip()
                key = normalize_text(text)
                if len(key) >= min_chars and key not in excluded and key not in found:
                    found[key] = Prompt(id=f"self:{text_digest(text)}", messages=[user(text)])
            if len(found) >= n:
                break
    if len(found) < n:
        log.warning("self-prompting found %d distinct prompts of %d asked for", len(found), n)
    return list(found.values())[:n]
