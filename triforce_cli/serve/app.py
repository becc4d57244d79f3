"""The HTTP side of `triforce serve`: a FastAPI application over one Pipeline (create_app).

Requests are parsed and checked here, on the event loop (tokenizing in a thread, one at a time), then handed to the
Worker, which generates them one after another on its own thread. A full queue is a 503 with Retry-After, found
before the prompt is tokenized; a body over the size limit is a 413. Streamed answers are server-sent events ending
with ``data: [DONE]``; their headers go out at once, and comment lines (``: queued``, ``: prefill 512/4096``) keep a
proxy's read timeout from firing while the request waits or its prompt is read, so an error the engine finds then
comes as an error event. A client that goes away (watched while it waits, and by Starlette once its stream runs) is
withdrawn from the queue or stopped at the next prefill chunk or verification.

The routes are plain functions (`routes`) over the state they share, a ServerState that create_app keeps in
`app.state.server`.
"""

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.stats import GenerationStats
from triforce_cli.errors import TriforceError
from triforce_cli.runtime.prompts import encode_messages, encode_prompt
from triforce_cli.serve import schemas as s
from triforce_cli.serve.metrics import CONTENT_TYPE, Metrics
from triforce_cli.serve.prefix_states import DEFAULT_BUDGET
from triforce_cli.serve.worker import Finished, GenerationRequest, Job, QueueFull, Worker

log = logging.getLogger("triforce.serve")

OPEN_ROUTES = ("/health",)  # answered without the API key
RETRY_AFTER_SECONDS = 1  # a full queue's advice: try again after this long
DISCONNECT_POLL_SECONDS = 0.1  # how often a waiting request checks that its client is still there
KEEPALIVE_SECONDS = 5.0  # the longest a stream goes without a line while its request waits or is prefilled
MAX_BODY_BYTES = 16 * 2**20  # a request body's default limit: room for a whole long context as text or token ids
CHAT_ROUTE, COMPLETIONS_ROUTE = "/v1/chat/completions", "/v1/completions"
GENERATION_ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE)


def usage_of(finished: Finished) -> s.Usage:
    """OpenAI's usage, with the prompt tokens not computed again as cached_tokens and the triforce extension."""
    stats: GenerationStats = finished.stats
    reused = stats.prompt_tokens if stats.prompt_cached else stats.reused_tokens
    tiers = [
        s.TierCounts(proposer=pair.proposer, verifier=pair.verifier, proposed=pair.drafted, accepted=pair.accepted)
        for pair in stats.acceptance
    ]
    return s.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=len(finished.token_ids),
        total_tokens=stats.prompt_tokens + len(finished.token_ids),
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=reused),
        triforce=s.TriforceUsage(
            mode=stats.mode,
            prefix_tokens_reused=stats.reused_tokens,
            prompt_cached=stats.prompt_cached,
            prefill_seconds=stats.prefill_seconds,
            decode_seconds=stats.decode_seconds,
            stop_reason=stats.stop_reason,
            tiers=tiers,
        ),
    )


