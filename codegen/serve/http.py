"""Rank 0's HTTP front: an ASGI app (Starlette) served by uvicorn in a thread of rank 0.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus text). Each request is parsed (codegen.serve.protocol), tokenised with the dir's tokenizer, bounded by
the model's context (`max_model_len`), and submitted as one sequence per prompt to the scheduler; the answer comes
back as events on an asyncio queue, in one JSON body or as server-sent events (`stream`). Every refusal is one 4xx
with OpenAI's error body: 400 (a field, naming it), 401 (`--api-key` set and no matching `Authorization: Bearer`),
404, 405, 408 (body not read within the timeout), 429 with `Retry-After` (the waiting queue is full). uvicorn bounds
the open connections (`limit_concurrency`: 503 beyond it). A client that goes away cancels its sequences: their
slots are free at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from codegen.serve.batching import DONE, ERROR, TOKEN, Scheduler, Seq
from codegen.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from codegen.serve.protocol import (DEFAULT_MAX_TOKENS, BadRequest, Completion, chat_logprobs, chunk,
                                    completion_logprobs, error, parse, response, usage_chunk)
from codegen.serve.text import ChoiceText

#: the largest request body read (bytes)
MAX_BODY = 1 << 20
#: how long a client has to send its body (seconds)
BODY_TIMEOUT_S = 30.0
#: what a 429 asks the client to wait (seconds)
RETRY_AFTER_S = 1
#: how often a non-streaming request checks that its client is still there (seconds)
DISCONNECT_CHECK_S = 0.25


class Frontend:
    """What the handlers share: the scheduler, the tokenizer, the model's name and bounds."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, max_model_len: int,
                 api_key: str | None = None, request_timeout: float = 600.0, metrics: Metrics | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.metrics = metrics or Metrics(model_name)
        self.vocab = len(tokenizer)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.render_chat = self._render_chat if has_template else None
        self.served = 0
        self._served_lock = threading.Lock()

    def _render_chat(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def count_served(self) -> None:
        with self._served_lock:
            self.served += 1

    def token_text(self, token: int) -> str:
        """A token's text for `logprobs`: decoded, or where that is not whole UTF-8 (part of a character) or empty
        the tokenizer's own token string, so different tokens never share a key of `top_logprobs`."""
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" in text or not text:
            name = self.tokenizer.convert_ids_to_tokens(token)
            return name if name else f"<token {token}>"  # beyond the tokenizer (a padded embedding matrix)
        return text

    def prompt_ids(self, request: Completion) -> list[list[int]]:
        """Each prompt's ids, within the model's context (else a 400 naming both lengths, as vLLM words it)."""
        out = []
        what = "messages" if request.kind == "chat" else "prompt"
        for token, _ in request.sampling.logit_bias:
            if token >= self.vocab:
                raise BadRequest(f"`logit_bias` names token {token}, beyond the vocabulary ({self.vocab} tokens)",
                                 "logit_bias")
        for prompt in request.prompts:
            ids = list(self.tokenizer(prompt, add_special_tokens=request.kind != "chat")["input_ids"])
            if not ids:
                raise BadRequest("a prompt tokenised to nothing", "prompt")
            if len(ids) >= self.max_model_len:
                raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                 f"your {what} has {len(ids)} tokens. Please reduce the length of the {what}.", what)
            wanted = request.max_tokens
            if wanted is not None and len(ids) + wanted > self.max_model_len:
                raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                 f"you requested {len(ids) + wanted} tokens ({len(ids)} in the {what}, {wanted} in "
                                 f"the completion). Please reduce the length of the {what} or completion.",
                                 request.max_tokens_field)
            out.append(ids)
        return out

    def budget(self, request: Completion, ids: list[int]) -> int:
        """The new tokens a prompt gets: what the client asked for, else the default capped to the context left."""
        if request.max_tokens is not None:
            return request.max_tokens
        return min(DEFAULT_MAX_TOKENS, self.max_model_len - len(ids))


def _error(status: int, message: str, param: str | None = None, kind: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error(message, param, kind, code), status_code=status, headers=headers)


