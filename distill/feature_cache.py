"""The target's hidden states for the teacher records, computed once and cached on disk (EAGLE-3's data).

For every record the cache keeps the window training reads (prompt + response, cut to max_seq_len as training
cuts it: distill.batching.fit_to_length) with the frozen target's states over the whole conversation, as decoding
reads them (a window cut from a long conversation still sees its start); the states are the ones the teacher's own
generation staged (distill.feature_capture) where it did, else the target runs here once over the records: by the
decoding engine's forward (`states`, decode.target_states.EngineStates, handed in by train/: the numbers decoding
computes, on a real target its K-quant kernels), or where none is given by transformers' model, in batches.
Per position:
    ids       [T] int64   the tokens
    features  [T, 3D]     bf16, the inputs of the drafter's three target layers (what decoding captures)
    final     [T, D]      bf16, the target's final normed state: its next-token distribution, via its head
    mask      [T] bool    positions whose next token is a response token (where the loss goes)

Layout: $SPECDISTILL_CACHE/features/<key>/ with shard-NNNNN.safetensors (SHARD_RECORDS records each) and
COMPLETE.json. The key is a sha256 over the target's fingerprint, the records' tokens, the layers, the
cut, the format and what computed the states (`states.name`: "engine", else "transformers"), so another target,
other data or other arithmetic never meets this cache. While being built it lives in
a `.partial` sibling: every shard file is written to a temporary name and renamed (a killed job keeps the
shards it finished and resumes after them), and only when all are there is the marker written and the
directory renamed into place. A directory without its marker, or with a missing shard, is never read.
The marker lists a key per record (`record_keys`) and one for what else decides the states (`head`: target,
layers, cut, format, arithmetic); a record that a complete cache beside this one with the same head holds is read
from there, not computed, and a shard whose records are all one such file's, in order, is that file hard-linked:
records appended to the teacher data, or reordered, leave the states made before as they were.
Reading is one shard at a time (`FeatureCache.shard`): memory holds a shard, not the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specdistill.distill.batching import batches_by_length, collate, fit_to_length
from specdistill.distill.feature_capture import FeatureStaging, check_layers
from specdistill.models.cache import MARKER, cache_root, publish_dir, write_marker

FORMAT_VERSION = 2  # 2: a cut record's states see the whole conversation (1: only its window)
SHARD_RECORDS = 64
STORE_DTYPE = torch.bfloat16
TRANSFORMERS_STATES = "transformers"  # the states' maker where no `states` is given: the model's own forward

# a record's (prompt, response) -> (features [T, len(layers) x D], final [T, D]) over both, with a `name` for the
# cache's key: decode.target_states.EngineStates
States = Callable[[Sequence[int], Sequence[int]], tuple[torch.Tensor, torch.Tensor]]


class FeatureCacheError(RuntimeError):
    """A feature cache that cannot be used: incomplete, or made for another target or data."""


@dataclass
class FeatureRecord:
    ids: torch.Tensor  # [T]
    features: torch.Tensor  # [T, 3D]
    final: torch.Tensor  # [T, D]
    mask: torch.Tensor  # [T] bool


def feature_cache_key(target_fingerprint: str, records: list[dict], layers: list[int], max_seq_len: int,
                      states_by: str = TRANSFORMERS_STATES) -> str:
    head = {"format_version": FORMAT_VERSION, "target": target_fingerprint, "layers": list(layers),
            "max_seq_len": max_seq_len, "dtype": str(STORE_DTYPE), "records": len(records), "states_by": states_by}
    return records_digest(head, records)


def head_key(target_fingerprint: str, layers: list[int], max_seq_len: int,
             states_by: str = TRANSFORMERS_STATES) -> str:
    """What decides a record's stored states besides the record: caches with equal heads can share records."""
    return feature_cache_key(target_fingerprint, [], layers, max_seq_len, states_by)


def record_key(record: dict) -> str:
    return records_digest({}, [record])


def records_digest(head: dict, records: list[dict]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(head, sort_keys=True).encode())
    for record in records:
        digest.update(repr((list(record["prompt_ids"]), list(record["response_ids"]))).encode())
    return digest.hexdigest()[:32]


