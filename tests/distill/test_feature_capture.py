"""The teacher generation stages the target's hidden states (distill.feature_capture) and the feature cache reads
them instead of running the target again: the staged states are the teacher-forced ones, the tokens do not change,
a cut record's window sees its whole conversation, a file that does not fit is not used."""

from __future__ import annotations

import os

import pytest
import torch

from specdistill.distill.feature_cache import compute_shard, feature_cache_dir, feature_cache_key, open_or_build
from specdistill.distill.feature_capture import FeatureStaging, LayerCapture
from specdistill.distill.generation import generate_batch
from tests.train.support import peaked_tiny_target

VOCAB = 32
LAYERS = [0, 1, 1]
PAD = 0
BF16_TOLERANCE = 1e-2  # staged states are bf16: a relative rounding of at most 2^-8


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_target(VOCAB, seed=3)


def prompts_of_lengths(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(9, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def teacher_forced(target, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, 3D], final [T, D]) of one sequence alone, fp32."""
    with torch.no_grad():
        out = target.model.get_decoder()(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in LAYERS], dim=-1)[0], out.last_hidden_state[0]


def assert_close(staged: torch.Tensor, exact: torch.Tensor) -> None:
    assert staged.shape == exact.shape
    assert torch.allclose(staged.float(), exact, rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE * exact.abs().max())


def staged_records(target, prompts, tmp_path, max_new_tokens=12):
    staging = FeatureStaging(target.fingerprint, LAYERS, tmp_path)
    responses = generate_batch(target.model, prompts, max_new_tokens=max_new_tokens, pad_id=PAD,
                               eos_token_ids=target.eos_token_ids, staging=staging)
    return staging, [{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, responses)]


def count_decoder_rows(target, monkeypatch) -> list[int]:
    """The rows of each forward of the target's decoder from now on (the records whose states are computed)."""
    computed: list[int] = []
    decoder = target.model.get_decoder()
    real_forward = decoder.forward

    def counting(*args, **kwargs):
        computed.append(kwargs["input_ids"].shape[0])
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", counting)
    return computed


def test_staged_states_are_the_teacher_forced_ones_at_every_position_and_the_tokens_do_not_change(target, tmp_path):
    prompts = prompts_of_lengths([3, 7, 5, 9])  # left padding of 6, 2, 4 and 0 columns
    plain = generate_batch(target.model, prompts, max_new_tokens=12, pad_id=PAD, eos_token_ids=target.eos_token_ids)
    staging, records = staged_records(target, prompts, tmp_path)
    assert [r["response_ids"] for r in records] == plain
    for record in records:
        sequence = record["prompt_ids"] + record["response_ids"]
        features, final = staging.get(record["prompt_ids"], record["response_ids"])
        exact_features, exact_final = teacher_forced(target, sequence)
        assert_close(features, exact_features)  # the last token's row included (feed_last_tokens)
        assert_close(final, exact_final)


def test_an_answer_ended_by_eos_before_the_others_is_staged_up_to_its_eos(target, tmp_path):
    prompts = prompts_of_lengths([4, 6, 5, 8], seed=1)
    plain = generate_batch(target.model, prompts, max_new_tokens=16, pad_id=PAD, eos_token_ids=target.eos_token_ids)
    eos = next((row[-1] for row in plain if len(row) > 2), None)
    assert eos is not None
    target.eos_token_ids.add(eos)  # one of the greedy tokens ends answers now: some stop early, some run on
    try:
        staging, records = staged_records(target, prompts, tmp_path, max_new_tokens=16)
    finally:
        target.eos_token_ids.discard(eos)
    lengths = {len(r["response_ids"]) for r in records}
    assert len(lengths) > 1
    for record in records:
        features, final = staging.get(record["prompt_ids"], record["response_ids"])
        exact_features, exact_final = teacher_forced(target, record["prompt_ids"] + record["response_ids"])
        assert_close(features, exact_features)
        assert_close(final, exact_final)


def test_the_cache_reads_staged_records_and_computes_only_the_rest(target, tmp_path, monkeypatch):
    prompts = prompts_of_lengths([4, 6, 5, 8, 3, 7])
    staging, records = staged_records(target, prompts, tmp_path)
    staging.discard(records[:3])  # the first three were never staged
    computed = count_decoder_rows(target, monkeypatch)
    mixed = compute_shard(target, records, LAYERS, 64, 4, PAD, staging)
    assert sum(computed) == 3
    monkeypatch.undo()
    fresh = compute_shard(target, records, LAYERS, 64, 4, PAD)
    for a, b in zip(mixed, fresh):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
        assert_close(a.features, b.features.float())
        assert_close(a.final, b.final.float())


def test_a_cut_records_window_sees_its_whole_conversation(target, tmp_path):
    prompts = prompts_of_lengths([20])
    staging, records = staged_records(target, prompts, tmp_path, max_new_tokens=12)
    record, max_seq_len = records[0], 16  # 20 + 12 tokens: the window keeps the prompt's last 4 and the response
    whole_features, whole_final = teacher_forced(target, record["prompt_ids"] + record["response_ids"])
    start = len(record["prompt_ids"]) - (max_seq_len - len(record["response_ids"]))
    for staged in (staging, None):
        [window] = compute_shard(target, records, LAYERS, max_seq_len, 4, PAD, staged)
        assert window.ids.tolist() == (record["prompt_ids"] + record["response_ids"])[start:]
        assert_close(window.features, whole_features[start:])
        assert_close(window.final, whole_final[start:])
        assert window.mask.sum() == len(record["response_ids"])
    alone, _ = teacher_forced(target, window.ids.tolist())
    assert not torch.allclose(window.features.float(), alone, atol=1e-2)  # not the window run on its own


def test_a_staged_file_that_does_not_fit_its_record_is_not_used(target, tmp_path):
    staging = FeatureStaging(target.fingerprint, LAYERS, tmp_path)
    d = target.model.config.hidden_size
    staging.put([10, 11], [12], torch.zeros(3, 3 * d), torch.zeros(3, d))
    assert staging.get([10, 11], [12]) is not None
    staging.path([10, 11], [12]).rename(staging.path([10, 11], [12, 13]))  # a file under another record's name
    assert staging.get([10, 11], [12, 13]) is None
    staging.path([10, 11], [12, 13]).write_bytes(b"half a file")
    assert staging.get([10, 11], [12, 13]) is None
    with pytest.raises(ValueError, match="staging 3 positions"):
        staging.put([10, 11], [12], torch.zeros(2, 3 * d), torch.zeros(2, d))


def test_staged_copies_are_removed_once_the_cache_is_published(target, tmp_path):
    prompts = prompts_of_lengths([4, 6, 5])
    staging, records = staged_records(target, prompts, tmp_path)
    assert all(staging.path(r["prompt_ids"], r["response_ids"]).is_file() for r in records)
    cache = open_or_build(target, records, LAYERS, 64, 4, PAD, root=tmp_path, staging=staging)
    assert cache.num_records == 3
    assert feature_cache_dir(feature_cache_key(target.fingerprint, records, LAYERS, 64), tmp_path).is_dir()
    assert not any(staging.path(r["prompt_ids"], r["response_ids"]).exists() for r in records)


def test_a_layer_out_of_range_names_the_field(target):
    with pytest.raises(ValueError, match="eagle3_layers"):
        LayerCapture(target.model, [0, 5])


def test_records_appended_or_reordered_take_the_states_an_earlier_cache_holds(target, tmp_path, monkeypatch):
    import shutil

    import specdistill.distill.feature_cache as feature_cache
    monkeypatch.setattr(feature_cache, "SHARD_RECORDS", 2)
    prompts = prompts_of_lengths([4, 6, 5, 8, 3, 7, 5, 6, 4])
    _, records = staged_records(target, prompts, tmp_path / "staged")
    first = open_or_build(target, records[:6], LAYERS, 64, 4, PAD, root=tmp_path / "cache")
    computed = count_decoder_rows(target, monkeypatch)
    appended = open_or_build(target, records, LAYERS, 64, 4, PAD, root=tmp_path / "cache")
    assert sum(computed) == 3  # the three appended records; the six before them are the first cache's files
    assert all(os.path.samefile(appended.directory / feature_cache.shard_name(i), first.directory /
                                feature_cache.shard_name(i)) for i in range(3))
    computed.clear()
    reordered = records[6:] + records[:6]  # no shard as before: each record's states read from the first cache
    grown = open_or_build(target, reordered, LAYERS, 64, 4, PAD, root=tmp_path / "cache")
    assert sum(computed) == 0
    shutil.rmtree(first.directory)
    shutil.rmtree(appended.directory)
    fresh = open_or_build(target, reordered, LAYERS, 64, 4, PAD, root=tmp_path / "fresh")
    assert sum(computed) == 9
    for index in range(fresh.num_shards):
        for a, b in zip(grown.shard(index), fresh.shard(index), strict=True):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
            # the same record's states, computed in another batch: torch's fp32 GEMMs may round a batch of other
            # shapes differently (on a Zen 4, 1 of 608 final values one bf16 step apart), another record's never
            torch.testing.assert_close(a.features, b.features)  # bf16 tolerances: about one bf16 step
            torch.testing.assert_close(a.final, b.final)


def test_states_of_another_head_are_not_taken(target, tmp_path, monkeypatch):
    prompts = prompts_of_lengths([4, 6, 5])
    _, records = staged_records(target, prompts, tmp_path / "staged")
    open_or_build(target, records, LAYERS, 64, 4, PAD, root=tmp_path / "cache")
    computed = count_decoder_rows(target, monkeypatch)
    open_or_build(target, records, LAYERS, 48, 4, PAD, root=tmp_path / "cache")  # another cut: another head
    assert sum(computed) == 3
