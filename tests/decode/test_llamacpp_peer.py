"""The llama.cpp peers (decode.llamacpp_peer): each method's server command line, the request, a recorded reply as our
output, where a peer's answer first leaves the baseline's, the error without `make llamacpp`, a server's whole life
against a stand-in llama-server (started per method, fed the prompt ids, stopped at the end even when it fails), and,
where `make llamacpp` was run, llama.cpp itself on the embedded default target's GGUF (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdistill.decode.evaluate import EvalConfig, build_methods, conversation_for_turn, evaluate_methods, main
from specdistill.decode.llamacpp_peer import (
    BIN_ENV,
    DRAFT,
    NGRAM,
    NGRAM_DRAFT_TOKENS,
    NGRAM_SIZE,
    PLAIN,
    LlamacppNotBuiltError,
    completion_payload,
    llamacpp_methods,
    resolve_gguf,
    server_binary,
    server_command,
    server_configs,
    speculation_errors,
    turn_output,
)
from specdistill.decode.peers import divergences, first_divergence, format_divergences
from specdistill.decode.questions import load_questions
from specdistill.decode.report import BASELINE, TurnResult
from specdistill.models.target import target_from_model
from tests.conftest import make_tiny_llama
from tests.decode.test_evaluate import MT_BENCH_LINES, make_chat_tokenizer, write_lines

# A /completion reply of llama-server (make llamacpp: llama-cpp-python 0.3.36's llama.cpp) for llamacpp+ngram on the
# embedded default target's GGUF, as it came, but for its long "generation_settings" and the prompt's text: the new ids
# end with SmolLM2's <|im_end|> (2), which llama.cpp keeps as our engine does
RECORDED_REPLY = {
    "index": 0, "content": "The quick brown fox jumps over lazy dog.",
    "tokens": [504, 2365, 6354, 16438, 27003, 690, 23790, 2767, 30, 2], "id_slot": 0, "stop": True,
    "model": "/root/.cache/specdistill/gguf/SmolLM2-135M-Instruct.Q4_1.gguf", "tokens_predicted": 10,
    "tokens_evaluated": 45, "has_new_line": False, "truncated": False, "stop_type": "eos", "stopping_word": "",
    "tokens_cached": 54,
    "timings": {"cache_n": 0, "prompt_n": 45, "prompt_ms": 862.727, "prompt_per_token_ms": 19.17171111111111,
                "prompt_per_second": 52.160185087519, "predicted_n": 10, "predicted_ms": 400.419,
                "predicted_per_token_ms": 44.491, "predicted_per_second": 22.47645591243173, "draft_n": 20,
                "draft_n_accepted": 4},
}


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# ---- command lines, request, reply --------------------------------------------------------------------------------

def test_each_method_is_one_server_with_its_threads_and_speculative_options(tmp_path):
    model, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    configs, skipped = server_configs(model, threads=3, gamma=4, draft=draft)
    assert [c.name for c in configs] == [PLAIN, NGRAM, DRAFT] and skipped == {}
    commands = {c.name: server_command(Path("llama-server"), c, 8123) for c in configs}
    for command in commands.values():
        assert option(command, "--model") == str(model)  # every method decodes the target's own GGUF
        assert option(command, "--threads") == option(command, "--threads-batch") == "3"
        assert option(command, "--port") == "8123" and option(command, "--host") == "127.0.0.1"
        assert option(command, "--parallel") == "1" and option(command, "--cache-ram") == "0"  # batch 1, no reuse
    assert "--spec-type" not in commands[PLAIN]
    ngram = commands[NGRAM]
    assert option(ngram, "--spec-type") == "ngram-simple" and "--spec-draft-model" not in ngram
    assert option(ngram, "--spec-ngram-simple-size-n") == str(NGRAM_SIZE)
    assert option(ngram, "--spec-ngram-simple-size-m") == str(NGRAM_DRAFT_TOKENS)
    with_draft = commands[DRAFT]
    assert option(with_draft, "--spec-type") == "draft-simple"
    assert option(with_draft, "--spec-draft-model") == str(draft) and option(with_draft, "--spec-draft-n-max") == "4"


def test_without_a_draft_model_the_draft_method_is_a_reason(tmp_path):
    configs, skipped = server_configs(tmp_path / "target.gguf", threads=2, gamma=5, draft=None)
    assert [c.name for c in configs] == [PLAIN, NGRAM]
    assert "--llamacpp-draft" in skipped[DRAFT]


def test_the_request_sends_the_exact_prompt_ids_greedy_without_a_prompt_cache():
    payload = completion_payload([151644, 872, 198, 7], 64)
    assert payload["prompt"] == [151644, 872, 198, 7]  # token ids, not text: no BOS added, no re-tokenization
    assert payload["n_predict"] == 64 and payload["temperature"] == 0 and payload["top_k"] == 1
    assert payload["cache_prompt"] is False and payload["return_tokens"] is True and payload["stream"] is False
    assert json.loads(json.dumps(payload)) == payload


def test_a_recorded_reply_becomes_our_output_and_statistics():
    out = turn_output(RECORDED_REPLY, 1.27, eos_token_ids={2}, max_new_tokens=64, speculative=True)
    assert out.tokens == RECORDED_REPLY["tokens"] and out.wall_s == 1.27  # the EOS kept, as our engine does
    assert (out.stats.drafted, out.stats.accepted, out.stats.new_tokens) == (20, 4, 10)
    assert out.stats.target_forwards == 6 and out.stats.alpha == 0.2  # 10 tokens, 4 of them accepted drafts
    assert turn_output(RECORDED_REPLY, 1.27, {2}, 64, speculative=False).stats is None  # plain decoding drafts nothing


def test_a_reply_is_cut_at_our_first_eos_and_at_max_new_tokens():
    reply = {**RECORDED_REPLY, "tokens": [5, 6, 0, 7, 8]}  # 0: an EOS of ours that llama.cpp went past
    assert turn_output(reply, 0.1, {0, 2}, 64, speculative=False).tokens == [5, 6, 0]
    assert turn_output(reply, 0.1, {2}, 2, speculative=False).tokens == [5, 6]


# ---- where a peer leaves the baseline ----------------------------------------------------------------------------

def test_first_divergence_is_the_first_differing_position():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([4], [1, 2]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # stopped early: leaves where the shorter one ends
    assert first_divergence([1, 2, 3, 2], [1, 2, 3]) == 3
    assert first_divergence([], []) is None


def turn(method: str, qid: str, k: int, tokens: list[int]) -> TurnResult:
    return TurnResult(qid, "writing", k, method, 5, tokens, "", 0.1, None)


def test_divergences_per_turn_mark_turns_whose_prompt_already_differed():
    results = [turn(BASELINE, "81", 0, [1, 2, 3]), turn("llamacpp", "81", 0, [1, 2, 4]),
               turn(BASELINE, "81", 1, [5, 6]), turn("llamacpp", "81", 1, [5, 6]),
               turn(BASELINE, "82", 0, [7, 8]), turn("llamacpp", "82", 0, [7, 8])]
    assert divergences(results, "llamacpp") == [
        {"question_id": "81", "turn": 0, "position": 2, "prompt_differs": False},
        {"question_id": "81", "turn": 1, "position": None, "prompt_differs": True},  # prompted with its own answer
        {"question_id": "82", "turn": 0, "position": None, "prompt_differs": False}]
    summary = {BASELINE: {}, "llamacpp": {"first_divergence": divergences(results, "llamacpp")}}
    assert format_divergences(summary).splitlines()[1] == "  llamacpp: 81/0 2, 81/1 =*, 82/0 ="
    assert format_divergences({BASELINE: {}}) == ""


# ---- no build, a bad draft, a target that is not a GGUF -------------------------------------------------------------

def test_without_make_llamacpp_the_error_names_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(BIN_ENV, str(tmp_path / "nothing"))
    with pytest.raises(LlamacppNotBuiltError, match="make llamacpp"):
        server_binary()
    with pytest.raises(LlamacppNotBuiltError, match="make llamacpp"):
        llamacpp_methods(SimpleNamespace(name="x.gguf"), 8, True, 2)
    questions = write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES)
    with pytest.raises(SystemExit) as exit_info:  # an argument error, before any model loads
        main(["--drafter", "prompt_lookup", "--questions", str(questions), "--peers", "llamacpp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --peers: llama.cpp is not built" in err and "`make llamacpp`" in err


def test_a_draft_model_needs_the_llamacpp_peers_and_must_be_a_gguf(tmp_path):
    with pytest.raises(ValueError, match="--peers llamacpp"):
        EvalConfig(drafters=("prompt_lookup",), questions="q", llamacpp_draft="draft.gguf")
    with pytest.raises(ValueError, match="not a GGUF model"):
        resolve_gguf(str(tmp_path / "missing.gguf"))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_gguf(str(tmp_path / "model.gguf")) == (tmp_path / "model.gguf").resolve()


def test_a_target_not_from_a_gguf_is_a_reason_for_every_method(monkeypatch, tmp_path):
    fake = fake_server(tmp_path)
    monkeypatch.setenv(BIN_ENV, str(fake.parent))
    target = SimpleNamespace(name=str(tmp_path), eos_token_ids={2})  # an HF directory without a GGUF behind it
    methods, skipped = llamacpp_methods(target, 8, True, 2)
    assert methods == [] and set(skipped) == {PLAIN, NGRAM, DRAFT}
    assert all("not from a GGUF" in reason for reason in skipped.values())


# ---- a server's life, against a stand-in llama-server -------------------------------------------------------------

FAKE_SERVER = '''#!{python}
"""Stands in for llama-server: records its command line, answers /health and /completion (tokens 10, 11, ... and the
first prompt id), or 500 when its model file is named fail.gguf; with a draft named badvocab.gguf it logs llama.cpp's
errors and serves on, as llama-server does."""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

args = sys.argv[1:]
port, model = int(args[args.index("--port") + 1]), args[args.index("--model") + 1]
record = Path({record!r})
with record.open("a") as f:
    f.write(json.dumps(args) + "\\n")
if "--spec-draft-model" in args and args[args.index("--spec-draft-model") + 1].endswith("badvocab.gguf"):
    print("0.01.135.337 E spec common_specu: the target and draft vocabs are not compatible", flush=True)
    print("0.01.135.480 E srv    load_model: failed to initialize speculative decoding context: draft model vocab "
          "type must match target model to use speculation", flush=True)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {{"status": "ok"}})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if model.endswith("fail.gguf"):
            return self.reply(500, {{"error": {{"message": "boom"}}}})
        with record.open("a") as f:
            f.write(json.dumps({{"request": request}}) + "\\n")
        tokens = [request["prompt"][0]] + list(range(10, 10 + request["n_predict"] - 1))
        timings = {{"predicted_per_second": 100.0}}
        if "--spec-type" in args:
            timings.update(draft_n=4, draft_n_accepted=1)
        self.reply(200, {{"tokens": tokens, "timings": timings, "stop_type": "limit"}})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def fake_server(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    binary = folder / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable, record=str(tmp_path / "record.jsonl")))
    binary.chmod(0o755)
    return binary


def records(tmp_path: Path) -> list:
    return [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]


@pytest.fixture
def gguf_chat_target(tmp_path):
    """A tiny chat target named by a .gguf file, as a target loaded from one is."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    return target_from_model(make_tiny_llama(vocab_size=64, layers=2, seed=0), make_chat_tokenizer(), str(gguf))


