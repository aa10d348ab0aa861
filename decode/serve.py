"""An OpenAI-compatible HTTP endpoint that generates with the speculative engine and logs every request.

    python -m decode.serve --target smollm2-135m --drafter STORE_OR_DIR --log-dir LOGS [--port 8000]

`/v1/completions` and `/v1/chat/completions` (streaming with server-sent events, or not), `/v1/models`
and `/health`. Each request appends one JSON line to LOGS (decode.request_log); when --drafter is a
drafter store (models.drafter_store) the server follows its `current` pointer and hot-swaps without a
restart. Bad requests get a 4xx with an OpenAI-style error body and the server goes on serving.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import queue
import threading
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from decode.request_log import DEFAULT_MAX_BYTES, RequestLogWriter
from decode.sampling import SamplingConfig
from decode.serving import Completion, DrafterSlot, Server, ServingLimits

log = logging.getLogger("specdistill.serve")

DEFAULT_MAX_TOKENS_LIMIT = 4096


# ---- request schemas ---------------------------------------------------------------------------------

class CommonParams(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, ...)

    model: str
    max_tokens: StrictInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    n: StrictInt = 1
    stream: StrictBool = False
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionRequest(CommonParams):
    prompt: str | list[StrictInt]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(CommonParams):
    messages: Annotated[list[Message], Field(min_length=1)]


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request checks ------------------------------------------------------------------------------------

def check_common(req: CommonParams, server: Server, prompt_tokens: int) -> tuple[int, SamplingConfig, list[str]]:
    """Everything the engine would refuse or ignore, refused here with the parameter it concerns."""
    if req.model != server.model_name:
        raise BadRequest(f"model {req.model!r} is not served here; this server serves {server.model_name!r}",
                         "model", 404, "model_not_found")
    if req.n != 1:
        raise BadRequest(f"n={req.n}: this server returns one choice per request", "n")
    if req.presence_penalty or req.frequency_penalty:
        raise BadRequest("presence_penalty and frequency_penalty are not supported (they would change the "
                         "target's distribution, which speculative decoding preserves)", "presence_penalty")
    limits = server.limits
    max_tokens = limits.max_tokens if req.max_tokens is None else req.max_tokens
    if not 1 <= max_tokens <= limits.max_tokens:
        raise BadRequest(f"max_tokens={max_tokens} is outside [1, {limits.max_tokens}]", "max_tokens")
    if prompt_tokens == 0:
        raise BadRequest("the prompt is empty", "prompt")
    if prompt_tokens > limits.max_prompt_tokens:
        raise BadRequest(f"the prompt has {prompt_tokens} tokens, more than the {limits.max_prompt_tokens} "
                         "allowed", "prompt", code="context_length_exceeded")
    context = context_window(server)
    if prompt_tokens + max_tokens > context:
        raise BadRequest(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the target's "
                         f"context window of {context} tokens", "max_tokens", code="context_length_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
        raise BadRequest(f"at most 4 stop sequences, got {len(stops)}", "stop")
    sampling = SamplingConfig(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed or 0)
    return max_tokens, sampling, stops


def context_window(server: Server) -> int:
    config = server.target.model.config.get_text_config()
    return int(getattr(config, "max_position_embeddings", 2048))


def completion_prompt_ids(req: CompletionRequest, server: Server) -> list[int]:
    vocab = server.target.vocab_size
    if isinstance(req.prompt, list):
        if any(not 0 <= t < vocab for t in req.prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(req.prompt)
    return server.target.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]


# ---- responses -------------------------------------------------------------------------------------

def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.output_ids),
            "total_tokens": c.prompt_tokens + len(c.output_ids)}


def speculative_info(c: Completion) -> dict:
    """A non-OpenAI extension: which drafter served the request and how it did."""
    return {"drafter_version": c.version, "tau": c.stats["tau"], "alpha": c.stats["alpha"],
            "output_ids": c.output_ids, "request_id": c.request_id}


def completion_body(c: Completion, model: str) -> dict:
    return {"id": f"cmpl-{c.request_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}],
            "usage": usage(c), "speculative": speculative_info(c)}


def chat_body(c: Completion, model: str) -> dict:
    return {"id": f"chatcmpl-{c.request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                                         "finish_reason": c.finish_reason}],
            "usage": usage(c), "speculative": speculative_info(c)}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_response(server: Server, prompt_ids, max_tokens, sampling, stops, fields, chat: bool) -> StreamingResponse:
    """Generate in a worker thread; the response iterates over its text deltas as they come."""
    deltas: queue.Queue = queue.Queue()
    done = object()
    result: dict = {}

    def work():
        try:
            result["completion"] = server.generate(prompt_ids, max_tokens, sampling, stops, fields, on_text=deltas.put)
        except Exception as e:  # reported in the stream: the status line has gone already
            log.exception("generation failed")
            result["error"] = str(e)
        deltas.put(done)

    threading.Thread(target=work, name="generate", daemon=True).start()
    created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None) -> dict:
        if chat:
            delta = {"content": text} if text is not None else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": "stream", "object": obj, "created": created, "model": server.model_name, "choices": [choice]}

    def events():
        if chat:
            first = chunk(None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield sse(first)
        while (item := deltas.get()) is not done:
            yield sse(chunk(item, None))
        if "error" in result:
            yield sse(error_body(result["error"], kind="server_error"))
        else:
            c = result["completion"]
            last = chunk(None if chat else "", c.finish_reason)
            last["usage"], last["speculative"] = usage(c), speculative_info(c)
            yield sse(last)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- the app -------------------------------------------------------------------------------------

def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        server.slot.close()
        server.log_writer.close()

    app = FastAPI(title="specdistill", description="speculative decoding server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
        return JSONResponse(error_body(message, where or None), status_code=400)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest):
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @app.get("/health")
    def health():
        return {"status": "ok", "drafter_version": server.slot.current().version, "swaps": server.slot.swaps}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "specdistill"}]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        prompt_ids = completion_prompt_ids(req, server)
        max_tokens, sampling, stops = check_common(req, server, len(prompt_ids))
        fields = {"endpoint": "completions", "model": req.model, "prompt": req.prompt}
        if req.stream:
            return stream_response(server, prompt_ids, max_tokens, sampling, stops, fields, chat=False)
        return completion_body(server.generate(prompt_ids, max_tokens, sampling, stops, fields), req.model)

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest):
        messages = [m.model_dump() for m in req.messages]
        prompt_ids = server.target.encode_chat(messages)
        max_tokens, sampling, stops = check_common(req, server, len(prompt_ids))
        fields = {"endpoint": "chat.completions", "model": req.model, "messages": messages}
        if req.stream:
            return stream_response(server, prompt_ids, max_tokens, sampling, stops, fields, chat=True)
        return chat_body(server.generate(prompt_ids, max_tokens, sampling, stops, fields), req.model)

    return app


def build_server(target, drafter: str | None, log_dir: str, model_name: str | None = None, gamma: int = 5,
                 adaptive: bool = True, max_prompt_tokens: int | None = None,
                 max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT, reload_interval_s: float = 1.0,
                 log_max_bytes: int = DEFAULT_MAX_BYTES) -> Server:
    slot = DrafterSlot(target, drafter, gamma=gamma, adaptive=adaptive, reload_interval_s=reload_interval_s)
    server = Server(target, slot, RequestLogWriter(log_dir, log_max_bytes), ServingLimits(0, max_tokens_limit),
                    model_name or target.name)
    server.limits.max_prompt_tokens = max_prompt_tokens or context_window(server) - 1
    return server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m decode.serve")
    p.add_argument("--target", default=None, help="target model (default: the embedded smollm2-135m)")
    p.add_argument("--drafter", default=None,
                   help="a drafter store (hot-swapped), a drafter directory, truncated:N or prompt_lookup; "
                        "default none (plain decoding)")
    p.add_argument("--log-dir", required=True, help="directory of the request log segments")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients ask for (default: the target's name)")
    p.add_argument("--gamma", type=int, default=5, help="draft depth")
    p.add_argument("--no-adaptive", action="store_true", help="always draft gamma tokens (fixed depth)")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT)
    p.add_argument("--reload-interval", type=float, default=1.0, help="seconds between checks of the store")
    p.add_argument("--log-max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="rotate log segments past this size")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    return p.parse_args(argv)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from models.target import load_target

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = load_target(args.target, device=args.device)
    server = build_server(target, args.drafter, args.log_dir, args.model_name, args.gamma, not args.no_adaptive,
                          args.max_prompt_tokens, args.max_tokens_limit, args.reload_interval, args.log_max_bytes)
    log.info("serving %s with drafter %s on http://%s:%d", server.model_name, server.slot.current().version,
             args.host, args.port)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
