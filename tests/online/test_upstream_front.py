"""The logging front before another OpenAI-compatible server: it answers what the upstream answered, logs exactly
that (the built-in server's record, streaming or not), fails clearly and logs nothing when the upstream fails,
and a client that goes away cancels the upstream request."""

from __future__ import annotations

import json
import os
import stat
import time

import httpx
import pytest

from specdistill.decode.request_log import (
    LogPosition,
    list_segments,
    parse_record,
    read_lines,
    segment_name,
)
from specdistill.decode.upstream import build_front, create_front_app
from tests.online.fake_upstream import MODEL, FakeUpstream, ServerThread, answer_words, create_fake_app
from tests.online.support import VOCAB, make_target


@pytest.fixture(scope="module")
def target():
    return make_target()


class Stack:
    """A fake upstream and the front before it, both listening on local ports."""

    def __init__(self, target, tmp_path, fake: FakeUpstream | None = None, upstream_url: str | None = None,
                 api_key: str | None = None, **front_kw):
        self.fake = fake or FakeUpstream()
        self.log_dir = tmp_path / "logs"
        self.upstream = ServerThread(create_fake_app(self.fake))
        self.target = target
        self.upstream_url, self.api_key, self.front_kw = upstream_url, api_key, front_kw

    def __enter__(self):
        self.upstream.__enter__()
        self.front = build_front(self.target, self.upstream_url or self.upstream.url + "/v1", str(self.log_dir),
                                 drafter_version="v000003", **self.front_kw)
        self.server = ServerThread(create_front_app(self.front, api_key=self.api_key)).__enter__()
        self.client = httpx.Client(base_url=self.server.url, timeout=30)
        return self

    def __exit__(self, *exc):
        self.client.close()
        self.server.__exit__()
        self.upstream.__exit__()

    def records(self) -> list[dict]:
        return [json.loads(x.raw) for x in read_lines(self.log_dir, LogPosition(), 10_000)]


def chat_body(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            **extra}


def ids(target, text: str) -> list[int]:
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def streamed(client: httpx.Client, path: str, body: dict, on_chunk=None) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if on_chunk is not None and events[-1] != "[DONE]":
                    on_chunk(json.loads(events[-1]))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_chat_answer_is_the_upstreams_and_its_record_is_the_built_in_servers(target, tmp_path):
    with Stack(target, tmp_path) as s:
        r = s.client.post("/v1/chat/completions", json=chat_body("w10 w11 w12", seed=5, top_p=0.9))
        assert r.status_code == 200, r.text
        words = answer_words("w10 w11 w12", 5)
        assert r.json()["choices"][0]["message"]["content"] == " ".join(words)
        [line] = read_lines(s.log_dir, LogPosition(), 10)
        record = parse_record(line, target.tokenizer_fingerprint, VOCAB, 1 << 20)  # what the daemon accepts
    assert record["prompt_ids"] == target.encode_chat([{"role": "user", "content": "w10 w11 w12"}])
    assert record["output_ids"] == ids(target, " ".join(words)) + [target.tokenizer.eos_token_id]  # stopped: EOS
    assert record["finish_reason"] == "stop" and record["model"] == MODEL
    assert record["sampling"] == {"temperature": 0.0, "top_p": 0.9, "top_k": 0, "seed": 5, "max_tokens": 8,
                                  "stop": []}
    assert record["messages"] == [{"role": "user", "content": "w10 w11 w12"}]
    assert record["drafter_version"] == "v000003" and record["target_fingerprint"] == target.fingerprint
    assert record["upstream"]["id"] == r.json()["id"]
    assert set(BUILT_IN_RECORD_KEYS) <= set(record)


BUILT_IN_RECORD_KEYS = ("schema", "id", "time", "latency_s", "queued_s", "endpoint", "model", "stream",
                        "prompt_ids", "output_ids", "finish_reason", "sampling", "stats", "drafter_version",
                        "target_fingerprint", "tokenizer_fingerprint")