def parsed(model: type[s.GenerationFields], body: bytes) -> s.GenerationFields:
    """The request body as model; an ApiError naming the first field that is wrong, unknown or not JSON."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "json_invalid":
            message = f"the body is not valid JSON: {first['ctx'].get('error', first['msg'])}"
            param = None
        elif first["type"] == "extra_forbidden":
            message = f"unknown field '{param}': not supported by this server (see docs/serving.md for the fields)"
        elif first["type"] == "missing":
            message = f"'{param}' is required"
        elif param is None:
            message = f"the body must be a JSON object: {first['msg']}"
        else:
            message = f"'{param}': {first['msg']}"
        raise s.ApiError(400, message, param=param) from None


class ApiKeyGuard:
    """ASGI middleware answering 401 to a request without `Authorization: Bearer <api_key>`, but on OPEN_ROUTES. A
    plain ASGI one: Starlette's BaseHTTPMiddleware wraps `receive`, which hides a client's going away from the
    routes."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "missing or incorrect API key: send the header 'Authorization: Bearer <key>'"
                error = s.ApiError(401, message, code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class ServerState:
    """What every route shares: the pipeline, the worker generating on it, the metrics, the name and context
    served, and the limits a request is checked against (create_app's arguments)."""

    pipeline: Pipeline
    worker: Worker
    metrics: Metrics
    name: str  # the model id clients send
    context: int  # the target's positions: prompt plus answer
    max_tokens_limit: int | None
    request_timeout: float | None
    max_body_bytes: int
    # the server's own settings, as the pipeline had them when the server was made: a request's unset fields take
    # these, never the settings the worker gave the pipeline for the request before it
    defaults: EngineConfig
    started: int = field(default_factory=lambda: int(time.time()))
    # a fast tokenizer is not to be used by two threads at once
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    ignored_logged: set[str] = field(default_factory=set)  # the ignored field names logged once already

    def card(self) -> s.ModelCard:
        return s.ModelCard(id=self.name, created=self.started, max_model_len=self.context)

    def check_model(self, requested: str) -> None:
        if requested != self.name:
            message = f"the model '{requested}' does not exist: this server serves '{self.name}'"
            raise s.ApiError(404, message, param="model", code="model_not_found")

    def queue_full(self) -> s.ApiError:
        message = f"the server is busy: {self.worker.queue_size} requests wait already; retry later"
        if self.worker.closed:
            message = "the server is shutting down"
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return s.ApiError(503, message, code="queue_full", kind="server_error", headers=headers)

    def too_large(self) -> s.ApiError:
        return s.ApiError(413, f"the request body is over this server's limit of {self.max_body_bytes} bytes")

    def log_ignored(self, body: s.GenerationFields) -> None:
        """Log each ignored field name the first time a request gives it."""
        for name in body.ignored_fields():
            if name not in self.ignored_logged:
                self.ignored_logged.add(name)
                log.info("ignoring the request field '%s': it does not change this server's output", name)

    async def tokenize(self, encode: Callable[[], list[int]]) -> list[int]:
        """encode() run in a thread, one tokenization at a time."""

        def run() -> list[int]:
            with self.tokenizer_lock:
                return encode()

        return await run_in_threadpool(run)

    def generation_request(
        self, body: s.GenerationFields, prompt_ids: list[int], prompt_param: str
    ) -> GenerationRequest:
        """The checked request: the token limit within the context (the server's --max-new-tokens by default, or
        what the context leaves), the sampling (the server's defaults where the request says nothing)."""
        context, max_tokens_limit, defaults = self.context, self.max_tokens_limit, self.defaults
        room = context - len(prompt_ids)
        if room < 1:
            raise s.ApiError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; the {context}-token context leaves no room for an answer",
                param=prompt_param,
                code="context_length_exceeded",
            )
        limit = body.token_limit
        if limit is None:
            limit = min(defaults.max_new_tokens, room, max_tokens_limit or room)
        elif max_tokens_limit is not None and limit > max_tokens_limit:
            raise s.ApiError(
                400, f"max_tokens {limit} is over this server's limit of {max_tokens_limit}", param="max_tokens"
            )
        elif limit > room:
            raise s.ApiError(
                400,
                f"the prompt's {len(prompt_ids)} tokens plus max_tokens {limit} exceed the {context}-token context;"
                f" at most {room} new tokens fit",
                param="max_tokens",
                code="context_length_exceeded",
            )
        top_p = defaults.sampling.top_p if body.top_p is None else body.top_p
        top_k = defaults.sampling.top_k if body.top_k is None else max(body.top_k, 0)
        if top_p == 0:  # the nucleus of no mass: the likeliest token alone
            top_p, top_k = 1.0, 1
        sampling = SamplingConfig(
            temperature=defaults.sampling.temperature if body.temperature is None else body.temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=defaults.sampling.min_p if body.min_p is None else body.min_p,
            seed=defaults.sampling.seed if body.seed is None else body.seed,
        )
        return GenerationRequest(prompt_ids, limit, sampling, body.stop_strings, body.stream)


