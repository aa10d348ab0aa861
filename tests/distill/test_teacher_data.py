"""Teacher data: determinism, resuming, EOS handling, top-k alignment, cache keys, process splitting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import specdistill.distill.teacher_data as teacher_data
from specdistill.distill.batching import collate
from specdistill.distill.losses import TopK, distill_loss
from specdistill.distill.prompts import Prompt
from specdistill.distill.teacher_data import (
    TeacherDataSettings,
    generate_teacher_data,
    load_teacher_data,
    teacher_data_key,
)
from tests.distill.conftest import make_tiny_target

WORDS = [f"w{i}" for i in range(50)]


def make_prompts(n: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(n)
    prompts = []
    for i in range(n):
        length = int(torch.randint(1, 7, (1,), generator=g))   # different lengths, so batches need padding
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (length,), generator=g)]
        prompts.append(Prompt(id=f"p{i}", messages=[{"role": "user", "content": " ".join(words)}]))
    return prompts


SETTINGS = TeacherDataSettings(max_new_tokens=12, greedy=True, num_samples=2, temperature=1.0, topk=4,
                               batch_size=3, shard_size=2, seed=5)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target()


def rows(dataset) -> list[dict]:
    return [dict(r) for r in dataset]


def test_rows_are_deterministic_under_a_seed(target, tmp_path):
    prompts = make_prompts(5)
    first = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path / "a"))
    again = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path / "b"))
    assert first == again
    other_seed = TeacherDataSettings(**{**SETTINGS.__dict__, "seed": 6})
    other = rows(generate_teacher_data(target, prompts, other_seed, out_dir=tmp_path / "c"))

    def sampled(data):
        return [r["response_ids"] for r in data if r["sample_idx"] > 0]

    def greedy(data):
        return [r["response_ids"] for r in data if r["sample_idx"] == 0]

    assert sampled(other) != sampled(first)
    assert greedy(other) == greedy(first)                   # the seed only moves the samples


def test_row_layout_prompt_order_and_unpadded_prompts(target, tmp_path):
    prompts = make_prompts(5)
    data = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path))
    assert [(r["prompt_id"], r["sample_idx"]) for r in data] == [(p.id, s) for p in prompts for s in (0, 1, 2)]
    by_id = {p.id: p for p in prompts}
    assert all(r["prompt_ids"] == target.encode_chat(by_id[r["prompt_id"]].messages) for r in data)


def test_responses_end_at_the_first_eos(target, tmp_path):
    settings = TeacherDataSettings(max_new_tokens=16, greedy=False, num_samples=6, batch_size=4, shard_size=4, seed=1)
    data = rows(generate_teacher_data(target, make_prompts(4), settings, out_dir=tmp_path))
    eos = target.eos_token_ids
    ended = 0
    for r in data:
        response = r["response_ids"]
        assert not any(tok in eos for tok in response[:-1])
        if response[-1] in eos:
            ended += 1
        else:
            assert len(response) == settings.max_new_tokens
    assert 0 < ended < len(data)


def test_greedy_answers_match_unbatched_generation(target, tmp_path):
    """Left padding in a batch must not change the target's greedy answer."""
    prompts = make_prompts(4)
    settings = TeacherDataSettings(max_new_tokens=8, batch_size=4, shard_size=4)
    data = rows(generate_teacher_data(target, prompts, settings, out_dir=tmp_path))
    for prompt, row in zip(prompts, data):
        ids = torch.tensor([target.encode_chat(prompt.messages)])
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=8, eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)
        single = out[0, ids.shape[1]:].tolist()
        assert row["response_ids"] == single[: len(row["response_ids"])]


def test_topk_is_aligned_with_the_response(target, tmp_path):
    data = rows(generate_teacher_data(target, make_prompts(4), SETTINGS, out_dir=tmp_path))
    for r in data:
        assert len(r["topk_ids"]) == len(r["response_ids"]) and all(len(ids) == 4 for ids in r["topk_ids"])
        for logprobs in r["topk_logprobs"]:
            assert all(a >= b for a, b in zip(logprobs, logprobs[1:])) and logprobs[0] <= 0
        if r["sample_idx"] == 0:    # the greedy token is the target's most likely one at every position
            assert [ids[0] for ids in r["topk_ids"]] == r["response_ids"]


def test_draft_equal_to_target_has_zero_loss_on_stored_topk(target, tmp_path):
    """End to end: stored top-k + collate + the tail-bucket loss, with the target itself as the draft."""
    data = rows(generate_teacher_data(target, make_prompts(3), SETTINGS, out_dir=tmp_path))
    batch = collate(data, pad_id=0, max_len=64)
    with torch.no_grad():
        logits = target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    topk = TopK(batch.topk_ids, batch.topk_logprobs)
    for kind in ("fkl", "rkl", "jsd", "tvd"):
        assert distill_loss(kind, logits, target=topk, mask=batch.loss_mask).item() == pytest.approx(0, abs=1e-4)
    other = make_tiny_target(seed=9).model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # tiny random models are close to uniform, so a different one is only a little off; still >> 0
    assert distill_loss("fkl", other, target=topk, mask=batch.loss_mask).item() > 1e-3


