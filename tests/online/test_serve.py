"""The HTTP server: OpenAI-shaped answers that are the target's greedy output, a log line per request,
4xx for bad requests without going down, and hot-swaps that drop nothing and stay lossless."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from specdistill.decode.request_log import list_segments, segment_name
from specdistill.decode.serve import build_server, create_app
from specdistill.models.drafter_store import init_store, publish_version
from tests.conftest import make_tiny_llama
from tests.online.support import VOCAB, greedy_reference, make_target, save_tiny_drafter, words


@pytest.fixture(scope="module")
def target():
    return make_target()


def make_client(target, tmp_path, drafter=None, **kw):
    server = build_server(target, drafter, str(tmp_path / "logs"), model_name="tiny", **kw)
    return server, TestClient(create_app(server))


def read_log(log_dir):
    lines = []
    for n in list_segments(log_dir):
        lines += [json.loads(x) for x in (log_dir / segment_name(n)).read_text().splitlines()]
    return lines


def chat(client, content, max_tokens=12, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_chat_answer_is_the_targets_greedy_output_and_is_logged(target, tmp_path):
    server, client = make_client(target, tmp_path, drafter=str(save_tiny_drafter(tmp_path / "d", target)))
    r = chat(client, "w10 w11 w12")
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = target.encode_chat([{"role": "user", "content": "w10 w11 w12"}])
    expected = greedy_reference(target, prompt_ids, 12)
    assert body["speculative"]["output_ids"] == expected
    assert body["choices"][0]["message"]["content"] == target.tokenizer.decode(expected, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(expected)
    [record] = read_log(tmp_path / "logs")
    assert record["prompt_ids"] == prompt_ids and record["output_ids"] == expected
    assert record["messages"] == [{"role": "user", "content": "w10 w11 w12"}]
    assert record["tokenizer_fingerprint"] == target.tokenizer_fingerprint
    assert record["stats"]["new_tokens"] == len(expected) and record["sampling"]["temperature"] == 0


def test_completions_accept_text_and_token_ids(target, tmp_path):
    _, client = make_client(target, tmp_path)
    ids = [9, 10, 11, 12]
    a = client.post("/v1/completions", json={"model": "tiny", "prompt": words(ids), "max_tokens": 8, "temperature": 0})
    b = client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0})
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["speculative"]["output_ids"] == greedy_reference(target, ids, 8)


def test_streamed_deltas_concatenate_to_the_full_answer(target, tmp_path):
    _, client = make_client(target, tmp_path, drafter="prompt_lookup")
    full = chat(client, "w20 w21 w22 w20 w21", max_tokens=20).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "w20 w21 w22 w20 w21"}],
            "max_tokens": 20, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_string_cuts_the_text(target, tmp_path):
    _, client = make_client(target, tmp_path)
    full = chat(client, "w30 w31", max_tokens=16).json()
    words_out = full["choices"][0]["message"]["content"].split()
    assert len(words_out) >= 3
    stop = words_out[2]
    cut = chat(client, "w30 w31", max_tokens=16, stop=[stop]).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    text = full["choices"][0]["message"]["content"]
    assert cut["choices"][0]["message"]["content"] == text[:text.find(stop)]


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "w9"}]}, 404),
    ("over-long prompt", {"model": "tiny", "messages": [{"role": "user", "content": "w9 " * 600}]}, 400),
    ("max_tokens zero", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}], "max_tokens": 0}, 400),
    ("absurd max_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}],
                           "max_tokens": 10**9}, 400),
    ("max_tokens a string", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}],
                             "max_tokens": "many"}, 400),
    ("messages not a list", {"model": "tiny", "messages": "w9"}, 400),
    ("unknown role", {"model": "tiny", "messages": [{"role": "robot", "content": "w9"}]}, 400),
    ("temperature a string", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}],
                              "temperature": "hot"}, 400),
    ("no model", {"messages": [{"role": "user", "content": "w9"}]}, 400),
    ("n=3", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}], "n": 3}, 400),
    ("body is a list", [1, 2, 3], 400),
]


@pytest.mark.parametrize("name,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(target, tmp_path, name, body, status):
    _, client = make_client(target, tmp_path, max_prompt_tokens=400)
    if isinstance(body, bytes):
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert chat(client, "w9", max_tokens=3).status_code == 200
    assert len(read_log(tmp_path / "logs")) == 1  # only the good request was logged


def test_completions_reject_token_ids_outside_the_vocabulary(target, tmp_path):
    _, client = make_client(target, tmp_path)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [3, VOCAB + 5], "max_tokens": 4})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_hot_swap_under_concurrent_requests_drops_none_and_stays_lossless(target, tmp_path):
    store = tmp_path / "store"
    init_store(store, save_tiny_drafter(tmp_path / "d0", target, seed=1))
    server, client = make_client(target, tmp_path, drafter=str(store), reload_interval_s=3600)
    prompts = [f"w{10 + i} w{20 + i % 7} w{30 + i % 5}" for i in range(12)]
    results: dict[int, object] = {}

    def ask(i):
        results[i] = chat(client, prompts[i], max_tokens=10)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads[:6]:
        t.start()
    publish_version(store, make_tiny_llama(vocab_size=VOCAB, layers=1, seed=7), target, {"seed": 7})
    assert server.slot.reload_if_changed()
    for t in threads[6:]:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(12)) and all(r.status_code == 200 for r in results.values())
    for i, r in results.items():
        ids = target.encode_chat([{"role": "user", "content": prompts[i]}])
        assert r.json()["speculative"]["output_ids"] == greedy_reference(target, ids, 10)
    versions = {rec["drafter_version"] for rec in read_log(tmp_path / "logs")}
    assert versions == {"v000000", "v000001"}
    assert len(read_log(tmp_path / "logs")) == 12


def test_log_rotates_by_size_and_keeps_every_request(target, tmp_path):
    _, client = make_client(target, tmp_path, log_max_bytes=2048)
    for i in range(8):
        assert chat(client, f"w{12 + i} w40", max_tokens=6).status_code == 200
    assert len(list_segments(tmp_path / "logs")) > 1
    assert len(read_log(tmp_path / "logs")) == 8


def test_a_request_in_flight_finishes_on_the_version_it_started_with(target, tmp_path):
    store = tmp_path / "store"
    init_store(store, save_tiny_drafter(tmp_path / "d0", target, seed=1))
    server, client = make_client(target, tmp_path, drafter=str(store), reload_interval_s=3600)
    result = {}
    busy = server.reserve()  # the engine is taken: the request arrives, takes its snapshot, and waits in line
    server.admission.wait_turn(busy)
    waiting = threading.Thread(target=lambda: result.setdefault("r", chat(client, "w11 w12", max_tokens=6)))
    waiting.start()
    threading.Event().wait(0.5)  # ample time to arrive and wait for the engine
    publish_version(store, make_tiny_llama(vocab_size=VOCAB, layers=1, seed=7), target, {"seed": 7})
    assert server.slot.reload_if_changed()
    server.admission.release(busy)
    waiting.join()
    assert result["r"].json()["speculative"]["drafter_version"] == "v000000"
    assert chat(client, "w11 w12", max_tokens=6).json()["speculative"]["drafter_version"] == "v000001"
