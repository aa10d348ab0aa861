"""The server under load and faults, over real HTTP (uvicorn on loopback): many clients at once, first come first
served with a bounded line, clients that vanish mid-stream, a killed server, a log that cannot be written,
parameters it does not honour, and an API key."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from specdistill.decode.request_log import LogPosition, list_segments, parse_record, read_lines, segment_name
from specdistill.decode.serve import UNSUPPORTED, build_server, create_app
from tests.online.support import greedy_reference, make_target, save_target_dir, save_tiny_drafter

MODEL = "tiny"


@pytest.fixture(scope="module")
def target():
    return make_target()


@contextmanager
def live_server(server, api_key=None):
    """The app served by uvicorn on a free loopback port, in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(server, api_key=api_key), log_level="warning", timeout_graceful_shutdown=1)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def body(prompt: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def read_stream(response) -> tuple[str, dict]:
    """(the streamed text, the final chunk)"""
    text, last = "", None
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        delta = chunk["choices"][0].get("delta", {})
        text += delta.get("content") or ""
        last = chunk
    return text, last


def log_records(log_dir: Path) -> list[dict]:
    out = []
    for n in list_segments(log_dir):
        out += [json.loads(x) for x in (log_dir / segment_name(n)).read_text().splitlines()]
    return out


def hold_engine(server):
    """Take the engine as a long generation would; returns the release function."""
    ticket = server.reserve()
    server.admission.wait_turn(ticket)
    return lambda: server.admission.release(ticket)


def wait_until(condition, timeout=10.0):
    end = time.time() + timeout
    while not condition():
        if time.time() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_32_concurrent_clients_get_the_targets_output_first_come_first_served(target, tmp_path):
    server = build_server(target, str(save_tiny_drafter(tmp_path / "d", target)), str(tmp_path / "logs"),
                          model_name=MODEL, max_queue=64)
    prompts = [f"w{10 + i % 40} w{11 + (i * 7) % 40} w{12 + (i * 3) % 40}" for i in range(32)]
    results: dict[int, tuple[list[int], str]] = {}
    with live_server(server) as url, httpx.Client(base_url=url, timeout=120) as client:
        release = hold_engine(server)  # all 32 arrive while the engine is busy, so all of them queue

        def call(i):
            stream = i % 2 == 0
            if stream:
                with client.stream("POST", "/v1/chat/completions", json=body(prompts[i], 10, True)) as r:
                    assert r.status_code == 200
                    text, last = read_stream(r)
                results[i] = (last["speculative"]["output_ids"], text)
            else:
                r = client.post("/v1/chat/completions", json=body(prompts[i], 10))
                assert r.status_code == 200, r.text
                results[i] = (r.json()["speculative"]["output_ids"], r.json()["choices"][0]["message"]["content"])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        wait_until(lambda: server.admission.waiting == 32)
        release()
        for t in threads:
            t.join()
    assert sorted(results) == list(range(32))
    for i, (ids, text) in results.items():
        expected = greedy_reference(target, target.encode_chat([{"role": "user", "content": prompts[i]}]), 10)
        assert ids == expected
        assert text == target.tokenizer.decode(expected, skip_special_tokens=True)
    records = log_records(tmp_path / "logs")
    assert len(records) == 32 and len({r["id"] for r in records}) == 32  # none lost, none duplicated
    by_start = sorted(records, key=lambda r: r["time"])
    assert [r["ticket"] for r in by_start] == sorted(r["ticket"] for r in records)  # served in arrival order


def test_past_the_queue_bound_429_with_retry_after_and_health_answers_meanwhile(target, tmp_path):
    server = build_server(target, None, str(tmp_path / "logs"), model_name=MODEL, max_queue=45)
    with live_server(server) as url, httpx.Client(base_url=url, timeout=60) as client:
        release = hold_engine(server)
        statuses = []
        waiting = [threading.Thread(target=lambda: statuses.append(
            client.post("/v1/chat/completions", json=body("w10 w11", 4)).status_code)) for _ in range(45)]
        for t in waiting:
            t.start()
        wait_until(lambda: server.admission.waiting == 45)  # more waiters than the server's 40 worker threads
        started = time.time()
        health = client.get("/health")
        assert time.time() - started < 1.0 and health.json()["waiting"] == 45 and health.json()["running"] == 1
        full = client.post("/v1/chat/completions", json=body("w10 w11", 4))
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert "queue" in full.json()["error"]["message"]
        streamed = client.post("/v1/chat/completions", json=body("w10 w11", 4, stream=True))
        assert streamed.status_code == 429  # refused before a stream starts, not inside it
        metrics = client.get("/metrics").text
        assert 'vllm:num_requests_waiting{model_name="tiny"} 45.0' in metrics
        assert 'specdistill:requests_rejected_total{model_name="tiny"} 2.0' in metrics
        release()
        for t in waiting:
            t.join()
    assert statuses == [200] * 45 and len(log_records(tmp_path / "logs")) == 45


def slow_down(server, seconds: float):
    """Make each target forward of the served engine take at least `seconds` (a long generation)."""
    runner = server.slot.current().engine.target
    forward = runner.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    runner.forward = slow


def test_a_client_that_disconnects_mid_stream_frees_the_engine_and_is_logged_cancelled(target, tmp_path):
    server = build_server(target, None, str(tmp_path / "logs"), model_name=MODEL, max_tokens_limit=400)
    slow_down(server, 0.05)
    prompt = "w10 w11 w12"
    with live_server(server) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body(prompt, 300, True)) as r:
                lines = r.iter_lines()
                for _ in range(4):  # the role chunk and three tokens' text
                    next(lines)
        gone = time.time()  # the connection is closed here
        wait_until(lambda: server.admission.running == 0, timeout=5)
        freed_after = time.time() - gone
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/v1/chat/completions", json=body(prompt, 3)).status_code == 200
    assert freed_after < 1.0  # one step is 50 ms here; the generation would have run 15 s more
    cancelled, after = log_records(tmp_path / "logs")
    expected = greedy_reference(target, target.encode_chat([{"role": "user", "content": prompt}]), 300)
    assert cancelled["finish_reason"] == "cancelled"
    assert 1 <= len(cancelled["output_ids"]) < 40
    assert cancelled["output_ids"] == expected[:len(cancelled["output_ids"])]  # only what the target emitted
    assert after["finish_reason"] in ("length", "stop")


