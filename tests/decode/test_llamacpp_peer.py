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

from specdistill.decode import llamacpp_convert
from specdistill.decode.evaluate import EvalConfig, build_methods, conversation_for_turn, evaluate_methods, main
from specdistill.decode.llamacpp_convert import (
    CONVERTER_ENV,
    OUTTYPE,
    check_converter_modules,
    convert_command,
    drafter_gguf,
    gguf_cache_key,
)
from specdistill.decode.llamacpp_peer import (
    BIN_ENV,
    DRAFT,
    EAGLE3,
    NGRAM,
    NGRAM_DRAFT_TOKENS,
    NGRAM_SIZE,
    PLAIN,
    LlamacppNotBuiltError,
    ServerConfig,
    completion_payload,
    eagle3_args,
    fatal_lines,
    feature_drafters,
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
from specdistill.models.cache import CACHE_ENV
from specdistill.models.drafters import load_drafter, save_drafter
from specdistill.models.eagle3 import Eagle3Drafter
from specdistill.models.export import TARGET_DIR
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


def test_the_eagle3_method_serves_the_converted_drafter_as_a_chain_of_gamma_tokens(tmp_path):
    model, draft = tmp_path / "target.gguf", tmp_path / "eagle3-abc.gguf"
    command = server_command(Path("llama-server"), ServerConfig(EAGLE3, model, 2, eagle3_args(draft, 6)), 8123)
    assert option(command, "--model") == str(model)  # the target's own GGUF verifies
    assert option(command, "--spec-type") == "draft-eagle3" and option(command, "--spec-draft-model") == str(draft)
    assert option(command, "--spec-draft-n-max") == "6"  # our --gamma
    assert option(command, "--spec-draft-n-min") == "0" and option(command, "--spec-draft-p-min") == "0"
    assert option(command, "--threads") == "2" and option(command, "--parallel") == "1"


def test_the_converter_reads_the_target_from_the_exports_own_folder(tmp_path):
    script, export, out = tmp_path / "convert_hf_to_gguf.py", tmp_path / "export", tmp_path / "d.gguf"
    command = convert_command(script, export, out)
    assert command[:3] == [sys.executable, str(script), str(export)]
    assert option(command, "--target-model-dir") == str(export / TARGET_DIR)  # models.export writes it
    assert option(command, "--outfile") == str(out) and option(command, "--outtype") == OUTTYPE


def test_one_eagle3_method_per_drafter_directory():
    eagle = SimpleNamespace(kind="eagle3", path="/runs/a")
    other = SimpleNamespace(kind="eagle3", path="/runs/b")
    assert feature_drafters(None, "eagle3") == {}
    assert feature_drafters({"prompt_lookup": SimpleNamespace(kind="prompt_lookup", path=None)}, "eagle3") == {}
    assert feature_drafters({"/runs/a": eagle, "/runs/a+prompt_lookup": eagle}, "eagle3") == {EAGLE3: "/runs/a"}
    assert feature_drafters({"/runs/a+prompt_lookup": eagle, "/runs/b": other, "/runs/a": eagle}, "eagle3") == {
        f"{EAGLE3}[/runs/a+prompt_lookup]": "/runs/a", f"{EAGLE3}[/runs/b]": "/runs/b"}


def test_a_dead_servers_reason_is_its_assertion_not_its_backtrace():
    assertion = 'llama-graph.cpp:1384: GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor is null") failed'
    log = f"0.06.093.048 I srv  load_model: loaded\n{assertion}\n#1  0x000055686cf900ab in ggml_print_backtrace ()\n"
    assert fatal_lines(log) == [assertion]


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


# ---- our EAGLE-3 drafter converted by (a stand-in for) llama.cpp's converter ---------------------------------------

FAKE_CONVERTER = '''#!{python}
"""Stands in for convert_hf_to_gguf.py: records its command line and the export it was given, writes --outfile; with
$FAIL_CONVERSION set, fails as the real one does on a drafter it refuses."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
export = Path(args[0])
with open({record!r}, "a") as f:
    f.write(json.dumps({{"converter": args, "files": sorted(p.name for p in export.rglob("*"))}}) + "\\n")
if os.environ.get("FAIL_CONVERSION"):
    print("ValueError: EAGLE-3 d2t contains duplicate target ids", file=sys.stderr)
    sys.exit(1)
Path(args[args.index("--outfile") + 1]).write_bytes(b"GGUF")
'''


def fake_converter(tmp_path: Path) -> Path:
    script = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(FAKE_CONVERTER.format(python=sys.executable, record=str(tmp_path / "record.jsonl")))
    return script


@pytest.fixture
def eagle3_setup(monkeypatch, tmp_path):
    """A stand-in converter and llama-server, a cache of our own, and an eagle3 drafter for a tiny 3-layer target
    named by a .gguf file."""
    gguf = tmp_path / "tiny3.gguf"
    gguf.write_bytes(b"GGUF")
    target = target_from_model(make_tiny_llama(vocab_size=64, layers=3, seed=0), make_chat_tokenizer(), str(gguf))
    monkeypatch.setenv(CONVERTER_ENV, str(fake_converter(tmp_path)))
    monkeypatch.setenv(BIN_ENV, str(fake_server(tmp_path).parent))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp_convert, "check_converter_modules", lambda: None)  # the stand-in needs none
    drafter = Eagle3Drafter.for_target(target.model, None, [0, 2, 1], seed=1)
    save_drafter(tmp_path / "eagle", drafter, target, "eagle3", config={**drafter.config})
    return target, tmp_path / "eagle"