def _sse(event) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def build_app(front: Frontend) -> Starlette:
    metrics = front.metrics

    def authorised(request: Request) -> bool:
        if front.api_key is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), front.api_key.encode())

    def unauthorised() -> JSONResponse:
        metrics.error(401)
        return _error(401, "Incorrect API key provided: pass it as `Authorization: Bearer KEY`.",
                      code="invalid_api_key")

    async def health(request: Request) -> Response:
        s = front.scheduler
        return JSONResponse({"status": "ok", "requests_served": front.served, "largest_batch": s.largest_batch,
                             "running": len(s.running), "waiting": len(s.waiting)})

    async def models(request: Request) -> Response:
        if not authorised(request):
            return unauthorised()
        return JSONResponse({"object": "list", "data": [
            {"id": front.model_name, "object": "model", "created": 0, "owned_by": "codegen",
             "max_model_len": front.max_model_len}]})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
            raise BadRequest(f"the body must be a JSON object of at most {MAX_BODY} bytes")
        data = bytearray()

        async def read() -> None:
            async for part in request.stream():
                data.extend(part)
                if len(data) > MAX_BODY:
                    raise BadRequest(f"the body must be a JSON object of at most {MAX_BODY} bytes")

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise BadRequest(f"the body was not sent within {BODY_TIMEOUT_S:g} s", status=408) from None
        if not data:
            raise BadRequest("the body must be a JSON object; it is empty")
        try:
            return json.loads(bytes(data))
        except ValueError:  # not JSON, or not UTF-8
            raise BadRequest("the body is not JSON (UTF-8)") from None

    def make_handler(kind: str):
        async def handler(request: Request) -> Response:
            if not authorised(request):
                return unauthorised()
            try:
                body = await read_json(request)

                def prepare():  # a long prompt's template and tokens, off the event loop
                    completion = parse(body, kind, front.model_name, front.render_chat)
                    return completion, front.prompt_ids(completion)

                completion, ids = await asyncio.to_thread(prepare)
            except BadRequest as exc:
                metrics.error(exc.status)
                return _error(exc.status, exc.message, exc.param, code=exc.code)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 - e.g. a chat template that raises on these messages
                metrics.error(400)
                return _error(400, f"the request could not be prepared: {type(exc).__name__}: "
                                   f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            seqs = []
            for index, prompt in enumerate(ids):
                def emit(kind_, value, index=index):
                    loop.call_soon_threadsafe(events.put_nowait, (index, kind_, value))
                seqs.append(Seq(prompt, front.budget(completion, prompt), completion.sampling, emit))
            if not all(front.scheduler.fits(s) for s in seqs):
                metrics.error(400)
                return _error(400, f"the prompt and max_tokens ({max(s.reserve for s in seqs)} tokens) exceed the "
                                   f"server's token budget ({front.scheduler.max_num_tokens}, --max-num-tokens)",
                              completion.max_tokens_field)
            if not front.scheduler.submit(seqs):
                metrics.error(429)
                return _error(429, f"the server is busy: {front.scheduler.max_waiting} requests are waiting already;"
                                   f" retry after {RETRY_AFTER_S} s", kind="rate_limit_error",
                              code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
            started = time.monotonic()
            if completion.stream:
                return StreamingResponse(_stream(front, completion, seqs, events, started),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                return await _whole(front, completion, seqs, events, started, request)
            finally:
                for seq in seqs:
                    seq.cancelled.set()  # no-op when done; frees the slots of a client that left

        return handler

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            return _error(405, f"method {request.method} is not allowed on {request.url.path}")
        return _error(exc.status_code, f"no such endpoint: {request.method} {request.url.path}",
                      kind="not_found_error" if exc.status_code == 404 else None)

    async def failed(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error: {type(exc).__name__}")

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", prometheus),
              Route("/v1/completions", make_handler("completion"), methods=["POST"]),
              Route("/v1/chat/completions", make_handler("chat"), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found, Exception: failed})


async def _events(front: Frontend, seqs: list[Seq], events: asyncio.Queue, started: float, done: set,
                  request: Request | None = None):
    """(index, kind, value) of every sequence until each is done or failed (or the request's time is up, or the
    client of a non-streaming `request` went away: checked every DISCONNECT_CHECK_S); the caller adds an index to
    `done` itself when it ends that sequence (a stop string): its later events are dropped."""
    deadline = started + front.request_timeout
    checked = time.monotonic()
    while len(done) < len(seqs):
        now = time.monotonic()
        left = deadline - now
        if request is not None and now - checked >= DISCONNECT_CHECK_S:
            checked = now
            if await request.is_disconnected():
                for seq in seqs:
                    seq.cancelled.set()
                return
        try:
            index, kind, value = await asyncio.wait_for(events.get(), max(0.0, min(left, 1.0)))
        except asyncio.TimeoutError:
            if left > 1.0:
                continue
            for seq in seqs:
                seq.cancelled.set()
            yield 0, ERROR, f"the request took longer than the server's --request-timeout ({front.request_timeout:g} s)"
            return
        if index in done:
            continue
        if kind in (DONE, ERROR):
            done.add(index)
        yield index, kind, value


def _logprobs(front: Frontend, request: Completion, entries: list, texts: list[str], offset: int):
    if request.kind == "chat":
        return chat_logprobs(entries)
    return completion_logprobs(entries, texts, offset)


async def _whole(front: Frontend, request: Completion, seqs: list[Seq], events: asyncio.Queue,
                 started: float, http_request: Request | None = None) -> Response:
    texts = [ChoiceText(front.tokenizer, request.stop, hold_back=False) for _ in seqs]
    finishes = ["length"] * len(seqs)
    entries: list[list] = [[] for _ in seqs]
    token_texts: list[list] = [[] for _ in seqs]
    failed = None
    done: set[int] = set()
    async for index, kind, value in _events(front, seqs, events, started, done, http_request):
        choice = texts[index]
        if kind == TOKEN:
            if choice.stopped:
                continue
            token, info = value
            choice.add(token)
            if info is not None:
                text = front.token_text(token)
                token_texts[index].append(text)
                entries[index].append((text, info[0], [(front.token_text(t), lp) for t, lp in info[1]]))
            if choice.stopped:
                finishes[index] = "stop"
                seqs[index].cancelled.set()  # its slot is free at the next step
                done.add(index)
        elif kind == DONE:
            if not choice.stopped:
                choice.finish()
                finishes[index] = value
        else:
            failed = value
    if failed is None and len(done) < len(seqs):  # the client went away: nobody to answer
        front.metrics.error(499)
        return Response(status_code=499)
    if failed is not None:
        front.metrics.error(504 if "request-timeout" in failed else 500)
        return _error(504 if "request-timeout" in failed else 500, failed, kind="server_error")
    prompts = [p if request.echo else "" for p in request.prompts]
    out = [p + c.text for p, c in zip(prompts, texts)]
    logprobs = None
    if request.sampling.logprobs is not None:
        logprobs = [_logprobs(front, request, e, t, len(p)) for e, t, p in zip(entries, token_texts, prompts)]
    for finish in finishes:
        front.metrics.finished(finish)
    front.metrics.e2e.observe(time.monotonic() - started)
    front.count_served()
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
    return JSONResponse(response(request, out, finishes, prompt_tokens, sum(len(c.tokens) for c in texts), logprobs))


async def _stream(front: Frontend, request: Completion, seqs: list[Seq], events: asyncio.Queue, started: float):
    texts = [ChoiceText(front.tokenizer, request.stop) for _ in seqs]
    try:
        if request.kind == "chat":
            first = chunk(request, 0, "", None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        if request.echo:
            for index, prompt in enumerate(request.prompts):
                yield _sse(chunk(request, index, prompt, None))
        done: set[int] = set()
        async for index, kind, value in _events(front, seqs, events, started, done):
            choice = texts[index]
            if kind == TOKEN:
                if choice.stopped:
                    continue
                delta = choice.add(value[0])
                if choice.stopped:
                    seqs[index].cancelled.set()
                    done.add(index)
                    yield _sse(chunk(request, index, delta, "stop"))
                    front.metrics.finished("stop")
                elif delta:
                    yield _sse(chunk(request, index, delta, None))
            elif kind == DONE:
                if not choice.stopped:
                    yield _sse(chunk(request, index, choice.finish(), value))
                    front.metrics.finished(value)
            else:
                front.metrics.error(500)
                yield _sse(error(value, kind="server_error"))
        if request.include_usage:
            yield _sse(usage_chunk(request, sum(len(s.prompt_ids) for s in seqs), sum(len(c.tokens) for c in texts)))
        yield b"data: [DONE]\n\n"
        front.metrics.e2e.observe(time.monotonic() - started)
        front.count_served()
    finally:  # also when the client went away (the generator is closed): its sequences stop
        for seq in seqs:
            seq.cancelled.set()


def listen(host: str, port: int) -> socket.socket:
    """The listening socket (bound before uvicorn starts, so port 0 is resolved and a busy port is one error)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def start_server(sock: socket.socket, front: Frontend, limit_concurrency: int, timeout_keep_alive: int = 5):
    """uvicorn serving the app on `sock` in a daemon thread; returns the server once it is up."""
    import uvicorn

    config = uvicorn.Config(build_app(front), log_level="warning", access_log=False, lifespan="off",
                            limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="codegen-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError("the HTTP server did not start")
    return server
