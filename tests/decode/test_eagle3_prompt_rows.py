"""EAGLE-3's reduced head extended per request by the prompt's tokens (decode.proposers.prompt_head): the map is a
least-squares fit, merged scores are the softmax over head and prompt rows, drafts reach the prompt's tokens, the
output stays the target's, sampling keeps its distribution, and bad settings are errors."""

import json
from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers.eagle3 import Eagle3Proposer, build_eagle3_proposer, prompt_rows
from specdistill.decode.proposers.prompt_head import PromptRows, fit_row_map
from specdistill.models.eagle3 import Eagle3Drafter
from tests.conftest import make_tiny_llama
from tests.decode.test_engine import target_greedy

PROMPT = [1, 5, 7, 9, 11, 5, 7, 41, 43, 47, 53]
VOCAB = [t for t in range(2, 40) if t not in PROMPT]  # the head lacks every prompt token


def drafter_for(target, vocab=VOCAB, seed=3):
    vocab_map = None if vocab is None else torch.tensor(vocab)
    return Eagle3Drafter.for_target(target, vocab_map, [0, 1, 1], seed=seed).eval()


def rows_for(drafter, target) -> PromptRows:
    return prompt_rows(SimpleNamespace(model=drafter, manifest={}), target, True)


def test_the_map_is_the_least_squares_fit():
    gen = torch.Generator().manual_seed(0)
    source, true_map = torch.randn(300, 16, generator=gen), torch.randn(16, 16, generator=gen)
    fitted = fit_row_map(source, source @ true_map, ridge=1e-6)
    torch.testing.assert_close(fitted, true_map, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"\[M, D\]"):
        fit_row_map(source, source[:, :8])


