"""The logging front: an OpenAI-compatible proxy in front of another server (vLLM, SGLang, llama.cpp's server) that
writes the same request log as the built-in engine, so the online daemon learns from traffic it never served.

    python -m specdistill.decode.serve --upstream http://127.0.0.1:8100 --target TARGET --log-dir LOGS

`/v1/completions` and `/v1/chat/completions`, streaming or not, go to the upstream engine unchanged (no
generation here); the answer comes back once its log line is written (for a stream: the chunk that carries the
finish reason and `[DONE]` are held until then), as in decode.serving. The record is the built-in server's
(decode.serving.Server.log_record): the prompt as sent and its ids, the output ids, the sampling settings, the
finish reason, the upstream's model name, and `upstream` with the engine and its drafter version. The ids are the
upstream's own when it returns them (vLLM does when asked: `--upstream-token-ids` adds its `return_token_ids`);
otherwise the prompt under the target's tokenizer (the chat template for messages) and the answer's text encoded
by it, plus EOS when the answer stopped with no stop string asked for (an upstream's text never shows the EOS).

Errors: a request the front cannot log faithfully (n > 1, several prompts, echo, tools) is a 400 naming the
parameter; an upstream 4xx is passed through; an upstream that cannot be reached or answers 5xx is a 502, one that
does not answer in --upstream-timeout a 504, and neither writes a log line. A client that goes away cancels the
upstream request (its connection is closed, which vLLM takes as an abort). A full disk degrades /health and the
front keeps serving (decode.serving.append_or_degrade).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdistill.decode.request_log import SCHEMA_VERSION, RequestLogWriter
from specdistill.decode.serve import BadRequest, add_error_handlers, error_body, require_api_key, sse
from specdistill.decode.serving import LogHealth, append_or_degrade
from specdistill.decode.upstream_router import NoEngine, UpstreamRouter

log = logging.getLogger("specdistill.upstream")

ENDPOINTS = {"completions": "/v1/completions", "chat.completions": "/v1/chat/completions"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
KEEPALIVE_S = 2.0  # below uvicorn's default keep-alive timeout (5 s), which vLLM's server runs with


@dataclass(frozen=True)
class FrontTarget:
    """What the front needs of the target: its tokenizer and fingerprints, not its weights (it never generates)."""
    name: str
    tokenizer: object
    fingerprint: str
    tokenizer_fingerprint: str
    eos_token_ids: frozenset[int]
    encode_chat: object  # messages -> prompt ids under the tokenizer's chat template

    @classmethod
    def of(cls, target) -> "FrontTarget":
        return cls(target.name, target.tokenizer, target.fingerprint, target.tokenizer_fingerprint,
                   frozenset(target.eos_token_ids), target.encode_chat)


@dataclass
class Front:
    target: FrontTarget
    router: UpstreamRouter
    log_writer: RequestLogWriter
    upstream_api_key: str | None = None  # sent upstream; None: the client's own Authorization is passed through
    own_api_key: bool = False            # the front checks a key of its own, which must not travel upstream
    timeout_s: float = 600.0
    request_token_ids: bool = False      # ask the upstream for its token ids (vLLM's `return_token_ids`)
    log_health: LogHealth = field(default_factory=LogHealth)


class UpstreamFailed(Exception):
    """The upstream could not answer: 502 (unreachable, 5xx, broken answer) or 504 (timed out)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class UpstreamRefused(Exception):
    """The upstream refused the request (4xx): passed through to the client as it came."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


# ---- what is logged --------------------------------------------------------------------------------

def check_loggable(body: dict, endpoint: str) -> None:
    """Refuse (400, naming the parameter) what would make the log line differ from what the client got."""
    if not isinstance(body.get("model"), str):
        raise BadRequest("model: a string naming the upstream's model is required", "model")
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        raise BadRequest("n and best_of must be 1: the logging front logs one answer per request", "n")
    if body.get("echo"):
        raise BadRequest("echo is not supported by the logging front (the answer would hold the prompt)", "echo")
    for name in ("tools", "functions"):
        if body.get(name):
            raise BadRequest(f"{name} is not supported by the logging front: the prompt the upstream renders with "
                             "them is not one the front can reproduce for the log", name)
    if endpoint == "completions" and not is_one_prompt(body.get("prompt")):
        raise BadRequest("prompt: one string or one list of token ids (the logging front logs one prompt per "
                         "request)", "prompt")
    if endpoint == "chat.completions" and not (isinstance(body.get("messages"), list) and body["messages"]):
        raise BadRequest("messages: a non-empty list is required", "messages")


def is_one_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def prompt_ids_of(target: FrontTarget, body: dict, endpoint: str) -> list[int]:
    if endpoint == "completions":
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return list(prompt)
        return target.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    try:
        return target.encode_chat([plain_message(m) for m in body["messages"]])
    except (TypeError, ValueError, KeyError) as e:
        raise BadRequest(f"messages: the target's chat template cannot encode them ({e})", "messages") from None


def plain_message(message) -> dict:
    """A message whose content is a string (text parts joined); other parts cannot be logged as ids."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError("each message must be an object with a role")
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError("only text content parts can be logged")
        content = "".join(p.get("text", "") for p in content)
    return {**message, "content": content or ""}


