"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes through the literal `accelerate launch` command: it is really
DeepSpeed at that stage (not DDP run in its place), it ends with DDP's weights from the same seed, a resumed run
ends with the uninterrupted run's weights, and the published drafter decodes losslessly. Methods that do not run
under DeepSpeed are refused at start with an error naming the method and the stage."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT
from tests.train.test_distill_entrypoint import ACCELERATE, job_args, run_entrypoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install '.[deepspeed]')")

ZERO2 = str(ROOT / "configs/accelerate/deepspeed_zero2.yaml")
ZERO3 = str(ROOT / "configs/accelerate/deepspeed_zero3.yaml")
DDP = str(ROOT / "configs/accelerate/cpu_ddp_2proc.yaml")
TWO_CPU = ["--num_processes", "2", "--mixed_precision", "no"]

from tests.train.test_distill_entrypoint import prompts_file, tiny_target_dir  # noqa: E402,F401  (fixtures)


def launch(config: str, args: list[str]):
    # fp32 in both: DeepSpeed's bf16 keeps bf16 weights, DDP autocasts (auto: bf16 for eagle3 on a native-bf16 CPU)
    return run_entrypoint(args + ["--mixed_precision", "no"],
                          launcher=[ACCELERATE, "launch", "--config_file", config, *TWO_CPU])


def launch_ok(config: str, args: list[str]) -> None:
    res = launch(config, args)
    assert res.returncode == 0, res.stderr[-3000:]


def assert_deepspeed_at(out, stage: int) -> None:
    """The run was really DeepSpeed at `stage` with 2 processes (not DDP run in its place)."""
    run = summary(out)
    assert run["distributed_type"] == "DEEPSPEED" and run["zero_stage"] == stage and run["num_processes"] == 2


def assert_decodes_losslessly(target_dir, drafter_dir, **proposer_options):
    """The published drafter's greedy speculation equals plain decoding; returns the loaded drafter."""
    from specdistill.decode.engine import SpeculativeEngine
    from specdistill.decode.proposers import build_proposer
    from specdistill.models.drafters import load_drafter
    from specdistill.models.target import load_target

    target = load_target(str(target_dir))
    drafter = load_drafter(str(drafter_dir), target)
    proposer = build_proposer(drafter, target.model, **proposer_options)
    prompt = target.encode_chat([{"role": "user", "content": "w1 w2 w3"}])
    plain = SpeculativeEngine(target.model, None).generate(prompt, 20).tokens
    assert SpeculativeEngine(target.model, proposer, adaptive=False).generate(prompt, 20).tokens == plain
    return drafter


def summary(out) -> dict:
    return json.loads((out / "drafter.work" / "summary.json").read_text())


