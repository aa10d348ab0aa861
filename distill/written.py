"""Written answers: text the target reads but did not write, for the drafters trained on its states.

    written_records(specs, target, exclude=..., seed=...) -> [{"prompt_ids", "response_ids", "written": True}]

A drafter trained on the target's states (EAGLE-3, DFlash, Medusa) learns the target's next-token distribution
at every position it reads, and that distribution is the target's whatever wrote the text before it: the labels
come from the target's own head over its states (distill.feature_cache), never from the text. So text the target
only reads is training data too, at the price of one prefill (every position of a sequence in one forward), where
an answer the target writes costs one forward per token: EAGLE's first recipe trained this way on a fixed corpus.
On a CPU the target writes about 36 answers a minute and reads several times more tokens than it writes in the same
time, so this is how a small machine's drafter sees more than its teacher data.

Sources (config `written_answers:`):

    jsonl:PATH?answer=KEY[&field=KEY&skip=N&limit=N]   a prompt file whose records carry an answer under KEY (GSM8K's
                                                       `answer`); the prompt is found as distill.prompts finds it
    files:GLOB[?limit=N&chars=N]                       text files (a glob; `{stdlib}` is this Python's standard
                                                       library), cut at line ends into pieces of at most `chars`
                                                       characters (default 1000); each piece is the answer, fenced
                                                       as code by the file's suffix, to a user turn naming the file

Pieces are taken in an order fixed by their path and position (a hash, so that `limit` samples every file rather
than the first ones alphabetically); prompts in `exclude` (the evaluation questions) are dropped, and so is an empty
answer. Each record is the chat-templated user turn and the answer's tokens with the target's EOS, marked
`written` so that what counts the target's own token use (the draft vocabulary) leaves it out.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import logging
import sysconfig
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

from specdistill.distill.prompts import normalize_text, open_records, parse_prompt_spec, record_to_messages, user

__all__ = ["WrittenAnswer", "written_answers", "written_records", "parse_written_spec", "file_pieces"]

log = logging.getLogger(__name__)

WRITTEN_GRAMMAR = "jsonl:PATH?answer=KEY[&field=KEY&skip=N&limit=N] or files:GLOB[?limit=N&chars=N]"
JSONL_OPTIONS = ("answer", "field", "skip", "limit")
FILES_OPTIONS = ("limit", "chars")
DEFAULT_PIECE_CHARS = 1000
FENCES = {".py": "python", ".c": "c", ".h": "c", ".cpp": "cpp", ".js": "javascript", ".ts": "typescript",
          ".rs": "rust", ".go": "go", ".java": "java", ".sh": "bash", ".sql": "sql", ".md": None, ".txt": None}


@dataclass
class WrittenAnswer:
    messages: list[dict]   # the conversation up to the user turn the answer follows
    answer: str


@dataclass
class WrittenSpec:
    kind: str              # "jsonl" | "files"
    location: str          # the file, or the glob with {stdlib} expanded
    options: dict


def parse_written_spec(spec: str) -> WrittenSpec:
    """A written-answer source; a malformed one is a ValueError naming it and the grammar."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"written_answers: {spec!r} is not a source; expected {WRITTEN_GRAMMAR}")
    body, _, query = spec.partition("?")
    kind, _, location = body.partition(":")
    if kind not in ("jsonl", "files") or not location:
        raise ValueError(f"written_answers: {spec!r} is not a source; expected {WRITTEN_GRAMMAR}")
    options = dict(parse_qsl(query, keep_blank_values=True)) if query else {}
    known = JSONL_OPTIONS if kind == "jsonl" else FILES_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"written_answers: {spec!r}: unknown option(s) {unknown}; {kind}: knows {known}")
    for name in ("skip", "limit", "chars"):
        if name in options:
            if not options[name].isdigit() or (name == "chars" and int(options[name]) == 0):
                least = "a positive" if name == "chars" else "a non-negative"
                raise ValueError(f"written_answers: {spec!r}: {name} must be {least} integer")
            options[name] = int(options[name])
    if kind == "jsonl" and not options.get("answer"):
        raise ValueError(f"written_answers: {spec!r}: a jsonl source needs answer=KEY, the field holding the answer")
    if kind == "files":
        location = location.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
    return WrittenSpec(kind, location, options)