def sampling_of(body: dict, endpoint: str) -> dict:
    """The request's sampling settings, the OpenAI defaults where it left them out (top_k <= 0: off, as ours 0)."""
    stop = body.get("stop")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None and endpoint == "completions":
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return {"temperature": number_or(body, "temperature", 1.0), "top_p": number_or(body, "top_p", 1.0),
            "top_k": max(int(number_or(body, "top_k", 0)), 0), "seed": body.get("seed") or 0,
            "max_tokens": max_tokens, "stop": [stop] if isinstance(stop, str) else list(stop or [])}


def number_or(body: dict, key: str, default: float) -> float:
    """body[key] as a float; `default` when absent or null (OpenAI clients send null for "the default")."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key}: a number is required, got {value!r}", key)
    return float(value)


def output_ids_of(target: FrontTarget, text: str, returned_ids: list[int] | None, finish_reason: str,
                  stop: list[str]) -> list[int]:
    """The upstream's own output ids when it returned them; else the text under the target's tokenizer, with the
    EOS appended when the answer stopped with no stop string asked for (the built-in log keeps the EOS it emitted,
    and an upstream's text never shows it)."""
    if returned_ids:
        return [int(t) for t in returned_ids]
    ids = target.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    eos = getattr(target.tokenizer, "eos_token_id", None)
    if finish_reason == "stop" and not stop and eos is not None:
        ids.append(int(eos))
    return ids


@dataclass
class Answer:
    """What the upstream answered, gathered from one body or a whole stream."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # the prompt as the upstream tokenized it, when it says
    finish_reason: str | None = None
    model: str | None = None
    upstream_id: str | None = None

    def add_choice(self, choice: dict, chat: bool, streamed: bool) -> None:
        if chat:
            part = (choice.get("delta") if streamed else choice.get("message")) or {}
            self.text += part.get("content") or ""
        else:
            self.text += choice.get("text") or ""
        self.token_ids += choice.get("token_ids") or []
        self.prompt_token_ids = choice.get("prompt_token_ids") or self.prompt_token_ids
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def add_body(self, body: dict, chat: bool, streamed: bool) -> None:
        self.model, self.upstream_id = body.get("model", self.model), body.get("id", self.upstream_id)
        self.prompt_token_ids = body.get("prompt_token_ids") or self.prompt_token_ids
        for choice in body.get("choices") or []:
            if choice.get("index", 0) == 0:
                self.add_choice(choice, chat, streamed)


def log_record(front: Front, engine, endpoint: str, body: dict, prompt_ids: list[int], answer: Answer,
               arrived: float, started: float) -> dict:
    """The built-in server's record (decode.serving.Server.log_record), keys in the same order."""
    sampling = sampling_of(body, endpoint)
    prompt_field = {"prompt": body["prompt"]} if endpoint == "completions" else {"messages": body["messages"]}
    output_ids = output_ids_of(front.target, answer.text, answer.token_ids, answer.finish_reason, sampling["stop"])
    return {"schema": SCHEMA_VERSION, "id": uuid.uuid4().hex, "time": started, "latency_s": time.time() - started,
            "queued_s": started - arrived, "endpoint": endpoint, "model": answer.model or body["model"],
            **prompt_field, "stream": bool(body.get("stream")), "prompt_ids": answer.prompt_token_ids or prompt_ids,
            "output_ids": output_ids,
            "finish_reason": answer.finish_reason, "sampling": sampling, "stats": {"new_tokens": len(output_ids)},
            "drafter_version": engine.drafter_version, "target_fingerprint": front.target.fingerprint,
            "tokenizer_fingerprint": front.target.tokenizer_fingerprint,
            "upstream": {"engine": engine.name, "id": answer.upstream_id}}


# ---- talking to the upstream ---------------------------------------------------------------------------

def upstream_headers(front: Front, request: Request) -> dict:
    headers = {"content-type": "application/json"}
    if front.upstream_api_key:
        headers["authorization"] = f"Bearer {front.upstream_api_key}"
    elif not front.own_api_key and request.headers.get("authorization"):
        headers["authorization"] = request.headers["authorization"]
    return headers


@contextlib.asynccontextmanager
async def upstream_errors(engine):
    """httpx's failures as UpstreamFailed: a timeout is a 504, anything else that broke the exchange a 502."""
    try:
        yield
    except httpx.TimeoutException as e:
        raise UpstreamFailed(504, f"the upstream engine {engine.name} ({engine.url}) did not answer in time "
                                  f"({type(e).__name__})") from None
    except httpx.HTTPError as e:
        raise UpstreamFailed(502, f"the upstream engine {engine.name} ({engine.url}) failed: "
                                  f"{type(e).__name__}: {e}") from None


async def open_upstream(client: httpx.AsyncClient, engine, path: str, body: dict, headers: dict) -> httpx.Response:
    """Send the request and read the status line; a refusal or a failure status raises with the body read."""
    request = client.build_request("POST", engine.url + path, json=body, headers=headers)
    async with upstream_errors(engine):
        response = await client.send(request, stream=True)
        if response.status_code < 400:
            return response
        content = await response.aread()
        await response.aclose()
    if response.status_code < 500:
        raise UpstreamRefused(response.status_code, content, response.headers.get("content-type", "application/json"))
    raise UpstreamFailed(502, f"the upstream engine {engine.name} answered {response.status_code}: "
                              f"{content[:500].decode('utf-8', 'replace')}")


async def until_disconnected(request: Request) -> None:
    """Return when the client goes away (its body is read by then, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work):
    """(True, work's result), or (False, None) when the client went away first: `work` is then cancelled, which
    closes its upstream connection (vLLM aborts a request whose connection closes)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


# ---- answering ---------------------------------------------------------------------------------------

def upstream_body(front: Front, body: dict) -> dict:
    """What goes upstream: the client's body, plus vLLM's `return_token_ids` when the front asks for the ids."""
    return {**body, "return_token_ids": True} if front.request_token_ids else body


async def answer_whole(front: Front, client, engine, request, endpoint, body, prompt_ids, arrived) -> Response:
    started = time.time()

    async def exchange() -> tuple[httpx.Response, dict]:
        response = await open_upstream(client, engine, ENDPOINTS[endpoint], upstream_body(front, body),
                                       upstream_headers(front, request))
        async with upstream_errors(engine):
            content = await response.aread()
        try:
            return response, json.loads(content)
        except ValueError:
            raise UpstreamFailed(502, f"the upstream engine {engine.name} answered with a body that is not JSON: "
                                      f"{content[:200]!r}") from None

    answered, result = await unless_disconnected(request, exchange())
    if not answered:  # nobody reads this status: the client has gone (499, as nginx logs it)
        log.info("client went away; upstream request to %s cancelled, nothing logged", engine.name)
        return Response(status_code=499)
    response, reply = result
    answer = Answer()
    answer.add_body(reply, chat=endpoint == "chat.completions", streamed=False)
    if answer.finish_reason is None:
        raise UpstreamFailed(502, f"the upstream engine {engine.name} answered without a finish_reason")
    append_or_degrade(front.log_writer, front.log_health,
                      log_record(front, engine, endpoint, body, prompt_ids, answer, arrived, started))
    return JSONResponse(reply, status_code=response.status_code)


async def answer_stream(front: Front, client, router, request, endpoint, body, prompt_ids, arrived) -> Response:
    """Open the upstream stream under a lease held until the relay ends; a failure before the first byte is a
    502/504, a failure after it an error event (and no log line). Chunks from the one with the finish reason on
    are held until the log line is written."""
    engine = await router.acquire()
    started = time.time()
    try:  # an engine may hold the request in its own queue before the first byte: a client may leave meanwhile
        answered, response = await unless_disconnected(
            request, open_upstream(client, engine, ENDPOINTS[endpoint], upstream_body(front, body),
                                   upstream_headers(front, request)))
    except BaseException:
        router.release(engine)
        raise
    if not answered:
        router.release(engine)
        return Response(status_code=499)

    async def relay():
        answer, held = Answer(), []
        try:
            async with upstream_errors(engine):
                async for data in sse_data(response):
                    chunk = json.loads(data)
                    answer.add_body(chunk, chat=endpoint == "chat.completions", streamed=True)
                    if answer.finish_reason is None and not held:
                        yield sse(chunk)
                    else:
                        held.append(chunk)
            if answer.finish_reason is None:
                raise UpstreamFailed(502, f"the upstream engine {engine.name}'s stream ended without a finish_reason")
            append_or_degrade(front.log_writer, front.log_health,
                              log_record(front, engine, endpoint, body, prompt_ids, answer, arrived, started))
            for chunk in held:
                yield sse(chunk)
        except (UpstreamFailed, ValueError) as e:  # the status line is gone: the error goes in the stream
            log.error("stream from %s broke: %s", engine.name, e)
            yield sse(error_body(str(e), kind="upstream_error"))
        finally:  # also when the client went away: closing the upstream stream cancels it there
            router.release(engine)
            with anyio.CancelScope(shield=True):  # the relay may be cancelled: the close must still happen
                await response.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(relay(), media_type="text/event-stream")


async def sse_data(response: httpx.Response):
    """The `data:` payloads of a server-sent event stream, up to (not including) `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data


async def read_json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- the app ---------------------------------------------------------------------------------------

def create_front_app(front: Front, api_key: str | None = None) -> FastAPI:
    """The front's HTTP app. With `api_key`, clients need it (and it is never sent upstream)."""
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        # an idle connection is dropped before the upstream drops it: uvicorn (vLLM's server) closes one after 5 s
        # idle, and a request sent on a connection the server is closing fails (a 502 here) instead of reconnecting
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=httpx.Timeout(front.timeout_s, connect=10.0), limits=limits) as client:
            state["client"] = client
            yield
        front.log_writer.close()

    front.own_api_key = bool(api_key)
    app = FastAPI(title="specdistill logging front", lifespan=lifespan)
    app.state.front = front
    require_api_key(app, api_key)
    add_error_handlers(app, lambda: 1)

    @app.exception_handler(UpstreamFailed)
    async def upstream_failed(_: Request, exc: UpstreamFailed):
        return JSONResponse(error_body(exc.message, kind="upstream_error", code=f"upstream_{exc.status}"),
                            status_code=exc.status)

    @app.exception_handler(UpstreamRefused)
    async def upstream_refused(_: Request, exc: UpstreamRefused):
        return Response(exc.body, status_code=exc.status, media_type=exc.content_type)

    @app.exception_handler(NoEngine)
    async def no_engine(_: Request, exc: NoEngine):
        return JSONResponse(error_body(str(exc), kind="upstream_error", code="no_engine"), status_code=503)

    async def forward(request: Request, endpoint: str) -> Response:
        arrived = time.time()
        body = await read_json_object(request)
        check_loggable(body, endpoint)
        prompt_ids = prompt_ids_of(front.target, body, endpoint)
        if body.get("stream"):
            return await answer_stream(front, state["client"], front.router, request, endpoint, body, prompt_ids,
                                       arrived)
        async with front.router.lease() as engine:
            return await answer_whole(front, state["client"], engine, request, endpoint, body, prompt_ids, arrived)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "chat.completions")

    @app.get("/v1/models")
    async def models(request: Request):
        return await pass_get(front, state["client"], request, "/v1/models")

    @app.get("/metrics")
    async def metrics(request: Request):
        """The engine served now's own metrics (vLLM's spec-decode counters among them)."""
        return await pass_get(front, state["client"], request, "/metrics")

    @app.get("/health")
    async def health():
        engine = front.router.engine
        return {**front.log_health.status(), "mode": "upstream",
                "engine": None if engine is None else {"name": engine.name, "url": engine.url,
                                                       "drafter_version": engine.drafter_version},
                "drafter_version": None if engine is None else engine.drafter_version,
                "running": front.router.in_flight(), "waiting": front.router.waiting}

    return app


