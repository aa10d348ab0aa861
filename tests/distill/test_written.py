"""Written answers (distill.written): text the target reads but did not write, as training records for the drafters
trained on its states. Files cut into pieces at line ends, sampled across files by a fixed order; answers read from
a prompt file's field; evaluation prompts left out; bad sources named; and the training job appending them after
the target's own answers, with the draft vocabulary still counted on what the target writes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specdistill.distill.written import file_pieces, parse_written_spec, written_answers, written_records
from specdistill.train import distill_steps as steps
from specdistill.train.config import ConfigError
from specdistill.train.distill_config import DistillConfig
from specdistill.train.medusa import candidate_vocab
from tests.distill.conftest import make_tiny_target

CODE = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40))


@pytest.mark.parametrize("chars", [20, 64, 200, 10_000])
def test_pieces_are_whole_lines_within_the_size_and_rebuild_the_text(chars):
    pieces = list(file_pieces(CODE, chars))
    assert all(len(p) <= chars for p in pieces)
    assert all(p.strip() for p in pieces)
    rebuilt = "\n".join(pieces)  # each cut is at a line end; only blank lines at a cut are dropped
    assert rebuilt.split() == CODE.split()
    if chars >= len(CODE):
        assert pieces == [CODE.rstrip("\n")]


def test_a_line_longer_than_a_piece_is_cut_to_it():
    assert [len(p) for p in file_pieces("x" * 50 + "\nshort\n", 16)] == [16, 5]


def make_files(root, n: int = 4) -> None:
    (root / "pkg").mkdir()
    for i in range(n):
        (root / "pkg" / f"mod{i}.py").write_text(CODE.replace("def f", f"def m{i}_"))
    (root / "pkg" / "notes.txt").write_text("not python\n")


def test_files_are_fenced_answers_to_a_turn_naming_the_file_and_limit_samples_across_files(tmp_path):
    make_files(tmp_path)
    every = written_answers([f"files:{tmp_path}/pkg/*.py?chars=200"])
    assert len(every) == 4 * len(list(file_pieces(CODE, 200)))
    assert all(a.answer.startswith("```python\n") and a.answer.endswith("\n```") for a in every)
    assert all(a.messages[0]["role"] == "user" and "`mod" in a.messages[0]["content"] for a in every)
    some = written_answers([f"files:{tmp_path}/pkg/*.py?chars=200&limit=6"])
    assert [a.answer for a in some] == [a.answer for a in every[:6]]  # limit takes a prefix of one fixed order
    assert len({a.messages[0]["content"].split("`")[1] for a in some}) > 1  # not the first file's pieces only
    assert written_answers([f"files:{tmp_path}/pkg/*.py?chars=200"]) == every  # the same order every time


def test_jsonl_answers_keep_their_prompt_and_leave_out_the_excluded(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"q{i}?", "answer": f"a{i}"} for i in range(5)] + [{"question": "blank", "answer": "  "}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = written_answers([f"jsonl:{path}?answer=answer&skip=1&limit=3"], exclude={"q2?"})
    assert [(a.messages[-1]["content"], a.answer) for a in got] == [("q1?", "a1"), ("q3?", "a3")]
    assert written_answers([f"jsonl:{path}?answer=answer&skip=5"]) == []  # an empty answer is no record


def test_bad_sources_are_errors_that_name_them(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "q", "reply": "a"}) + "\n" + json.dumps({"question": "q", "answer": 3}))
    with pytest.raises(ValueError, match="needs answer=KEY"):
        parse_written_spec(f"jsonl:{path}")
    with pytest.raises(ValueError, match=r"unknown option.*'field'"):
        parse_written_spec(f"files:{tmp_path}/*.py?field=x")
    with pytest.raises(ValueError, match="chars must be a positive integer"):
        parse_written_spec(f"files:{tmp_path}/*.py?chars=0")
    with pytest.raises(ValueError, match="is not a source"):
        parse_written_spec("self:4")
    with pytest.raises(ValueError, match=r"record 0 has no field 'answer'"):
        written_answers([f"jsonl:{path}?answer=answer"])
    with pytest.raises(ValueError, match=r"record 1: 'answer' is a int, not text"):
        written_answers([f"jsonl:{path}?answer=answer&skip=1"])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        written_answers([f"files:{tmp_path}/none/*.py"])
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")
    with pytest.raises(ValueError, match=r"latin\.py is not UTF-8"):
        written_answers([f"files:{tmp_path}/*.py"])


def test_records_are_the_chat_templated_turn_and_the_answer_with_the_eos(tmp_path):
    target = make_tiny_target()
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"prompt": "w1 w2", "answer": "w3 w4 w5"}) + "\n")
    [record] = written_records([f"jsonl:{path}?answer=answer"], target)
    assert record["prompt_ids"] == target.encode_chat([{"role": "user", "content": "w1 w2"}])
    words = target.tokenizer("w3 w4 w5", add_special_tokens=False)["input_ids"]
    assert record["response_ids"] == words + [target.tokenizer.eos_token_id] and record["written"] is True


def test_the_job_appends_them_after_the_targets_answers_and_counts_its_vocabulary_without_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 3}"}) + "\n" for i in range(6)))
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"prompt": f"w{i} w9", "answer": "w40 w40 w41"}) + "\n" for i in range(3)))
    target = make_tiny_target()
    accelerator = SimpleNamespace(process_index=0, num_processes=1, wait_for_everyone=lambda: None)
    common = dict(method="eagle3", prompts=[f"jsonl:{prompts}"], max_new_tokens=5, gen_batch_size=4, max_seq_len=32,
                  exclude_prompts=[f"jsonl:{answers}?limit=1"])
    own = steps.teacher_records(DistillConfig(**common), target, accelerator)
    cfg = DistillConfig(**common, written_answers=[f"jsonl:{answers}?answer=answer"], draft_vocab=4)
    records = steps.teacher_records(cfg, target, accelerator)
    assert records[:len(own)] == own and all(r.get("written") for r in records[len(own):])
    assert len(records) - len(own) == 2  # the first answer's prompt is an excluded (evaluation) one
    target.vocab_size = 64
    vocab = candidate_vocab(cfg, target, records)
    assert torch.equal(vocab, candidate_vocab(cfg, target, own))  # w40 and w41 written 6 times, still not in it


def test_only_methods_trained_on_the_targets_states_take_them_and_a_bad_source_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="written_answers: method seqkd learns from what the target writes"):
        DistillConfig(method="seqkd", written_answers=[f"files:{tmp_path}/*.py"])
    with pytest.raises(ConfigError, match="needs answer=KEY"):
        DistillConfig(method="eagle3", written_answers=[f"jsonl:{tmp_path}/a.jsonl"])
    for method in ("eagle3", "dflash", "medusa"):
        assert DistillConfig(method=method, written_answers=[f"files:{tmp_path}/*.py"]).written_answers
