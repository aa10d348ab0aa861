"""The CUDA path: speculative decoding on a GPU is lossless against plain decoding of the same target in the
same dtype, the verification steps replayed as CUDA graphs compute what the eager steps do (every bucket,
recorded once and reused across requests), so does the EAGLE-3 drafter's graphed tree step, and an EAGLE-3
drafter trains there. Marked `gpu` (`make test-gpu`); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import PromptLookupProposer, WithPromptLookup
from specdistill.decode.proposers.draft_model import DraftModelProposer
from specdistill.decode.proposers.eagle3 import Eagle3Proposer
from specdistill.decode.runner import ModelRunner
from specdistill.decode.step_graphs import BUCKETS, DISABLE_ENV, bucket_for
from specdistill.models.eagle3 import Eagle3Drafter
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import PROMPT
from tests.decode.test_step_graphs import random_tree, run_tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.bfloat16]


def tiny_on_gpu(dtype, seed=0, layers=4):
    return make_tiny_llama(seed=seed, layers=layers, peak=4.0).to("cuda", dtype)


def plain(target, n=48) -> list[int]:
    """Our own plain decoding of the same target in the same dtype: the reference speculation must equal."""
    return SpeculativeEngine(target, None).generate(PROMPT, n).tokens


def proposers(target):
    drafter = make_tiny_llama(seed=5, layers=1, peak=4.0).to("cuda", target.dtype)
    eagle = Eagle3Drafter.for_target(target, None, [1, 2, 3], seed=3).to("cuda", target.dtype).eval()
    embed = target.get_input_embeddings()
    return {
        "draft_model": DraftModelProposer(drafter, gamma=4),
        "prompt_lookup": PromptLookupProposer(),
        "eagle3_chain": Eagle3Proposer(eagle, embed, depth=4, topk=1, tree_nodes=4),
        "eagle3_tree": Eagle3Proposer(eagle, embed, depth=6, topk=4, tree_nodes=16),
        "eagle3+prompt_lookup": WithPromptLookup(Eagle3Proposer(eagle, embed, depth=5, topk=3, tree_nodes=9),
                                                 PromptLookupProposer()),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_greedy_speculation_equals_plain_decoding_on_cuda(dtype):
    target = tiny_on_gpu(dtype)
    ref = plain(target)
    for name, proposer in proposers(target).items():
        for adaptive in (False, True):
            engine = SpeculativeEngine(target, proposer, adaptive=adaptive)
            assert engine.target.steps is not None and engine.target.steps.graphed
            assert engine.one_shape == (dtype == torch.bfloat16)  # bf16: every forward one step shape
            out = engine.generate(PROMPT, 48).tokens
            assert out == ref, f"{name} (adaptive={adaptive}, {dtype}) diverged from plain decoding"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_graph_replays_equal_eager_steps_for_every_bucket(dtype, monkeypatch):
    target = tiny_on_gpu(dtype)
    prompt = [3 + i % 60 for i in range(80)]  # longer than the largest bucket: an eager prefill
    graphed = ModelRunner(target)
    monkeypatch.setenv(DISABLE_ENV, "1")
    eager = ModelRunner(target, fixed_steps=True)
    assert graphed.steps.graphed and not eager.steps.graphed
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    with torch.inference_mode():
        for nodes in sorted({1, 2, 3, *BUCKETS, 37}):
            tree = random_tree(nodes, seed=nodes)
            got, want = run_tree(graphed, prompt, tree), run_tree(eager, prompt, tree)
            for a, b in zip(got, want):  # prefill logits, tree logits, features, hidden
                torch.testing.assert_close(a.float(), b.float(), **tol)
            assert torch.equal(got[1].argmax(-1), want[1].argmax(-1))
    assert graphed.steps.captures == len({bucket_for(n) for n in {1, 2, 3, *BUCKETS, 37}})


def test_requests_reuse_the_recorded_graphs():
    target = tiny_on_gpu(torch.bfloat16)
    engine = SpeculativeEngine(target, PromptLookupProposer(), adaptive=False)  # the same trees every request
    first = engine.generate(PROMPT, 48).tokens
    recorded = engine.target.steps.captures
    assert recorded == len(engine.target.steps.steps) > 0  # each step recorded once
    for _ in range(3):
        assert engine.generate(PROMPT, 48).tokens == first
    assert engine.target.steps.captures == recorded  # nothing recorded again


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_eagle3_draft_graphs_draft_what_eager_steps_draft_and_are_recorded_once(dtype, monkeypatch):
    from specdistill.decode.draft_steps import DISABLE_ENV as NO_DRAFT_GRAPHS

    target = tiny_on_gpu(dtype)
    eagle = Eagle3Drafter.for_target(target, None, [1, 2, 3], seed=3).to("cuda", dtype).eval()
    embed, shape = target.get_input_embeddings(), dict(depth=6, topk=4, tree_nodes=16)
    graphed = Eagle3Proposer(eagle, embed, **shape)  # the CUDA default: fixed steps, graphed
    monkeypatch.setenv(NO_DRAFT_GRAPHS, "1")
    eager = Eagle3Proposer(eagle, embed, fixed_steps=True, **shape)
    monkeypatch.delenv(NO_DRAFT_GRAPHS)
    assert graphed.graphed and graphed.fixed_steps and not eager.graphed
    runs = {}
    for name, proposer in (("graphed", graphed), ("eager", eager)):
        trees, original = [], proposer.draft_tree
        proposer.draft_tree = lambda *a, o=original, t=trees: t.append(o(*a)) or t[-1]
        tokens = SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPT, 48).tokens
        runs[name] = tokens, [(tree.tokens, tree.parents) for tree in trees]
    assert runs["graphed"] == runs["eager"]  # the same kernels replayed: the same trees, token for token
    assert runs["graphed"][0] == plain(target)
    recorded = dict(graphed.step.graphs)  # depth -> (graph, output)
    assert 6 in recorded and graphed.context_step.graphs  # the full depth's graph, and the context rows'
    contexts = dict(graphed.context_step.graphs)
    SpeculativeEngine(target, graphed, adaptive=False).generate(PROMPT, 32)
    assert graphed.step.graphs[6] is recorded[6]  # a new request replays the recorded graphs
    assert all(graphed.context_step.graphs[rows] is graph for rows, graph in contexts.items())


def test_plain_decoding_on_cuda_matches_cpu_in_fp32():
    cpu = make_tiny_llama(seed=0, layers=4, peak=4.0)
    assert plain(cpu.to("cuda")) == plain(make_tiny_llama(seed=0, layers=4, peak=4.0))


def test_eagle3_trains_on_cuda_and_decodes_losslessly(tmp_path, monkeypatch):
    from specdistill.decode.proposers import build_proposer
    from specdistill.models.drafters import load_drafter
    from specdistill.train.eagle3 import train_eagle3
    from tests.train.support import greedy_records, peaked_tiny_target
    from tests.train.test_eagle3_train import VOCAB, eagle3_config, held_out_prompts

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    target = peaked_tiny_target(VOCAB, seed=1)
    records = greedy_records(target, VOCAB, n=48, new_tokens=20)
    target.model.to("cuda")
    accelerator = Accelerator(mixed_precision="bf16")
    assert accelerator.device.type == "cuda"
    out = train_eagle3(eagle3_config(tmp_path, max_steps=40), accelerator, target, records[:40],
                       held_out_prompts(records))
    drafter = load_drafter(out, target)  # on the target's device
    proposer = build_proposer(drafter, target.model, eos_token_ids=target.eos_token_ids)
    for prompt in held_out_prompts(records):
        ref = SpeculativeEngine(target.model, None, target.eos_token_ids).generate(prompt, 20).tokens
        got = SpeculativeEngine(target.model, proposer, target.eos_token_ids).generate(prompt, 20)
        assert got.tokens == ref
    assert got.stats.target_forwards < 20  # it drafts something the target accepts
