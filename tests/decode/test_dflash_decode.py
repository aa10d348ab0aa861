"""DFlash decoding: lossless with chains and trees (EOS and max_new_tokens inside a block, prompt-lookup steps that
skip the drafter), sampling keeps the target's distribution, and the training forward is what decoding computes."""

import math
import time
from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.lean_dflash import LeanDFlash
from specdistill.decode.lean_eagle3 import DISABLE_ENV as LEAN_DISABLE_ENV
from specdistill.decode.proposers import PromptLookupProposer, WithPromptLookup
from specdistill.decode.proposers.dflash import (
    DFlashProposer,
    build_dflash_proposer,
    dflash_drafting_weights,
    tree_candidates,
)
from specdistill.decode.tree import DEFAULT_MIN_PROB
from specdistill.models.dflash import DFlashDrafter
from specdistill.models.kernel_linear import Q8Int8Linear
from specdistill.models.kernels import int8_unavailable
from specdistill.models.packed_linear import drafting_weights
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import PROMPT, target_greedy
from tests.models.test_dflash import features_of


def tiny_dflash(target, vocab=None, layers=(1, 2), num_layers=2, block_size=6, seed=3):
    vocab_map = None if vocab is None else torch.tensor(vocab)
    return DFlashDrafter.for_target(target, vocab_map, num_layers=num_layers, block_size=block_size,
                                    target_layers=list(layers), seed=seed).eval()


def recorded_trees(proposer) -> list:
    """Every tree the proposer drafts, kept as it returns them."""
    trees, original = [], proposer.propose
    proposer.propose = lambda *a: trees.append(original(*a)) or trees[-1]
    return trees


@pytest.mark.parametrize("shape, adaptive", [(dict(), True), (dict(depth=2), False), (dict(topk=3), False),
                                             (dict(topk=2, tree_nodes=4), False), (dict(topk=2, min_prob=0.3), True)])
def test_greedy_output_is_the_targets(shape, adaptive):
    target = make_tiny_llama(seed=0, layers=3, peak=4.0)
    ref = target_greedy(target, PROMPT, 32)
    proposer = DFlashProposer(tiny_dflash(target), target.get_input_embeddings(), **{"min_prob": 0, **shape})
    trees = recorded_trees(proposer)
    gen = SpeculativeEngine(target, proposer, adaptive=adaptive).generate(PROMPT, 32)
    assert gen.tokens == ref and gen.stats.new_tokens == 32
    if not adaptive:  # unpriced, no floor: every tree is the tree_nodes most probable candidates
        depth, nodes = shape.get("depth", 5), shape.get("tree_nodes", shape.get("depth", 5) * shape.get("topk", 1))
        assert max(len(t) - 1 for t in trees) == nodes
        if shape.get("topk", 1) == 1:
            assert max(t.max_depth for t in trees) == depth


def block_proposer(block_size: int = 6, **kw) -> DFlashProposer:
    target = make_tiny_llama(seed=0, layers=3)
    return DFlashProposer(tiny_dflash(target, block_size=block_size), target.get_input_embeddings(), **kw)


def row_logits(rows: list[dict[int, float]], vocab: int = 64) -> torch.Tensor:
    """[d, vocab] logits whose softmax puts each row's given probabilities on its tokens and the rest of the mass
    evenly on the other tokens."""
    logits = torch.empty(len(rows), vocab)
    for i, row in enumerate(rows):
        logits[i] = math.log((1 - sum(row.values())) / (vocab - len(row)))
        for token, p in row.items():
            logits[i, token] = math.log(p)
    return logits


def test_candidates_are_scored_by_their_path_and_stop_under_an_eos():
    logq = [[math.log(0.8), math.log(0.1)], [math.log(0.5), math.log(0.4)], [math.log(0.9), math.log(0.05)]]
    tokens, parents, scores, depths = tree_candidates(logq, [[10, 11], [20, 21], [30, 31]], eos_token_ids={20})
    assert tokens == [10, 11, 20, 21] and depths == [1, 1, 2, 2]  # nothing under the EOS at depth 2
    assert parents == [-1, -1, 0, 0]  # alternatives hang beside the chain's node, under its parent
    assert [round(math.exp(x), 6) for x in scores] == [0.8, 0.1, 0.4, 0.32]
    assert all(p < 0 or scores[i] <= scores[p] for i, p in enumerate(parents))  # closed under ancestors


