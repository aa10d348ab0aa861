"""Many prompts decoded side by side by the engine's forward (decode.batch_generation): every answer is the
engine's plain greedy decode of its prompt alone, token for token, whatever the number of sequences per forward; EOS
and max_new_tokens end each answer where plain decoding does; the staged hidden states are the target's at every
position of each record; bad arguments are errors naming them. On the kernel path of both target kinds: the default
target's grids (Q4_1 layers, Q8_0 head) and a real-size target's (a Qwen2 on a GGUF's K-quant blocks)."""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.batch_generation import batch_generation_unavailable, generate_greedy_together
from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.runner import ModelRunner
from specdistill.distill.feature_capture import FeatureStaging
from specdistill.models import kernels
from specdistill.models.gguf_blocks import attach_kquant_blocks
from specdistill.models.target import target_from_model
from tests.decode.test_kernel_path_lossless import kernel_target
from tests.models.kquant_fixtures import make_tiny_kquant_qwen2, write_gguf

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None,
                                reason=f"the kernel library does not load here: {kernels.unavailable()}")

LENGTHS = (5, 17, 9, 40, 3, 70, 12)  # prompts of every size, one past the kernels' 64 rows (a prefill by SDPA)
EOS = 2


@pytest.fixture(scope="module", params=["q41-llama", "kquant-qwen2"])
def target(request, tmp_path_factory):
    if request.param == "q41-llama":
        return kernel_target()
    model, tensors = make_tiny_kquant_qwen2(seed=4)
    attach_kquant_blocks(model, write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "qwen2", tensors))
    return target_from_model(model, None, "tiny-kquant-qwen2")


def random_prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def plain_decodes(model, prompts, max_new_tokens: int, eos: set[int]) -> list[list[int]]:
    engine = SpeculativeEngine(model, None, eos_token_ids=eos)
    return [engine.generate(p, max_new_tokens).tokens for p in prompts]


def test_the_engine_runs_both_target_kinds_and_names_why_not_elsewhere(target):
    from tests.conftest import make_tiny_llama

    assert batch_generation_unavailable(target.model) is None
    assert "bfloat16" in batch_generation_unavailable(make_tiny_llama(hidden_size=128).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="engine generation"):  # head_dim 8: not the library's attention
        generate_greedy_together(make_tiny_llama(), [[5, 6]], max_new_tokens=2, eos_token_ids=set(), max_batch=1)


@pytest.mark.parametrize("max_batch", [1, 3, 64])
def test_every_answer_is_the_engines_plain_decode_of_its_prompt_alone(target, max_batch):
    prompts = random_prompts(target.model.config.vocab_size)
    plain = plain_decodes(target.model, prompts, 24, {EOS})
    got = generate_greedy_together(target.model, prompts, max_new_tokens=24, eos_token_ids={EOS},
                                   max_batch=max_batch)
    assert got == plain


def test_eos_ends_some_answers_early_and_the_others_run_on_to_max_new_tokens(target):
    prompts = random_prompts(target.model.config.vocab_size, seed=1)
    free = plain_decodes(target.model, prompts, 20, set())
    # a token some answers produce before their end and others never do
    eos = next(t for t in sorted(set().union(*free))
               if any(t in row[:-1] for row in free) and any(t not in row for row in free))
    plain = plain_decodes(target.model, prompts, 20, {eos})
    assert any(len(row) < 20 for row in plain) and any(len(row) == 20 for row in plain)  # the case this test is for
    got = generate_greedy_together(target.model, prompts, max_new_tokens=20, eos_token_ids={eos}, max_batch=3)
    assert got == plain
    for row in got:  # cut after the first EOS, kept; none past it
        assert eos not in row[:-1] and (row[-1] == eos or len(row) == 20)


def test_an_answer_of_one_token_and_answers_of_max_new_tokens_one(target):
    prompts = random_prompts(target.model.config.vocab_size, seed=2)
    first = [row[0] for row in plain_decodes(target.model, prompts, 1, set())]
    assert generate_greedy_together(target.model, prompts, max_new_tokens=1, eos_token_ids=set(),
                                    max_batch=2) == [[t] for t in first]
    ended = generate_greedy_together(target.model, prompts, max_new_tokens=8, eos_token_ids={first[0]}, max_batch=2)
    assert ended[0] == [first[0]]


