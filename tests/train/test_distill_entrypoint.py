"""train/distill.py end to end on a tiny offline target saved as an HF directory.

Properties: the literal `accelerate launch train/distill.py` command works; a config typo is an
error naming the key; trainable weights change and the target's do not; a resumed run ends with
the weights of an uninterrupted one; two CPU processes agree on the weights; the drafter
directory loads in the evaluation path; a peaked target is learned (alpha rises).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdistill.train.config import ConfigError, load_config
from specdistill.train.distill_config import DistillConfig
from tests.conftest import ROOT
from tests.distill.conftest import make_tiny_target

PY = sys.executable
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny, peaked target (a clear greedy choice at every step) with a chat tokenizer."""
    path = tmp_path_factory.mktemp("target")
    target = make_tiny_target(seed=0)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(40.0)
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = [{"prompt": " ".join(f"w{(i * 7 + j * 3) % 50}" for j in range(4 + i % 5))} for i in range(24)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def job_args(target_dir, prompts, out: Path, **overrides) -> list[str]:
    fields = dict(method="seqkd", target=str(target_dir), drafter="small:layers=1,hidden=32",
                  output_dir=str(out / "drafter"), prompts=f"jsonl:{prompts}", max_new_tokens=12,
                  gen_batch_size=8, batch_size=4, epochs=2, max_seq_len=48, warmup_steps=2, lr=3e-3,
                  eval_every=0, eval_prompts=f"jsonl:{prompts}?limit=3", eval_max_new_tokens=12,
                  checkpoint_every=0, log_every=1, seed=3)
    fields.update(overrides)
    return [x for k, v in fields.items() for x in (f"--{k}", str(v))]


def run_entrypoint(args: list[str], launcher: list[str] | None = None, env_extra: dict | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    cmd = (launcher or [PY]) + ["train/distill.py"] + args
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def drafter_weights(out: Path) -> dict[str, torch.Tensor]:
    files = sorted((out / "drafter").rglob("*.safetensors"))
    weights = {}
    for f in files:
        if f.name != "vocab_map.safetensors":
            weights.update(load_file(f))
    return weights


def test_config_typo_is_an_error_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: seqkd\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(DistillConfig, ["--config", str(bad)])
    with pytest.raises(SystemExit):
        load_config(DistillConfig, ["--lerning_rate", "0.1"])
    with pytest.raises(ConfigError, match="batch_size"):
        load_config(DistillConfig, ["--batch_size", "many"])
    with pytest.raises(ConfigError, match="loss"):
        load_config(DistillConfig, ["--method", "kd", "--loss", "ce", "--topk", "4"])
    with pytest.raises(ConfigError, match="teacher_backend.*builtin.*vllm"):
        load_config(DistillConfig, ["--teacher_backend", "sglang"])
    assert load_config(DistillConfig, ["--teacher_backend", "vllm"]).teacher_backend == "vllm"


def test_teacher_settings_keep_the_greedy_answer_beside_samples_when_asked():
    from specdistill.train.distill_steps import teacher_settings

    greedy = teacher_settings(load_config(DistillConfig, []))
    assert (greedy.sample_indices, greedy.shard_size) == ([0], 64)  # the defaults keep every existing cache key
    cfg = load_config(DistillConfig, ["--gen_temperature", "0.8", "--samples_per_prompt", "2",
                                      "--gen_keep_greedy", "true", "--gen_shard_size", "256"])
    both = teacher_settings(cfg)
    assert (both.sample_indices, both.temperature, both.shard_size) == ([0, 1, 2], 0.8, 256)
    sampled = teacher_settings(load_config(DistillConfig, ["--gen_temperature", "0.8", "--samples_per_prompt", "2"]))
    assert sampled.sample_indices == [0, 1]  # samples only: index 0 is a sample, not the greedy answer
    with pytest.raises(ConfigError, match="gen_keep_greedy"):
        load_config(DistillConfig, ["--gen_keep_greedy", "true"])
    with pytest.raises(ConfigError, match="gen_shard_size"):
        load_config(DistillConfig, ["--gen_shard_size", "0"])


def test_cpu_training_uses_the_machines_cores_not_accelerates_one_thread():
    from specdistill.train.distill import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(0, 1) == cores  # accelerate launch's OMP_NUM_THREADS=1 is not what a lone process gets
    assert cpu_threads(0, 2) == max(1, cores // 2) and cpu_threads(0, 4 * cores) == 1
    assert cpu_threads(3, 1) == 3  # asked for
    with pytest.raises(ConfigError, match="threads"):
        load_config(DistillConfig, ["--threads", "-1"])


def test_auto_mixed_precision_is_bf16_on_cuda_and_for_eagle3_on_cpus_with_native_bf16(monkeypatch):
    import specdistill.train.distill as distill

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for native, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(distill, "native_bf16_cpu", lambda native=native: native)
        assert distill.resolve_mixed_precision("auto", "eagle3") == expected
        assert distill.resolve_mixed_precision("auto", "eagle3", deepspeed=True) == "no"  # bf16 weights, not autocast
        assert distill.resolve_mixed_precision("auto", "kd") == "no"  # not measured under bf16 on a CPU
        for chosen in ("no", "bf16", "fp16"):  # a choice stands whatever the machine and method
            assert distill.resolve_mixed_precision(chosen, "eagle3") == chosen
            assert distill.resolve_mixed_precision(chosen, "seqkd") == chosen
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert {distill.resolve_mixed_precision("auto", m) for m in ("eagle3", "seqkd", "medusa")} == {"bf16"}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_native_bf16_is_what_the_cpu_flags_say():
    from specdistill.train.distill import native_bf16_cpu

    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert native_bf16_cpu() == bool({"avx512_bf16", "amx_tile"} & flags)


def test_precedence_default_yaml_cli(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("lr: 0.01\nbatch_size: 3\nprompts: ['self:5']\n")
    cfg = load_config(DistillConfig, ["--config", str(path), "--batch_size", "5"])
    assert (cfg.lr, cfg.batch_size, cfg.prompts, cfg.epochs) == (0.01, 5, ["self:5"], DistillConfig().epochs)
    assert cfg.work_dir == cfg.output_dir + ".work"


def test_literal_accelerate_launch_trains_and_resumes(tiny_target_dir, prompts_file, tmp_path):
    """One process, by the documented command; then the same job interrupted and resumed."""
    full = tmp_path / "full"
    res = run_entrypoint(job_args(tiny_target_dir, prompts_file, full, checkpoint_every=2),
                         launcher=[ACCELERATE, "launch", "--num_processes", "1", "--cpu"])
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((full / "drafter" / "manifest.json").read_text())
    assert manifest["kind"] == "draft_model"
    assert manifest["config"]["output_dir"] == str(full / "drafter")
    # the record names the precision that ran (auto resolved), the log that it was auto's choice
    from specdistill.train.distill import resolve_mixed_precision
    assert manifest["config"]["mixed_precision"] == resolve_mixed_precision("auto", "seqkd")
    assert f"mixed precision: {manifest['config']['mixed_precision']} (auto)" in res.stderr
    # each phase's time and memory, in the order they ran (teacher data: a seqkd job has no second turns)
    phases = json.loads((full / "drafter.work" / "phases.json").read_text())
    assert [p["name"] for p in phases] == ["target", "teacher data", "drafter training"]
    assert all(p["seconds"] >= 0 and 0 < p["peak_rss_gib"] <= p["job_peak_rss_gib"] for p in phases)

    part = tmp_path / "part"
    first = run_entrypoint(job_args(tiny_target_dir, prompts_file, part, checkpoint_every=2, stop_at_step=3))
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (part / "drafter").exists()  # stopped: nothing published yet
    resumed = run_entrypoint(job_args(tiny_target_dir, prompts_file, part, checkpoint_every=2, resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = drafter_weights(full), drafter_weights(part)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5)


def file_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_peaked_target_is_learned_and_only_the_drafter_changes(tiny_target_dir, prompts_file, tmp_path):
    """truncated:1 of a peaked target: held-out alpha rises well above its start; the target's files
    are untouched and the drafter's weights moved away from the copied layer."""
    before = file_digest(tiny_target_dir / "model.safetensors")
    res = run_entrypoint(job_args(tiny_target_dir, prompts_file, tmp_path, drafter="truncated:1", epochs=6,
                                  eval_every=12, lr=1e-2))
    assert res.returncode == 0, res.stderr[-3000:]
    assert file_digest(tiny_target_dir / "model.safetensors") == before
    history = json.loads((tmp_path / "drafter.work" / "summary.json").read_text())["history"]
    assert history[0]["step"] == 0
    start, best = history[0]["alpha"], max(h["alpha"] for h in history)
    assert best > start + 0.2, history
    target = load_file(tiny_target_dir / "model.safetensors")
    trained = drafter_weights(tmp_path)
    moved = [k for k in trained if k in target and not torch.allclose(trained[k], target[k])]
    assert any("layers.0" in k for k in moved)


def test_two_cpu_processes_agree_on_the_weights(tiny_target_dir, prompts_file, tmp_path):
    res = run_entrypoint(job_args(tiny_target_dir, prompts_file, tmp_path),
                         launcher=[ACCELERATE, "launch", "--config_file",
                                   str(ROOT / "configs/accelerate/cpu_ddp_2proc.yaml")])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "drafter.work" / "summary.json").read_text())
    assert summary["num_processes"] == 2
    assert len(set(summary["replica_weight_digests"])) == 1
    assert (tmp_path / "drafter" / "manifest.json").is_file()


def test_colbt_ensemble_trains_loads_and_decodes_losslessly(tiny_target_dir, prompts_file, tmp_path):
    """method colbt through the entrypoint: an ensemble directory whose members load on their own,
    and whose merged-tree decoding is the target's greedy output."""
    from specdistill.decode.engine import SpeculativeEngine
    from specdistill.decode.proposers import build_proposer
    from specdistill.models.drafters import load_drafter
    from specdistill.models.target import load_target

    res = run_entrypoint(job_args(tiny_target_dir, prompts_file, tmp_path, method="colbt", epochs=1,
                                  **{"colbt.holdout": 4, "colbt.max_tree_nodes": 8})
                         + ["--colbt.members", "truncated:1", "small:layers=1,hidden=32"])
    assert res.returncode == 0, res.stderr[-3000:]
    target = load_target(str(tiny_target_dir))
    ensemble = load_drafter(str(tmp_path / "drafter"), target)
    assert ensemble.kind == "ensemble" and len(ensemble.members) == 2
    member = load_drafter(str(tmp_path / "drafter" / ensemble.manifest["members"][1]), target)
    assert member.kind == "draft_model"
    prompt = target.encode_chat([{"role": "user", "content": "w1 w2 w3"}])
    ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = SpeculativeEngine(target.model, build_proposer(ensemble, target.model, gamma=3), adaptive=False)
    assert engine.generate(prompt, 20).tokens == ref


@pytest.mark.parametrize("extra", [
    {"method": "kd", "loss": "fkl", "topk": 8},
    {"method": "kd", "loss": "jsd", "jsd_beta": 0.5, "topk": 8},
    {"method": "kd", "loss": "rkl", "on_policy_lambda": 0.5, "topk": 8},
    {"method": "kd", "loss": "fkl", "topk": 8, "draft_vocab": 40},
], ids=["fkl_topk", "jsd_topk", "rkl_half_on_policy", "fkl_topk_reduced_vocab"])
def test_token_level_kd_learns_the_peaked_target(tiny_target_dir, prompts_file, tmp_path, extra):
    res = run_entrypoint(job_args(tiny_target_dir, prompts_file, tmp_path, drafter="truncated:1", epochs=8,
                                  eval_every=12, lr=1e-2, **extra))
    assert res.returncode == 0, res.stderr[-3000:]
    history = json.loads((tmp_path / "drafter.work" / "summary.json").read_text())["history"]
    assert max(h["alpha"] for h in history) > history[0]["alpha"] + 0.1, history


def test_missing_tracker_package_is_a_clear_error(tiny_target_dir, prompts_file, tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    res = run_entrypoint(job_args(tiny_target_dir, prompts_file, tmp_path, tracker="wandb"))
    assert res.returncode != 0 and "tracker: wandb is not installed" in res.stderr
    assert not (tmp_path / "drafter").exists()
