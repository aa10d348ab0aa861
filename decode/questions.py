"""Question files for evaluation: MT-bench / Spec-Bench JSONL, or plain `{"prompt": ...}` JSONL (HumanEval's
`{"task_id", "prompt", ...}` among them), either one gzip-compressed (a name ending in .gz).

MT-bench and Spec-Bench lines are `{"question_id", "category", "turns": [turn1, turn2, ...]}`; a
plain line is `{"prompt": "..."}` (optionally with "question_id"/"id"/"task_id" and "category") and becomes a
one-turn question in category "default". Every error names the file and the line.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CATEGORY = "default"


class QuestionFileError(ValueError):
    """A question file exists but a line in it cannot be used."""


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]  # the user's messages, in order; turn k+1 follows the model's answer to turn k


def load_questions(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Question]:
    """The first `limit` questions of a JSONL file (all when limit is None), in file order; with
    per_category, only the first `per_category` questions of each category count (MT-bench's file is
    sorted by category, so its first N questions are all one category)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    questions: list[Question] = []
    taken: dict[str, int] = {}
    with open_text(path) as lines:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            question = parse_question(line, f"{path}:{line_no}", line_no)
            if per_category is not None and taken.get(question.category, 0) >= per_category:
                continue
            taken[question.category] = taken.get(question.category, 0) + 1
            questions.append(question)
            if limit is not None and len(questions) >= limit:
                break
    if not questions:
        raise QuestionFileError(f"question file {path} has no questions")
    check_unique_ids(questions, path)
    return questions


def open_text(path: Path):
    """A question file's lines: gzip-compressed where its name ends in .gz."""
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def parse_question(line: str, where: str, line_no: int) -> Question:
    """One JSONL line -> a Question; `where` ("file:line") prefixes every error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise QuestionFileError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(record, dict):
        raise QuestionFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        return parse_mt_bench(record, where)
    if "prompt" in record:
        return parse_prompt(record, where, line_no)
    raise QuestionFileError(f"{where}: a question needs 'turns' (MT-bench / Spec-Bench format) or 'prompt'; "
                            f"found keys {sorted(record)}")


def parse_mt_bench(record: dict, where: str) -> Question:
    for key in ("question_id", "category"):
        if key not in record:
            raise QuestionFileError(f"{where}: MT-bench question is missing {key!r}")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise QuestionFileError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    return Question(str(record["question_id"]), str(record["category"]), tuple(turns))


def parse_prompt(record: dict, where: str, line_no: int) -> Question:
    prompt = record["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise QuestionFileError(f"{where}: 'prompt' must be a non-empty string")
    question_id = record.get("question_id", record.get("id", record.get("task_id", line_no)))
    return Question(str(question_id), str(record.get("category", DEFAULT_CATEGORY)), (prompt,))


def check_unique_ids(questions: list[Question], path: Path) -> None:
    """Results are keyed by question id, so two questions with one id would be silently merged."""
    seen = set()
    for q in questions:
        if q.question_id in seen:
            raise QuestionFileError(f"question file {path} has question_id {q.question_id!r} more than once")
        seen.add(q.question_id)


def categories(questions: list[Question]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(q.category for q in questions))
