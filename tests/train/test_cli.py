"""`specdistill` (train/cli.py): each command reaches the module it names with its arguments unchanged; `train`
builds the accelerate launch the README documents; unknown commands and benchmarks are errors."""

from __future__ import annotations

import importlib

import pytest

from specdistill.train import cli

CONFIG = "configs/distill/quickstart.yaml"


def test_train_launches_the_job_as_make_demo_does():
    argv = cli.launch_argv([CONFIG])
    assert argv[0] == "launch" and argv[-3:] == [str(cli.ROOT / "train" / "distill.py"), "--config", CONFIG]
    assert ["--num_processes", "1"] == argv[argv.index("--num_processes"):argv.index("--num_processes") + 2]
    assert "--mixed_precision" in argv and "--config_file" not in argv


def test_train_takes_where_to_run_and_passes_the_jobs_overrides_through():
    argv = cli.launch_argv([CONFIG, "--where", "configs/accelerate/cpu_ddp_2proc.yaml", "--max_steps", "3",
                            "--online"])
    assert argv[1:3] == ["--config_file", "configs/accelerate/cpu_ddp_2proc.yaml"]
    assert "--num_processes" not in argv  # the where-to-run file says how many
    assert argv[-5:] == [str(cli.ROOT / "train" / "online.py"), "--config", CONFIG, "--max_steps", "3"]


def test_train_refuses_a_missing_config(capsys):
    with pytest.raises(SystemExit):
        cli.launch_argv(["configs/distill/no_such_job.yaml"])
    assert "no_such_job.yaml does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("command, module", [("eval", "specdistill.decode.evaluate"),
                                             ("serve", "specdistill.decode.serve"),
                                             ("export", "specdistill.models.export"),
                                             ("speedup-model", "specdistill.train.tools.speedup_model"),
                                             ("training-gain", "specdistill.train.tools.training_gain")])
def test_a_command_hands_its_arguments_to_its_module(monkeypatch, command, module):
    seen = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda argv: seen.append(argv) or 3)
    assert cli.main([command, "--x", "1"]) == 3
    assert seen == [["--x", "1"]]


def test_every_tool_is_a_module_with_a_main():
    for module, _ in cli.TOOLS.values():
        assert callable(importlib.import_module(f"specdistill.train.tools.{module}").main)


def test_unknown_commands_and_benchmarks_exit_2(capsys):
    assert cli.main(["distill"]) == 2
    assert "unknown command 'distill'" in capsys.readouterr().err
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert "decode_methods" in capsys.readouterr().err


def test_help_lists_every_command_and_bench_lists_the_benchmarks(capsys):
    assert cli.main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ["train", "bench", *cli.MODULES, *cli.TOOLS])
    assert cli.main(["bench", "--list"]) == 0
    assert {"decode_methods", "engine", "forward_rows"} <= set(capsys.readouterr().out.split())


def test_bench_runs_the_benchmark_module(capsys):
    assert cli.main(["bench", "decode_methods", "--dry-run", "--sets", "mt-bench"]) == 0
    assert "python -m decode.evaluate" in capsys.readouterr().out