async def pass_get(front: Front, client: httpx.AsyncClient, request: Request, path: str) -> Response:
    """A GET answered by the engine served now (no lease: nothing to drain, and it never waits in line)."""
    engine = front.router.engine
    if engine is None:
        raise NoEngine("no upstream engine is being served right now (an engine swap is under way)")
    async with upstream_errors(engine):
        response = await client.get(engine.url + path, headers=upstream_headers(front, request))
    if response.status_code >= 500:
        raise UpstreamFailed(502, f"the upstream engine {engine.name} answered {response.status_code} on {path}")
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type"))


# ---- building and running ------------------------------------------------------------------------------

UPSTREAM_API_KEY_ENV = "SPECDISTILL_UPSTREAM_API_KEY"


def build_front(target, upstream: str | None, log_dir: str, *, drafter_version: str = "none",
                upstream_api_key: str | None = None, timeout_s: float = 600.0, max_queue: int = 64,
                log_max_bytes: int | None = None, request_token_ids: bool = False) -> Front:
    """A front over one upstream engine (`upstream` None: no engine until a supervisor points one)."""
    from specdistill.decode.request_log import DEFAULT_MAX_BYTES
    from specdistill.decode.upstream_router import Engine, base_url

    engine = None if upstream is None else Engine("upstream", base_url(upstream), drafter_version)
    return Front(FrontTarget.of(target), UpstreamRouter(engine, max_queue, max_wait_s=timeout_s),
                 RequestLogWriter(log_dir, log_max_bytes or DEFAULT_MAX_BYTES), upstream_api_key,
                 timeout_s=timeout_s, request_token_ids=request_token_ids)


def run_front(args) -> None:
    """`python -m decode.serve --upstream URL ...` (decode.serve.parse_args): load the target's tokenizer and
    fingerprint, then serve the front until stopped."""
    import uvicorn

    from specdistill.models.target import load_target

    target = load_target(args.target, device="cpu", dtype=args.dtype)  # once, for the fingerprint; then freed
    front = build_front(target, args.upstream, args.log_dir, drafter_version=args.upstream_drafter_version,
                        upstream_api_key=args.upstream_api_key, timeout_s=args.upstream_timeout,
                        max_queue=args.max_queue, log_max_bytes=args.log_max_bytes,
                        request_token_ids=args.upstream_token_ids)
    del target
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    log.info("logging front on http://%s:%d for %s, logging to %s", args.host, args.port, args.upstream, args.log_dir)
    uvicorn.run(create_front_app(front, api_key=args.api_key), host=args.host, port=args.port, log_level="warning")
