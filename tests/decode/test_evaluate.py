"""The evaluation command: question files, the multi-turn protocol, the report, and the CLI's errors."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from specdistill.decode.evaluate import (
    EXIT_MISMATCH,
    EvalConfig,
    build_methods,
    build_parser,
    config_from_args,
    conversation_for_turn,
    evaluate_methods,
    main,
    run_evaluation,
    run_question,
)
from specdistill.decode.peers import Method, TurnOutput, assisted_skip_reason
from specdistill.decode.questions import Question, QuestionFileError, categories, load_questions
from specdistill.decode.report import BASELINE, lossless_failures, write_report
from specdistill.decode.runtime_facts import KERNEL_FLAGS
from specdistill.decode.sampling import Verdict
from specdistill.models.drafters import Drafter, load_drafter
from specdistill.models.medusa import MedusaHeads
from specdistill.models.target import target_from_model
from tests.conftest import SHARED_DATA, make_tiny_llama

VOCAB = 64
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":"]  # ids 0..6; pad/bos/eos match make_tiny_llama
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_chat_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: the chat roles, then words w7..w63, so every id the tiny model emits decodes to a word
    that encodes back to the same id (a turn-1 answer survives the round trip into turn 2's prompt)."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), VOCAB)})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def chat_target():
    return target_from_model(make_tiny_llama(vocab_size=VOCAB, layers=2, seed=0), make_chat_tokenizer(), "tiny-chat")


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


MT_BENCH_LINES = [
    json.dumps({"question_id": 81, "category": "writing", "turns": ["w10 w11 w12", "w13 w14"]}),
    "",
    json.dumps({"question_id": 82, "category": "math", "turns": ["w20 w21"]}),
    json.dumps({"question_id": 83, "category": "writing", "turns": ["w30 w31 w32 w33"]}),
]


# ---- question files --------------------------------------------------------------------------------

def test_loads_mt_bench_format_in_file_order(tmp_path):
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    assert [q.question_id for q in questions] == ["81", "82", "83"]
    assert questions[0] == Question("81", "writing", ("w10 w11 w12", "w13 w14"))
    assert categories(questions) == ["writing", "math"]
    assert [q.question_id for q in load_questions(tmp_path / "q.jsonl", limit=2)] == ["81", "82"]


def test_loads_prompt_format_as_single_turn_default_category(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "w10 w11"}),
                                              json.dumps({"prompt": "w12", "id": "a", "category": "code"})])
    first, second = load_questions(path)
    assert first == Question("1", "default", ("w10 w11",))  # id = line number when the line has none
    assert second == Question("a", "code", ("w12",))


@pytest.mark.skipif(not (SHARED_DATA / "mt_bench" / "question.jsonl").is_file(), reason="shared data not present")
def test_loads_the_real_mt_bench_file():
    questions = load_questions(SHARED_DATA / "mt_bench" / "question.jsonl")
    assert len(questions) == 80 and len(categories(questions)) == 8
    assert all(len(q.turns) == 2 for q in questions)
    two_each = load_questions(SHARED_DATA / "mt_bench" / "question.jsonl", per_category=2)
    assert len(two_each) == 16 and categories(two_each) == categories(questions)
    for category in categories(questions):  # the first two of each, in file order
        assert [q for q in two_each if q.category == category] == [q for q in questions if q.category == category][:2]
    assert len(load_questions(SHARED_DATA / "mt_bench" / "question.jsonl", limit=5, per_category=2)) == 5


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "invalid JSON"),
    (json.dumps([1, 2]), "expected a JSON object"),
    (json.dumps({"question": "w1"}), "needs 'turns'"),
    (json.dumps({"question_id": 9, "turns": ["w1"]}), "missing 'category'"),
    (json.dumps({"question_id": 9, "category": "c", "turns": []}), "non-empty list"),
    (json.dumps({"prompt": ""}), "'prompt' must be a non-empty string"),
])
def test_bad_lines_are_errors_naming_file_and_line(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES[:1] + [""] + [bad_line])
    with pytest.raises(QuestionFileError, match=message) as err:
        load_questions(path)
    assert f"{path}:3:" in str(err.value)


def test_missing_empty_and_duplicate_files_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_questions(tmp_path / "nope.jsonl")
    with pytest.raises(QuestionFileError, match="no questions"):
        load_questions(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(QuestionFileError, match="question_id '81' more than once"):
        load_questions(write_lines(tmp_path / "dup.jsonl", [MT_BENCH_LINES[0], MT_BENCH_LINES[0]]))


# ---- the multi-turn protocol -----------------------------------------------------------------------

def test_conversation_for_turn_carries_the_methods_own_answers():
    turns = ["t1", "t2", "t3"]
    assert conversation_for_turn(turns, [], 0) == [{"role": "user", "content": "t1"}]
    assert conversation_for_turn(turns, ["a1", "a2"], 2) == [
        {"role": "user", "content": "t1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "t2"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "t3"}]
    with pytest.raises(ValueError, match="turn 1 needs"):
        conversation_for_turn(turns, [], 1)


def test_turn_two_is_conditioned_on_this_methods_turn_one_output():
    seen = []
    target = SimpleNamespace(encode_chat=lambda messages: seen.append(messages) or [1, 2, 3],
                             tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: f" said {ids} "))
    method = Method("fake", lambda prompt: TurnOutput([7, 8, len(seen)], 0.5, None))
    results = run_question(method, Question("q", "c", ("first", "second")), target)
    assert seen[1] == [{"role": "user", "content": "first"},
                       {"role": "assistant", "content": "said [7, 8, 1]"},  # decoded and stripped
                       {"role": "user", "content": "second"}]
    assert [r.turn for r in results] == [0, 1] and results[1].tokens == [7, 8, 2]


# ---- the evaluation and its report -----------------------------------------------------------------

def test_report_has_the_required_keys_and_baseline_speedup_one(tmp_path, chat_target):
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    drafters = {spec: load_drafter(spec, chat_target) for spec in ("truncated:1", "prompt_lookup")}
    config = EvalConfig(drafters=tuple(drafters), questions=str(tmp_path / "q.jsonl"), max_new_tokens=12,
                        warmup=1, peers="hf")
    result = run_evaluation(chat_target, drafters, questions, config, progress=False)
    out = write_report(tmp_path / "out", result.config, result.summary, result.results, result.skipped)
    report = json.loads((out / "report.json").read_text())

    assert {"target_fingerprint", "drafter_manifests", "machine", "max_new_tokens"} <= set(report["config"])
    assert report["config"]["target_fingerprint"] == chat_target.fingerprint
    assert {"torch", "threads", "device"} <= set(report["config"]["machine"])
    methods = report["methods"]
    assert set(methods) == {BASELINE, "speculative[truncated:1]", "speculative[prompt_lookup]", "hf_generate",
                            "hf_assisted[truncated:1]", "hf_prompt_lookup"}
    assert "hf_assisted[prompt_lookup]" in report["skipped"]  # no draft model to assist with
    fields = {"tokens_per_s", "speedup", "tau", "alpha", "mismatches", "new_tokens", "wall_s",
              "target_forwards", "acceptance_per_position", "by_category"}
    for row in methods.values():
        assert fields <= set(row)
        assert set(row["by_category"]) == {"writing", "math"}
        assert row["new_tokens"] == sum(c["new_tokens"] for c in row["by_category"].values())
    base = methods[BASELINE]
    assert base["speedup"] == 1.0 and all(c["speedup"] == 1.0 for c in base["by_category"].values())
    assert base["tau"] == 1.0 and base["mismatches"] == 0
    # our speculative decoding is lossless: every turn (4 of them) equals the baseline token for token
    for name in ("speculative[truncated:1]", "speculative[prompt_lookup]"):
        assert methods[name]["mismatches"] == 0 and methods[name]["tau"] >= 1.0
    assert methods["hf_generate"]["tau"] is None and methods["hf_generate"]["alpha"] is None
    assert base["tokens_per_s"] == pytest.approx(base["new_tokens"] / base["wall_s"])
    assert "| baseline |" in (out / "report.md").read_text()
    for plot in ("speedup_by_category.png", "acceptance_per_position.png"):
        assert (out / plot).read_bytes()[:8] == PNG_MAGIC
    turns = [json.loads(line) for line in (out / "turns.jsonl").read_text().splitlines()]
    assert len(turns) == 4 * len(methods)  # 2 + 1 + 1 turns per method


def test_self_drafters_are_skipped_for_assisted_generation(chat_target):
    """Medusa heads (with or without a candidate vocabulary) are no assistant_model for transformers."""
    heads = MedusaHeads.from_target(chat_target.model, num_heads=2)
    for vocab_map in (None, torch.arange(8)):
        drafter = Drafter("medusa", heads, vocab_map, {}, None)
        assert "medusa" in assisted_skip_reason(drafter, chat_target)
    assert assisted_skip_reason(load_drafter("truncated:1", chat_target), chat_target) is None


def test_sampling_run_reports_no_mismatch_count(tmp_path, chat_target):
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES[2:3]))
    config = EvalConfig(drafters=("truncated:1",), questions="q", max_new_tokens=6, warmup=0, temperature=0.8)
    result = run_evaluation(chat_target, load_drafter("truncated:1", chat_target), questions, config, progress=False)
    assert set(result.summary) == {BASELINE, "speculative"}
    assert all(row["mismatches"] is None for row in result.summary.values())


def dies_on_call(name: str, n: int, fallible: bool) -> Method:
    """A peer whose n-th call raises RuntimeError, as a vLLM worker killed mid-run does."""
    calls = []

    def run(prompt_ids):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("vLLM worker failed (EngineDeadError)")
        return TurnOutput([1, 2], 0.01, None)

    return Method(name, run, lossless=False, fallible=fallible)


@pytest.mark.parametrize("n", [1, 3])  # dies in the warm-up, or after some measured turns
def test_a_fallible_peer_that_dies_is_dropped_with_its_reason_and_the_run_goes_on(tmp_path, chat_target, n):
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    config = EvalConfig(drafters=("x",), questions="q", max_new_tokens=6, warmup=1)
    methods, skipped = build_methods(chat_target, {}, config)
    result = evaluate_methods([*methods, dies_on_call("vllm_x", n, fallible=True)], skipped, chat_target, {},
                              questions, config, progress=False)
    assert set(result.summary) == {BASELINE}
    assert "failed during the run" in result.skipped["vllm_x"] and "EngineDeadError" in result.skipped["vllm_x"]
    assert {r.method for r in result.results} == {BASELINE}
    assert len(result.results) == sum(len(q.turns) for q in questions)


def test_an_error_of_our_own_method_ends_the_run(tmp_path, chat_target):
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    config = EvalConfig(drafters=("x",), questions="q", max_new_tokens=6, warmup=0)
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        evaluate_methods([dies_on_call("ours", 2, fallible=False)], {}, chat_target, {}, questions, config,
                         progress=False)


# ---- the command line ------------------------------------------------------------------------------

@pytest.fixture
def target_dir(tmp_path):
    directory = tmp_path / "tiny-target"
    make_tiny_llama(vocab_size=VOCAB, layers=2, seed=0).save_pretrained(directory)
    make_chat_tokenizer().save_pretrained(directory)
    return directory


def test_cli_writes_the_report_and_prints_the_table(tmp_path, target_dir, capsys):
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    code = main(["--target", str(target_dir), "--drafter", "truncated:1", "--questions", str(questions),
                 "--limit", "1", "--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "run")])
    assert code == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["methods"]) == {"baseline", "speculative"}
    assert report["config"]["limit"] == 1 and report["config"]["questions_evaluated"] == 1
    assert report["config"]["drafter_manifest"]["kind"] == "draft_model"
    printed = capsys.readouterr().out
    assert "[writing]" in printed and "[overall]" in printed and "speculative" in printed


def test_speedup_model_script_reads_an_evaluation_report(tmp_path, target_dir, capsys):
    """`specdistill speedup-model` (train.tools.speedup_model) on a real report: one row per drafter, each answer a
    probability or None."""
    from specdistill.train.tools import speedup_model as script

    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    assert main(["--target", str(target_dir), "--drafter", "truncated:1", "--drafter", "prompt_lookup",
                 "--questions", str(questions), "--limit", "2", "--max-new-tokens", "12", "--warmup", "0",
                 "--fixed-depth", "--out", str(tmp_path / "run")]) == 0
    report_path = tmp_path / "run" / "report.json"
    report = json.loads(report_path.read_text())  # a peer's entry as llama.cpp's report it: no acceptance by position
    report["methods"]["llamacpp+ngram"] = dict(report["methods"]["speculative[prompt_lookup]"],
                                               acceptance_per_position=[], draft_time_s=0.0)
    report_path.write_text(json.dumps(report))
    result = script.main([str(report_path), "--target", str(target_dir), "--rows", "1", "2", "4",
                          "--reps", "1", "--out", str(tmp_path / "model")])
    assert sorted(row["method"] for row in result["methods"]) == ["speculative[prompt_lookup]",
                                                                   "speculative[truncated:1]"]
    assert result["not_modelled"] == ["llamacpp+ngram"]
    assert result["verify_cost"][1] == 1.0 and set(result["verify_cost"]) == {1, 2, 4}
    for row in result["methods"]:
        assert row["draft_cost"] >= 0 and row["modelled_speedup"] > 0
        assert all(a is None or 0 <= a <= 1 for a in [*row["needed"].values(), *row["needed_free_drafter"].values()])
    assert (tmp_path / "model" / "speedup_model.json").is_file()
    assert "a for 1.5x" in capsys.readouterr().out


@pytest.mark.parametrize("args, argument", [
    (["--drafter", "no_such_drafter"], "--drafter"),
    (["--drafter", "truncated:9"], "--drafter"),
    (["--drafter", "truncated:1", "--limit", "0"], "--limit"),
    (["--drafter", "truncated:1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--drafter", "truncated:1", "--temperature", "-1"], "--temperature"),
    (["--drafter", "truncated:1", "--drafter-weights", "half"], "--drafter-weights"),
    (["--drafter", "truncated:1", "--lookup-first", "-1"], "--lookup-first"),
    (["--drafter", "truncated:1", "--lookup-weak-chain", "-2"], "--lookup-weak-chain"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, target_dir, capsys, args, argument):
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", str(target_dir), "--questions", str(questions), "--out", str(tmp_path / "o")] + args)
    assert exit_info.value.code == 2
    assert f"argument {argument}" in capsys.readouterr().err


def test_lookup_and_drafter_weight_options_reach_the_proposers(chat_target, monkeypatch, tmp_path):
    import specdistill.decode.evaluate as evaluate
    from specdistill.decode.proposers import WithPromptLookup
    from specdistill.models.drafters import load_drafter

    questions = str(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    args = build_parser().parse_args(["--drafter", "truncated:1+prompt_lookup", "--questions", questions,
                                      "--lookup-first", "0", "--lookup-weak-chain", "3",
                                      "--drafter-weights", "float32"])
    config = config_from_args(args)
    assert (config.lookup_first, config.lookup_weak_chain, config.drafter_weights) == (0, 3, "float32")
    built = []
    original = evaluate.build_proposer
    monkeypatch.setattr(evaluate, "build_proposer", lambda *a, **kw: built.append(original(*a, **kw)) or built[-1])
    build_methods(chat_target, {spec: load_drafter(spec, chat_target) for spec in config.drafters}, config)
    (proposer,) = built
    assert isinstance(proposer, WithPromptLookup) and (proposer.lookup_first, proposer.weak_chain) == (0, 3)
    with pytest.raises(ValueError, match="lookup_first"):
        EvalConfig(drafters=("prompt_lookup",), questions="q.jsonl", lookup_first=-1)


def test_missing_or_broken_question_file_exits_2(tmp_path, target_dir, capsys):
    for path in (tmp_path / "missing.jsonl", write_lines(tmp_path / "bad.jsonl", ["{oops"])):
        with pytest.raises(SystemExit) as exit_info:
            main(["--target", str(target_dir), "--drafter", "truncated:1", "--questions", str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "argument --questions" in err and path.name in err


def test_fixed_depth_drafts_the_full_gamma_every_step(tmp_path, chat_target):
    """--fixed-depth turns the adaptive draft length off: every step drafts min(gamma, room left)."""
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))[:1]
    drafters = {"truncated:1": load_drafter("truncated:1", chat_target)}
    config = EvalConfig(drafters=tuple(drafters), questions=str(tmp_path / "q.jsonl"), max_new_tokens=40,
                        warmup=0, gamma=3, fixed_depth=True)
    result = run_evaluation(chat_target, drafters, questions, config, progress=False)
    turns = [r for r in result.results if r.method.startswith("speculative")]
    assert turns and result.summary[turns[0].method]["mismatches"] == 0
    for turn in turns:
        steps = turn.stats.target_forwards
        # at most the last 3 steps have less than gamma + 1 tokens of room; every other one drafts 3
        assert turn.stats.drafted >= 3 * (steps - 3) and len(turn.stats.drafted_per_position) == 3
    args = build_parser().parse_args(["--drafter", "truncated:1", "--questions", str(tmp_path / "q.jsonl"),
                                      "--fixed-depth"])
    assert config_from_args(args).fixed_depth and not config_from_args(
        build_parser().parse_args(["--drafter", "x", "--questions", str(tmp_path / "q.jsonl")])).fixed_depth


def test_prompt_vocab_flag_defaults_to_the_manifest(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"prompt": "hi"}\n')
    base = ["--drafter", "x", "--questions", str(tmp_path / "q.jsonl")]
    parse = build_parser().parse_args
    assert config_from_args(parse(base)).prompt_vocab is None
    assert config_from_args(parse(base + ["--prompt-vocab"])).prompt_vocab is True
    assert config_from_args(parse(base + ["--no-prompt-vocab"])).prompt_vocab is False


# ---- losslessness binds; the report records what ran --------------------------------------------------

def accept_every_draft(tree, best):
    """A broken greedy verifier: it follows the first drafted chain to its end, so the drafter's tokens are emitted
    whatever the target says (a lossy engine)."""
    node, path = 0, [0]
    while tree.children(node):
        node = tree.children(node)[0]
        path.append(node)
    return Verdict(path, best[node])


def evaluate_cli(tmp_path, target_dir, *extra: str) -> int:
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    return main(["--target", str(target_dir), "--drafter", "truncated:1", "--questions", str(questions),
                 "--limit", "2", "--max-new-tokens", "12", "--warmup", "0", "--fixed-depth",
                 "--out", str(tmp_path / "run"), *extra])


@pytest.mark.parametrize("allow", [False, True])
def test_a_lossy_engine_exits_3_after_writing_the_whole_report(tmp_path, target_dir, capsys, monkeypatch, allow):
    from specdistill.decode import engine

    monkeypatch.setattr(engine, "verify_greedy_tokens", accept_every_draft)
    code = evaluate_cli(tmp_path, target_dir, *(["--allow-mismatches"] if allow else []))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    row = report["methods"]["speculative"]
    assert row["lossless"] and row["mismatches"] > 0  # the broken verifier did change the output
    assert report["methods"][BASELINE]["mismatches"] == 0  # plain decoding verifies no drafts: unaffected
    assert len((tmp_path / "run" / "turns.jsonl").read_text().splitlines()) == 2 * 3  # nothing lost
    assert report["config"]["allow_mismatches"] == allow
    assert "`speculative` LOSSLESSNESS VIOLATED" in (tmp_path / "run" / "report.md").read_text()
    captured = capsys.readouterr()
    assert "[overall]" in captured.out  # the table is printed first
    assert f"speculative: {row['mismatches']} of {row['turns']} turns" in captured.err
    assert "LOSSLESSNESS VIOLATED" in captured.err
    assert code == (0 if allow else EXIT_MISMATCH) and EXIT_MISMATCH not in (0, 1, 2)


def test_a_peer_that_is_not_bound_to_the_baseline_may_differ(tmp_path, target_dir, capsys, monkeypatch):
    """A method with lossless=False (a peer whose arithmetic differs) is reported with its mismatches and never
    fails the run; our engine's methods still bind."""
    import specdistill.decode.evaluate as evaluate

    original = evaluate.build_methods

    def with_a_rounding_peer(*args, **kwargs):
        methods, skipped = original(*args, **kwargs)
        baseline = methods[0]

        def run(prompt_ids):
            out = baseline.run(prompt_ids)
            return TurnOutput([9 if out.tokens[0] != 9 else 10] + out.tokens[1:], out.wall_s, None)

        return [*methods, Method("other_kernels", run, lossless=False)], skipped

    monkeypatch.setattr(evaluate, "build_methods", with_a_rounding_peer)
    assert evaluate_cli(tmp_path, target_dir) == 0
    methods = json.loads((tmp_path / "run" / "report.json").read_text())["methods"]
    assert methods["other_kernels"]["mismatches"] == methods["other_kernels"]["turns"] == 3
    assert methods["other_kernels"]["lossless"] is False and methods["speculative"]["lossless"] is True
    assert methods["speculative"]["mismatches"] == 0
    assert "LOSSLESSNESS" not in capsys.readouterr().err
    assert "LOSSLESSNESS" not in (tmp_path / "run" / "report.md").read_text()