def conversions(tmp_path: Path) -> list[dict]:
    return [r for r in records(tmp_path) if isinstance(r, dict) and "converter" in r]


def test_a_drafter_converts_once_from_an_export_that_carries_the_target(eagle3_setup, tmp_path):
    target, drafter_dir = eagle3_setup
    gguf = drafter_gguf(drafter_dir, target, "eagle3")
    assert gguf.is_file() and gguf.parent == tmp_path / "cache" / "llamacpp" and gguf.suffix == ".gguf"
    (done,) = conversions(tmp_path)
    assert {"config.json", "model.safetensors", TARGET_DIR, "tokenizer.json"} <= set(done["files"])
    assert option(done["converter"], "--target-model-dir").endswith(f"export/{TARGET_DIR}")
    assert drafter_gguf(drafter_dir, target, "eagle3") == gguf and len(conversions(tmp_path)) == 1  # cached
    assert not [p for p in gguf.parent.iterdir() if p.name.startswith(".")]  # no work folder left behind


def test_the_cache_key_follows_the_drafters_content_and_the_converter(eagle3_setup, tmp_path):
    _, drafter_dir = eagle3_setup
    script = fake_converter(tmp_path)
    key = gguf_cache_key(drafter_dir, script)
    assert gguf_cache_key(drafter_dir, script) == key
    assert gguf_cache_key(drafter_dir, script, "f16") != key
    (script.parent / "conversion").mkdir()
    (script.parent / "conversion" / "llama.py").write_text("# a newer converter\n")
    assert gguf_cache_key(drafter_dir, script) != key
    key = gguf_cache_key(drafter_dir, script)
    weights = next((drafter_dir / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))  # one bit of one weight
    assert gguf_cache_key(drafter_dir, script) != key


def test_a_conversion_that_fails_names_the_drafter_and_says_why(eagle3_setup, monkeypatch, tmp_path):
    target, drafter_dir = eagle3_setup
    monkeypatch.setenv("FAIL_CONVERSION", "1")
    with pytest.raises(RuntimeError, match="duplicate target ids") as info:
        drafter_gguf(drafter_dir, target, "eagle3")
    assert str(drafter_dir) in str(info.value) and "status 1" in str(info.value)
    assert not list((tmp_path / "cache" / "llamacpp").iterdir())  # nothing half-written in the cache


def test_without_the_converter_or_sentencepiece_the_error_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv(CONVERTER_ENV, str(tmp_path / "nowhere.py"))
    with pytest.raises(LlamacppNotBuiltError, match="make llamacpp"):
        drafter_gguf(tmp_path, None, "eagle3")
    monkeypatch.setattr(llamacpp_convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="sentencepiece"):
        check_converter_modules()


def test_the_evaluation_runs_each_eagle3_drafter_on_its_own_server(eagle3_setup, tmp_path):
    target, drafter_dir = eagle3_setup
    drafter = load_drafter(str(drafter_dir), target)
    methods, skipped = llamacpp_methods(target, 4, True, 2, gamma=3, log_dir=tmp_path / "logs",
                                        drafters={str(drafter_dir): drafter})
    try:
        assert [m.name for m in methods] == [PLAIN, NGRAM, EAGLE3] and set(skipped) == {DRAFT}
        (command,) = [r for r in records(tmp_path) if isinstance(r, list) and "draft-eagle3" in r]
        assert option(command, "--spec-draft-model") == str(drafter_gguf(drafter_dir, target, "eagle3"))
        assert option(command, "--spec-draft-n-max") == "3"
        out = methods[2].run([5, 6, 7])
        assert out.stats.drafted == 4 and out.stats.accepted == 1  # its draft counters, as the other methods'
    finally:
        for method in methods:
            method.close()


