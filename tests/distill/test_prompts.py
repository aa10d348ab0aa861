"""Prompt sources: the ../shared/data formats, spec grammar, exclusion, datasets, self-prompting."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest

import specdistill.distill.prompts as prompts_module
from specdistill.distill.prompts import (
    exclusion_texts,
    load_prompt_sources,
    load_prompts,
    normalize_text,
    parse_prompt_spec,
    sample_self_prompts,
)
from tests.conftest import SHARED_DATA

needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is absent")


def first_records(path, n):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


# ---- the shared data formats ----------------------------------------------------------------------

@needs_shared
def test_mt_bench_takes_turn_one_with_question_ids():
    path = SHARED_DATA / "mt_bench" / "question.jsonl"
    prompts = load_prompts(f"jsonl:{path}")
    records = first_records(path, 80)
    assert len(prompts) == 80
    assert prompts[0].id == f"mt_bench/question:{records[0]['question_id']}"
    assert prompts[0].messages == [{"role": "user", "content": records[0]["turns"][0]}]


@needs_shared
@pytest.mark.parametrize("name", ["question_v0.1.jsonl", "question_v2.0.jsonl"])
def test_arena_hard_prompt_and_uid(name):
    path = SHARED_DATA / "arena_hard" / name
    record = first_records(path, 1)[0]
    prompts = load_prompts(str(path), limit=4)          # a bare .jsonl path is a jsonl spec
    assert len(prompts) == 4
    assert prompts[0].id.endswith(f":{record['uid']}") and prompts[0].text == record["prompt"]


@needs_shared
def test_gsm8k_questions_have_stable_content_ids():
    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    few, more = load_prompts(f"jsonl:{path}?limit=3"), load_prompts(f"jsonl:{path}", limit=10)
    assert [p.text for p in few] == [r["question"] for r in first_records(path, 3)]
    assert [p.id for p in few] == [p.id for p in more[:3]]
    assert len({p.id for p in more}) == 10


@needs_shared
def test_skip_leaves_out_the_files_first_records_and_keeps_their_ids():
    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    whole = load_prompts(f"jsonl:{path}?limit=10")
    later = load_prompts(f"jsonl:{path}?skip=4&limit=3")
    assert [(p.id, p.text) for p in later] == [(p.id, p.text) for p in whole[4:7]]
    assert exclusion_texts(f"jsonl:{path}?skip=4&limit=3") == {normalize_text(p.text) for p in whole[4:7]}


@needs_shared
def test_self_instruct_appends_the_instance_input():
    path = SHARED_DATA / "self_instruct" / "seed_tasks.jsonl"
    records = first_records(path, 175)
    prompts = {p.id: p for p in load_prompts(f"jsonl:{path}")}
    with_input = next(r for r in records if r["instances"][0]["input"].strip())
    without = next(r for r in records if not r["instances"][0]["input"].strip())
    assert prompts[f"self_instruct/seed_tasks:{with_input['id']}"].text == \
        f"{with_input['instruction']}\n\n{with_input['instances'][0]['input']}"
    assert prompts[f"self_instruct/seed_tasks:{without['id']}"].text == without["instruction"]


@needs_shared
def test_humaneval_gzip_prompt_and_task_id():
    path = SHARED_DATA / "humaneval" / "HumanEval.jsonl.gz"
    prompts = load_prompts(f"jsonl:{path}")
    record = first_records(path, 1)[0]
    assert len(prompts) == 164
    assert prompts[0].id == f"humaneval/HumanEval:{record['task_id']}" and prompts[0].text == record["prompt"]


@needs_shared
def test_evaluation_prompts_are_excluded_from_training():
    mt_bench = f"jsonl:{SHARED_DATA / 'mt_bench' / 'question.jsonl'}"
    excluded = exclusion_texts(mt_bench)
    assert len(excluded) == 160                          # both turns of 80 questions
    assert load_prompts(mt_bench, exclude=excluded) == []


@needs_shared
def test_an_exclusion_limit_excludes_only_the_first_records():
    arena = SHARED_DATA / "arena_hard" / "question_v0.1.jsonl"
    first3 = load_prompts(f"jsonl:{arena}?limit=3")
    excluded = exclusion_texts(f"jsonl:{arena}?limit=3")
    assert excluded == {normalize_text(p.text) for p in first3}
    kept = load_prompts(f"jsonl:{arena}", exclude=excluded)
    assert len(kept) == len(load_prompts(f"jsonl:{arena}")) - 3 and kept[0].id == load_prompts(f"jsonl:{arena}")[3].id


# ---- spec grammar ---------------------------------------------------------------------------------

def test_spec_grammar():
    assert parse_prompt_spec("hf:org/name:test").split == "test"
    assert parse_prompt_spec("hf:org/name").split is None
    assert parse_prompt_spec("hf:/data/my_set").location == "/data/my_set"
    assert parse_prompt_spec("self:12?limit=5").options == {"limit": 5}
    assert parse_prompt_spec("self:12?batch=256").options == {"batch": 256}
    assert parse_prompt_spec("jsonl:a.jsonl?field=q").options == {"field": "q"}
    for bad in ["", "csv:a.csv", "prompts.txt", "self:many", "self:0", "jsonl:", "jsonl:a.jsonl?color=red",
                "jsonl:a.jsonl?limit=x", "self:4?batch=0", "self:4?batch=x", "jsonl:a.jsonl?batch=8",
                "jsonl:a.jsonl?skip=-1", "self:4?skip=2"]:
        with pytest.raises(ValueError) as err:
            parse_prompt_spec(bad)
        assert repr(bad) in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(f"jsonl:{tmp_path / 'nope.jsonl'}")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_field_option_chat_messages_dedupe_and_exclude(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"q": "alpha question", "text": "ignored"},
        {"q": "  alpha   question "},                       # the same text after whitespace normalization
        {"q": "beta question", "id": 7},
        {"q": ""},                                          # empty: dropped
        {"q": "gamma question"},
    ])
    prompts = load_prompts(f"jsonl:{path}?field=q", exclude={"gamma  question"})
    assert [p.text for p in prompts] == ["alpha question", "beta question"]
    assert prompts[1].id == f"{tmp_path.name}/mixed:7"     # <folder>/<file stem>:<native id>
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]}])
    assert load_prompts(str(chat))[0].messages == [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no prompt field"):
        load_prompts(str(write_jsonl(tmp_path / "odd.jsonl", [{"foo": "bar"}])))


def test_sources_combine_in_order_without_repeats(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "two"}, {"prompt": "three"}])
    assert [p.text for p in load_prompt_sources([f"jsonl:{a}", f"jsonl:{b}"])] == ["one", "two", "three"]


def test_hf_dataset_saved_to_disk_with_field_and_split(tmp_path):
    data = datasets.Dataset.from_dict({"instruction_text": ["first task", "second task"], "id": ["a", "b"]})
    data.save_to_disk(str(tmp_path / "single"))
    prompts = load_prompts(f"hf:{tmp_path / 'single'}", field="instruction_text")
    assert [(p.id, p.text) for p in prompts] == [("single:a", "first task"), ("single:b", "second task")]
    datasets.DatasetDict({"test": data}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_prompts(f"hf:{tmp_path / 'dict'}:test?field=instruction_text")) == 2
    with pytest.raises(ValueError, match="no split 'train'"):
        load_prompts(f"hf:{tmp_path / 'dict'}?field=instruction_text")


# ---- self-prompting -------------------------------------------------------------------------------

def test_self_prompts_are_distinct_finished_user_turns_and_seeded(tiny_chat_target):
    first = sample_self_prompts(tiny_chat_target, 6, seed=3, min_chars=2, max_prompt_tokens=16)
    again = sample_self_prompts(tiny_chat_target, 6, seed=3, min_chars=2, max_prompt_tokens=16)
    other = sample_self_prompts(tiny_chat_target, 6, seed=4, min_chars=2, max_prompt_tokens=16)
    assert len(first) == 6 and first == again and first != other
    texts = [p.text for p in first]
    assert len(set(texts)) == 6 and all(len(t) >= 2 for t in texts)
    assert not any("<|im_end|>" in t or "<|im_start|>" in t for t in texts)
    assert all(p.id.startswith("self:") and p.messages == [{"role": "user", "content": p.text}] for p in first)
    kept = sample_self_prompts(tiny_chat_target, 6, seed=3, min_chars=2, max_prompt_tokens=16, exclude={texts[0]})
    assert texts[0] not in {normalize_text(p.text) for p in kept}


def test_self_prompts_are_cached_by_target_and_settings(tiny_chat_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path))
    first = load_prompts("self:4", target=tiny_chat_target, seed=1, min_chars=2)
    assert len(list((tmp_path / "self_prompts").glob("*.json"))) == 1

    def no_generation(*args, **kwargs):
        raise AssertionError("self-prompts were generated again instead of read from the cache")

    monkeypatch.setattr(prompts_module, "sample_self_prompts", no_generation)
    assert load_prompts("self:4", target=tiny_chat_target, seed=1, min_chars=2) == first
    with pytest.raises(AssertionError, match="generated again"):  # another seed is another key
        load_prompts("self:4", target=tiny_chat_target, seed=2, min_chars=2)
    with pytest.raises(AssertionError, match="generated again"):  # so is another exclusion set
        load_prompts("self:4", target=tiny_chat_target, seed=1, min_chars=2, exclude={"some question"})
    assert load_prompts("self:4?batch=16", target=tiny_chat_target, seed=1, min_chars=2) == first  # the default
    with pytest.raises(AssertionError, match="generated again"):  # another batch size samples other prompts
        load_prompts("self:4?batch=8", target=tiny_chat_target, seed=1, min_chars=2)


def test_self_spec_needs_a_target():
    with pytest.raises(ValueError, match="self:4"):
        load_prompts("self:4")