def test_the_tree_keeps_the_most_probable_candidates_above_the_floor():
    rows = [{5: 0.9, 6: 0.05}, {7: 0.5, 8: 0.45}, {9: 0.3, 10: 0.2}]  # chain paths 0.9, 0.45, 0.135
    tree = block_proposer(topk=2, tree_nodes=3, min_prob=0).greedy_tree(1, row_logits(rows))
    assert sorted(tree.tokens[1:]) == [5, 7, 8]  # 8 (0.405) outranks the deeper chain node 9 (0.135)
    tree = block_proposer(topk=2, tree_nodes=10, min_prob=0.2).greedy_tree(1, row_logits(rows))
    assert sorted(tree.tokens[1:]) == [5, 7, 8]  # every other candidate's path is below 0.2
    assert len(block_proposer(min_prob=0.95).greedy_tree(1, row_logits(rows))) == 1  # a plain decoding step


def test_priced_trees_follow_the_price_of_a_row():
    rows = [{5: 0.9}, {7: 0.8}, {9: 0.5}, {11: 0.2}, {13: 0.1}]  # chain paths 0.9, 0.72, 0.36, 0.072, 0.0072
    sizes = []
    for row_cost in (0.0, 0.05, 0.3, 10.0):
        proposer = block_proposer(min_prob=0)
        proposer.started = time.perf_counter()
        proposer.price_verification(lambda n, c=row_cost: 1.0 + c * (n - 1))
        sizes.append(len(proposer.greedy_tree(1, row_logits(rows))) - 1)
    assert sizes[0] == 5 and sizes[-1] == 0 and sizes == sorted(sizes, reverse=True)
    unpriced = block_proposer(min_prob=0, priced=False)
    unpriced.price_verification(lambda n: float(n))
    assert len(unpriced.greedy_tree(1, row_logits(rows))) - 1 == 5


def test_the_tree_options_come_from_the_call_else_the_manifest():
    target = make_tiny_llama(seed=0, layers=3)
    drafter = SimpleNamespace(model=tiny_dflash(target), manifest={"extra": {"decoding": {"min_prob": 0.2,
                                                                                        "priced": False}}})
    built = build_dflash_proposer(drafter, target)
    assert built.min_prob == 0.2 and not built.priced
    built = build_dflash_proposer(drafter, target, dflash_min_prob=0, dflash_priced=True)
    assert built.min_prob == 0 and built.priced
    drafter.manifest = {}
    assert build_dflash_proposer(drafter, target).min_prob == DEFAULT_MIN_PROB["cpu"]
    with pytest.raises(ValueError, match="dflash.min_prob"):
        build_dflash_proposer(drafter, target, dflash_min_prob=1.0)


def test_eos_and_max_new_tokens_inside_a_block():
    target = make_tiny_llama(seed=0, layers=3, peak=4.0)
    ref = target_greedy(target, PROMPT, 40)
    eos = ref[13]
    drafter = tiny_dflash(target)
    proposer = DFlashProposer(drafter, target.get_input_embeddings(), eos_token_ids={eos}, min_prob=0)
    gen = SpeculativeEngine(target, proposer, {eos}, adaptive=False).generate(PROMPT, 40)
    assert gen.tokens == ref[:ref.index(eos) + 1]
    for max_new in (1, 2, 4, 7):
        assert SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPT, max_new).tokens == ref[:max_new]


def oracle_drafter(target, ref: list[int], block_size: int = 6) -> DFlashProposer:
    """A proposer whose blocks are the target's own greedy continuation (known in advance): every draft is
    accepted, so EOS and max_new_tokens fall inside blocks, never at their ends only."""
    proposer = DFlashProposer(tiny_dflash(target, block_size=block_size), target.get_input_embeddings())
    vocab = target.config.vocab_size

    def block(seq, rows=slice(None)):
        n = len(seq) - len(PROMPT)
        logits = torch.zeros(block_size, vocab)
        for i in range(1, block_size):
            logits[i, ref[n + i - 1] if n + i - 1 < len(ref) else 0] = 10.0
        proposer.pending = []
        return logits[rows]

    proposer.draft_block = block
    return proposer