def test_resume_regenerates_only_missing_shards(target, tmp_path, monkeypatch):
    prompts = make_prompts(5)                                 # shard_size 2 -> shards 0, 1, 2
    made: list[int] = []
    real = teacher_data.generate_shard

    def counting(target, prompts, settings, shard, teacher=None, staging=None, greedy_answers=None):
        made.append(shard)
        return real(target, prompts, settings, shard, teacher, staging, greedy_answers)

    monkeypatch.setattr(teacher_data, "generate_shard", counting)
    full = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path))
    assert made == [0, 1, 2]
    shutil.rmtree(tmp_path / "shards" / "shard-00001")
    (tmp_path / "shards" / ".tmp-shard-00001-deadbeef").mkdir()   # debris of an interrupted write
    with pytest.raises(FileNotFoundError, match=r"\[1\]"):
        load_teacher_data(tmp_path)
    made.clear()
    resumed = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path))
    assert made == [1]
    assert resumed == full == rows(load_teacher_data(tmp_path))
    assert not list((tmp_path / "shards").glob(".tmp-*"))


def test_processes_split_shards_and_together_equal_one_process(target, tmp_path):
    prompts = make_prompts(5)
    single = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path / "one"))
    part0 = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path / "two", process_index=0,
                                       num_processes=2))
    part1 = rows(generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path / "two", process_index=1,
                                       num_processes=2))
    assert {r["prompt_id"] for r in part0} == {"p0", "p1", "p4"} and {r["prompt_id"] for r in part1} == {"p2", "p3"}
    assert rows(load_teacher_data(tmp_path / "two")) == single
    with pytest.raises(ValueError, match="process_index"):
        generate_teacher_data(target, prompts, SETTINGS, out_dir=tmp_path / "x", process_index=2, num_processes=2)