def test_staged_states_are_the_targets_at_every_position_of_each_record(target, tmp_path):
    layers = [0, 1, 1]
    staging = FeatureStaging(target.fingerprint, layers, tmp_path)
    prompts = random_prompts(target.model.config.vocab_size, lengths=(6, 30, 11), seed=3)
    answers = generate_greedy_together(target.model, prompts, max_new_tokens=12, eos_token_ids={EOS}, max_batch=2,
                                       staging=staging)
    runner = ModelRunner(target.model, static_shapes=False)
    runner.feature_layers = layers
    for prompt, answer in zip(prompts, answers):
        staged = staging.get(prompt, answer)
        assert staged is not None
        features, final = staged  # bf16 [T, 3D], [T, D] over prompt + answer, the answer's last token included
        runner.start(len(prompt) + len(answer))
        hidden, _ = runner.forward(prompt + answer)  # the whole record in one forward
        for got, exact in ((features, runner.features), (final, hidden)):
            assert got.shape == exact.shape
            torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2 * float(exact.abs().max()))


@pytest.mark.parametrize("kwargs,named", [
    (dict(max_batch=0), "max_batch"), (dict(max_batch=65), "max_batch"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[5, 6], []]), "empty prompt"), (dict(prompts=[]), "empty list"),
])
def test_bad_arguments_are_errors_that_name_them(target, kwargs, named):
    call = dict(prompts=[[5, 6, 7]], max_new_tokens=4, eos_token_ids={EOS}, max_batch=2) | kwargs
    prompts = call.pop("prompts")
    with pytest.raises(ValueError, match=named):
        generate_greedy_together(target.model, prompts, **call)


def test_the_arena_gives_each_sequence_its_own_positions_and_gets_them_all_back():
    from types import SimpleNamespace

    from specdistill.decode.batch_generation import Arena

    gen = torch.Generator().manual_seed(5)
    needs = torch.randint(1, 50, (40,), generator=gen).tolist()
    arena = Arena(SimpleNamespace(num_layers=1), needs, regions=4)
    capacity = sum(sorted(needs, reverse=True)[:4])
    held: dict[int, tuple[int, int]] = {}
    for i, need in enumerate(needs):
        while (base := arena.take(need)) is None:  # wait for room as the generator does: release the oldest
            assert held, "an empty arena must fit any single need"
            oldest = next(iter(held))
            arena.release(*held.pop(oldest))
        assert 0 <= base and base + need <= capacity
        assert all(base + need <= b or b + n <= base for b, n in held.values())  # no overlap
        held[i] = (base, need)
        assert len(held) <= 4
    for base, need in held.values():
        arena.release(base, need)
    assert arena.spans == [(0, capacity)] and arena.room == 4


def test_teacher_data_written_by_the_engine_are_its_plain_decodes(tmp_path):
    """train/ picks the engine's generator for a target the engine runs (transformers' elsewhere) and hands it to the
    teacher data, whose greedy answers are then the engine's plain decodes of the chat-templated prompts."""
    from specdistill.distill.prompts import Prompt
    from specdistill.distill.teacher_data import TeacherDataSettings, generate_teacher_data
    from specdistill.train.distill_steps import greedy_generator
    from tests.distill.conftest import CHAT_TEMPLATE
    from tests.models.conftest import make_tiny_target, make_tiny_tokenizer

    model = kernel_target().model
    tokenizer = make_tiny_tokenizer(model.config.vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    target = target_from_model(model, tokenizer, "tiny-q41-words")
    assert greedy_generator(target) == "engine"
    assert greedy_generator(make_tiny_target()) == "generate"  # head_dim 8: not the kernel library's attention
    prompts = [Prompt(id=f"p{i}", messages=[{"role": "user", "content": " ".join(f"w{5 + (i * j) % 50}"
                                                                               for j in range(3 + 4 * i))}])
               for i in range(5)]
    settings = TeacherDataSettings(max_new_tokens=10, batch_size=3, shard_size=2, greedy_generator="engine")
    rows = list(generate_teacher_data(target, prompts, settings, out_dir=tmp_path,
                                      greedy_answers=generate_greedy_together))
    plain = plain_decodes(model, [target.encode_chat(p.messages) for p in prompts], 10, set(target.eos_token_ids))
    assert [r["response_ids"] for r in rows] == plain