def test_a_log_that_cannot_be_written_degrades_the_server_but_not_the_answers(target, tmp_path):
    log_dir = tmp_path / "logs"
    first = build_server(target, None, str(log_dir), model_name=MODEL)
    assert TestClient(create_app(first)).post("/v1/chat/completions", json=body("w10", 3)).status_code == 200
    first.log_writer.close()
    before = (log_dir / segment_name(0)).read_bytes()
    server = build_server(target, None, str(log_dir), model_name=MODEL)
    # the next segments are a full device: every write fails with ENOSPC, as on a full disk
    for n in (1, 2, 3):
        (log_dir / segment_name(n)).symlink_to("/dev/full")
    client = TestClient(create_app(server))
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=body("w10 w11", 4))
        assert r.status_code == 200 and r.json()["speculative"]["output_ids"]
    health = client.get("/health").json()
    assert health["status"] == "degraded" and "request log" in health["reason"] and health["unlogged_requests"] == 2
    assert 'specdistill:request_log_failures_total{model_name="tiny"} 2.0' in client.get("/metrics").text
    assert (log_dir / segment_name(0)).read_bytes() == before  # nothing already written is damaged
    for n in (1, 2, 3):
        (log_dir / segment_name(n)).unlink()
    assert client.post("/v1/chat/completions", json=body("w10 w12", 4)).status_code == 200
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["unlogged_requests"] == 2
    assert len(log_records(log_dir)) == 2  # the first server's request and the one after recovery