def test_each_method_runs_its_own_server_on_the_prompt_ids_and_is_stopped_at_the_end(monkeypatch, tmp_path,
                                                                                     gguf_chat_target):
    monkeypatch.setenv(BIN_ENV, str(fake_server(tmp_path).parent))
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES))
    config = EvalConfig(drafters=("x",), questions="q", max_new_tokens=5, warmup=1, peers="llamacpp",
                        llamacpp_draft=str(tmp_path / "tiny.gguf"), out=str(tmp_path / "run"))
    methods, skipped = build_methods(gguf_chat_target, {}, config)
    assert [m.name for m in methods] == [BASELINE, PLAIN, NGRAM, DRAFT] and skipped == {}
    servers = [m.close.__self__.process for m in methods[1:]]
    result = evaluate_methods(methods, skipped, gguf_chat_target, {}, questions, config, progress=False)
    assert all(process.poll() is not None for process in servers)  # every server stopped
    commands = [r for r in records(tmp_path) if isinstance(r, list)]
    assert len(commands) == 3  # one server per method, started once for the whole evaluation
    assert all(option(c, "--threads") == str(torch.get_num_threads()) for c in commands)
    requests = [r["request"] for r in records(tmp_path) if isinstance(r, dict)]
    first_turns = [gguf_chat_target.encode_chat(conversation_for_turn(q.turns, [], 0)) for q in questions]
    assert all(prompt in [r["prompt"] for r in requests] for prompt in first_turns)  # our prompt ids, as they are
    assert all(r["n_predict"] == 5 and r["top_k"] == 1 for r in requests)
    row = result.summary[NGRAM]
    assert row["lossless"] is False and row["alpha"] == 0.25  # its draft counters, summed over turns
    assert result.summary[PLAIN]["tau"] is None
    assert [d["turn"] for d in row["first_divergence"]] == [0, 1, 0, 0]  # every turn of every question
    log_head = (tmp_path / "run" / "llamacpp_logs" / "llamacpp_ngram.log").read_text().splitlines()[0]
    assert log_head.startswith("$ ") and "--spec-type ngram-simple" in log_head  # the log says what ran