def written_answers(specs: Sequence[str], exclude: Collection[str] = ()) -> list[WrittenAnswer]:
    """Every source's answers in order; a prompt in `exclude` (normalized texts) is dropped."""
    excluded = {normalize_text(t) for t in exclude}
    out: list[WrittenAnswer] = []
    for spec in specs:
        parsed = parse_written_spec(spec)
        found = jsonl_answers(parsed, spec) if parsed.kind == "jsonl" else file_answers(parsed, spec)
        kept = [a for a in found if a.answer.strip() and normalize_text(a.messages[-1]["content"]) not in excluded]
        log.info("written answers %s: %d", spec, len(kept))
        out += kept
    return out


def jsonl_answers(parsed: WrittenSpec, spec: str) -> list[WrittenAnswer]:
    _, records = open_records(parse_prompt_spec(f"jsonl:{parsed.location}"), spec)
    records = itertools.islice(records, parsed.options.get("skip", 0), None)
    key, field = parsed.options["answer"], parsed.options.get("field")
    out = []
    for index, record in records:
        if key not in record:
            raise ValueError(f"written_answers: {spec!r} record {index} has no field {key!r} (keys: {sorted(record)})")
        if not isinstance(record[key], str):
            raise ValueError(f"written_answers: {spec!r} record {index}: {key!r} is a {type(record[key]).__name__}, "
                             "not text")
        out.append(WrittenAnswer(record_to_messages(record, field, where=f"{spec} record {index}"), record[key]))
        if len(out) == parsed.options.get("limit", -1):
            break
    return out


def file_answers(parsed: WrittenSpec, spec: str) -> list[WrittenAnswer]:
    paths = sorted(Path(p) for p in glob.glob(parsed.location, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"written_answers: {spec!r} matches no file ({parsed.location})")
    root, chars = glob_root(parsed.location), parsed.options.get("chars", DEFAULT_PIECE_CHARS)
    pieces = [(path, k, piece) for path in paths for k, piece in enumerate(file_pieces(read_text(path, spec), chars))]
    pieces.sort(key=lambda p: hashlib.sha1(f"{p[0]}:{p[1]}".encode()).hexdigest())
    return [piece_answer(path, k, piece, root) for path, k, piece in pieces[: parsed.options.get("limit")]]


def glob_root(pattern: str) -> Path:
    """The folder a glob's names are shown relative to: its parts before the first wildcard."""
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts[:-1]))
    return Path(*fixed) if fixed else Path(".")


def read_text(path: Path, spec: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"written_answers: {spec!r}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") \
            from None


def file_pieces(text: str, chars: int) -> Iterator[str]:
    """The text cut at line ends into pieces of at most `chars` characters (a longer line is a piece alone, cut);
    blank pieces left out."""
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if size + len(line) > chars and piece:
            yield from kept_piece(piece)
            piece, size = [], 0
        piece.append(line[:chars])
        size += len(piece[-1])
    yield from kept_piece(piece)


def kept_piece(lines: list[str]) -> Iterator[str]:
    text = "".join(lines).rstrip("\n")
    if text.strip():
        yield text


def piece_answer(path: Path, index: int, piece: str, root: Path) -> WrittenAnswer:
    name = path.relative_to(root) if path.is_relative_to(root) else path.name
    language = FENCES.get(path.suffix, path.suffix.lstrip("."))
    fence = f"```{language}\n" if language else "```\n"
    return WrittenAnswer([user(f"Show part {index + 1} of the file `{name}`.")], f"{fence}{piece}\n```")


def written_records(specs: Sequence[str], target, exclude: Collection[str] = ()) -> list[dict]:
    """The sources' answers as training records: the user turn chat-templated as the teacher data's prompts are,
    the answer's tokens and the target's EOS."""
    eos = target.tokenizer.eos_token_id
    if eos not in target.eos_token_ids:
        raise ValueError(f"written_answers: the tokenizer of target {target.name!r} names no EOS token of its own "
                         "to end an answer with")
    records = []
    for written in written_answers(specs, exclude):
        prompt_ids = target.encode_chat(written.messages)
        answer_ids = target.tokenizer(written.answer, add_special_tokens=False)["input_ids"]
        records.append({"prompt_ids": prompt_ids, "response_ids": list(answer_ids) + [eos], "written": True})
    return records