def test_the_front_logs_the_same_fields_as_the_built_in_server(target, tmp_path):
    from types import SimpleNamespace

    from specdistill.decode.sampling import SamplingConfig
    from specdistill.decode.serving import Completion, Server

    done = Completion([5, 6], "w5 w6", "length", "v000000", {"new_tokens": 2}, "rid", 2)
    built_in = Server.log_record(SimpleNamespace(target=target), done, [9, 10], 2, SamplingConfig(), [],
                                 {"endpoint": "completions", "model": "tiny", "prompt": "w9 w10", "stream": False,
                                  "ticket": 0}, started=0.0)
    with Stack(target, tmp_path) as s:
        assert s.client.post("/v1/completions", json={"model": MODEL, "prompt": "w9 w10", "max_tokens": 3}
                             ).status_code == 200
        [front] = s.records()
    assert set(built_in) - {"ticket"} <= set(front)  # the engine's queue ticket has no meaning upstream
    assert set(front["sampling"]) == set(built_in["sampling"])


def test_completions_with_text_or_ids_and_a_length_finish(target, tmp_path):
    with Stack(target, tmp_path) as s:
        a = s.client.post("/v1/completions", json={"model": MODEL, "prompt": "w9 w10 w11", "max_tokens": 3})
        b = s.client.post("/v1/completions", json={"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 3})
        assert a.status_code == b.status_code == 200
        first, second = s.records()
    assert first["prompt_ids"] == second["prompt_ids"] == [9, 10, 11]
    assert first["prompt"] == "w9 w10 w11" and second["prompt"] == [9, 10, 11]
    assert first["finish_reason"] == "length" and len(first["output_ids"]) == 3  # no EOS: it did not stop
    assert first["output_ids"] == ids(target, a.json()["choices"][0]["text"])


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat_body("w20 w21 w22")),
    ("/v1/completions", {"model": MODEL, "prompt": "w20 w21 w22", "max_tokens": 8}),
])
def test_a_stream_relays_every_chunk_and_finishes_only_once_logged(target, tmp_path, path, body):
    with Stack(target, tmp_path, FakeUpstream(chunk_delay_s=0.01)) as s:
        whole = s.client.post(path, json=body).json()
        logged_at_finish = []

        def on_chunk(chunk):
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                logged_at_finish.append(len(s.records()))

        chunks = streamed(s.client, path, body, on_chunk)
        records = s.records()
    chat = "chat" in path
    text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
                   for c in chunks)
    assert text == (whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"])
    assert logged_at_finish == [2]  # the whole answer's line and the stream's, before its finish reached us
    assert records[0]["output_ids"] == records[1]["output_ids"] and records[1]["stream"] is True


def test_an_upstream_error_is_a_502_and_no_log_line(target, tmp_path):
    with Stack(target, tmp_path, FakeUpstream(fail_status=500)) as s:
        r = s.client.post("/v1/chat/completions", json=chat_body("w10"))
        with s.client.stream("POST", "/v1/chat/completions", json=chat_body("w10", stream=True)) as st:
            stream_status = st.status_code
        assert s.client.get("/health").json()["status"] == "ok"
        assert s.records() == []
    assert r.status_code == 502 and stream_status == 502
    assert "answered 500" in r.json()["error"]["message"]


def test_an_unreachable_upstream_is_a_502(target, tmp_path):
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    with Stack(target, tmp_path, upstream_url=f"http://127.0.0.1:{port}") as s:
        r = s.client.post("/v1/completions", json={"model": MODEL, "prompt": "w9", "max_tokens": 2})
        assert s.records() == []
    assert r.status_code == 502 and "ConnectError" in r.json()["error"]["message"]


def test_an_upstream_that_does_not_answer_in_time_is_a_504_and_no_log_line(target, tmp_path):
    with Stack(target, tmp_path, FakeUpstream(hang=True), timeout_s=0.5) as s:
        r = s.client.post("/v1/chat/completions", json=chat_body("w10"))
        assert s.records() == []
    assert r.status_code == 504 and "did not answer in time" in r.json()["error"]["message"]


def test_an_upstream_refusal_is_passed_through_and_not_logged(target, tmp_path):
    with Stack(target, tmp_path) as s:
        r = s.client.post("/v1/chat/completions", json={**chat_body("w10"), "model": "other"})
        assert s.records() == []
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("api_key", [None, "front-key"], ids=["open", "behind-the-key-check"])
def test_a_client_that_goes_away_cancels_the_upstream_request(target, tmp_path, api_key):
    fake = FakeUpstream(hang=True)
    with Stack(target, tmp_path, fake, api_key=api_key) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.server.url + "/v1/chat/completions", json=chat_body("w10"), timeout=0.5,
                       headers={"Authorization": f"Bearer {api_key}"})
        assert wait_for(lambda: len(fake.cancelled) == 1)
        assert wait_for(lambda: s.front.router.in_flight() == 0)
        assert s.records() == []


