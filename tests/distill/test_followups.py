"""Second turns (distill.followups): which prompts get one and which request is a function of (seed, prompt id);
the conversation holds the target's own first answer without its EOS; the training job adds their answers
to the teacher data, each record's prompt holding the first answer's tokens."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from specdistill.distill.followups import FOLLOW_UPS, follow_up_prompts, load_follow_ups
from specdistill.distill.prompts import Prompt
from specdistill.train import distill_steps as steps
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from tests.distill.conftest import IM_END, make_tiny_target, make_tiny_tokenizer

TOKENIZER = make_tiny_tokenizer()
EOS = {TOKENIZER.eos_token_id, IM_END}


def word_ids(words: str) -> list[int]:
    return TOKENIZER(words, add_special_tokens=False)["input_ids"]


def prompts_and_records(n: int) -> tuple[list[Prompt], list[dict]]:
    prompts = [Prompt(id=f"p{i}", messages=[{"role": "user", "content": f"w{i % 50} w{(i + 1) % 50}"}])
               for i in range(n)]
    records = [{"prompt_id": p.id, "sample_idx": 0, "response_ids": word_ids(f"w{i % 40} w7") + [IM_END]}
               for i, p in enumerate(prompts)]
    return prompts, records


def by_id(prompts: list[Prompt]) -> dict[str, list[dict]]:
    return {p.id: p.messages for p in prompts}


def test_share_zero_gives_none_and_share_one_gives_every_answered_prompt_in_order():
    prompts, records = prompts_and_records(12)
    assert follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 0.0) == []
    second = follow_up_prompts(prompts, records[:-2], TOKENIZER, EOS, FOLLOW_UPS, 1.0)  # the last two: no answer
    assert [p.id.split(">")[0] for p in second] == [p.id for p in prompts[:-2]]
    for first, turn in zip(prompts, second):
        user1, answer, user2 = turn.messages
        assert user1 == first.messages[0]
        assert answer["role"] == "assistant" and user2["role"] == "user"
        assert user2["content"] in FOLLOW_UPS
        assert "<|im_end|>" not in answer["content"] and answer["content"].endswith("w7")  # EOS left out


def test_the_choice_depends_on_the_seed_and_prompt_id_only_and_a_larger_share_keeps_a_smaller_ones():
    prompts, records = prompts_and_records(400)
    quarter = follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 0.25, seed=1)
    shuffled = prompts[:]
    random.Random(0).shuffle(shuffled)
    assert by_id(follow_up_prompts(shuffled, records, TOKENIZER, EOS, FOLLOW_UPS, 0.25, seed=1)) == by_id(quarter)
    assert 60 <= len(quarter) <= 140
    half = by_id(follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 0.5, seed=1))
    assert set(by_id(quarter)) < set(half)
    other_seed = follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 0.25, seed=2)
    assert set(by_id(other_seed)) != set(by_id(quarter))
    requests = {p.messages[-1]["content"] for p in follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 1.0)}
    assert len(requests) > len(FOLLOW_UPS) // 2  # spread over the list


def test_sampled_answers_and_empty_answers_are_not_reworked():
    prompts, records = prompts_and_records(3)
    records[0] = {**records[0], "sample_idx": 1}  # p0 has only a sampled answer
    records[1] = {**records[1], "response_ids": [IM_END]}  # p1 answered nothing
    second = follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 1.0)
    assert [p.id.split(">")[0] for p in second] == ["p2"]


def test_bad_share_and_request_files_are_errors(tmp_path):
    prompts, records = prompts_and_records(2)
    with pytest.raises(ValueError, match="follow_up_share"):
        follow_up_prompts(prompts, records, TOKENIZER, EOS, FOLLOW_UPS, 1.5)
    file = tmp_path / "requests.txt"
    file.write_text("# mine\n\nShorter, please.\n  Now as a poem.  \n")
    assert load_follow_ups(file) == ["Shorter, please.", "Now as a poem."]
    file.write_text("# nothing but a comment\n\n")
    with pytest.raises(ValueError, match="no requests"):
        load_follow_ups(file)
    with pytest.raises(FileNotFoundError, match="follow_ups"):
        load_follow_ups(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="follow_up_share"):
        DistillConfig(follow_up_share=-0.1)
    with pytest.raises(ConfigError, match="follow_ups"):
        DistillConfig(follow_up_share=0.5, follow_ups=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="follow_ups"):
        DistillConfig(follow_ups=str(file.with_name("requests.txt")))  # a file without a share reads nothing


def test_the_training_job_adds_second_turns_whose_prompts_hold_the_first_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 3} w{i + 5}"}) + "\n" for i in range(10)))
    requests = tmp_path / "requests.txt"
    requests.write_text("w1 w2\nw3 w4\n")
    target = make_tiny_target()
    accelerator = SimpleNamespace(process_index=0, num_processes=1, wait_for_everyone=lambda: None)
    common = dict(prompts=[f"jsonl:{prompts_file}"], max_new_tokens=6, gen_batch_size=4, max_seq_len=48)
    plain = steps.teacher_records(DistillConfig(**common), target, accelerator)
    cfg = DistillConfig(**common, follow_up_share=1.0, follow_ups=str(requests))
    records = steps.teacher_records(cfg, target, accelerator)
    assert records[:len(plain)] == plain  # the first turns are the same cached rows
    second = records[len(plain):]
    answered = [r for r in plain if words_of(r["response_ids"], target)]
    assert len(second) == len(answered) > 0
    for first, turn in zip(answered, second):
        assert turn["prompt_id"].startswith(first["prompt_id"] + ">followup:")
        assert contains(turn["prompt_ids"], first["prompt_ids"][:-3])  # the first user turn, before its end
        assert contains(turn["prompt_ids"], words_of(first["response_ids"], target))
        assert turn["response_ids"]
    assert steps.teacher_records(cfg, target, accelerator) == records  # cached: the same rows again


def words_of(response: list[int], target) -> list[int]:
    """The answer as the conversation holds it: decoded without special tokens (EOS, BOS, padding)."""
    return [t for t in response if t not in target.tokenizer.all_special_ids]


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))