def server_state(request: Request) -> ServerState:
    """The state of the application that request came to (create_app)."""
    return request.app.state.server


def create_app(
    *,
    pipeline: Pipeline,
    model_name: str | None = None,
    api_key: str | None = None,
    queue_size: int = 16,
    prompt_cache: Path | None = None,
    prefix_memory: int = DEFAULT_BUDGET,
    max_tokens_limit: int | None = None,
    request_timeout: float | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    cors_origins: list[str] | None = None,
) -> FastAPI:
    """The OpenAI-compatible application over pipeline; its worker thread runs while the application does
    (lifespan).

    Args:
        pipeline: the loaded models, with the defaults of every request (EngineConfig.max_new_tokens and sampling).
            Its caches are sized for the target's whole context (EngineConfig.cache_positions), unless they are
            sized already, so that prompts of any length keep the last prefill for the next one (prefix reuse).
        model_name: the id clients name in `model`; None: the target's name.
        api_key: where given, every route but /health needs `Authorization: Bearer <api_key>`.
        queue_size: requests that may wait beside the one being generated; one more is answered 503.
        prompt_cache: a folder of saved prefills reused across restarts (Pipeline.generate_ids), or None.
        prefix_memory: bytes of host memory for the prefix states kept between requests, each request reusing the
            longest it shares (serve/prefix_states.py); 0: only the last generation's, which the full cache holds.
        max_tokens_limit: the most new tokens one request may ask for (a 400 beyond), or None: what the context holds.
        request_timeout: seconds a request may wait and generate before it ends with a 504, or None: no limit.
        max_body_bytes: the largest request body taken; a larger one is a 413.
        cors_origins: browser origins allowed to call the API ("*": any), or None: no CORS headers.
    Returns:
        The FastAPI application, for uvicorn to serve.
    """
    context = pipeline.context_tokens
    pipeline.size_for_whole_context()
    metrics = Metrics()
    worker = Worker(
        pipeline=pipeline,
        queue_size=queue_size,
        metrics=metrics,
        prompt_cache=prompt_cache,
        prefix_memory=prefix_memory,
    )
    app = FastAPI(title="triforce", lifespan=lifespan)
    app.state.server = ServerState(
        pipeline=pipeline,
        worker=worker,
        metrics=metrics,
        name=model_name or pipeline.target.name,
        context=context,
        max_tokens_limit=max_tokens_limit,
        request_timeout=request_timeout,
        max_body_bytes=max_body_bytes,
        defaults=pipeline.config,
    )
    app.state.worker = worker  # what a graceful shutdown drains (cli/serve.py)
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    if cors_origins:  # added last, so outermost: a preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"], max_age=600
        )
    app.add_exception_handler(s.ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    app.include_router(routes)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The worker thread runs while the application does."""
    worker = app.state.server.worker
    worker.start()
    try:
        yield
    finally:
        await run_in_threadpool(worker.close)


async def api_error(request: Request, error: s.ApiError) -> JSONResponse:
    if request.url.path in GENERATION_ROUTES:
        outcome = "rejected" if error.status == 503 else "invalid" if error.status < 500 else "failed"
        server_state(request).metrics.request(request.url.path, outcome)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    return await api_error(request, s.ApiError(error.status_code, str(error.detail), code=str(error.status_code)))


async def unexpected(request: Request, error: Exception) -> JSONResponse:
    log.error("request failed", exc_info=error)
    message = "the server failed; its log has the details"
    return await api_error(request, s.ApiError(500, message, kind="server_error"))


routes = APIRouter()


@routes.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    """ok, or 503 naming what is wrong: the worker thread has stopped, the server is shutting down, or the
    CUDA device does not answer."""
    server = server_state(request)
    problems = {}
    if not server.worker.alive:
        problems["worker"] = "stopped"
    elif server.worker.closed:
        problems["worker"] = "shutting down"
    device = torch.device(server.pipeline.target.device)
    if device.type == "cuda":
        try:
            torch.cuda.mem_get_info(device)
        except RuntimeError as error:
            problems["device"] = f"{device} does not answer: {error}"
    if problems:
        return JSONResponse({"status": "error", **problems}, status_code=503)
    return JSONResponse({"status": "ok"})


@routes.get("/metrics")
async def prometheus(request: Request) -> Response:
    server = server_state(request)
    text = server.metrics.render(waiting=server.worker.waiting, generating=server.worker.busy)
    return Response(text, media_type=CONTENT_TYPE)


@routes.get("/v1/models")
async def models(request: Request) -> s.ModelList:
    return s.ModelList(data=[server_state(request).card()])


@routes.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> s.ModelCard:
    server = server_state(request)
    server.check_model(model_id)
    return server.card()


@routes.post(CHAT_ROUTE)
async def chat_completions(request: Request) -> Response:
    server = server_state(request)
    body = await checked(server, request, s.ChatCompletionRequest)
    messages = [{"role": message.template_role, "content": message.text} for message in body.messages]
    tokenizer = server.pipeline.target.tokenizer
    try:
        ids = await server.tokenize(lambda: encode_messages(tokenizer, messages))
    except TriforceError as error:  # the template's own refusal among them: roles it does not take, or out of order
        raise s.ApiError(400, str(error), param="messages") from None
    return await answer(server, request, CHAT_ROUTE, body, server.generation_request(body, ids, "messages"))


@routes.post(COMPLETIONS_ROUTE)
async def completions(request: Request) -> Response:
    server = server_state(request)
    body = await checked(server, request, s.CompletionRequest)
    prompt = body.one_prompt
    tokenizer = server.pipeline.target.tokenizer
    if isinstance(prompt, str):
        ids = await server.tokenize(lambda: encode_prompt(tokenizer, prompt, chat=False))
    else:
        vocab = server.pipeline.target.model.config.vocab_size
        if any(not 0 <= token < vocab for token in prompt):
            raise s.ApiError(400, f"a prompt token id lies outside the vocabulary (0..{vocab - 1})", param="prompt")
        ids = list(prompt)
    return await answer(server, request, COMPLETIONS_ROUTE, body, server.generation_request(body, ids, "prompt"))


async def checked(server: ServerState, request: Request, model: type[s.GenerationFields]) -> s.GenerationFields:
    """The request's body parsed and checked, up to what needs the tokenizer; a 503 where the queue is full."""
    body = parsed(model, await request_body(server, request))
    server.check_model(body.model)
    body.check_refused()
    server.log_ignored(body)
    if not server.worker.has_room():
        raise server.queue_full()
    return body


async def request_body(server: ServerState, request: Request) -> bytes:
    """The body, read up to max_body_bytes; a 413 beyond, told by Content-Length before any of it is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > server.max_body_bytes:
        raise server.too_large()
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > server.max_body_bytes:
            raise server.too_large()
    return bytes(body)


async def answer(
    server: ServerState, request: Request, route: str, body: s.GenerationFields, generation: GenerationRequest
) -> Response | BaseModel:
    """Queue the generation and answer it: one JSON object, or a stream of server-sent events (its headers
    sent at once)."""
    include_usage = body.include_usage  # checked before the job is queued
    job = Job(generation, asyncio.get_running_loop(), server.request_timeout)
    try:
        server.worker.submit(job)
    except QueueFull:
        raise server.queue_full() from None
    reply = Answer(route, f"{'chatcmpl' if route == CHAT_ROUTE else 'cmpl'}-{uuid.uuid4().hex}", server.name)
    if body.stream:
        return StreamingResponse(
            stream(server, reply, job, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    kind, value = await first_event(server.worker, request, job)
    if kind == "gone":
        server.metrics.request(route, "cancelled")
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    if kind == "error":
        raise value
    server.metrics.request(route, "ok")
    return reply.complete(value)


async def watch(worker: Worker, request: Request, job: Job) -> None:
    """Until cancelled: where the client goes away, withdraw its job and wake its reader."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    worker.withdraw(job)
    job.events.put_nowait(("gone", None))


async def first_event(worker: Worker, request: Request, job: Job) -> tuple[str, object]:
    """The job's first event, the client watched meanwhile (a streamed job's stream watches it afterwards)."""
    watcher = asyncio.create_task(watch(worker, request, job))
    try:
        return await job.events.get()
    finally:
        watcher.cancel()


async def next_event(job: Job) -> tuple[str, object] | None:
    """The job's next event, or None where none came within KEEPALIVE_SECONDS."""
    try:
        return await asyncio.wait_for(job.events.get(), KEEPALIVE_SECONDS)
    except TimeoutError:
        return None


@dataclass(frozen=True)
class Answer:
    """The response objects of one answer on route (chat or completions): whole, or as the events of a stream."""

    route: str
    ident: str  # chatcmpl-... or cmpl-...
    model: str

    def complete(self, finished: Finished) -> BaseModel:
        usage = usage_of(finished)
        if self.route == CHAT_ROUTE:
            message = s.AssistantMessage(content=finished.text)
            choice = s.ChatChoice(message=message, finish_reason=finished.finish_reason)
            return s.ChatCompletion(id=self.ident, model=self.model, choices=[choice], usage=usage)
        choice = s.CompletionChoice(text=finished.text, finish_reason=finished.finish_reason)
        return s.Completion(id=self.ident, model=self.model, choices=[choice], usage=usage)

    def chunk(self, text: str | None, finish: str | None = None, role: str | None = None) -> str:
        """One event of a streamed answer: a piece of text, or its finish reason (and the chat's role first)."""
        if self.route == CHAT_ROUTE:
            choice = s.ChatChunkChoice(delta=s.Delta(role=role, content=text), finish_reason=finish)
            event = s.ChatCompletionChunk(id=self.ident, model=self.model, choices=[choice])
        else:
            choice = s.CompletionChoice(text=text or "", finish_reason=finish)
            event = s.Completion(id=self.ident, model=self.model, choices=[choice])
        return f"data: {event.model_dump_json()}\n\n"

    def usage_chunk(self, usage: s.Usage) -> str:
        """The last event of a stream with stream_options.include_usage: no choices, the usage."""
        kind = s.ChatCompletionChunk if self.route == CHAT_ROUTE else s.Completion
        return f"data: {kind(id=self.ident, model=self.model, choices=[], usage=usage).model_dump_json()}\n\n"


async def stream(server: ServerState, answer: Answer, job: Job, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed answer, with comment lines while it waits and while its prompt is read; a
    client gone (Starlette cancels this) stops the generation."""
    done = False
    try:
        yield ": queued\n\n"
        if answer.route == CHAT_ROUTE:
            yield answer.chunk("", role="assistant")
        state = "queued"
        while True:
            event = await next_event(job)
            if event is None:
                yield f": {state}\n\n"
                continue
            kind, value = event
            if kind == "started":
                state = "prefill"
                yield ": prefill\n\n"
            elif kind == "prefill":
                state = f"prefill {value[0]}/{value[1]}"
                yield f": {state}\n\n"
            elif kind == "text":
                state = "generating"
                yield answer.chunk(value)
            else:
                break
        if kind == "done":
            yield answer.chunk(None, finish=value.finish_reason)
            if include_usage:
                yield answer.usage_chunk(usage_of(value))
            server.metrics.request(answer.route, "ok")
        elif kind == "error":
            yield f"data: {json.dumps(value.body())}\n\n"
            server.metrics.request(answer.route, "rejected" if value.status == 503 else "failed")
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:
            server.worker.withdraw(job)
            server.metrics.request(answer.route, "cancelled")