def test_log_is_private_to_its_owner(target, tmp_path):
    server = build_server(target, None, str(tmp_path / "logs"), model_name=MODEL)
    assert TestClient(create_app(server)).post("/v1/chat/completions", json=body("w10", 3)).status_code == 200
    assert stat.S_IMODE(os.stat(tmp_path / "logs").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "logs" / segment_name(0)).st_mode) == 0o600


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_parameters_that_would_change_the_output_are_refused_by_name(target, tmp_path, name):
    client = TestClient(create_app(build_server(target, None, str(tmp_path / "logs"), model_name=MODEL)))
    value = {"logit_bias": {"10": 5}, "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
             "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
             "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": "yes",
             "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 4, "ignore_eos": True, "guided_json": {},
             "guided_regex": "w1.", "guided_choice": ["w10"], "use_beam_search": True, "echo": True,
             "suffix": "w20", "best_of": 3}[name]
    endpoint, request = "/v1/chat/completions", body("w10 w11", 4, **{name: value})
    if name in ("echo", "suffix", "best_of"):
        endpoint, request = "/v1/completions", {"model": MODEL, "prompt": "w10 w11", "max_tokens": 4, name: value}
    r = client.post(endpoint, json=request)
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_neutral_values_of_unsupported_parameters_are_accepted(target, tmp_path):
    client = TestClient(create_app(build_server(target, None, str(tmp_path / "logs"), model_name=MODEL)))
    r = client.post("/v1/chat/completions", json=body("w10 w11", 4, logprobs=False, tools=[], logit_bias={},
                                                      response_format={"type": "text"}, user="someone"))
    assert r.status_code == 200, r.text


def test_api_key_guards_every_endpoint_but_health(target, tmp_path):
    server = build_server(target, None, str(tmp_path / "logs"), model_name=MODEL)
    client = TestClient(create_app(server, api_key="s3cret"))
    right = {"Authorization": "Bearer s3cret"}
    assert client.get("/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers=right).status_code == 200
    assert client.post("/v1/chat/completions", json=body("w10", 3)).status_code == 401
    assert client.post("/v1/chat/completions", json=body("w10", 3), headers=right).status_code == 200
    assert len(log_records(tmp_path / "logs")) == 1  # refused requests are not generated nor logged


def test_metrics_count_what_was_served(target, tmp_path):
    server = build_server(target, str(save_tiny_drafter(tmp_path / "d", target)), str(tmp_path / "logs"),
                          model_name=MODEL)
    client = TestClient(create_app(server))
    for prompt in ("w10 w11", "w12 w13", "w14 w15"):
        assert client.post("/v1/chat/completions", json=body(prompt, 8)).status_code == 200
    text = client.get("/metrics").text
    records = log_records(tmp_path / "logs")

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))
        return float(line.rsplit(" ", 1)[1])

    assert value("vllm:generation_tokens_total") == sum(len(r["output_ids"]) for r in records)
    assert value("vllm:spec_decode_num_accepted_tokens_total") == sum(r["stats"]["accepted"] for r in records)
    assert value("vllm:spec_decode_num_draft_tokens_total") == sum(r["stats"]["drafted"] for r in records)
    assert value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:num_requests_running") == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(target_dir: Path, log_dir: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdistill.decode.serve", "--target", str(target_dir), "--log-dir", str(log_dir),
           "--port", str(port), "--model-name", MODEL, "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    end = time.time() + 120
    while time.time() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
    proc.kill()
    raise AssertionError("server did not start")


def test_sigkill_mid_traffic_loses_no_acknowledged_request(tmp_path):
    target_dir = save_target_dir(tmp_path / "target")
    log_dir = tmp_path / "logs"
    port = free_port()
    proc = start_server_process(target_dir, log_dir, port)
    acknowledged: list[str] = []
    stop = threading.Event()

    def traffic():
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            i = 0
            while not stop.is_set():
                try:
                    r = client.post("/v1/chat/completions", json=body(f"w{10 + i % 40} w{20 + i % 30}", 24))
                except httpx.HTTPError:
                    return  # the server died mid-request: not acknowledged
                if r.status_code == 200:
                    acknowledged.append(r.json()["speculative"]["request_id"])
                i += 1

    client_thread = threading.Thread(target=traffic)
    client_thread.start()
    wait_until(lambda: len(acknowledged) >= 15, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stop.set()
    client_thread.join()
    restarted = start_server_process(target_dir, log_dir, port)  # appends to a new segment
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body("w10 w11", 4), timeout=30)
        acknowledged.append(r.json()["speculative"]["request_id"])
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=30)
    assert len(list_segments(log_dir)) == 2
    lines = read_lines(log_dir, LogPosition(), max_lines=10_000)
    good, torn = [], 0
    for line in lines:
        try:
            good.append(parse_record(line, make_target().tokenizer_fingerprint, 64, 1 << 20)["id"])
        except Exception:
            torn += 1
    assert torn <= 1  # at most the line the server was writing when it was killed
    assert set(acknowledged) <= set(good)  # every answered request was logged first
    assert len(good) - len(acknowledged) <= 1  # at most the one in flight when the server died
    assert len(set(good)) == len(good)