def test_a_client_that_leaves_a_stream_cancels_the_upstream_stream(target, tmp_path):
    fake = FakeUpstream(words=200, chunk_delay_s=0.05)
    with Stack(target, tmp_path, fake) as s:
        with httpx.Client(base_url=s.server.url, timeout=30) as client:
            with client.stream("POST", "/v1/chat/completions", json=chat_body("w10", max_tokens=500, stream=True)) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
        assert wait_for(lambda: len(fake.cancelled) == 1)
        assert fake.finished == [] and wait_for(lambda: s.front.router.in_flight() == 0)
        assert s.records() == []


@pytest.mark.parametrize("name,body", [
    ("n", chat_body("w10", n=2)),
    ("tools", chat_body("w10", tools=[{"type": "function", "function": {"name": "f"}}])),
    ("prompt", {"model": MODEL, "prompt": ["w9", "w10"]}),
    ("echo", {"model": MODEL, "prompt": "w9", "echo": True}),
    ("model", {"messages": [{"role": "user", "content": "w9"}]}),
])
def test_what_cannot_be_logged_faithfully_is_refused_by_name(target, tmp_path, name, body):
    with Stack(target, tmp_path) as s:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = s.client.post(path, json=body)
        assert s.fake.received == [] and s.records() == []
    assert r.status_code == 400 and r.json()["error"]["param"] == name


def test_a_full_disk_degrades_health_and_answers_go_on(target, tmp_path):
    with Stack(target, tmp_path) as s:
        assert s.client.post("/v1/chat/completions", json=chat_body("w10")).status_code == 200
        s.front.log_writer.close()
        for n in (1, 2, 3):  # the next segments are a full device: every write fails with ENOSPC
            (s.log_dir / segment_name(n)).symlink_to("/dev/full")
        s.front.log_writer.segment = 1
        assert s.client.post("/v1/chat/completions", json=chat_body("w11")).status_code == 200
        with s.client.stream("POST", "/v1/chat/completions", json=chat_body("w12", stream=True)) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        health = s.client.get("/health").json()
        assert health["status"] == "degraded" and "request log" in health["reason"]
        assert health["unlogged_requests"] == 2
        for n in (1, 2, 3):
            (s.log_dir / segment_name(n)).unlink()
        assert s.client.post("/v1/chat/completions", json=chat_body("w13")).status_code == 200
        assert s.client.get("/health").json()["status"] == "ok"
        assert len(s.records()) == 2
        assert stat.S_IMODE(os.stat(s.log_dir / segment_name(list_segments(s.log_dir)[-1])).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(s.log_dir).st_mode) == 0o700


def test_api_keys_the_fronts_own_stays_here_or_the_clients_passes_through(target, tmp_path):
    with Stack(target, tmp_path / "own", api_key="front-key", upstream_api_key="engine-key") as s:
        assert s.client.post("/v1/chat/completions", json=chat_body("w10")).status_code == 401
        ok = s.client.post("/v1/chat/completions", json=chat_body("w10"),
                           headers={"Authorization": "Bearer front-key"})
        assert ok.status_code == 200 and s.fake.headers[-1]["authorization"] == "Bearer engine-key"
    with Stack(target, tmp_path / "through") as s:
        s.client.post("/v1/chat/completions", json=chat_body("w10"), headers={"Authorization": "Bearer client-key"})
        assert s.fake.headers[-1]["authorization"] == "Bearer client-key"


def test_metrics_and_models_are_the_upstreams(target, tmp_path):
    with Stack(target, tmp_path) as s:
        assert "vllm:spec_decode_num_drafts_total" in s.client.get("/metrics").text
        assert s.client.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_with_upstream_token_ids_the_log_holds_the_ids_the_upstream_returned(target, tmp_path):
    with Stack(target, tmp_path, request_token_ids=True) as s:
        r = s.client.post("/v1/completions", json={"model": MODEL, "prompt": "w9 w10", "max_tokens": 8})
        [record] = s.records()
        assert s.fake.received[-1]["return_token_ids"] is True
    assert record["output_ids"] == r.json()["choices"][0]["token_ids"]
    assert record["prompt_ids"] == [1, 2, 3]  # the upstream's own tokenization of the prompt wins