def feature_cache_dir(key: str, root: str | Path | None = None) -> Path:
    return Path(root or cache_root()) / "features" / key


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def num_shards(n_records: int) -> int:
    return -(-n_records // SHARD_RECORDS)


def build_feature_cache(target, records: list[dict], layers: list[int], max_seq_len: int, batch_size: int,
                        pad_id: int, out_dir: Path, process_index: int = 0, num_processes: int = 1,
                        staging: FeatureStaging | None = None, states: States | None = None,
                        head: str | None = None) -> None:
    """Compute this process's shards (index % num_processes == process_index) into the `.partial`
    directory; the caller publishes it (`publish_feature_cache`) once every process is done. With `head`
    (head_key), records a complete cache beside out_dir with that head holds are taken from it (a whole file
    hard-linked); records the generator staged (`staging`) are read, not computed; the others by `states` where
    given (compute_shard)."""
    if (out_dir / MARKER).is_file():
        return
    partial = partial_dir(out_dir)
    partial.mkdir(parents=True, exist_ok=True)
    check_layers(target.model, layers)
    mine = [i for i in range(num_shards(len(records))) if i % num_processes == process_index]
    donors = records_beside(out_dir, head) if head is not None else RecordsBeside({}, {})
    for index in tqdm(mine, desc="target hidden states", disable=process_index != 0):
        if (partial / shard_name(index)).is_file():
            continue  # finished by an earlier, interrupted run of the same key
        shard = records[index * SHARD_RECORDS:(index + 1) * SHARD_RECORDS]
        whole = donors.whole_file(shard)
        if whole is not None:
            link_shard(whole, partial / shard_name(index))
            continue
        write_shard(partial / shard_name(index), compute_shard(target, shard, layers, max_seq_len, batch_size,
                                                               pad_id, staging, states, donors.read))


def publish_feature_cache(out_dir: Path, key: str, target_fingerprint: str, records: list[dict],
                          head: str | None = None) -> None:
    """Mark the finished `.partial` directory complete and rename it into place (main process)."""
    if (out_dir / MARKER).is_file():
        return
    partial = partial_dir(out_dir)
    n_records = len(records)
    missing = [shard_name(i) for i in range(num_shards(n_records)) if not (partial / shard_name(i)).is_file()]
    if missing:
        raise FeatureCacheError(f"{partial}: shards {missing[:3]}... were not written; not publishing")
    write_marker(partial, {"key": key, "target_fingerprint": target_fingerprint, "records": n_records,
                           "shards": num_shards(n_records), "format_version": FORMAT_VERSION, "head": head,
                           "record_keys": [record_key(r) for r in records]})
    publish_dir(partial, out_dir)


@dataclass
class RecordsBeside:
    """Where the complete caches beside a new one hold each record's states: {record key: (shard file, index in it)},
    and each file's record count."""
    where: dict[str, tuple[Path, int]]
    sizes: dict[Path, int]

    def whole_file(self, records: list[dict]) -> Path | None:
        """The file that holds exactly these records in this order, if one does."""
        places = [self.where.get(record_key(r)) for r in records]
        if not places or places[0] is None:
            return None
        file = places[0][0]
        return file if places == [(file, i) for i in range(len(records))] and self.sizes[file] == len(records) \
            else None

    def read(self, record: dict) -> FeatureRecord | None:
        place = self.where.get(record_key(record))
        if place is None:
            return None
        file, i = place
        with safe_open(str(file), framework="pt") as f:
            return FeatureRecord(*(f.get_tensor(f"{i}.{name}") for name in ("ids", "features", "final", "mask")))


def records_beside(out_dir: Path, head: str) -> RecordsBeside:
    """The records of the complete caches beside out_dir whose markers name the same head and list their records."""
    where: dict[str, tuple[Path, int]] = {}
    sizes: dict[Path, int] = {}
    for sibling in sorted(out_dir.parent.iterdir()) if out_dir.parent.is_dir() else []:
        if sibling == out_dir or not (sibling / MARKER).is_file():
            continue
        info = json.loads((sibling / MARKER).read_text())
        keys = info.get("record_keys") or []
        if info.get("head") != head or len(keys) != int(info.get("records", -1)):
            continue
        for start in range(0, len(keys), SHARD_RECORDS):
            file = sibling / shard_name(start // SHARD_RECORDS)
            if file.is_file():
                chunk = keys[start:start + SHARD_RECORDS]
                sizes[file] = len(chunk)
                where.update((key, (file, i)) for i, key in enumerate(chunk))
    return RecordsBeside(where, sizes)


def link_shard(source: Path, path: Path) -> None:
    """`source`'s shard file at `path`: a hard link where the file system makes one, else a copy; under a temporary
    name first, as a computed shard is written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, path)


def partial_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


@torch.no_grad()
def compute_shard(target, records: list[dict], layers: list[int], max_seq_len: int, batch_size: int,
                  pad_id: int, staging: FeatureStaging | None = None, states: States | None = None,
                  stored: Callable[[dict], FeatureRecord | None] | None = None) -> list[FeatureRecord]:
    """Each record's window with the target's states over its whole conversation: what `stored` (an earlier cache's
    window of the same record) or else `staging` has, the rest computed here: each by `states` where given, else by
    the model's decoder in batches of similar length."""
    out: list[FeatureRecord | None] = [None] * len(records)
    todo = []
    for index, record in enumerate(records):
        out[index] = stored(record) if stored is not None else None
        if out[index] is not None:
            continue
        staged = staging.get(record["prompt_ids"], record["response_ids"]) if staging is not None else None
        if staged is None:
            todo.append(index)
        else:
            out[index] = window_of(record, *staged, max_seq_len)
    if states is not None:
        for index in todo:
            record = records[index]
            out[index] = window_of(record, *states(record["prompt_ids"], record["response_ids"]), max_seq_len)
        return out
    decoder = target.model.get_decoder()
    for chunk in batches_by_length([records[i] for i in todo], batch_size):
        indices = [todo[j] for j in chunk]
        whole = max(len(records[i]["prompt_ids"]) + len(records[i]["response_ids"]) for i in indices)
        batch = collate([records[i] for i in indices], pad_id, whole).to(target.device)  # uncut, right-padded
        result = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        if getattr(result, "hidden_states", None) is None:
            raise ValueError(f"eagle3: the target's decoder ({type(decoder).__name__}) returned no hidden "
                             "states for output_hidden_states=True")
        features = torch.cat([result.hidden_states[i] for i in layers], dim=-1)  # [B, T, 3D]
        for row, (index, length) in enumerate(zip(indices, batch.attention_mask.sum(-1).tolist())):
            out[index] = window_of(records[index], features[row, :length], result.last_hidden_state[row, :length],
                                   max_seq_len)
    return out


def window_of(record: dict, features: torch.Tensor, final: torch.Tensor, max_seq_len: int) -> FeatureRecord:
    """The record's training window (fit_to_length's cut: the prompt's end and the response's start, one
    contiguous span) out of the states of its whole sequence, features [T, 3D] and final [T, D]."""
    prompt, response = list(record["prompt_ids"]), list(record["response_ids"])
    kept_prompt, kept_response = fit_to_length(prompt, response, max_seq_len)
    start, n = len(prompt) - len(kept_prompt), len(kept_prompt) + len(kept_response)
    window = collate([record], 0, max_seq_len)  # the ids and loss mask exactly as training cuts them
    return FeatureRecord(window.input_ids[0, :n], features[start:start + n].to("cpu", STORE_DTYPE),
                         final[start:start + n].to("cpu", STORE_DTYPE), window.loss_mask[0, :n])


def write_shard(path: Path, records: list[FeatureRecord]) -> None:
    tensors = {}
    for i, r in enumerate(records):
        tensors.update({f"{i}.ids": r.ids.contiguous(), f"{i}.features": r.features.contiguous(),
                        f"{i}.final": r.final.contiguous(), f"{i}.mask": r.mask.contiguous()})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"records": str(len(records))})
    os.replace(tmp, path)


