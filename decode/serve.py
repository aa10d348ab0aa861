"""An OpenAI-compatible HTTP endpoint that generates with the speculative engine and logs every request.

    python -m decode.serve --target smollm2-135m --drafter STORE_OR_DIR --log-dir LOGS [--port 8000]

`/v1/completions` and `/v1/chat/completions` (streaming with server-sent events, or not), `/v1/models`
and `/health`. Each request appends one JSON line to LOGS (decode.request_log); when --drafter is a
drafter store (models.drafter_store) the server follows its `current` pointer and hot-swaps without a
restart. Bad requests get a 4xx with an OpenAI-style error body and the server goes on serving.

    python -m decode.serve --upstream URL --target TARGET --log-dir LOGS [--port 8000]

is the logging front instead (decode.upstream): no generation here, every request goes to the OpenAI-compatible
server at URL (vLLM, SGLang, llama.cpp's) and is logged as this server logs its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import typing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from specdistill.decode.admission import AdmissionQueue, QueueFull
from specdistill.decode.request_log import DEFAULT_MAX_BYTES, RequestLogWriter
from specdistill.decode.sampling import SamplingConfig
from specdistill.decode.serve_metrics import CONTENT_TYPE_LATEST
from specdistill.decode.serving import DEFAULT_MAX_QUEUE, Completion, DrafterSlot, Server, ServingLimits

log = logging.getLogger("specdistill.serve")

DEFAULT_MAX_TOKENS_LIMIT = 4096
API_KEY_ENV = "SPECDISTILL_API_KEY"


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
    # accepted only so that they can be refused by name (UNSUPPORTED): each would change the output
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    use_beam_search: Any = None


def _unset(*neutral):
    return lambda value: value is None or any(value == n and type(value) is type(n) for n in neutral)


# OpenAI (and vLLM) request parameters that would change the output and that this server does not implement:
# a request that sets one to anything but its neutral value gets a 400 naming it, never an answer that ignores it
UNSUPPORTED: dict[str, typing.Callable[[Any], bool]] = {
    "logit_bias": _unset({}),
    "logprobs": _unset(False, 0),
    "top_logprobs": _unset(0),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": _unset([]),
    "tool_choice": _unset("none"),
    "functions": _unset([]),
    "function_call": _unset("none"),
    "parallel_tool_calls": lambda v: True if v is None else isinstance(v, bool),  # meaningless without tools
    "repetition_penalty": lambda v: v is None or (isinstance(v, (int, float)) and v == 1),
    "min_p": lambda v: v is None or (isinstance(v, (int, float)) and v == 0),
    "min_tokens": _unset(0),
    "ignore_eos": _unset(False),
    "guided_json": _unset(),
    "guided_regex": _unset(),
    "guided_choice": _unset(),
    "use_beam_search": _unset(False),
    "echo": _unset(False),
    "suffix": _unset(""),
    "best_of": _unset(1),
}


def check_supported(req: CommonParams) -> None:
    for name, is_neutral in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if not is_neutral(value):
            raise BadRequest(f"{name} is not supported by this server (it would change the output); "
                             f"got {value!r}", name, code="unsupported_parameter")


class CompletionRequest(CommonParams):
    prompt: str | list[StrictInt]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


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
    check_supported(req)
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


async def in_own_thread(fn: typing.Callable[[], Any]) -> Any:
    """fn() in a thread of its own: a request waiting in line for the engine must not hold one of the
    server's shared worker threads, or 40 waiting requests would starve /health and the streams."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value):
        if not future.done():
            setter(value)

    def work():
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            loop.call_soon_threadsafe(settle, future.set_exception, e)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=work, name="generate", daemon=True).start()
    return await future


