"""`teacher_backend: openai`: the target's top-k read from the serving engine's prompt_logprobs (vLLM's extension)
equals the daemon's own teacher-forced scoring, and a server that cannot give them is a clear TeacherUnavailable."""

from __future__ import annotations

import pytest
import torch
from fastapi import FastAPI, Request

from specdistill.distill.generation import pad_token_id
from specdistill.distill.teacher_openai import OpenAIScorer, TeacherUnavailable, topk_rows
from specdistill.train.config import ConfigError
from specdistill.train.online_config import OnlineConfig
from specdistill.train.online_learn import score_requests
from tests.online.fake_upstream import ServerThread
from tests.online.support import make_target, prompt_for


@pytest.fixture(scope="module")
def target():
    return make_target()


def fake_vllm(target, k_extra: bool = True, with_prompt_logprobs: bool = True) -> FastAPI:
    """/v1/completions answering prompt_logprobs as vLLM does: per position the top-k and the actual token."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids, k = body["prompt"], body["prompt_logprobs"]
        with torch.no_grad():
            logprobs = torch.log_softmax(target.model(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
        entries = [None]
        for p in range(1, len(ids)):
            top = logprobs[p - 1].topk(k)
            chosen = dict(zip(top.indices.tolist(), top.values.tolist()))
            if k_extra:
                chosen[ids[p]] = float(logprobs[p - 1, ids[p]])
            entries.append({str(t): {"logprob": lp, "rank": 1, "decoded_token": f"w{t}"} for t, lp in chosen.items()})
        choice = {"index": 0, "text": "", "finish_reason": "length"}
        if with_prompt_logprobs:
            choice["prompt_logprobs"] = entries
        return {"id": "x", "model": "tiny", "choices": [choice]}

    return app


def records(n: int = 5) -> list[dict]:
    return [{"id": f"r{i}", "prompt_ids": prompt_for(i), "output_ids": [10 + i, 20 + i, 30, 2],
             "sampling": {"max_tokens": 8}} for i in range(n)]


@pytest.mark.parametrize("with_prompt", [False, True])
def test_the_engines_prompt_logprobs_give_the_same_entries_as_the_local_target(target, with_prompt):
    pad = pad_token_id(target.tokenizer, target.eos_token_ids)
    local = score_requests(target, records(), 4, pad, with_prompt=with_prompt)
    with ServerThread(fake_vllm(target)) as server:
        scorer = OpenAIScorer(server.url + "/v1", "tiny")
        remote = score_requests(target, records(), 4, pad, with_prompt=with_prompt, teacher=scorer)
        scorer.close()
    for a, b in zip(local, remote):
        assert a.topk_ids == b.topk_ids and a.prompt_topk_ids == b.prompt_topk_ids
        assert torch.allclose(torch.tensor(a.topk_logprobs), torch.tensor(b.topk_logprobs), atol=1e-4)
        assert len(a.prompt_topk_ids) == (len(a.prompt_ids) - 1 if with_prompt else 0)


def test_the_actual_token_outside_the_top_k_is_left_out():
    entry = {"5": {"logprob": -0.1}, "9": {"logprob": -2.0}, "7": {"logprob": -9.0}}  # 7: the actual, unlikely token
    assert topk_rows([None, entry], 1, 1, 2) == ([[5, 9]], [[-0.1, -2.0]])


def test_a_server_without_prompt_logprobs_is_a_clear_error(target):
    with ServerThread(fake_vllm(target, with_prompt_logprobs=False)) as server:
        scorer = OpenAIScorer(server.url, "tiny")
        with pytest.raises(TeacherUnavailable, match="no prompt_logprobs"):
            scorer([[9, 10]], [[11, 12]], 4)


def test_the_openai_backend_needs_its_url_and_model_and_no_target_samples(tmp_path):
    base = dict(log_dir=str(tmp_path), store=str(tmp_path), work_dir=str(tmp_path), teacher_backend="openai")
    with pytest.raises(ConfigError, match="teacher_url"):
        OnlineConfig(**base)
    with pytest.raises(ConfigError, match="samples_per_request"):
        OnlineConfig(**base, teacher_url="http://127.0.0.1:1", teacher_model="m", samples_per_request=2)
    with pytest.raises(ConfigError, match="teacher_backend"):
        OnlineConfig(**{**base, "teacher_backend": "grpc"})
