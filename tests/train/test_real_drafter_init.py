"""A named real target as a drafter's starting point (`drafter: qwen2.5-coder-0.5b`): it comes with its GGUF's K-quant
blocks attached, which the engine computes those linears from; training changes the fp32 weights, so the drafter
built for training must draft with those, not with the blocks of the model it started as."""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.decode.runner import ModelRunner
from specdistill.models.drafters import Drafter
from specdistill.models.gguf_blocks import ATTRIBUTE
from specdistill.models.kernel_linear import kquant_usable
from specdistill.models.target import target_from_model
from specdistill.train import distill_steps
from specdistill.train.distill_config import DistillConfig
from tests.models.conftest import make_tiny_tokenizer
from tests.models.kquant_fixtures import attach_directly, make_tiny_kquant_qwen2

TOKENS = [5, 17, 3, 40, 22, 9, 61, 30]


def runner_logits(model: torch.nn.Module) -> torch.Tensor:
    """[T, V] the engine's logits of TOKENS (decode.runner: the lean decoder, K-quant blocks where attached)."""
    runner = ModelRunner(model)
    runner.start(len(TOKENS) + 1)
    with torch.no_grad():
        return runner.forward(TOKENS)[1]


def trained_a_little(model: torch.nn.Module) -> torch.nn.Module:
    """The model after some training: every weight moved."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


@pytest.fixture(scope="module")
def kquant_drafter():
    model, tensors = make_tiny_kquant_qwen2(seed=1)
    attach_directly(model, tensors)  # as models.drafters.load_drafter attaches a named real target's blocks
    if not kquant_usable(model.model.layers[0].self_attn.q_proj):
        pytest.skip("this CPU does not run the K-quant kernels: the blocks are never read")
    return model, tensors


def test_a_real_target_drafter_trains_and_drafts_its_own_weights(kquant_drafter, monkeypatch):
    blocked, tensors = kquant_drafter
    target_model, _ = make_tiny_kquant_qwen2(seed=2)
    target = target_from_model(target_model, make_tiny_tokenizer(), name="tiny-qwen2")
    monkeypatch.setattr(distill_steps, "load_drafter",
                        lambda spec, target: Drafter("draft_model", copy.deepcopy(blocked), None, {}, None))
    cfg = DistillConfig(method="seqkd", drafter="qwen2.5-coder-0.5b", prompts=["self:4"])
    drafter, _ = distill_steps.build_drafter(cfg, target, records=[])
    assert not any(hasattr(m, ATTRIBUTE) for m in drafter.modules())
    trained_a_little(drafter)
    with torch.no_grad():
        reference = drafter(input_ids=torch.tensor([TOKENS])).logits[0]  # [T, V] its trained fp32 weights
    torch.testing.assert_close(runner_logits(drafter), reference, atol=2e-3, rtol=1e-3)
    # the drafter as it would be with its blocks kept drafts the model it started as: what the fix prevents
    stale = copy.deepcopy(drafter)
    attach_directly(stale, tensors)
    assert (runner_logits(stale) - reference).abs().max() > 0.05


def test_seqkd_with_lora_on_a_reduced_qwen2_drafter_trains_to_a_budget_and_publishes_it(tmp_path, monkeypatch):
    """The qwen_coder_seqkd.yaml recipe in miniature: a Qwen2 drafter (attention biases, its own head) cut to a
    reduced head, LoRA on it, trained by Seq-KD under max_minutes: the decided steps run, only LoRA trained (the
    published drafter is the start plus merged adapters, its frozen rows untouched), held-out tau measured at the
    start and the end, and the published drafter decodes losslessly."""
    import json

    from accelerate import Accelerator

    from specdistill.decode.engine import SpeculativeEngine
    from specdistill.decode.proposers import build_proposer
    from specdistill.models.drafters import load_drafter
    from specdistill.train import step_budget
    from specdistill.train.kd import train_kd
    from tests.distill.conftest import make_tiny_tokenizer as chat_tokenizer
    from tests.train.support import greedy_records

    target_model, _ = make_tiny_kquant_qwen2(seed=2)
    with torch.no_grad():
        target_model.lm_head.weight.mul_(40.0)  # a peaked target: a clear greedy choice to learn
    target = target_from_model(target_model, chat_tokenizer(), name="tiny-qwen2")
    start, _ = make_tiny_kquant_qwen2(seed=1)
    start.save_pretrained(tmp_path / "start")
    records = greedy_records(target, 64, n=16, new_tokens=8)
    questions = tmp_path / "held_out.jsonl"
    questions.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 3} w{i + 7}"}) + "\n" for i in range(2)))
    monkeypatch.setattr(step_budget, "CALIBRATION_STEPS", 0)
    monkeypatch.setattr(step_budget, "seconds_since_start", lambda: 0.0)
    observe = step_budget.StepBudget.observe_step
    monkeypatch.setattr(step_budget.StepBudget, "observe_step", lambda self, seconds, step: observe(self, 1.0, step))
    monkeypatch.setattr(step_budget.StepBudget, "per_eval", lambda self: 10.0)
    cfg = DistillConfig(method="seqkd", drafter=str(tmp_path / "start"), draft_vocab=40, lora_r=4, lr=1e-2,
                        batch_size=4, max_steps=1000, max_minutes=0.5, warmup_steps=2, eval_every=1000,
                        eval_prompts=f"jsonl:{questions}", eval_max_new_tokens=8, checkpoint_every=0,
                        max_seq_len=48, output_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"))
    out = train_kd(cfg, Accelerator(cpu=True), target, records)
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    # decided after the 2 warm-up steps: of the 30 s, 10 s kept for the final evaluation leave 20 steps of 1 s
    assert summary["step"] == summary["decided_steps"] == 2 + 20
    assert [h["step"] for h in summary["history"]] == [0, 22]
    drafter = load_drafter(str(out), target)
    weights = dict(drafter.model.named_parameters())
    assert weights["model.embed_tokens.weight"].equal(start.model.embed_tokens.weight)  # not a LoRA module: frozen
    assert not weights["model.layers.0.self_attn.q_proj.weight"].equal(start.model.layers[0].self_attn.q_proj.weight)
    engine = SpeculativeEngine(target.model, build_proposer(drafter, target.model), target.eos_token_ids)
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids)
    for record in records[:3]:
        assert engine.generate(record["prompt_ids"], 12).tokens == plain.generate(record["prompt_ids"], 12).tokens