def test_eos_and_max_new_tokens_inside_an_accepted_block():
    target = make_tiny_llama(seed=0, layers=3, peak=4.0)
    ref = target_greedy(target, PROMPT, 48)
    eos = ref[9]  # emitted in the second block (blocks of 5 drafts + 1 bonus)
    proposer = oracle_drafter(target, ref + [0] * 8)
    proposer.eos_token_ids = {eos}
    gen = SpeculativeEngine(target, proposer, {eos}, adaptive=False).generate(PROMPT, 40)
    assert gen.tokens == ref[:ref.index(eos) + 1] and gen.stats.target_forwards <= 3
    proposer.eos_token_ids = set()
    for max_new in (3, 8, 10):
        gen = SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPT, max_new)
        assert gen.tokens == ref[:max_new]


@pytest.mark.parametrize("lookup_first", [0, 1])
def test_with_prompt_lookup_stays_lossless(lookup_first):
    """Also when lookup-only steps skip the drafter: it adds the skipped positions' context at its next step."""
    target = make_tiny_llama(seed=0, layers=3, peak=4.0)
    ref = target_greedy(target, PROMPT, 40)
    inner = DFlashProposer(tiny_dflash(target), target.get_input_embeddings(), topk=2, min_prob=0)
    drafted, original = [], inner.propose
    inner.propose = lambda seq, *a: drafted.append(len(seq)) or original(seq, *a)
    wrapped = WithPromptLookup(inner, PromptLookupProposer(num_tokens=6), lookup_first=lookup_first)
    steps, engine_propose = [], wrapped.propose
    wrapped.propose = lambda seq, *a: steps.append(len(seq)) or engine_propose(seq, *a)
    assert SpeculativeEngine(target, wrapped, adaptive=False).generate(PROMPT, 40).tokens == ref
    if lookup_first == 1:
        assert 0 < len(drafted) < len(steps)  # some steps were the lookup's alone


def test_reduced_vocabulary_drafts_only_its_tokens():
    target = make_tiny_llama(seed=0, layers=3)
    proposer = DFlashProposer(tiny_dflash(target, vocab=list(range(2, 40))), target.get_input_embeddings(), topk=2,
                              min_prob=0)
    trees = recorded_trees(proposer)
    assert SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPT, 12).tokens == \
        target_greedy(target, PROMPT, 12)
    assert trees and all(2 <= t < 40 for tree in trees for t in tree.tokens[1:])