def test_a_drafter_the_converter_refuses_is_a_reason_beside_the_other_methods(eagle3_setup, monkeypatch, tmp_path):
    target, drafter_dir = eagle3_setup
    monkeypatch.setenv("FAIL_CONVERSION", "1")
    drafter = load_drafter(str(drafter_dir), target)
    methods, skipped = llamacpp_methods(target, 4, True, 2, log_dir=tmp_path / "logs",
                                        drafters={str(drafter_dir): drafter})
    try:
        assert [m.name for m in methods] == [PLAIN, NGRAM]
        assert "llama.cpp's converter failed" in skipped[EAGLE3] and "duplicate target ids" in skipped[EAGLE3]
    finally:
        for method in methods:
            method.close()


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def interleaved_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """ggml's LLAMA_ROPE_TYPE_NORM (EAGLE3's) on [T, H, hd] at positions 0..T-1: pairs (2i, 2i + 1) rotate."""
    hd = x.shape[-1]
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, hd, 2) / hd)
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]  # [T, 1, hd / 2]
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def llamacpp_eagle3_logits(gguf: Path, embeds: torch.Tensor, hidden: list[torch.Tensor]) -> torch.Tensor:
    """What llama.cpp's EAGLE3 graphs (src/models/eagle3.cpp of the pinned tree) compute from a converted GGUF, at
    every position of one sequence (step 0): g = fc(the inputs of its target_layers, concatenated in that order); the
    decoder layer on [attn_norm(embedding); attn_norm_2(g)], RoPE NORM, residual g, ffn_norm, SiLU MLP; output_norm,
    output; draft logits scattered to the target ids d2t holds, -inf elsewhere. embeds [T, D]: row t the embedding of
    token t + 1; hidden[i] [T, D_target]: the input of target layer i."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    w = {t.name: torch.from_numpy(t.data.copy()).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    meta = {k.removeprefix("eagle3."): v.contents() for k, v in reader.fields.items() if k.startswith("eagle3.")}
    eps, heads, kv_heads = (meta["attention.layer_norm_rms_epsilon"], meta["attention.head_count"],
                            meta["attention.head_count_kv"])
    t = embeds.shape[0]
    g = torch.cat([hidden[i] for i in meta["target_layers"]], dim=-1) @ w["fc.weight"].T  # the encoder
    x = torch.cat([rms_norm(embeds, w["blk.0.attn_norm.weight"], eps), rms_norm(g, w["blk.0.attn_norm_2.weight"], eps)],
                  dim=-1)
    q, k, v = ((x @ w[f"blk.0.attn_{n}.weight"].T).view(t, h, -1) for n, h in (("q", heads), ("k", kv_heads),
                                                                               ("v", kv_heads)))
    q, k = interleaved_rope(q, meta["rope.freq_base"]), interleaved_rope(k, meta["rope.freq_base"])
    k, v = (m.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for m in (k, v))
    attended = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    h = g + attended.transpose(0, 1).reshape(t, -1) @ w["blk.0.attn_output.weight"].T
    m = rms_norm(h, w["blk.0.ffn_norm.weight"], eps)
    h = h + (torch.nn.functional.silu(m @ w["blk.0.ffn_gate.weight"].T) * (m @ w["blk.0.ffn_up.weight"].T)) \
        @ w["blk.0.ffn_down.weight"].T
    draft = rms_norm(h, w["output_norm.weight"], eps) @ w["output.weight"].T  # [T, M]
    logits = torch.full((t, meta["vocab_size"]), float("-inf"))
    logits[:, w["d2t"].long()] = draft
    return logits


@pytest.mark.slow
def test_llamacpps_converter_turns_our_export_into_the_same_drafter(monkeypatch, tmp_path):
    """Our export through llama.cpp's own converter, read back and computed as llama.cpp's EAGLE3 graph computes it,
    gives our drafter's logits on the embedded default target's own features."""
    try:
        llamacpp_convert.converter_script()
        check_converter_modules()
    except (LlamacppNotBuiltError, RuntimeError) as err:
        pytest.skip(str(err))
    from specdistill.models.target import load_target

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    target = load_target()
    vocab_map = torch.arange(0, target.vocab_size, 7)[:4096]  # a reduced head: d2t offsets that are not zero
    drafter = Eagle3Drafter.for_target(target.model, vocab_map, [15, 2, 27], seed=5)  # fused out of layer order
    save_drafter(tmp_path / "eagle", drafter, target, "eagle3", config={**drafter.config})
    gguf = drafter_gguf(tmp_path / "eagle", target, "eagle3")
    ids = torch.tensor([target.encode_chat([{"role": "user", "content": "Name three colours of the sea."}])])
    with torch.no_grad():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states  # [i]: the input of layer i
        embeds = target.model.get_input_embeddings()(ids[:, 1:])  # row t: the token t + 1
        ours_features = torch.cat([hidden[i] for i in drafter.target_layers], dim=-1)[:, :-1]
        ours = torch.full((embeds.shape[1], target.vocab_size), float("-inf"))
        ours[:, drafter.vocab_map] = drafter.logits(drafter.unroll([embeds], ours_features)[0])[0]
        theirs = llamacpp_eagle3_logits(gguf, embeds[0], [h[0, :-1] for h in hidden])
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    torch.testing.assert_close(theirs[:, vocab_map], ours[:, vocab_map], rtol=1e-4, atol=1e-3)
    assert torch.isinf(theirs).sum() == theirs.shape[0] * (target.vocab_size - vocab_map.numel())