def stream_response(server: Server, prompt_ids, max_tokens, sampling, stops, fields, chat: bool) -> StreamingResponse:
    """Generate in a thread of its own; the response relays its text deltas as they come. The place in line
    is taken first, so a full queue is a 429 rather than a stream that fails. A client that goes away sets
    `cancelled`, which stops the generation at the engine's next step."""
    ticket = server.reserve()
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue = asyncio.Queue()
    done = object()
    result: dict = {}
    cancelled = threading.Event()

    def put(item) -> None:
        loop.call_soon_threadsafe(deltas.put_nowait, item)

    def work():
        try:
            result["completion"] = server.generate(prompt_ids, max_tokens, sampling, stops, fields, on_text=put,
                                                   ticket=ticket, cancelled=cancelled)
        except Exception as e:  # reported in the stream: the status line has gone already
            log.exception("generation failed")
            result["error"] = str(e)
        put(done)

    threading.Thread(target=work, name="generate-stream", daemon=True).start()
    created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None) -> dict:
        if chat:
            delta = {"content": text} if text is not None else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": "stream", "object": obj, "created": created, "model": server.model_name, "choices": [choice]}

    async def events():
        try:
            if chat:
                first = chunk(None, None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield sse(first)
            while (item := await deltas.get()) is not done:
                yield sse(chunk(item, None))
            if "error" in result:
                yield sse(error_body(result["error"], kind="server_error"))
            elif result.get("completion") is not None:
                c = result["completion"]
                last = chunk(None if chat else "", c.finish_reason)
                last["usage"], last["speculative"] = usage(c), speculative_info(c)
                yield sse(last)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the stream was cancelled or closed early), or the stream is over
            cancelled.set()

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- the app -------------------------------------------------------------------------------------

def create_app(server: Server, api_key: str | None = None) -> FastAPI:
    """The HTTP app. With `api_key`, every endpoint but /health needs `Authorization: Bearer <api_key>`."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        server.slot.close()
        server.log_writer.close()

    app = FastAPI(title="specdistill", description="speculative decoding server", lifespan=lifespan)
    app.state.server = server

    require_api_key(app, api_key)
    add_error_handlers(app, lambda: retry_after_s(server))

    # async handlers run on the event loop, never waiting behind requests: /health answers during generation
    @app.get("/health")
    async def health():
        return {**server.log_health.status(), "drafter_version": server.slot.current().version,
                "swaps": server.slot.swaps, "running": server.admission.running, "waiting": server.admission.waiting}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "specdistill"}]}

    async def answer(prompt_ids, max_tokens, sampling, stops, fields, chat: bool):
        if fields.pop("stream"):
            return stream_response(server, prompt_ids, max_tokens, sampling, stops, fields, chat=chat)
        ticket = server.reserve()
        completion = await in_own_thread(lambda: server.generate(prompt_ids, max_tokens, sampling, stops, fields,
                                                                 ticket=ticket))
        return (chat_body if chat else completion_body)(completion, fields["model"])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt_ids = completion_prompt_ids(req, server)
        max_tokens, sampling, stops = check_common(req, server, len(prompt_ids))
        fields = {"endpoint": "completions", "model": req.model, "prompt": req.prompt, "stream": req.stream}
        return await answer(prompt_ids, max_tokens, sampling, stops, fields, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        messages = [m.model_dump() for m in req.messages]
        prompt_ids = server.target.encode_chat(messages)
        max_tokens, sampling, stops = check_common(req, server, len(prompt_ids))
        fields = {"endpoint": "chat.completions", "model": req.model, "messages": messages, "stream": req.stream}
        return await answer(prompt_ids, max_tokens, sampling, stops, fields, chat=True)

    return app


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    """With `api_key`, every endpoint but /health needs `Authorization: Bearer <api_key>` (401 otherwise)."""
    if api_key:
        app.add_middleware(ApiKeyCheck, expected=f"Bearer {api_key}".encode())


class ApiKeyCheck:
    """The API-key check as plain ASGI, not Starlette's BaseHTTPMiddleware: the app below keeps the server's own
    `receive`, so a client's disconnect reaches it unchanged (the logging front cancels the upstream call on it)."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        response = JSONResponse(error_body("a valid API key is required: Authorization: Bearer <key>",
                                           code="invalid_api_key", kind="authentication_error"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def add_error_handlers(app: FastAPI, retry_after: typing.Callable[[], int]) -> None:
    """OpenAI-style error bodies: 400 for invalid requests (naming the field), the BadRequest's own status, and 429
    with Retry-After when the line is full."""
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

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, exc: QueueFull):
        return JSONResponse(error_body(f"the server is busy: {exc}; retry later", code="queue_full",
                                       kind="rate_limit_error"),
                            status_code=429, headers={"Retry-After": str(retry_after())})