def test_a_server_that_fails_mid_run_is_dropped_and_still_stopped(monkeypatch, tmp_path, gguf_chat_target):
    monkeypatch.setenv(BIN_ENV, str(fake_server(tmp_path).parent))
    failing = tmp_path / "fail.gguf"
    failing.write_bytes(b"GGUF")
    target = target_from_model(gguf_chat_target.model, gguf_chat_target.tokenizer, str(failing))
    questions = load_questions(write_lines(tmp_path / "q.jsonl", MT_BENCH_LINES[2:3]))
    config = EvalConfig(drafters=("x",), questions="q", max_new_tokens=4, warmup=0, peers="llamacpp")
    methods, skipped = build_methods(target, {}, config)
    servers = [m.close.__self__.process for m in methods[1:]]
    result = evaluate_methods(methods, skipped, target, {}, questions, config, progress=False)
    assert "answered 500" in result.skipped[PLAIN] and set(result.summary) == {BASELINE}
    assert all(process.poll() is not None for process in servers)


def test_a_draft_whose_speculation_does_not_start_is_a_reason_not_a_plain_server(monkeypatch, tmp_path,
                                                                                gguf_chat_target):
    monkeypatch.setenv(BIN_ENV, str(fake_server(tmp_path).parent))
    draft = tmp_path / "badvocab.gguf"
    draft.write_bytes(b"GGUF")
    methods, skipped = llamacpp_methods(gguf_chat_target, 4, True, 2, draft=str(draft), log_dir=tmp_path / "logs")
    try:
        assert [m.name for m in methods] == [PLAIN, NGRAM]
        assert "started without its speculative decoding" in skipped[DRAFT]
        assert "the target and draft vocabs are not compatible" in skipped[DRAFT]
    finally:
        for method in methods:
            method.close()


