"""The OpenAI-compatible requests `serve` accepts and the responses it sends, as plain data: no HTTP, no model.

A request is checked field by field; anything wrong is a `BadRequest` whose message names the field, sent back
as a 400 with OpenAI's error shape. Completions take `prompt` (a string or a list of strings: one choice each),
chat completions take `messages` (rendered with the dir's chat template). Sampling: `temperature` (0 or absent
with `top_p` absent: greedy), `top_p`, `max_tokens`, `seed`; `stream` sends server-sent events.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

#: the most new tokens one request may ask for (and the default)
MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request the server refuses (400): its message says which field is wrong and why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Sampling:
    """How one request samples; requests with equal Sampling are batched together."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


@dataclass
class Completion:
    """One parsed request: one or more prompts (text), how to sample them, how to answer."""

    kind: str  # "completion" | "chat"
    prompts: list[str]
    max_tokens: int
    sampling: Sampling
    stream: bool
    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, key: str, low: float, high: float, default: float | None) -> float | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"`{key}` must be a number from {low:g} to {high:g}, got {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"`{key}` must be an integer from {low} to {high}, got {value!r}", key)
    return value


def parse(body: object, kind: str, model: str, render_chat=None) -> Completion:
    """The request of a `/v1/completions` (kind "completion") or `/v1/chat/completions` ("chat") body.

    `render_chat(messages) -> str` applies the dir's chat template (None: the dir has none, chat is refused).
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if kind == "chat":
        if render_chat is None:
            raise BadRequest("this model dir has no chat template: use /v1/completions", "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("`messages` must be a non-empty list of {\"role\": str, \"content\": str}", "messages")
        prompts = [render_chat(messages)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            raise BadRequest("`prompt` must be a string or a non-empty list of strings", "prompt")
    if any(not p for p in prompts):
        raise BadRequest("a prompt must not be empty", "prompt")
    if body.get("n", 1) != 1:
        raise BadRequest("only `n` = 1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"`stream` must be true or false, got {stream!r}", "stream")
    max_tokens = _integer(body, "max_tokens", 1, MAX_TOKENS_LIMIT, DEFAULT_MAX_TOKENS)
    temperature = _number(body, "temperature", 0.0, 2.0, None)
    top_p = _number(body, "top_p", 0.0, 1.0, None)
    seed = _integer(body, "seed", 0, 2**63 - 1, None)
    if top_p == 0.0:
        raise BadRequest("`top_p` must be above 0", "top_p")
    greedy = (temperature is None or temperature == 0.0) and top_p is None
    if temperature == 0.0:
        greedy = True
    sampling = Sampling(greedy=greedy, temperature=1.0 if temperature is None else temperature,
                        top_p=1.0 if top_p is None else top_p, seed=None if greedy else seed)
    return Completion(kind, prompts, max_tokens, sampling, stream, model)


def _choice(request: Completion, index: int, text: str, finish: str | None, stream: bool) -> dict:
    if request.kind == "chat":
        key = "delta" if stream else "message"
        content = {"role": "assistant", "content": text} if not stream else ({"content": text} if text else {})
        return {"index": index, key: content, "finish_reason": finish}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


def response(request: Completion, texts: list[str], finishes: list[str], prompt_tokens: int,
             completion_tokens: int) -> dict:
    """The whole answer of a request that did not stream."""
    return {
        "id": request.id,
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [_choice(request, i, t, f, False) for i, (t, f) in enumerate(zip(texts, finishes))],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def chunk(request: Completion, index: int, text: str, finish: str | None) -> dict:
    """One server-sent event of a streaming request."""
    return {
        "id": request.id,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [_choice(request, index, text, finish, True)],
    }


def error(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
