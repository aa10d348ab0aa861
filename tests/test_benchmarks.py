"""benchmarks/: the harness (interleaving, warm-up, the machine's fingerprint, the JSON report), the decoding
benchmark's command lines (ones decode.evaluate accepts) and a tiny run of it, and every benchmark's arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import attention_heads, compare_commits, decode_methods, engine_options, lookup_depths
from benchmarks.harness import ROOT, cpu_info, fingerprint, interleave, median_ms, write_report
from specdistill.decode.evaluate import EvalConfig, build_methods, build_parser, config_from_args
from specdistill.models import kernels
from specdistill.models.drafters import load_drafter
from specdistill.models.target import target_from_model
from tests.conftest import make_tiny_llama
from tests.decode.test_evaluate import MT_BENCH_LINES, VOCAB, make_chat_tokenizer, write_lines

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 f16c avx512f avx512_vnni avx512_bf16
processor\t: 1
flags\t\t: fpu
"""


def test_cpu_info_reads_the_model_and_the_flags_that_choose_kernels():
    model, flags = cpu_info(CPUINFO)
    assert model == "AMD EPYC 9R14"
    assert flags == ["avx2", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"]  # no AMX here, and only the first CPU's


def test_fingerprint_names_the_machine_and_the_code():
    machine = fingerprint()
    assert {"cpu", "cpu_flags", "cores", "torch", "commit", "date"} <= set(machine)
    assert machine["cores"] >= 1 and machine["date"].endswith("+00:00")


def test_interleave_warms_up_then_alternates_the_order():
    calls = []
    times = interleave({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3, warmup=2,
                       before=lambda: calls.append("-"))
    assert calls[:4] == ["a", "b", "a", "b"]  # warm-up, untimed, no `before`
    assert calls[4:] == ["-", "a", "-", "b", "-", "b", "-", "a", "-", "a", "-", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(ms >= 0 for ms in median_ms(times).values())


def test_write_report_keeps_the_machine_and_arguments_beside_the_results(tmp_path):
    args = decode_methods.parse_args(["--out", str(tmp_path)])
    path = write_report(tmp_path, "x", {"figure": 1.5}, args)
    report = json.loads(path.read_text())
    assert report["benchmark"] == "x" and report["results"] == {"figure": 1.5}
    assert report["args"]["preset"] == "lookup" and "cpu_flags" in report["machine"]


@pytest.mark.parametrize("preset", list(decode_methods.PRESETS))
def test_every_preset_is_a_command_line_the_evaluation_accepts(preset, tmp_path):
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    args = decode_methods.parse_args(["--preset", preset, "--out", str(tmp_path / "out")])
    for question_set in args.sets:
        config = config_from_args(build_parser().parse_args(decode_methods.evaluate_argv(args, question_set,
                                                                                         questions)))
        assert config.drafters == tuple(decode_methods.PRESETS[preset]["drafters"])
        assert config.max_new_tokens == 128 and config.out.endswith(question_set)
        preset_of = decode_methods.PRESETS[preset]
        assert config.per_category == (preset_of.get("per_category", 2) if question_set == "mt-bench" else None)
        assert config.limit == (8 if question_set == "humaneval" else None)
        assert config.target == preset_of.get("target")


def test_peers_none_runs_our_methods_only(tmp_path, capsys):
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    args = decode_methods.parse_args(["--preset", "qwen-coder", "--peers", "none", "--out", str(tmp_path / "out")])
    assert args.peers == []
    argv = decode_methods.evaluate_argv(args, "humaneval", questions)
    config = config_from_args(build_parser().parse_args(argv))
    assert config.peers == () and config.llamacpp_draft is None  # the preset's llama.cpp draft goes with its peers
    with pytest.raises(SystemExit):
        decode_methods.parse_args(["--peers", "none", "--peers", "hf"])
    assert "--peers none runs no peers; it cannot join hf" in capsys.readouterr().err


def test_a_missing_drafter_names_the_job_that_trains_it():
    missing = decode_methods.missing_drafters(["prompt_lookup", "runs/no_such_job/drafter",
                                               "runs/smollm2_eagle3/drafter+prompt_lookup"])
    assert any("no_such_job" in m for m in missing)
    assert all("specdistill train configs/distill/smollm2_eagle3.yaml" in m for m in missing if "eagle3" in m)


def test_reps_other_than_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        decode_methods.parse_args(["--reps", "2"])
    assert "--reps" in capsys.readouterr().err


def test_the_heldout_arena_set_is_late_short_and_at_most_four_per_subcategory(tmp_path):
    source = tmp_path / "arena.jsonl"
    records = [{"uid": f"u{i}", "category": "c", "subcategory": "math" if i % 2 else "poem",
                "prompt": "x" * (800 if i == 401 else 10)} for i in range(420)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = [json.loads(line) for line in
             decode_methods.write_heldout_arena(source, tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["question_id"] for r in lines] == ["u400", "u402", "u403", "u404", "u405", "u406", "u407", "u409"]
    assert {r["category"] for r in lines} == {"math", "poem"} and all(set(r) == {"question_id", "category", "prompt"}
                                                                      for r in lines)


def test_a_tiny_run_writes_the_evaluation_report(tmp_path):
    target = tmp_path / "tiny-target"
    make_tiny_llama(vocab_size=VOCAB, layers=2, seed=0).save_pretrained(target)
    make_chat_tokenizer().save_pretrained(target)
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    code = decode_methods.main(["--preset", "table", "--drafter", "prompt_lookup", "--sets", "mt-bench",
                                "--mt-bench", str(questions), "--target", str(target), "--max-new-tokens", "6",
                                "--warmup", "0", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "mt-bench" / "report.json").read_text())
    assert set(report["methods"]) == {"baseline", "speculative"}


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                                        if p.stem not in ("__init__", "harness")))
def test_every_benchmark_starts_and_parses_its_arguments(name):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--reps" in done.stdout


def test_the_lookup_study_replays_every_answer_token_and_a_depth_per_length_is_never_worse():
    records = [([1, 5, 7, 9, 3], [5, 7, 9, 3, 5, 7, 9, 3, 5, 7, 2]), ([4, 4, 4], [4, 4, 4, 4, 8, 4, 4])]
    tokens, rows, by_length = lookup_depths.replay(records, lambda n: 0)
    assert tokens == sum(len(a) for _, a in records) and rows == 0
    assert sum(stats[0] for stats in by_length.values()) == tokens  # depth 0: one token a step
    deep, deep_rows, deep_by_length = lookup_depths.replay(records, lambda n: 10)
    assert deep == tokens and deep_rows > 0 and sum(s[0] for s in deep_by_length.values()) < tokens
    one, one_speed, per, per_speed = lookup_depths.best_depths(records, 0.2)
    assert per_speed >= one_speed and set(per) == {1, 2, 3} and one in lookup_depths.DEPTHS


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"the kernel library: {kernels.unavailable()}")
def test_the_attention_benchmark_checks_both_ways_give_the_same_bits(tmp_path):
    results = attention_heads.main(["--heads", "6", "--kv-heads", "2", "--hd", "64", "--rows", "1", "3",
                                    "--context", "20", "--reps", "2", "--out", str(tmp_path)])
    assert results["same_bits"] is True
    assert set(results["us_a_layer"]["together"]) == {"1x20", "3x20"}
    assert (tmp_path / "attention_heads.json").exists()


def test_the_older_side_of_a_comparison_runs_its_own_code(tmp_path):
    tree = tmp_path / "old"
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), "HEAD"], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        with pytest.raises(RuntimeError, match="one version twice"):  # the installed names lead to the checkout
            compare_commits.check_imports_from(tree)
        compare_commits.link_packages(tree)
        compare_commits.check_imports_from(tree)
    finally:
        compare_commits.remove_worktree(tree)


