"""llama.cpp as a peer in the evaluation (`--peers llamacpp`): llama.cpp's own server decoding the very GGUF file our
target was converted from, plainly (`llamacpp`), with its n-gram speculation (`llamacpp+ngram`), with a draft model
given by `--llamacpp-draft` (`llamacpp+draft`) and with each EAGLE-3 or DFlash drafter given by `--drafter`
(`llamacpp+eagle3`, `llamacpp+dflash`), on the same prompt token ids as our methods, interleaved question by question
like every method.

llamacpp+eagle3 and llamacpp+dflash are our drafter as a llama.cpp user would run it: exported (the speculators
format; DFlash's checkpoint), converted by llama.cpp's own `convert_hf_to_gguf.py` from the same tree as the binaries
and cached (decode.llamacpp_convert), and served with `--spec-type draft-eagle3` / `draft-dflash`, a chain of --gamma
tokens per step.

llama.cpp is built by `make llamacpp` (.llamacpp/bin, from the llama.cpp tree that the pinned llama-cpp-python sdist
vendors). Each method is one `llama-server` process (one slot, this process's torch thread count, on localhost at a
free port), started when the methods are built and stopped by Method.close, or when this process exits or dies
(PR_SET_PDEATHSIG). Each turn is one `/completion` request: the prompt as token ids (no BOS added to a token list; no
prompt cache, so every turn prefills afresh as our engine does), greedy (temperature 0, top_k 1), at most
max_new_tokens, the generated ids sent back. Its wall time is measured here around the request (the server's prompt
and generation time plus one localhost round trip); its acceptance comes from the server's `timings` (draft_n,
draft_n_accepted).

llama.cpp computes with its own kernels, on the GGUF's quantized blocks: its greedy output may leave ours. So its
methods are not bound to the baseline's output (Method.lossless False), and the report gives, per turn, the token
position where such a peer's answer first leaves the baseline's (decode.peers.first_divergence).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from specdistill.decode.engine import truncate_at_eos
from specdistill.decode.llamacpp_convert import LlamacppNotBuiltError, drafter_gguf
from specdistill.decode.metrics import RequestStats
from specdistill.decode.peers import Method, TurnOutput

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
BIN_ENV = "SPECDISTILL_LLAMACPP_BIN"  # a folder holding llama-server (default: .llamacpp/bin, built by make llamacpp)
PLAIN, NGRAM, DRAFT, EAGLE3, DFLASH = ("llamacpp", "llamacpp+ngram", "llamacpp+draft", "llamacpp+eagle3",
                                      "llamacpp+dflash")
FEATURE_METHODS = {"eagle3": EAGLE3, "dflash": DFLASH}  # our drafter kinds llama.cpp runs -> the method's name
# llama.cpp's n-gram speculation closest to our prompt_lookup drafter: its `ngram-simple` finds the latest earlier
# occurrence of the last NGRAM_SIZE tokens and drafts up to NGRAM_DRAFT_TOKENS of what followed (ours: the longest of
# 3..1 tokens, 10 drafts; llama.cpp's defaults, 12 and 48, are for long agentic contexts and never match in a chat)
NGRAM_SIZE = 2
NGRAM_DRAFT_TOKENS = 10
CONTEXT_TOKENS = 8192  # the server's context: an MT-bench turn-2 prompt and its answer fit with room to spare
STARTUP_TIMEOUT_S = 180.0  # loading a GGUF of 1.5B parameters and the warm-up run take seconds; a draft adds its own
REQUEST_TIMEOUT_S = 900.0
# llama-server's log lines: "0.01.135.337 E spec common_specu: the target and draft vocabs are not compatible"
SPECULATION_ERROR = re.compile(r"^\S+ E (.*(?:\bspec\b|specul).*)$", re.IGNORECASE)
# what a server that died says last: ".../llama-graph.cpp:1384: GGML_ASSERT(t_layer_inp[il] != nullptr ...) failed"
FATAL_LINE = re.compile(r"GGML_ASSERT|GGML_ABORT|terminate called|^\S+ E ")


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or ROOT / ".llamacpp" / "bin")


def server_binary(folder: Path | None = None) -> Path:
    """The llama-server binary, or LlamacppNotBuiltError saying how to build it."""
    binary = Path(folder or bin_dir()) / "llama-server"
    if not os.access(binary, os.X_OK):
        raise LlamacppNotBuiltError(f"llama.cpp is not built ({binary} does not exist): run `make llamacpp` "
                                    f"(about 11 minutes on 2 cores), or set ${BIN_ENV} to the folder of a llama-server")
    return binary


def check_setup(draft: str | None) -> None:
    """Before anything loads: LlamacppNotBuiltError without `make llamacpp`, ValueError for a --llamacpp-draft that
    is no GGUF model (a named one is fetched now, as loading it would)."""
    server_binary()
    if draft is not None:
        try:
            resolve_gguf(draft)
        except ValueError as err:
            raise ValueError(f"argument --llamacpp-draft: {err}") from err


# ---- the GGUF file a target or a draft is -----------------------------------------------------------------------

def resolve_gguf(spec: str) -> Path:
    """The GGUF file that `spec` names: the embedded default's name, a named real target (models.real_targets,
    fetched and verified on first use), a .gguf file, or a directory converted from one (its cache marker names the
    file). ValueError says why not."""
    from specdistill.models.embedded import EMBEDDED_NAME
    from specdistill.models.real_targets import REAL_TARGETS, fetch_gguf

    if spec == EMBEDDED_NAME:
        return embedded_gguf()
    if spec in REAL_TARGETS:
        return fetch_gguf(REAL_TARGETS[spec])
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    source = marker_gguf(path) if path.is_dir() else None
    if source is not None:
        return source
    names = ", ".join([EMBEDDED_NAME, *REAL_TARGETS])
    raise ValueError(f"{spec!r} is not a GGUF model llama.cpp can load: expected one of {names}, a .gguf file, or a "
                     "directory converted from one (its COMPLETE.json naming the .gguf file, which must still exist)")


def marker_gguf(directory: Path) -> Path | None:
    """The existing .gguf file a cached conversion's marker (models.cache) records under "gguf" or "source"."""
    from specdistill.models.cache import MARKER

    try:
        info = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    source = Path(str(info.get("gguf") or info.get("source") or ""))
    return source if source.suffix == ".gguf" and source.is_absolute() and source.is_file() else None