def test_cache_key_names_the_default_directory_and_guards_it(target, tmp_path):
    prompts = make_prompts(3)
    settings = TeacherDataSettings(max_new_tokens=4, shard_size=4)
    key = teacher_data_key(target, prompts, settings)
    generate_teacher_data(target, prompts, settings, cache_root=tmp_path)
    out = tmp_path / "teacher" / key
    assert json.loads((out / "settings.json").read_text())["key"] == key
    assert len(load_teacher_data(out)) == 3
    changed = [
        teacher_data_key(target, prompts, TeacherDataSettings(max_new_tokens=5, shard_size=4)),
        teacher_data_key(target, prompts[:2], settings),
        teacher_data_key(target, [Prompt("p0", [{"role": "user", "content": "w1"}])] + prompts[1:], settings),
        teacher_data_key(make_tiny_target(fingerprint="another"), prompts, settings),
    ]
    assert len({key, *changed}) == 5
    with pytest.raises(ValueError, match="key"):
        generate_teacher_data(target, prompts[:2], settings, out_dir=out)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="greedy"):
        TeacherDataSettings(greedy=False, num_samples=0)
    with pytest.raises(ValueError, match="temperature"):
        TeacherDataSettings(num_samples=1, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        TeacherDataSettings(max_new_tokens=0)


def test_long_prompts_are_skipped(target, tmp_path):
    prompts = [Prompt("short", [{"role": "user", "content": "w1"}]),
               Prompt("long", [{"role": "user", "content": " ".join(WORDS[:30])}])]
    settings = TeacherDataSettings(max_new_tokens=4, max_prompt_tokens=12)
    assert [r["prompt_id"] for r in generate_teacher_data(target, prompts, settings, out_dir=tmp_path)] == ["short"]


# ---- teacher_backend: vllm (distill.teacher_vllm) ------------------------------------------------------

class TeacherFromTarget:
    """Stands in for the vLLM worker: answers with the tiny target's own greedy decoding, and records the
    requests (a real vLLM run: the slow tests of tests/decode/test_vllm_peer.py, after `make vllm`)."""

    calls: list = []

    def __init__(self, target):
        self.target = target

    def responses(self, prompts, samples, max_new_tokens, temperature, top_p):
        from specdistill.distill.generation import generate_batch
        TeacherFromTarget.calls.append((len(prompts), list(samples), temperature, top_p))
        eos = set(self.target.eos_token_ids)
        return [generate_batch(self.target.model, [p], max_new_tokens=max_new_tokens, pad_id=0, eos_token_ids=eos)[0]
                for p in prompts]

    def close(self):
        pass


def test_the_builtin_backend_keeps_its_cache_keys_and_vllm_and_the_engine_get_their_own(target):
    import hashlib
    from dataclasses import asdict
    prompts = make_prompts(3)
    # the settings before backends and greedy generators
    settings = {k: v for k, v in asdict(SETTINGS).items() if k not in ("backend", "greedy_generator")}
    payload = {"format_version": teacher_data.FORMAT_VERSION, "fingerprint": target.fingerprint,
               "chat_template": getattr(target.tokenizer, "chat_template", None),
               "eos_token_ids": sorted(target.eos_token_ids), "prompts": [[p.id, p.messages] for p in prompts],
               "settings": settings}
    before = hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
    assert teacher_data_key(target, prompts, SETTINGS) == before
    vllm = TeacherDataSettings(**{**SETTINGS.__dict__, "backend": "vllm"})
    assert teacher_data_key(target, prompts, vllm) != before
    engine = TeacherDataSettings(**{**SETTINGS.__dict__, "greedy_generator": "engine"})
    assert teacher_data_key(target, prompts, engine) not in (before, teacher_data_key(target, prompts, vllm))


def test_the_engines_generator_must_be_handed_in_and_an_unknown_one_is_named(target, tmp_path):
    engine = TeacherDataSettings(**{**SETTINGS.__dict__, "greedy_generator": "engine"})
    with pytest.raises(ValueError, match="greedy_answers"):
        generate_teacher_data(target, make_prompts(2), engine, out_dir=tmp_path)
    with pytest.raises(ValueError, match="greedy_generator 'fast'"):
        TeacherDataSettings(greedy_generator="fast")


def test_vllm_backend_rows_are_the_builtin_format_and_train_identically(target, tmp_path, monkeypatch):
    monkeypatch.setattr(teacher_data, "VllmTeacher", TeacherFromTarget)
    TeacherFromTarget.calls = []
    greedy = TeacherDataSettings(max_new_tokens=12, greedy=True, topk=4, batch_size=3, shard_size=2, seed=5)
    prompts = make_prompts(5)
    builtin = rows(generate_teacher_data(target, prompts, greedy, out_dir=tmp_path / "builtin"))
    via_vllm = TeacherDataSettings(**{**greedy.__dict__, "backend": "vllm"})
    served = rows(generate_teacher_data(target, prompts, via_vllm, out_dir=tmp_path / "vllm"))
    assert served == builtin  # same rows, same columns, same top-k
    assert [n for n, *_ in TeacherFromTarget.calls] == [2, 2, 1]  # one batched request per shard
    assert all(sample == (True, sample[1]) for _, samples, _, _ in TeacherFromTarget.calls for sample in samples)
    losses = []
    for data in (builtin, served):
        batch = collate(data, pad_id=0, max_len=64)
        logits = make_tiny_target(seed=9).model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        losses.append(distill_loss("fkl", logits, target=TopK(batch.topk_ids, batch.topk_logprobs),
                                   mask=batch.loss_mask).item())
    assert losses[0] == losses[1]


def test_vllm_backend_asks_for_seeded_samples(target, tmp_path, monkeypatch):
    monkeypatch.setattr(teacher_data, "VllmTeacher", TeacherFromTarget)
    TeacherFromTarget.calls = []
    settings = TeacherDataSettings(**{**SETTINGS.__dict__, "backend": "vllm", "topk": 0})
    generate_teacher_data(target, make_prompts(2), settings, out_dir=tmp_path)
    (n, samples, temperature, top_p), = TeacherFromTarget.calls
    assert n == 6 and [g for g, _ in samples] == [True, False, False] * 2
    seeds = [seed for g, seed in samples if not g]
    assert len(set(seeds)) == 4 and (temperature, top_p) == (1.0, 1.0)


def test_vllm_backend_without_its_environment_is_a_clear_error(target, tmp_path, monkeypatch):
    from specdistill.models.vllm_env import PYTHON_ENV
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "missing" / "python"))
    settings = TeacherDataSettings(**{**SETTINGS.__dict__, "backend": "vllm"})
    with pytest.raises(RuntimeError, match="teacher_backend vllm: no vLLM environment.*make vllm"):
        generate_teacher_data(target, make_prompts(2), settings, out_dir=tmp_path / "t")
    assert not list((tmp_path / "t").glob("shards/*"))
    with pytest.raises(ValueError, match="builtin, vllm"):
        TeacherDataSettings(backend="sglang")


def test_appended_prompts_are_answered_and_the_earlier_shards_copied_from_the_data_before_them(target, tmp_path,
                                                                                              monkeypatch):
    prompts = make_prompts(9)
    first = prompts[:6]
    first[2] = Prompt("p2", [{"role": "user", "content": "w7 w8"}])  # shard 1 differs from the grown list's
    generate_teacher_data(target, first, SETTINGS, cache_root=tmp_path / "cache")
    made = []
    real = teacher_data.generate_shard

    def counting(target_, chunk, settings, shard, *args):
        made.append(shard)
        return real(target_, chunk, settings, shard, *args)

    monkeypatch.setattr(teacher_data, "generate_shard", counting)
    grown = rows(generate_teacher_data(target, prompts, SETTINGS, cache_root=tmp_path / "cache"))
    assert made == [1, 3, 4]  # shard 1's prompts changed, 3 and 4 are new; 0 and 2 were copied
    monkeypatch.undo()
    assert grown == rows(generate_teacher_data(target, prompts, SETTINGS, cache_root=tmp_path / "fresh"))
    assert len(list((tmp_path / "cache" / "teacher").iterdir())) == 2