def test_lossless_failures_name_bound_methods_with_mismatches_only():
    summary = {BASELINE: {"lossless": True, "mismatches": 0, "turns": 4},
               "speculative[a]": {"lossless": True, "mismatches": 2, "turns": 4},
               "speculative[b]": {"lossless": True, "mismatches": 0, "turns": 4},
               "hf_generate": {"lossless": False, "mismatches": 3, "turns": 4},
               "sampled": {"lossless": True, "mismatches": None, "turns": 4}}  # sampling: no token check
    assert lossless_failures(summary) == {"speculative[a]": "2 of 4 turns"}


def test_the_report_records_what_ran_resolved(tmp_path, target_dir):
    from specdistill.decode.runtime_facts import git_commit, kernel_facts
    from specdistill.models.packed_linear import float16_weights_supported

    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    assert main(["--target", str(target_dir), "--drafter", "truncated:1", "--drafter", "prompt_lookup",
                 "--questions", str(questions), "--limit", "1", "--max-new-tokens", "4", "--warmup", "0",
                 "--out", str(tmp_path / "run")]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    runtime = report["runtime"]
    assert report["config"]["drafter_weights"] == "auto"  # what was asked ...
    # ... and what ran: a CPU fp32 drafter drafts in fp16 copies wherever FBGEMM's fp16 GEMM runs
    assert runtime["drafters"] == {
        "speculative[truncated:1]": {"kind": "draft_model",
                                     "weights": "float16" if float16_weights_supported() else "float32"},
        "speculative[prompt_lookup]": {"kind": "prompt_lookup", "weights": None}}
    target = runtime["target"]
    assert (target["precision"], target["dtype"], target["decoder"]) == ("float32", "float32", "lean")
    assert sum(target["layer_matrices"].values()) == 4 * 2  # q/k/v, o, gate/up, down per layer
    assert target["greedy_head"] is False  # this head is not on the Q8_0 grid: every logit is computed
    assert runtime["kernel_library"] == kernel_facts()
    assert runtime["kernel_library"]["state"] in ("loaded", "unavailable")
    assert runtime["fp32_gemm_padding"]["choice"] == "off" or ":" in runtime["fp32_gemm_padding"]["choice"]
    assert set(runtime["cpu_flags"]) <= set(KERNEL_FLAGS) and runtime["torch"] == torch.__version__
    assert runtime["git_commit"] == git_commit() and re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", runtime["git_commit"])
    assert "auto" not in json.dumps(runtime)
    markdown = (tmp_path / "run" / "report.md").read_text()
    assert "## runtime" in markdown and "speculative[truncated:1] (kind draft_model, weights float" in markdown
    assert f"- git_commit: {runtime['git_commit']}" in markdown


def test_git_commit_is_none_outside_a_checkout(tmp_path):
    from specdistill.decode.runtime_facts import git_commit

    assert git_commit(tmp_path) is None