def embedded_gguf() -> Path:
    """The embedded default target's GGUF as a file in the cache. models.embedded converts it without keeping it, so
    it is taken from the wheel again (or $SPECDISTILL_SMOLLM2_GGUF) once, checked against the sha256 its conversion
    recorded, and renamed into place: the very bytes our target was dequantized from."""
    from specdistill.models.cache import MARKER, cache_root
    from specdistill.models.embedded import GGUF_MEMBER, embedded_target_dir, locate_embedded_gguf
    from specdistill.models.gguf_convert import file_sha256

    expected = json.loads((embedded_target_dir() / MARKER).read_text()).get("sha256")
    final = cache_root() / "gguf" / Path(GGUF_MEMBER).name
    if final.is_file() and file_sha256(final) == expected:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-gguf-", dir=final.parent) as work:
        copy = Path(work) / final.name
        shutil.copyfile(locate_embedded_gguf(Path(work)), copy)
        if file_sha256(copy) != expected:
            raise RuntimeError(f"the embedded target's GGUF is not the file its conversion was made from "
                               f"(sha256 {expected}); delete {embedded_target_dir()} to convert it again")
        os.replace(copy, final)
    return final


def target_gguf(target) -> tuple[Path | None, str | None]:
    """(the target's GGUF file, None), or (None, why llama.cpp cannot run this target)."""
    try:
        return resolve_gguf(target.name), None
    except ValueError as err:
        return None, f"target {target.name!r} is not from a GGUF file llama.cpp could load ({err})"


