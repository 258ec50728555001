"""Rank 0's HTTP front: OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`.

Each request is parsed (codegen.serve.protocol), tokenised with the dir's tokenizer, and submitted as one job per
prompt to the batcher; the handler thread then waits for the job events and answers, in one JSON body or as
server-sent events (`stream`). A bad request gets a 4xx with OpenAI's error shape; a client that goes away
mid-stream only cancels its own jobs: the server goes on serving.
"""

from __future__ import annotations

import json
import queue
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from codegen.serve.batching import DONE, ERROR, TOKEN, Batcher, Job
from codegen.serve.protocol import BadRequest, Completion, chunk, error, parse, response

#: the largest request body read (bytes)
MAX_BODY = 1 << 20


class TextStream:
    """The text of one job's tokens so far, handed out as deltas (never half a UTF-8 character)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""  # an incomplete character (or a re-segmentation): wait for the next token
        delta, self.sent = text[len(self.sent):], text
        return delta

    def rest(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta


class Frontend:
    """What the handlers share: the batcher, the tokenizer, the model's name."""

    def __init__(self, batcher: Batcher, tokenizer, model_name: str) -> None:
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.render_chat = self._render_chat if has_template else None
        self.served = 0

    def _render_chat(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def jobs(self, request: Completion) -> list[Job]:
        sink: queue.Queue = queue.Queue()
        jobs = []
        for index, prompt in enumerate(request.prompts):
            ids = self.tokenizer(prompt, add_special_tokens=request.kind != "chat")["input_ids"]
            if not ids:
                raise BadRequest("a prompt tokenised to nothing", "prompt")
            jobs.append(Job(list(ids), request.max_tokens, request.sampling, index, sink))
        return jobs


def make_server(host: str, port: int, frontend: Frontend) -> ThreadingHTTPServer:
    """The HTTP server (not started): `serve_forever()` in a thread of rank 0."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "codegen-serve"

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            pass  # one line per request would drown the launcher's output

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - the base class's name
            if self.path == "/health":
                return self._json(200, {"status": "ok", "requests_served": frontend.served,
                                        "largest_batch": frontend.batcher.largest_batch})
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [
                    {"id": frontend.model_name, "object": "model", "owned_by": "codegen"}]})
            return self._json(404, error(f"no such endpoint: GET {self.path}", kind="not_found"))

        def do_POST(self):  # noqa: N802
            kinds = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
            if self.path not in kinds:
                return self._json(404, error(f"no such endpoint: POST {self.path}", kind="not_found"))
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length <= 0 or length > MAX_BODY:
                    raise BadRequest(f"the body must be a JSON object of at most {MAX_BODY} bytes")
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError:
                    raise BadRequest("the body is not JSON") from None
                request = parse(body, kinds[self.path], frontend.model_name, frontend.render_chat)
                jobs = frontend.jobs(request)
            except BadRequest as exc:
                return self._json(400, error(exc.message, exc.param))
            frontend.batcher.submit(jobs)
            if request.stream:
                return self._stream(request, jobs)
            return self._whole(request, jobs)

        def _events(self, jobs: list[Job]):
            """(index, kind, value) of every job until each is done or failed."""
            open_jobs = len(jobs)
            sink = jobs[0].sink
            while open_jobs:
                index, kind, value = sink.get()
                if kind in (DONE, ERROR):
                    open_jobs -= 1
                yield index, kind, value

        def _whole(self, request: Completion, jobs: list[Job]) -> None:
            streams = [TextStream(frontend.tokenizer) for _ in jobs]
            finishes = ["length"] * len(jobs)
            failed = None
            for index, kind, value in self._events(jobs):
                if kind == TOKEN:
                    streams[index].add(value)
                elif kind == DONE:
                    finishes[index] = value
                else:
                    failed = value
            if failed is not None:
                return self._json(500, error(failed, kind="server_error"))
            for stream in streams:
                stream.rest()
            texts = [s.sent for s in streams]
            prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
            frontend.served += 1
            self._json(200, response(request, texts, finishes, prompt_tokens, sum(len(s.tokens) for s in streams)))

        def _stream(self, request: Completion, jobs: list[Job]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            streams = [TextStream(frontend.tokenizer) for _ in jobs]
            try:
                if request.kind == "chat":
                    first = chunk(request, 0, "", None)
                    first["choices"][0]["delta"] = {"role": "assistant"}
                    self._send(first)
                for index, kind, value in self._events(jobs):
                    if kind == TOKEN:
                        delta = streams[index].add(value)
                        if delta:
                            self._send(chunk(request, index, delta, None))
                    elif kind == DONE:
                        self._send(chunk(request, index, streams[index].rest(), value))
                    else:
                        self._send(error(value, kind="server_error"))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                frontend.served += 1
            except (BrokenPipeError, ConnectionResetError):
                for job in jobs:  # the client went away: its jobs stop, the server goes on
                    job.cancelled.set()

        def _send(self, event: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