def retry_after_s(server: Server) -> int:
    """Seconds until a place in line is likely free: one mean request latency so far, at least 1."""
    return max(1, round(server.metrics.mean_latency_s()))


def build_server(target, drafter: str | None, log_dir: str, model_name: str | None = None, gamma: int = 5,
                 adaptive: bool = True, max_prompt_tokens: int | None = None,
                 max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT, reload_interval_s: float = 1.0,
                 log_max_bytes: int = DEFAULT_MAX_BYTES, max_queue: int = DEFAULT_MAX_QUEUE) -> Server:
    slot = DrafterSlot(target, drafter, gamma=gamma, adaptive=adaptive, reload_interval_s=reload_interval_s)
    server = Server(target, slot, RequestLogWriter(log_dir, log_max_bytes), ServingLimits(0, max_tokens_limit),
                    model_name or target.name, admission=AdmissionQueue(max_queue))
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
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for the engine; past it: 429 with Retry-After")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${API_KEY_ENV})")
    p.add_argument("--upstream", default=None,
                   help="URL of an OpenAI-compatible server (vLLM, SGLang, llama.cpp's): be a logging front for it "
                        "(decode.upstream) instead of generating; --target then only gives the tokenizer and "
                        "fingerprint of the log records")
    p.add_argument("--upstream-api-key", default=os.environ.get("SPECDISTILL_UPSTREAM_API_KEY"),
                   help="the key sent upstream (default: $SPECDISTILL_UPSTREAM_API_KEY; without it the client's own "
                        "Authorization is passed through, unless --api-key makes the front check a key of its own)")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds the upstream may take to answer (or between two chunks of a stream): past it, 504")
    p.add_argument("--upstream-token-ids", action="store_true",
                   help="ask the upstream for its prompt and output token ids (vLLM >= 0.10.2's return_token_ids) and "
                        "log those; without it the answer's text is encoded with the target's tokenizer")
    p.add_argument("--upstream-drafter-version", default="none",
                   help="the drafter version the upstream speculates with, written into each log record")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", choices=_precisions(), default=None,
                   help="what the target computes in (models.target.PRECISIONS; default: float32 on CPU, bfloat16 on "
                        "CUDA); the request log records the outputs of this precision")
    return p.parse_args(argv)


def _precisions() -> tuple[str, ...]:
    from specdistill.models.target import PRECISIONS
    return PRECISIONS


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from specdistill.models.target import load_target

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.upstream:
        from specdistill.decode.upstream import run_front

        if args.drafter is not None:
            raise SystemExit("decode.serve: --drafter does not apply with --upstream (the upstream engine drafts; "
                             "train.engine_swap serves a drafter store through vLLM)")
        return run_front(args)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    server = build_server(target, args.drafter, args.log_dir, args.model_name, args.gamma, not args.no_adaptive,
                          args.max_prompt_tokens, args.max_tokens_limit, args.reload_interval, args.log_max_bytes,
                          args.max_queue)
    log.info("serving %s with drafter %s on http://%s:%d", server.model_name, server.slot.current().version,
             args.host, args.port)
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who reaches this port can generate and have "
                    "their prompts logged", args.host)
    uvicorn.run(create_app(server, api_key=args.api_key), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
