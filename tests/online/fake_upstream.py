"""A tiny OpenAI-compatible server standing in for vLLM in the logging front's and the swap supervisor's tests,
and a helper that runs any ASGI app on a free local port in a thread.

Its answer to any prompt is a few words of the tests' tiny vocabulary (tests.online.support), chosen from the
prompt, so the target's tokenizer encodes them back to known ids. Knobs (FakeUpstream fields) make it slow, fail,
hang or refuse; what it received and which requests it saw cancelled are kept for the tests to check. Run as a
script it is a fake engine process for train.engine_swap:

    python tests/online/fake_upstream.py --port P --version V [--never-healthy] [--startup-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeUpstream:
    model: str = MODEL
    version: str = "none"
    words: int = 5               # words per answer (fewer if max_tokens is smaller: finish "length")
    chunk_delay_s: float = 0.0   # between streamed words (and before a whole answer)
    fail_status: int = 0         # answer every completion with this status
    hang: bool = False           # never answer (until the client goes away)
    healthy: bool = True
    received: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # request ids whose client went away
    finished: list[str] = field(default_factory=list)


def answer_words(prompt_text: str, n: int) -> list[str]:
    seed = sum(map(ord, prompt_text))
    return [f"w{8 + (seed + 7 * k) % 56}" for k in range(n)]


def prompt_text(body: dict) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content")) for m in body["messages"])
    return str(body.get("prompt"))


def create_fake_app(fake: FakeUpstream) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return Response(status_code=200 if fake.healthy else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fake.model, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(f"vllm:spec_decode_num_drafts_total{{model_name=\"{fake.model}\"}} 3.0\n",
                        media_type="text/plain")

    async def complete(request: Request, chat: bool):
        body = await request.json()
        fake.received.append(body)
        fake.headers.append(dict(request.headers))
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.get("model") != fake.model:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} does not exist",
                                           "type": "NotFoundError", "code": 404}}, status_code=404)
        if fake.fail_status:
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=fake.fail_status)
        if fake.hang:
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            fake.cancelled.append(rid)
            return Response(status_code=499)
        max_tokens = body.get("max_tokens") or 16
        words = answer_words(prompt_text(body), min(fake.words, max_tokens))
        finish = "length" if len(words) == max_tokens else "stop"
        if body.get("stream"):
            return StreamingResponse(stream(fake, rid, words, finish, chat), media_type="text/event-stream")
        await asyncio.sleep(fake.chunk_delay_s)
        fake.finished.append(rid)
        text = " ".join(words)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        if body.get("return_token_ids"):  # vLLM's extension; the tests' vocabulary: word wN is token N, EOS 2
            choice["token_ids"] = [int(w[1:]) for w in words] + ([2] if finish == "stop" else [])
            choice["prompt_token_ids"] = [1, 2, 3]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": fake.model, "system_fingerprint": fake.version, "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


async def stream(fake: FakeUpstream, rid: str, words: list[str], finish: str, chat: bool):
    done = False
    try:
        for i, word in enumerate(words):
            await asyncio.sleep(fake.chunk_delay_s)
            piece = word if i == 0 else " " + word
            choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat else \
                {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
            yield f"data: {json.dumps(chunk_body(fake, rid, choice, chat))}\n\n"
        last = {"index": 0, "delta": {}, "finish_reason": finish} if chat else \
            {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        yield f"data: {json.dumps(chunk_body(fake, rid, last, chat))}\n\n"
        yield "data: [DONE]\n\n"
        done = True
    finally:
        (fake.finished if done else fake.cancelled).append(rid)


def chunk_body(fake: FakeUpstream, rid: str, choice: dict, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
            "model": fake.model, "system_fingerprint": fake.version, "choices": [choice]}


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 at a free port, in a thread (a context manager)."""

    def __init__(self, app):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description="a fake OpenAI-compatible engine for the swap supervisor's tests")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--version", default="none")
    p.add_argument("--never-healthy", action="store_true", help="answer /health with 503 forever")
    p.add_argument("--startup-s", type=float, default=0.0, help="seconds before listening (an engine loading)")
    p.add_argument("--chunk-delay-s", type=float, default=0.0)
    args = p.parse_args()
    time.sleep(args.startup_s)
    fake = FakeUpstream(version=args.version, healthy=not args.never_healthy, chunk_delay_s=args.chunk_delay_s)
    uvicorn.run(create_fake_app(fake), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
