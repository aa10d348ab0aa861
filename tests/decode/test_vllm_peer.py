"""The vLLM peers (decode.vllm_peer): a peer that cannot run is a reason in the report, never a crash; a worker
that dies is an error carrying its output; vLLM's counters become our statistics; and, where `make vllm` was run,
vLLM's greedy decoding of a real target equals ours (slow: vLLM compiles for minutes)."""

from __future__ import annotations

import sys

import pytest
import torch

from specdistill.decode.evaluate import EvalConfig, build_methods
from specdistill.decode.vllm_peer import (
    PYTHON_ENV,
    WORKER_MEMORY_GIB,
    VllmWorker,
    export_name,
    memory_shortfall,
    stats_from,
    unavailable_reason,
    vllm_python,
)
from tests.conftest import ROOT
from tests.decode.test_evaluate import chat_target  # noqa: F401  (fixture)


def test_no_vllm_environment_is_a_reason_for_each_vllm_method(monkeypatch, tmp_path, chat_target):  # noqa: F811
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "missing" / "python"))
    assert "make vllm" in unavailable_reason(chat_target)
    config = EvalConfig(drafters=("prompt_lookup",), questions="q.jsonl", peers="vllm")
    methods, skipped = build_methods(chat_target, {}, config)
    assert [m.name for m in methods] == ["baseline"]
    assert set(skipped) == {"vllm_generate", "vllm_ngram"} and all("make vllm" in r for r in skipped.values())


def test_drafters_vllm_cannot_load_are_reasons_naming_them(monkeypatch, tmp_path, chat_target):  # noqa: F811
    from specdistill.decode.vllm_peer import vllm_methods
    from specdistill.models.drafters import Drafter

    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "missing" / "python"))
    drafters = {"truncated:1": Drafter(kind="draft_model", model=None, vocab_map=None, manifest={}, path=None),
                "prompt_lookup": Drafter(kind="prompt_lookup", model=None, vocab_map=None, manifest={}, path=None),
                "e3": Drafter(kind="eagle3", model=None, vocab_map=None, manifest={}, path="e3"),
                "la": Drafter(kind="lookahead", model=None, vocab_map=None, manifest={}, path="la"),
                "e3+pl": Drafter(kind="eagle3", model=None, vocab_map=None, manifest={}, path="e3", with_lookup=True)}
    methods, skipped = vllm_methods(chat_target, 16, True, drafters=drafters)
    assert methods == []
    assert "no lookahead drafter" in skipped["vllm_lookahead[la]"]
    assert "prompt-lookup chain" in skipped["vllm_eagle3[e3+pl]"]
    for name in ("vllm_draft_model[truncated:1]", "vllm_eagle3[e3]", "vllm_ngram"):  # loadable: the reason is
        assert "make vllm" in skipped[name]  # the missing environment
    assert not any("prompt_lookup" in name for name in skipped)  # its vLLM counterpart is vllm_ngram


def test_peers_accept_several_and_refuse_unknown_names():
    assert EvalConfig(drafters=("prompt_lookup",), questions="q", peers="hf,vllm").peers == ("hf", "vllm")
    assert EvalConfig(drafters=("prompt_lookup",), questions="q", peers=("vllm", "hf")).peers == ("vllm", "hf")
    assert EvalConfig(drafters=("prompt_lookup",), questions="q").peers == ()
    with pytest.raises(ValueError, match="peers"):
        EvalConfig(drafters=("prompt_lookup",), questions="q", peers="sglang")