@pytest.mark.parametrize("hidden", [32, 128])  # head_dim 8: torch's operations; 32: the kernel library's where it runs
def test_the_training_blocks_are_what_decoding_computes(hidden):
    """DFlashDrafter.blocks at anchor a (training) equals the proposer's block after the first a + 1 tokens,
    its context fed in two uneven steps as decoding feeds it (decode.lean_dflash's forward)."""
    target = make_tiny_llama(seed=0, layers=3, hidden_size=hidden)
    drafter = tiny_dflash(target, block_size=5)
    ids = [1, 5, 7, 9, 11, 5, 7, 13, 17, 19, 23, 29]
    embed = target.get_input_embeddings()
    with torch.no_grad():
        feats = features_of(target, ids, drafter.target_layers)  # [T, 2D]
        anchors = torch.tensor([[4, 9, 2]])
        outputs = drafter.blocks(feats[None], embed(torch.tensor(ids))[anchors], anchors)  # [1, 3, 5, D]
        for j, a in enumerate(anchors[0].tolist()):
            proposer = DFlashProposer(drafter, embed)
            assert isinstance(proposer.net, LeanDFlash)
            proposer.begin(ids, 64)
            proposer.observe_prefill(feats[:a // 2])
            proposer.draft_block(ids[:a // 2 + 1])  # an earlier step, whose block is dropped
            proposer.observe_prefill(feats[a // 2:a])
            logits = proposer.draft_block(ids[:a + 1])  # [5, M]
            torch.testing.assert_close(logits, drafter.logits(outputs[0, j]), atol=1e-5, rtol=1e-4)


def test_sampling_keeps_the_targets_distribution_and_a_wrong_rule_fails(monkeypatch):
    """Sampled drafts go in with their q; a drafter confidently wrong (q near one-hot) must not bias the
    output, and resampling from p instead of the residual after a rejection must show up as bias."""
    from tests.decode.test_sampling import assert_unbiased_and_a_wrong_rule_caught

    vocab, prompt = 8, [1, 3, 5]
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0, layers=3)
    drafter = tiny_dflash(target, block_size=3, seed=5)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(20.0)  # a peaked q, far from the target's p
    engine = SpeculativeEngine(target, DFlashProposer(drafter, target.get_input_embeddings()))
    assert_unbiased_and_a_wrong_rule_caught(monkeypatch, engine, target, prompt, vocab)


def test_a_depth_past_the_block_is_an_error():
    target = make_tiny_llama(seed=0, layers=3)
    with pytest.raises(ValueError, match="dflash.depth"):
        DFlashProposer(tiny_dflash(target, block_size=4), target.get_input_embeddings(), depth=4)


def net_matrices(net) -> list:
    """The matrices a proposer's net drafts with: the lean forward's, or the module copy's linears."""
    if isinstance(net, LeanDFlash):
        return [net.fc, net.lm_head] + [getattr(layer, name) for layer in net.layers
                                       for name in ("qkv", "kv", "o", "gate_up", "down")]
    return [m for m in net.modules() if isinstance(m, (torch.nn.Linear, Q8Int8Linear))]


@pytest.mark.skipif(int8_unavailable() is not None, reason=f"the int8 kernel: {int8_unavailable()}")
@pytest.mark.parametrize("lean", [True, False])
def test_int8_drafting_weights_stay_lossless_and_draft_nearly_what_float32_drafts(lean, monkeypatch):
    if not lean:
        monkeypatch.setenv(LEAN_DISABLE_ENV, "1")  # the drafter's own modules over int8 copies
    target = make_tiny_llama(seed=0, layers=3, peak=4.0, hidden_size=128)  # every matrix a multiple of 32
    drafter = tiny_dflash(target, block_size=8)
    ref = target_greedy(target, PROMPT, 40)
    proposer = DFlashProposer(drafter, target.get_input_embeddings(), weights="int8")
    assert isinstance(proposer.net, LeanDFlash) == lean
    linears = net_matrices(proposer.net)
    assert linears and all(isinstance(m, Q8Int8Linear) for m in linears)  # fc, every layer's matrices, the head
    assert proposer.weight_format() == "int8"
    for adaptive in (False, True):
        assert SpeculativeEngine(target, proposer, adaptive=adaptive).generate(PROMPT, 40).tokens == ref
    exact = DFlashProposer(drafter, target.get_input_embeddings(), weights="float32")
    blocks = []
    with torch.inference_mode():  # as the engine drafts (the proposer's cache is the engine's)
        features = features_of(target, PROMPT, drafter.target_layers)  # [T, K x D]
        for p in (proposer, exact):
            p.begin(PROMPT, 64)
            p.observe_prefill(features[:-1])  # the context: every position before the block's first row
            blocks.append(p.draft_block(PROMPT))  # [B, M]
    int8_logits, fp32_logits = blocks
    assert float((int8_logits - fp32_logits).abs().max() / fp32_logits.abs().max()) < 5e-2  # Q8_0 and x's rounding
    assert float((int8_logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean()) >= 0.75
    assert dflash_drafting_weights(drafter, "auto") == "int8"
    assert dflash_drafting_weights(drafter, "float32") == "float32"


def test_drafting_weights_that_cannot_run_are_errors_that_say_why():
    odd = tiny_dflash(make_tiny_llama(seed=0, layers=3, hidden_size=48))  # K = 48: not whole groups of 32
    assert dflash_drafting_weights(odd, "auto") == drafting_weights(odd, "auto")  # auto never fails on a shape
    with pytest.raises(ValueError, match="int8"):
        dflash_drafting_weights(odd, "int8")
    with pytest.raises(ValueError, match="q8_0"):
        dflash_drafting_weights(odd, "q8_0")
    with pytest.raises(ValueError, match="drafter weights"):
        dflash_drafting_weights(odd, "bfloat8")
