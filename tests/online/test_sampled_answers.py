"""`samples_per_request`: the daemon lets the target sample more answers to the training requests' prompts.
The samples are the target's own (their first token follows its tempered distribution), scored along
themselves exactly as logged outputs are, repeatable after a crash, persisted with their request, never
given to held-out requests, and never counted as requests."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from specdistill.distill.replay import Entry
from specdistill.distill.teacher_data import teacher_forced_topk
from specdistill.train.config import ConfigError
from specdistill.train.online import OnlineDaemon
from specdistill.train.online_learn import attach_samples, pick_variant, score_requests
from tests.online.support import make_target, prompt_for, served_record
from tests.online.test_online_daemon import config, drain, env, write_log  # noqa: F401 (env is a fixture)


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def entries(target):
    records = [served_record(target, f"r{i}", prompt_for(i), max_tokens=10) for i in range(6)]
    return score_requests(target, records, 8, pad_id=0)


def test_each_entry_gets_k_answers_within_its_limit_scored_along_themselves(target, entries):
    mine = copy.deepcopy(entries)
    made = attach_samples(target, mine, k=2, temperature=1.0, topk=8, pad_id=0, seed=3, batch_size=4)
    assert made == sum(len(s["response_ids"]) for e in mine for s in e.samples) > 0
    for entry in mine:
        assert entry.variants == 3
        for sample in entry.samples:
            answer = sample["response_ids"]
            assert 1 <= len(answer) <= entry.max_new_tokens
            assert all(t not in target.eos_token_ids for t in answer[:-1])  # an EOS only ends one
            ids, logprobs = teacher_forced_topk(target.model, [entry.prompt_ids], [answer], 8, 0)[0]
            assert sample["topk_ids"] == ids
            assert torch.allclose(torch.tensor(sample["topk_logprobs"]), torch.tensor(logprobs))


def test_sampling_repeats_under_the_same_seed_and_differs_under_another(target, entries):
    def answers(seed):
        mine = copy.deepcopy(entries)
        attach_samples(target, mine, k=2, temperature=1.0, topk=4, pad_id=0, seed=seed)
        return [s["response_ids"] for e in mine for s in e.samples]

    assert answers(7) == answers(7)
    assert answers(7) != answers(8)


def test_the_first_sampled_token_follows_the_targets_tempered_distribution(target):
    """600 one-token answers to one prompt at temperature 0.5: of the temperatures on a grid, 0.5 makes them
    the likeliest under softmax(logits / T) (a sampler at the wrong temperature, or greedy, would not)."""
    prompt = prompt_for(3)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt])).logits[0, -1].double()  # [V]
    entry = Entry("p", prompt, [1], [[1]], [[0.0]], max_new_tokens=1)
    attach_samples(target, [entry], k=600, temperature=0.5, topk=1, pad_id=0, seed=0)
    drawn = torch.tensor([s["response_ids"][0] for s in entry.samples])  # [600]
    grid = [0.25, 0.35, 0.5, 0.7, 1.0]
    loglik = {t: float(torch.log_softmax(logits / t, -1)[drawn].sum()) for t in grid}
    assert max(loglik, key=loglik.get) == 0.5, loglik


def test_a_variant_record_is_its_sample_and_draws_only_when_there_are_samples(entries):
    entry = copy.deepcopy(entries[0])
    rng = random.Random(0)
    state = rng.getstate()
    assert pick_variant(entry, rng) == 0 and rng.getstate() == state  # no samples: the rng is untouched
    entry.samples = [{"response_ids": [9, 10], "topk_ids": [[9], [10]], "topk_logprobs": [[-0.1], [-0.2]]}]
    assert entry.record(variant=1) == {"prompt_ids": entry.prompt_ids, "response_ids": [9, 10],
                                       "topk_ids": [[9], [10]], "topk_logprobs": [[-0.1], [-0.2]]}
    assert entry.record(variant=0)["response_ids"] == entry.response_ids
    assert {pick_variant(entry, rng) for _ in range(50)} == {0, 1}


def test_the_daemon_samples_for_training_requests_only_keeps_them_across_a_restart_and_counts_requests(
        env, tmp_path):  # noqa: F811
    write_log(tmp_path, env["records"][:15])
    cfg = config(env, tmp_path, samples_per_request=2, sample_temperature=1.0)
    daemon = OnlineDaemon(cfg)
    drain(daemon)
    buffer = daemon.state.buffer
    assert daemon.state.counters.ingested == 15 == len(buffer) + len(buffer.holdout)
    assert buffer.holdout and all(not e.samples for e in buffer.holdout)
    assert all(len(e.samples) == 2 for e in buffer.train.values())
    before = {i: e.samples for i, e in buffer.train.items()}
    daemon.update()  # trains on the samples too, and publishes or keeps: either way it runs to the end
    again = OnlineDaemon(cfg)
    assert {i: e.samples for i, e in again.state.buffer.train.items()} == before
    assert again.state.counters.ingested == 15


@pytest.mark.parametrize("field,value", [("samples_per_request", -1), ("sample_temperature", 0.0)])
def test_bad_sampling_settings_name_the_field(env, tmp_path, field, value):  # noqa: F811
    with pytest.raises(ConfigError, match=field):
        config(env, tmp_path, **{field: value})