def test_speculation_errors_are_the_error_lines_about_speculation():
    log = ("0.00.648.280 I common_speculative_init_result: loading draft model 'draft.gguf'\n"
           "0.01.135.337 E spec common_specu: the target and draft vocabs are not compatible\n"
           "0.01.135.400 E srv    load_model: failed to load something else\n"
           "0.01.239.444 W srv          init: --cache-idle-slots requires --cache-ram, disabling\n")
    assert speculation_errors(log) == ["spec common_specu: the target and draft vocabs are not compatible"]


# ---- llama.cpp itself ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_llama_server_decodes_the_embedded_targets_gguf(tmp_path):
    try:
        server_binary()
    except LlamacppNotBuiltError as err:
        pytest.skip(str(err))
    from specdistill.models.target import load_target

    target = load_target()
    methods, skipped = llamacpp_methods(target, 16, True, torch.get_num_threads(), log_dir=tmp_path)
    try:
        assert [m.name for m in methods] == [PLAIN, NGRAM], skipped
        prompt = target.encode_chat([{"role": "user", "content": "Count from 1 to 50, separated by commas."}])
        out = methods[0].run(prompt)
        assert len(out.tokens) == 16 and out.stats is None and out.wall_s > 0
        assert all(0 <= t < target.vocab_size for t in out.tokens)
        assert target.tokenizer.decode(out.tokens).startswith("1")
    finally:
        for method in methods:
            method.close()