def test_merged_scores_are_the_softmax_over_head_and_prompt_rows():
    target = make_tiny_llama(seed=0, layers=2)
    drafter = drafter_for(target)
    rows = rows_for(drafter, target)
    rows.begin(PROMPT)
    assert rows.ids.tolist() == sorted(set(PROMPT))
    outs = torch.randn(4, drafter.lm_head.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        head_logits = drafter.logits(outs)  # [4, M]
        top = torch.log_softmax(head_logits, dim=-1).topk(3, dim=-1)
        values, tokens = rows.merge_top(outs, top.values, top.indices, drafter.vocab_map[top.indices], 3)
        full = torch.log_softmax(torch.cat([head_logits, rows.logits(outs)], dim=-1), dim=-1)  # [4, M + N]
    ids = torch.cat([drafter.vocab_map, rows.ids])
    expected = full.topk(3, dim=-1)
    torch.testing.assert_close(values, expected.values, atol=1e-5, rtol=1e-5)
    assert tokens.tolist() == ids[expected.indices].tolist()


def test_the_extension_is_per_request():
    target = make_tiny_llama(seed=0, layers=2)
    rows = rows_for(drafter_for(target), target)
    rows.begin(PROMPT)
    rows.begin([2, 3, 60])  # 2 and 3 are head tokens; 60 is not
    assert rows.ids.tolist() == [60] and rows.rows.shape == (1, target.config.hidden_size)
    rows.begin([2, 3])
    assert not rows.active


def test_prompt_tokens_are_drafted_and_the_output_stays_the_targets():
    target = make_tiny_llama(seed=0, layers=4, peak=4.0)
    drafter = drafter_for(target)
    proposer = Eagle3Proposer(drafter, target.get_input_embeddings(), depth=4, topk=3, tree_nodes=10,
                              prompt_rows=rows_for(drafter, target))
    trees = []
    original = proposer.draft_tree
    proposer.draft_tree = lambda *a: trees.append(original(*a)) or trees[-1]
    assert SpeculativeEngine(target, proposer, adaptive=False).generate(PROMPT, 30).tokens == \
        target_greedy(target, PROMPT, 30)
    drafted = {t for tree in trees for t in tree.tokens[1:]}
    assert drafted <= set(VOCAB) | set(PROMPT)
    assert drafted & set(PROMPT)  # tokens the head alone can never draft


def test_sampling_keeps_the_targets_distribution_and_a_wrong_rule_fails(monkeypatch):
    from tests.decode.test_sampling import assert_unbiased_and_a_wrong_rule_caught

    vocab, prompt = 8, [1, 3, 5]
    target = make_tiny_llama(vocab_size=vocab, seed=0, peak=3.0)
    drafter = drafter_for(target, vocab=[0, 2, 4, 6], seed=5)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(20.0)  # a peaked q, far from the target's p
    proposer = Eagle3Proposer(drafter, target.get_input_embeddings(), depth=2, prompt_rows=rows_for(drafter, target))
    assert_unbiased_and_a_wrong_rule_caught(monkeypatch, SpeculativeEngine(target, proposer), target, prompt, vocab)


def test_prompt_vocab_follows_the_manifest_and_bad_settings_are_errors():
    target = make_tiny_llama(seed=0, layers=2)
    drafter = drafter_for(target)
    loaded = SimpleNamespace(model=drafter, manifest={"extra": {"prompt_vocab": True}})
    assert build_eagle3_proposer(loaded, target).prompt_rows is not None
    assert build_eagle3_proposer(loaded, target, prompt_vocab=False).prompt_rows is None
    assert build_eagle3_proposer(SimpleNamespace(model=drafter, manifest={}), target).prompt_rows is None
    full = SimpleNamespace(model=drafter_for(target, vocab=None), manifest={})
    with pytest.raises(ValueError, match="full vocabulary"):
        build_eagle3_proposer(full, target, prompt_vocab=True)
    with pytest.raises(ValueError, match="fixed-shape steps"):
        Eagle3Proposer(drafter, target.get_input_embeddings(), fixed_steps=True, prompt_rows=rows_for(drafter, target))


def test_the_tree_tool_writes_prompt_vocab_into_the_manifest(tmp_path):
    from specdistill.models.drafters import load_drafter, save_drafter
    from specdistill.models.target import load_target
    from specdistill.train.tools import eagle3_tree
    from tests.models.conftest import make_tiny_tokenizer

    path = tmp_path / "target"
    make_tiny_llama(layers=2, seed=0).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    target = load_target(str(path))
    for name, vocab in (("reduced", VOCAB), ("full", None)):
        drafter = drafter_for(target.model, vocab=vocab)
        save_drafter(tmp_path / name, drafter, target, "eagle3", dict(drafter.config))
    eagle3_tree.main(["--drafter", str(tmp_path / "reduced"), "--prompt-vocab", "on", "--out", str(tmp_path / "on"),
                      "--target", str(path)])
    assert load_drafter(tmp_path / "on", target).manifest["extra"]["prompt_vocab"] is True
    assert "prompt_vocab" not in (load_drafter(tmp_path / "reduced", target).manifest.get("extra") or {})
    with pytest.raises(SystemExit, match="full vocabulary"):
        eagle3_tree.main(["--drafter", str(tmp_path / "full"), "--prompt-vocab", "on", "--target", str(path)])


def test_head_coverage_counts_answer_tokens_in_the_head_and_in_each_turns_prompt(tmp_path):
    """Turn 0's prompt is its user turn; turn 1's also holds turn 0's answer (as the evaluation rebuilt it)."""
    from specdistill.models.drafters import save_drafter
    from specdistill.models.target import load_target
    from specdistill.train.tools import head_coverage
    from tests.models.conftest import make_tiny_tokenizer

    path = tmp_path / "target"
    make_tiny_llama(layers=2, seed=0).save_pretrained(path)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    target = load_target(str(path))
    drafter = drafter_for(target.model, vocab=list(range(4, 30)))
    save_drafter(tmp_path / "drafter", drafter, target, "eagle3", dict(drafter.config))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "1", "category": "writing", "turns": ["w40 w41", "w50"]}) + "\n")
    report = tmp_path / "report"
    report.mkdir()
    config = {"questions": str(questions), "limit": None, "per_category": None, "target_name": str(path)}
    (report / "report.json").write_text(json.dumps({"config": config}))
    rows = [("baseline", 0, [5, 40, 45]), ("baseline", 1, [45, 50, 60]), ("speculative", 0, [1, 2, 3])]
    (report / "turns.jsonl").write_text("".join(json.dumps({"question_id": "1", "category": "writing", "turn": k,
                                                            "method": m, "tokens": t}) + "\n" for m, k, t in rows))
    result = head_coverage.main([str(report), "--drafter", str(tmp_path / "drafter")])[str(report)]
    # head: 5 alone; prompts: 40 (turn 0), then 45 (turn 0's answer) and 50 (turn 1); 60 nowhere
    assert result["all"] == {"tokens": 6, "head": round(1 / 6, 4), "head_or_prompt": round(4 / 6, 4)}
    assert json.loads((report / "head_coverage.json").read_text())["coverage"]["writing"] == result["writing"]