# ---- the server's command line, request and reply ---------------------------------------------------------------

@dataclass(frozen=True)
class ServerConfig:
    name: str  # the method
    model: Path  # the target's GGUF
    threads: int  # generation and prompt threads (the draft model's defaults to the same)
    spec_args: tuple[str, ...] = ()  # the speculative options; () = plain decoding
    context: int = CONTEXT_TOKENS


def server_command(binary: Path, config: ServerConfig, port: int) -> list[str]:
    """llama-server on localhost: one slot (batch size 1, the whole context its own), no RAM prompt cache (each turn
    prefills afresh), no web UI."""
    return [str(binary), "--model", str(config.model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(config.threads), "--threads-batch", str(config.threads), "--ctx-size", str(config.context),
            "--parallel", "1", "--cache-ram", "0", "--no-webui", *config.spec_args]


def ngram_args() -> tuple[str, ...]:
    return ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_SIZE),
            "--spec-ngram-simple-size-m", str(NGRAM_DRAFT_TOKENS))


def draft_args(draft: Path, gamma: int) -> tuple[str, ...]:
    """A draft model drafting a chain of gamma tokens (our --gamma) at every step: no minimum, no probability cut-off
    (llama.cpp's draft-simple has no adaptive depth like our engine's)."""
    return ("--spec-type", "draft-simple", "--spec-draft-model", str(draft), "--spec-draft-n-max", str(gamma),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0")


def eagle3_args(draft: Path, gamma: int) -> tuple[str, ...]:
    """An EAGLE-3 GGUF drafting a chain of gamma tokens at every step, with no probability cut-off (llama.cpp drafts
    EAGLE-3 as a chain: no tree, no adaptive depth)."""
    return ("--spec-type", "draft-eagle3", "--spec-draft-model", str(draft), "--spec-draft-n-max", str(gamma),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0")


def dflash_args(draft: Path, gamma: int) -> tuple[str, ...]:
    """A DFlash GGUF filling a block of gamma drafts in one forward at every step (llama.cpp drafts it as a chain,
    the block's top token per row: no tree, no adaptive depth)."""
    return ("--spec-type", "draft-dflash", "--spec-draft-model", str(draft), "--spec-draft-n-max", str(gamma),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0")


SPEC_ARGS = {"eagle3": eagle3_args, "dflash": dflash_args}


def feature_drafters(drafters, kind: str = "eagle3") -> dict[str, str]:
    """{method name: drafter directory} for the drafters of `kind` (eagle3, dflash) among {spec: Drafter}: one method
    per directory (DIR and DIR+prompt_lookup are one drafter to llama.cpp), named llamacpp+<kind>, or
    llamacpp+<kind>[spec] when there are several."""
    method = FEATURE_METHODS[kind]
    first_spec: dict[str, str] = {}  # drafter directory -> the first spec that named it
    for spec, drafter in (drafters or {}).items():
        if drafter.kind == kind and drafter.path:
            first_spec.setdefault(drafter.path, spec)
    if len(first_spec) == 1:
        return {method: next(iter(first_spec))}
    return {f"{method}[{spec}]": path for path, spec in first_spec.items()}


def server_configs(model: Path, threads: int, gamma: int, draft: Path | None) -> tuple[list[ServerConfig], dict]:
    """One server per method: plain, n-gram and (with a draft GGUF) draft-model speculation; {method: reason} for
    the ones left out."""
    configs = [ServerConfig(PLAIN, model, threads), ServerConfig(NGRAM, model, threads, ngram_args())]
    if draft is None:
        return configs, {DRAFT: "no draft model given (--llamacpp-draft PATH_OR_NAME)"}
    return [*configs, ServerConfig(DRAFT, model, threads, draft_args(draft, gamma))], {}


def completion_payload(prompt_ids: list[int], max_new_tokens: int) -> dict:
    """A /completion request: exactly these token ids, greedy, at most max_new_tokens, the new ids sent back."""
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "temperature": 0.0, "top_k": 1,
            "seed": 0, "cache_prompt": False, "return_tokens": True, "stream": False}


def turn_output(reply: dict, wall_s: float, eos_token_ids: Iterable[int], max_new_tokens: int,
                speculative: bool) -> TurnOutput:
    """A /completion reply as our methods' output: the new ids cut at our first EOS (llama.cpp keeps the EOS it stops
    at, as we do) and at max_new_tokens; statistics from its draft counters for a speculative method, None else."""
    tokens = truncate_at_eos([int(t) for t in reply["tokens"]], eos_token_ids)[:max_new_tokens]
    stats = stats_from(reply.get("timings") or {}, len(tokens), wall_s) if speculative else None
    return TurnOutput(tokens, wall_s, stats)


def stats_from(timings: dict, new_tokens: int, wall_s: float) -> RequestStats:
    """llama.cpp's draft counters as our statistics. Every verification is one target forward that emits its accepted
    drafts plus one token (the prompt's forward emits the first), so forwards = new tokens - accepted drafts, as ours.
    Its reply has no acceptance per draft position."""
    drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    return RequestStats(new_tokens=new_tokens, target_forwards=max(1, new_tokens - accepted), drafted=drafted,
                        accepted=accepted, total_time_s=wall_s)


# ---- one server process -----------------------------------------------------------------------------------------

def speculation_errors(log_text: str) -> list[str]:
    """llama-server's error lines (level E after the timestamp) about speculative decoding, without the timestamp."""
    return [m.group(1).strip() for line in log_text.splitlines() if (m := SPECULATION_ERROR.match(line))]


def fatal_lines(log_text: str) -> list[str]:
    """llama-server's assertion failures and error lines: why a server that stopped answering died."""
    return [line.strip() for line in log_text.splitlines() if FATAL_LINE.search(line)]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: the server gets SIGTERM when this process dies, even by SIGKILL, so none is ever left behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LlamaServer:
    """One llama-server process, its command line and output in log_path; started at construction, ready or an
    error with the log's tail."""

    def __init__(self, config: ServerConfig, log_path: Path, binary: Path | None = None):
        self.config, self.log_path = config, Path(log_path)
        self.port = free_port()
        self.command = server_command(binary or server_binary(), config, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log_file:
            log_file.write(f"$ {' '.join(self.command)}\n".encode())  # what ran, above what it said
            log_file.flush()
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self._finalizer = weakref.finalize(self, stop_process, self.process)  # at exit, or when dropped
        try:
            self.wait_ready(STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until it answers 200 (the model loaded and warmed up); an error with the log's tail if the
        server exits or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.config.name}: llama-server exited with status {self.process.returncode} "
                                   f"at start: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self.check_speculation()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        raise RuntimeError(f"{self.config.name}: llama-server not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def check_speculation(self) -> None:
        """A server whose speculation failed to start (a draft model whose vocabulary is not the target's) logs the
        error and serves plain decoding all the same: refuse it, or a plain server would be reported as speculating."""
        errors = speculation_errors(self.log_path.read_text(errors="replace")) if self.config.spec_args else []
        if errors:
            raise RuntimeError(f"{self.config.name}: llama-server started without its speculative decoding: "
                               + " | ".join(errors))

    def complete(self, payload: dict) -> tuple[dict, float]:
        """POST /completion; (the reply, the wall time around it). A RuntimeError names the method and says why."""
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                body = response.read()
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"{self.config.name}: llama-server answered {err.code}: {err.read()[:600]!r}") from err
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise RuntimeError(f"{self.config.name}: no answer from llama-server ({err}): "
                               f"{self.fatal_lines() or self.log_tail()}") from err
        return json.loads(body), time.perf_counter() - start

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 15) -> str:
        return " | ".join(self.log_text().splitlines()[-lines:])

    def fatal_lines(self) -> str:
        """What a server that died said about why (its assertion or error lines), rather than its backtrace."""
        time.sleep(0.5)  # a crashing server writes its assertion, then gdb's backtrace, before it exits
        return " | ".join(fatal_lines(self.log_text()))

    def close(self) -> None:
        self._finalizer()


def server_method(server: LlamaServer, max_new_tokens: int, eos_token_ids) -> Method:
    speculative = bool(server.config.spec_args)
    eos = sorted(int(t) for t in eos_token_ids)

    def run(prompt_ids: list[int]) -> TurnOutput:
        reply, wall_s = server.complete(completion_payload(prompt_ids, max_new_tokens))
        return turn_output(reply, wall_s, eos, max_new_tokens, speculative)

    # its own kernels on quantized blocks: divergence from the baseline is reported, never failing the run
    return Method(server.config.name, run, lossless=False, close=server.close, fallible=True)


def feature_configs(model: Path, threads: int, gamma: int, methods: dict[str, str], target, kind: str = "eagle3"
                    ) -> tuple[list[ServerConfig], dict[str, str]]:
    """One llama-server per {method: drafter directory of `kind`}, the drafter converted now (or taken from the
    cache); a drafter that does not convert is a reason in the returned {method: reason}."""
    configs, skipped = [], {}
    for name, drafter_dir in methods.items():
        try:
            draft = drafter_gguf(drafter_dir, target, kind)
            configs.append(ServerConfig(name, model, threads, SPEC_ARGS[kind](draft, gamma)))
        except (RuntimeError, ValueError, OSError) as err:
            skipped[name] = str(err)
    return configs, skipped


def llamacpp_methods(target, max_new_tokens: int, greedy: bool, threads: int, gamma: int = 5,
                     draft: str | None = None, log_dir: Path | None = None,
                     drafters=None) -> tuple[list[Method], dict[str, str]]:
    """llamacpp, llamacpp+ngram, (with a draft GGUF, a name or path) llamacpp+draft and, for the eagle3 and dflash
    drafters among {spec: Drafter}, llamacpp+eagle3 and llamacpp+dflash: each a server started now (Method.close
    stops it). LlamacppNotBuiltError without `make llamacpp`; a method that cannot run (the target not from a GGUF,
    sampling, a drafter the converter refuses, a server that fails to start) is a reason in the returned
    {method: reason}."""
    binary = server_binary()
    features = {kind: feature_drafters(drafters, kind) for kind in FEATURE_METHODS}
    names = [PLAIN, NGRAM, DRAFT, *(name for methods in features.values() for name in methods)]
    model, reason = target_gguf(target)
    reason = reason or (None if greedy else "the llama.cpp peers run greedy decoding only")
    if reason:
        log.warning("skipping the llama.cpp peers: %s", reason)
        return [], dict.fromkeys(names, reason)
    configs, skipped = server_configs(model, threads, gamma, None if draft is None else resolve_gguf(draft))
    for kind, methods in features.items():
        more, unconverted = feature_configs(model, threads, gamma, methods, target, kind)
        configs, skipped = [*configs, *more], {**skipped, **unconverted}
    for name, why in skipped.items():
        log.info("skipping %s: %s", name, why)
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="llamacpp-logs-"))
    methods = []
    for config in configs:
        log.info("starting %s: llama-server on %s", config.name, config.model.name)
        try:
            server = LlamaServer(config, logs / f"{config.name.replace('+', '_')}.log", binary)
        except (RuntimeError, OSError) as err:
            skipped[config.name] = str(err)
            log.warning("skipping %s: %s", config.name, err)
            continue
        methods.append(server_method(server, max_new_tokens, target.eos_token_ids))
    return methods, skipped