class FeatureCache:
    """A complete feature cache, read one shard at a time."""

    def __init__(self, directory: Path, key: str, target_fingerprint: str):
        marker = directory / MARKER
        if not marker.is_file():
            raise FeatureCacheError(f"{directory} is not a complete feature cache (no {MARKER}); delete it to rebuild")
        info = json.loads(marker.read_text())
        if info.get("target_fingerprint") != target_fingerprint:
            raise FeatureCacheError(f"{directory} holds hidden states of another target (fingerprint "
                                    f"{info.get('target_fingerprint')}, this one {target_fingerprint})")
        if info.get("key") != key:
            raise FeatureCacheError(f"{directory} was made for other records or settings (key {info.get('key')})")
        self.directory, self.num_records, self.num_shards = directory, int(info["records"]), int(info["shards"])
        missing = [shard_name(i) for i in range(self.num_shards) if not (directory / shard_name(i)).is_file()]
        if missing:
            raise FeatureCacheError(f"{directory} is incomplete: {missing[:3]} missing; delete it to rebuild")

    def shard_size(self, index: int) -> int:
        return min(SHARD_RECORDS, self.num_records - index * SHARD_RECORDS)

    def response_counts(self, index: int) -> list[tuple[int, int]]:
        """Per record of shard `index`: (its window's length, its response positions), read without loading
        the states (what prices a training step before it runs: train.eagle3.BatchPlan.work)."""
        with safe_open(str(self.directory / shard_name(index)), framework="pt") as f:
            return [(f.get_slice(f"{i}.ids").get_shape()[0], int(f.get_tensor(f"{i}.mask").sum()))
                    for i in range(self.shard_size(index))]

    def shard(self, index: int) -> list[FeatureRecord]:
        tensors = load_file(str(self.directory / shard_name(index)))
        return [FeatureRecord(tensors[f"{i}.ids"], tensors[f"{i}.features"], tensors[f"{i}.final"],
                              tensors[f"{i}.mask"]) for i in range(self.shard_size(index))]


def open_or_build(target, records: list[dict], layers: list[int], max_seq_len: int, batch_size: int, pad_id: int,
                  accelerator=None, root: str | Path | None = None,
                  staging: FeatureStaging | None = None, states: States | None = None) -> FeatureCache:
    """The cache for these records, built first when absent (shards split across processes), from the states
    the generator staged where it did (their staged copies are removed once the cache is published), the others
    computed by `states` (else the model's own forward)."""
    states_by = TRANSFORMERS_STATES if states is None else states.name
    key = feature_cache_key(target.fingerprint, records, layers, max_seq_len, states_by)
    head = head_key(target.fingerprint, layers, max_seq_len, states_by)
    out_dir = feature_cache_dir(key, root)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    build_feature_cache(target, records, layers, max_seq_len, batch_size, pad_id, out_dir, rank, world, staging,
                        states, head)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    if rank == 0:
        publish_feature_cache(out_dir, key, target.fingerprint, records, head)
        if staging is not None:
            staging.discard(records)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return FeatureCache(out_dir, key, target.fingerprint)