def test_a_worker_that_dies_at_start_is_an_error_with_its_output(monkeypatch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named vllm' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv(PYTHON_ENV, str(fake))
    assert vllm_python() == fake
    with pytest.raises(RuntimeError, match="ImportError: no module named vllm"):
        VllmWorker(tmp_path, "float32", None)


def test_exports_of_drafters_with_the_same_directory_name_never_share_a_directory():
    names = [export_name(s) for s in ("runs/a/drafter", "runs/b/drafter", "/abs/runs/a/drafter", "truncated:4")]
    assert len(set(names)) == len(names)
    assert names[0].startswith("a_drafter-") and export_name("runs/a/drafter") == names[0]  # stable
    assert all(c.isalnum() or c in "-_." for name in names for c in name)


def test_another_engine_is_refused_with_a_reason_when_memory_is_short():
    assert memory_shortfall(WORKER_MEMORY_GIB + 0.5) is None
    reason = memory_shortfall(WORKER_MEMORY_GIB - 1.5)
    assert "not enough memory for another vLLM engine" in reason and "3.5 GiB available" in reason


def test_vllm_counters_become_our_statistics():
    reply = {"tokens": list(range(20)), "wall_s": 2.0,
             "spec": {"drafts": 6, "draft_tokens": 30, "accepted": 10, "accepted_per_position": [5, 3, 1, 1, 0]}}
    stats = stats_from(reply)
    assert stats.new_tokens == 20 and stats.target_forwards == 10 and stats.tau == 2.0
    assert stats.alpha == pytest.approx(10 / 30)
    assert stats.drafted_per_position == [6] * 5 and stats.accepted_per_position == [5, 3, 1, 1, 0]
    assert stats_from({"tokens": [1, 2], "wall_s": 1.0, "spec": {"drafts": 0}}) is None


def vllm_reply(target, speculative: dict | None, prompt: list[int], max_new_tokens: int) -> dict:
    """One greedy generation by a vLLM worker (float32, 2 threads) with this speculative_config, the worker closed."""
    from specdistill.decode.vllm_peer import target_directory

    worker = VllmWorker(target_directory(target), "float32", speculative, 2)
    try:
        return worker.generate(prompt, max_new_tokens, sorted(target.eos_token_ids))
    finally:
        worker.close()


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "python").exists(), reason="no vLLM environment (make vllm)")
def test_vllm_greedy_equals_our_engine_on_the_default_target():
    from specdistill.decode.engine import SpeculativeEngine
    from specdistill.models.target import load_target

    target = load_target()
    prompt = target.encode_chat([{"role": "user", "content": "Name three colours and say why the sky is blue."}])
    ours = SpeculativeEngine(target.model, None, target.eos_token_ids).generate(prompt, 48).tokens
    reply = vllm_reply(target, None, prompt, 48)
    assert reply["tokens"] == ours, (reply["tokens"], ours, sys.version)


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "python").exists(), reason="no vLLM environment (make vllm)")
def test_vllm_runs_an_exported_draft_model_losslessly(tmp_path):
    """The real engine on a `--format vllm` export: truncated:24 of the default target as vLLM's draft model (the
    untrained shallower truncations are accepted nowhere, in either engine). Its answer is our plain decoding's, and
    its acceptance is ours for the same 5-token chains, within 15%."""
    from specdistill.decode.engine import SpeculativeEngine
    from specdistill.decode.proposers import build_proposer
    from specdistill.decode.vllm_peer import exported_config, stats_from
    from specdistill.models.drafters import load_drafter
    from specdistill.models.target import load_target

    target = load_target()
    drafter = load_drafter("truncated:24", target)
    speculative = exported_config("truncated:24", drafter, target, tmp_path)
    assert speculative["method"] == "draft_model" and speculative["num_speculative_tokens"] == 5
    prompt = target.encode_chat([{"role": "user", "content": "List the days of the week."}])
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids).generate(prompt, 48).tokens
    proposer = build_proposer(drafter, target.model, gamma=5, eos_token_ids=target.eos_token_ids)
    ours = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False).generate(prompt, 48)
    reply = vllm_reply(target, speculative, prompt, 48)
    assert reply["tokens"] == plain == ours.tokens
    theirs = stats_from(reply)
    assert theirs is not None and ours.stats.tau > 1.5
    assert abs(theirs.tau - ours.stats.tau) <= 0.15 * ours.stats.tau, (theirs.tau, ours.stats.tau)


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "python").exists(), reason="no vLLM environment (make vllm)")
def test_vllm_runs_an_exported_dflash_drafter_losslessly(tmp_path):
    """vLLM's `dflash` method on a `--format vllm` export of a DFlash drafter (untrained, its layers the target's
    deep ones, a reduced head): vLLM loads it, drafts its whole block each step, and its answer is our plain
    decoding's, as ours is with the same drafter at the same fixed block. (A trained drafter's acceptance in both
    engines: docs/results.md, "DFlash in vLLM".)"""
    from specdistill.decode.engine import SpeculativeEngine
    from specdistill.decode.proposers import build_proposer
    from specdistill.decode.vllm_peer import exported_config, stats_from
    from specdistill.models.dflash import DFlashDrafter
    from specdistill.models.drafters import load_drafter, save_drafter
    from specdistill.models.target import load_target

    target = load_target()
    model = DFlashDrafter.for_target(target.model, torch.arange(0, target.vocab_size, 3)[:8192], num_layers=1,
                                     block_size=5, target_layers=[2, 15, 27], seed=3)
    save_drafter(tmp_path / "dflash", model, target, "dflash", config={**model.config})
    drafter = load_drafter(str(tmp_path / "dflash"), target)
    speculative = exported_config(str(tmp_path / "dflash"), drafter, target, tmp_path / "exports")
    assert speculative["method"] == "dflash" and speculative["num_speculative_tokens"] == 4
    prompt = target.encode_chat([{"role": "user", "content": "List the days of the week."}])
    plain = SpeculativeEngine(target.model, None, target.eos_token_ids).generate(prompt, 32).tokens
    proposer = build_proposer(drafter, target.model, eos_token_ids=target.eos_token_ids, dflash_min_prob=0,
                              dflash_priced=False)
    ours = SpeculativeEngine(target.model, proposer, target.eos_token_ids, adaptive=False).generate(prompt, 32)
    reply = vllm_reply(target, speculative, prompt, 32)
    assert reply["tokens"] == plain == ours.tokens
    theirs = stats_from(reply)
    assert theirs is not None and len(theirs.accepted_per_position) == 4  # it drafted the whole block
    assert abs(theirs.tau - ours.stats.tau) <= 0.15 * ours.stats.tau, (theirs.tau, ours.stats.tau)
