"""`specdistill tree-shape` (train/tools/tree_shape.py): a trained EAGLE-3 or DFlash drafter's decoding tree
shape rewritten in its manifest, which the proposer then drafts with; other kinds and bad values are refused."""

from __future__ import annotations

import pytest

from specdistill.decode.proposers import build_proposer
from specdistill.models.dflash import DFlashDrafter
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.target import load_target
from specdistill.train.tools.tree_shape import main
from tests.conftest import make_tiny_llama
from tests.models.conftest import make_tiny_tokenizer


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tiny_llama(layers=3, seed=0).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def saved(kind: str, target, path):
    if kind == "eagle3":
        model = Eagle3Drafter.for_target(target.model, None, [0, 1, 2])
    else:
        model = DFlashDrafter.for_target(target.model, None, num_layers=1, block_size=5, target_layers=[1, 2])
    save_drafter(path, model, target, kind, config={**model.config})
    return path


@pytest.mark.parametrize("kind, prefix", [("eagle3", "eagle3"), ("dflash", "dflash")])
def test_the_shape_is_written_and_the_proposer_drafts_with_it(kind, prefix, target_dir, tmp_path):
    target = load_target(str(target_dir))
    source = saved(kind, target, tmp_path / "d")
    out = main(["--drafter", str(source), "--depth", "3", "--topk", "2", "--tree-nodes", "5", "--min-prob", "0",
                "--no-priced", "--out", str(tmp_path / "shaped"), "--target", str(target_dir)])
    shaped = load_drafter(str(out), target)
    assert shaped.manifest["extra"]["decoding"] == {"depth": 3, "topk": 2, "tree_nodes": 5, "min_prob": 0,
                                                    "priced": False}
    proposer = build_proposer(shaped, target.model)
    assert (proposer.max_depth, proposer.topk, proposer.tree_nodes, proposer.min_prob, proposer.priced) == \
        (3, 2, 5, 0.0, False)
    assert build_proposer(load_drafter(str(source), target), target.model).priced  # the source is untouched
    kept = main(["--drafter", str(out), "--min-prob", "0.2", "--target", str(target_dir)])  # in place; the rest kept
    assert load_drafter(str(kept), target).manifest["extra"]["decoding"]["min_prob"] == 0.2
    assert load_drafter(str(kept), target).manifest["extra"]["decoding"]["priced"] is False


def test_other_kinds_and_bad_values_are_refused(target_dir, tmp_path):
    target = load_target(str(target_dir))
    save_drafter(tmp_path / "lookup", None, target, "prompt_lookup", config={})
    with pytest.raises(SystemExit, match="'eagle3' and 'dflash'"):
        main(["--drafter", str(tmp_path / "lookup"), "--depth", "2", "--target", str(target_dir)])
    source = saved("dflash", target, tmp_path / "d")
    with pytest.raises(SystemExit, match="min-prob"):
        main(["--drafter", str(source), "--min-prob", "1", "--target", str(target_dir)])
    with pytest.raises(SystemExit, match="depth"):
        main(["--drafter", str(source), "--depth", "0", "--target", str(target_dir)])
