"""Batches put the loss exactly on response positions; a reduced vocabulary maps back exactly."""

from collections import Counter

import torch

from specdistill.distill.batching import batches_by_length, collate, fit_to_length, with_absent_column
from specdistill.distill.vocab import coverage, inverse_map, select_draft_vocab


def test_labels_sit_where_logits_predict_the_response():
    records = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}, {"prompt_ids": [1], "response_ids": [2, 3, 4]}]
    b = collate(records, pad_id=0, max_len=16)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]
    assert b.loss_mask.tolist() == [[False, False, True, True, False], [True, True, True, False, False]]
    # position t predicts input t + 1: the label at every masked position is the next input token
    nxt = torch.roll(b.input_ids, -1, dims=1)
    assert torch.equal(b.labels[b.loss_mask], nxt[b.loss_mask])
    assert b.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 1, 0]]


def test_long_sequences_keep_the_prompt_end_and_a_response_start():
    prompt, response = fit_to_length(list(range(10)), [100, 101, 102], max_len=6)
    assert prompt == [7, 8, 9] and response == [100, 101, 102]
    prompt, response = fit_to_length([1, 2], list(range(10)), max_len=4)
    assert prompt == [2] and response == [0, 1, 2]


def test_topk_aligned_with_labels():
    rec = {"prompt_ids": [1, 2], "response_ids": [3, 4],
           "topk_ids": [[3, 5], [4, 6]], "topk_logprobs": [[-0.1, -2.0], [-0.2, -3.0]]}
    b = collate([rec], pad_id=0, max_len=8)
    assert b.topk_ids[0, 1].tolist() == [3, 5] and b.topk_ids[0, 2].tolist() == [4, 6]
    assert torch.equal(b.topk_ids[b.loss_mask][:, 0], b.labels[b.loss_mask])


def test_reduced_vocab_maps_labels_and_drops_absent_ones():
    counts = Counter({7: 10, 3: 5, 9: 1, 11: 1})
    vmap = select_draft_vocab(counts, 3, target_vocab=20, always=[2])
    assert vmap.tolist() == [2, 3, 7]  # eos kept, then the most frequent, sorted
    inv = inverse_map(vmap, 20)
    assert inv[vmap].tolist() == [0, 1, 2] and int((inv >= 0).sum()) == 3
    assert coverage(counts, vmap) == 15 / 17
    rec = {"prompt_ids": [1], "response_ids": [7, 9, 3], "topk_ids": [[7, 9], [9, 7], [3, 7]],
           "topk_logprobs": [[-0.1, -3.0], [-0.5, -1.0], [-0.1, -3.0]]}
    b = collate([rec], pad_id=0, max_len=8, target_to_draft=inv)
    assert b.loss_mask[0].tolist() == [True, False, True, False]  # token 9 cannot be drafted
    assert b.labels[0, [0, 2]].tolist() == [2, 1]
    assert b.topk_ids[0, 0].tolist() == [2, 3]  # 9 -> the absent column, index n_draft = 3
    assert b.topk_logprobs[0, 0, 1] == float("-inf")
    assert with_absent_column(torch.zeros(1, 4, 3)).shape == (1, 4, 4)


def test_tokens_to_add_are_the_most_frequent_absent_ones_above_the_count_floor():
    from specdistill.distill.vocab import tokens_to_add

    counts = Counter({5: 9, 7: 4, 8: 4, 2: 50, 11: 2, 13: 6})
    vocab_map = torch.tensor([2, 5])
    assert tokens_to_add(counts, vocab_map, max_new=10, min_count=3).tolist() == [13, 7, 8]  # ties by id
    assert tokens_to_add(counts, vocab_map, max_new=2, min_count=3).tolist() == [13, 7]
    assert tokens_to_add(counts, vocab_map, max_new=10, min_count=7).tolist() == []


def test_batches_by_length_cover_every_record_once_shortest_first():
    lengths = [(5, 9), (1, 1), (30, 2), (4, 4), (2, 0), (7, 7), (3, 3)]
    records = [{"prompt_ids": [1] * p, "response_ids": [2] * r} for p, r in lengths]
    batches = batches_by_length(records, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(records)))
    totals = [sum(lengths[i]) for i in flat]
    assert totals == sorted(totals)
    assert batches_by_length([], 4) == []