def test_engine_options_run_each_drafter_twice_in_one_report(tmp_path):
    target = tmp_path / "tiny-target"
    make_tiny_llama(vocab_size=VOCAB, layers=2, seed=0).save_pretrained(target)
    make_chat_tokenizer().save_pretrained(target)
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    code = engine_options.main(["--option", "max_tree_nodes=16", "--drafter", "prompt_lookup", "--questions",
                                str(questions), "--target", str(target), "--max-new-tokens", "6", "--warmup", "0",
                                "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["methods"]) == {"baseline", "speculative[prompt_lookup]",
                                      "speculative[prompt_lookup@max_tree_nodes=16]"}
    assert report["config"]["engine_options"] == {"max_tree_nodes": 16}
    assert all(m["mismatches"] == 0 for m in report["methods"].values())


def test_engine_options_reach_the_twins_engines_only():
    target = target_from_model(make_tiny_llama(vocab_size=VOCAB, layers=2, seed=0), make_chat_tokenizer(), "tiny")
    config = EvalConfig(drafters=("prompt_lookup",), questions="q", max_new_tokens=6, warmup=0)
    drafters = {"a": load_drafter("prompt_lookup", target), "b": load_drafter("prompt_lookup", target)}
    methods, _ = build_methods(target, drafters, config, engine_options={"b": {"max_tree_nodes": 16}})
    engines = {m.name: m.engine for m in methods}
    assert engines["speculative[a]"].max_tree_nodes == 64 and engines["speculative[b]"].max_tree_nodes == 16


@pytest.mark.parametrize("pair, named", [("nonsense=1", "nonsense"), ("max_tree_nodes", "KEY=VALUE"),
                                         ("max_tree_nodes=many", "not JSON"), ("adaptive=false", "adaptive")])
def test_a_bad_engine_option_is_an_error_naming_it(pair, named):
    with pytest.raises(ValueError, match=named):
        engine_options.engine_options([pair])