def published_weights(out) -> dict[str, torch.Tensor]:
    files = sorted((out / "drafter").rglob("*.safetensors"))
    assert files, f"no weights under {out / 'drafter'}"
    return {k: v for f in files for k, v in load_file(f).items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def ddp_run(tiny_target_dir, prompts_file, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("ddp")
    launch_ok(DDP, job_args(tiny_target_dir, prompts_file, out))
    return out


@pytest.mark.parametrize("config,stage", [(ZERO2, 2), (ZERO3, 3)], ids=["zero2", "zero3"])
def test_zero_is_deepspeed_and_ends_with_ddps_weights(ddp_run, tiny_target_dir, prompts_file, tmp_path,  # noqa: F811
                                                      config, stage):
    launch_ok(config, job_args(tiny_target_dir, prompts_file, tmp_path))
    assert_deepspeed_at(tmp_path, stage)
    assert summary(ddp_run)["distributed_type"] == "MULTI_CPU"
    assert_same_weights(published_weights(tmp_path), published_weights(ddp_run))


@pytest.mark.parametrize("config", [ZERO2, ZERO3], ids=["zero2", "zero3"])
def test_resume_equals_the_uninterrupted_run_and_decodes_losslessly(ddp_run, tiny_target_dir,  # noqa: F811
                                                                    prompts_file, tmp_path, config):  # noqa: F811
    args = job_args(tiny_target_dir, prompts_file, tmp_path, checkpoint_every=3)
    launch_ok(config, args + ["--stop_at_step", "3"])
    assert not (tmp_path / "drafter").exists()  # stopped early: nothing published yet
    launch_ok(config, args + ["--resume", "true"])
    assert summary(tmp_path)["step"] == summary(ddp_run)["step"]
    assert_same_weights(published_weights(tmp_path), published_weights(ddp_run))
    assert_decodes_losslessly(tiny_target_dir, tmp_path / "drafter", gamma=3)


@pytest.mark.parametrize("config,method,stage", [(ZERO3, "colbt", 3), (ZERO2, "medusa", 2)])
def test_unsupported_method_or_stage_is_an_error_naming_both(tiny_target_dir, prompts_file, tmp_path,  # noqa: F811
                                                             config, method, stage):
    res = launch(config, job_args(tiny_target_dir, prompts_file, tmp_path, method=method))
    assert res.returncode != 0
    assert f"method {method} does not run under DeepSpeed ZeRO stage {stage}" in res.stderr
    assert not (tmp_path / "drafter").exists()


# ---- eagle3: a loop of its own (no dataloader for DeepSpeed to read the batch size from; the loss calls the
# drafter's parts, not the engine's forward; the whole drafter gathered for measuring and saving under ZeRO-3)

def eagle3_args(target_dir, prompts, out, **overrides) -> list[str]:
    fields = {"method": "eagle3", "eagle3.steps": 2, "eagle3.depth": 3, "eagle3.topk": 2, "eagle3.tree_nodes": 4,
              "draft_vocab": 0, "batch_size": 4, "epochs": 3, "lr": 3e-3}
    fields.update(overrides)
    return job_args(target_dir, prompts, out, **fields) + ["--eagle3.layers", "0", "1", "1"]


@pytest.fixture(scope="module")
def eagle3_ddp_run(tiny_target_dir, prompts_file, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eagle3_ddp")
    launch_ok(DDP, eagle3_args(tiny_target_dir, prompts_file, out))
    return out


@pytest.mark.parametrize("config,stage", [(ZERO2, 2), (ZERO3, 3)], ids=["zero2", "zero3"])
def test_eagle3_under_zero_ends_with_ddps_weights_and_decodes_losslessly(eagle3_ddp_run, tiny_target_dir,  # noqa: F811
                                                                         prompts_file, tmp_path, config, stage):  # noqa: F811
    launch_ok(config, eagle3_args(tiny_target_dir, prompts_file, tmp_path))
    assert_deepspeed_at(tmp_path, stage)
    assert summary(eagle3_ddp_run)["step"] == summary(tmp_path)["step"] > 0
    trained, reference = published_weights(tmp_path), published_weights(eagle3_ddp_run)
    initial = {k: v for f in sorted((tmp_path / "drafter.work" / "initial").rglob("*.safetensors"))
               for k, v in load_file(f).items()}
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # it trained
    assert_same_weights(trained, reference)
    assert assert_decodes_losslessly(tiny_target_dir, tmp_path / "drafter").kind == "eagle3"


def test_eagle3_resumed_from_a_zero3_checkpoint_equals_the_uninterrupted_run(eagle3_ddp_run, tiny_target_dir,  # noqa: F811
                                                                              prompts_file, tmp_path):  # noqa: F811
    args = eagle3_args(tiny_target_dir, prompts_file, tmp_path, checkpoint_every=4)
    launch_ok(ZERO3, args + ["--stop_at_step", "4"])
    assert not (tmp_path / "drafter").exists()  # stopped early: nothing published yet
    launch_ok(ZERO3, args + ["--resume", "true"])
    assert summary(tmp_path)["step"] == summary(eagle3_ddp_run)["step"]
    assert_same_weights(published_weights(tmp_path), published_weights(eagle3_ddp_run))
