"""The OpenAI-compatible requests `serve` accepts and the responses it sends, as plain data: no HTTP, no model.

A request is checked field by field; anything wrong is a `BadRequest` whose message names the field, sent back as
a 400 with OpenAI's error shape. Every field of OpenAI's completions / chat completions request is either honoured,
accepted and documented as having no effect here (`user`, `model`, `metadata`, `store`, `service_tier`), or refused
with a 400 naming it (`n` > 1, `suffix`, `best_of` > 1, tools, non-text response formats, ...); a field OpenAI does
not define (beyond vLLM's `top_k` and `repetition_penalty`, which are honoured) is a 400 with OpenAI's wording,
"Unrecognized request argument supplied: NAME".

Honoured: `prompt` (a string or a list of strings: one choice each) / `messages` (rendered with the dir's chat
template), `max_tokens` / `max_completion_tokens` (chat), `temperature` (0, or absent with `top_p` absent: greedy),
`top_p`, `top_k`, `seed`, `stop` (strings, matched on the decoded text; the stop string is not returned),
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `logprobs` (completions: the top k,
0-5; chat: `logprobs` + `top_logprobs` 0-20; not with `stream`), `echo` (completions), `stream`,
`stream_options.include_usage`.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

#: the new tokens a request gets when it names no `max_tokens` (capped to what the context has left)
DEFAULT_MAX_TOKENS = 16
#: OpenAI's limits
MAX_STOP = 4
MAX_LOGPROBS = {"completion": 5, "chat": 20}

#: fields accepted and documented as having no effect here
IGNORED = ("user", "metadata", "store", "service_tier")
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "n", "stop", "seed",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "max_tokens", *IGNORED}
KNOWN = {
    "completion": _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
                       "tool_choice", "functions", "function_call", "parallel_tool_calls", "modalities", "audio",
                       "prediction", "reasoning_effort", "web_search_options"},
}
#: OpenAI fields this server refuses whenever they carry a value
REFUSED = {"tools": "tool calls are not supported", "tool_choice": "tool calls are not supported",
           "functions": "function calls are not supported", "function_call": "function calls are not supported",
           "parallel_tool_calls": "tool calls are not supported", "modalities": "only text output is supported",
           "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
           "reasoning_effort": "this model has no reasoning-effort setting",
           "web_search_options": "web search is not supported",
           "suffix": "`suffix` (insertion) is not supported"}


class BadRequest(ValueError):
    """A request the server refuses (4xx, 400 unless `status` says otherwise): its message says which field is
    wrong and why."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its next token (rank 0 only: the ranks get the chosen tokens)."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias) pairs
    logit_bias: tuple = ()
    #: None: no logprobs; k: the chosen token's logprob and the k most likely
    logprobs: int | None = None


@dataclass
class Completion:
    """One parsed request: one or more prompts (text), how to sample them, how to answer."""

    kind: str  # "completion" | "chat"
    prompts: list[str]
    #: None: the default (DEFAULT_MAX_TOKENS, capped to the context left); else what the client asked for
    max_tokens: int | None
    sampling: Sampling
    stream: bool
    model: str
    stop: list[str] = field(default_factory=list)
    include_usage: bool = False
    echo: bool = False
    #: the name of the field that set max_tokens (for errors)
    max_tokens_field: str = "max_tokens"
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, key: str, low: float, high: float, default: float | None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise BadRequest(f"`{key}` must be a number from {low:g} to {high:g}, got {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, low: int, high: int | None, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        limit = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise BadRequest(f"`{key}` must be an integer {limit}, got {value!r}", key)
    return value


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"`{key}` must be true or false, got {value!r}", key)
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    shape = "`messages` must be a non-empty list of {\"role\": str, \"content\": str or text parts}"
    if not isinstance(messages, list) or not messages:
        raise BadRequest(shape, "messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(shape, "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest("only text content parts ({\"type\": \"text\", \"text\": str}) are supported",
                                 "messages")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise BadRequest(shape, "messages")
        out.append({**message, "content": content})
    return out


def parse(body: object, kind: str, model: str, render_chat=None) -> Completion:
    """The request of a `/v1/completions` (kind "completion") or `/v1/chat/completions` ("chat") body.

    `render_chat(messages) -> str` applies the dir's chat template (None: the dir has none, chat is refused).
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in body:
        if key not in KNOWN[kind]:
            raise BadRequest(f"Unrecognized request argument supplied: {key}", key)
    for key, why in REFUSED.items():
        value = body.get(key)
        harmless = value in (None, [], False) or (key == "tool_choice" and value in ("none", "auto")) or \
            (key == "parallel_tool_calls" and isinstance(value, bool))  # what SDKs send with no tools
        if not harmless and key in KNOWN[kind]:
            raise BadRequest(f"{why}: remove `{key}`", key)
    if kind == "chat":
        if render_chat is None:
            raise BadRequest("this model dir has no chat template: use /v1/completions", "messages")
        prompts = [render_chat(_messages(body))]
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            raise BadRequest("only {\"type\": \"text\"} response formats are supported", "response_format")
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
    if _integer(body, "n", 1, None, 1) != 1:
        raise BadRequest("only `n` = 1 is supported", "n")
    if kind == "completion" and _integer(body, "best_of", 1, None, 1) != 1:
        raise BadRequest("only `best_of` = 1 is supported", "best_of")
    stream = _bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest("`stream_options` is only allowed when `stream` is true", "stream_options")
        if not isinstance(options, dict) or any(k != "include_usage" for k in options):
            raise BadRequest("`stream_options` takes only {\"include_usage\": bool}", "stream_options")
        include_usage = _bool(options, "include_usage")
    max_field = "max_tokens"
    max_tokens = _integer(body, "max_tokens", 1, None, None)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_field = "max_completion_tokens"
        max_tokens = _integer(body, "max_completion_tokens", 1, None, None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"`stop` must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    temperature = _number(body, "temperature", 0.0, 2.0, None)
    top_p = _number(body, "top_p", 0.0, 1.0, None)
    if top_p == 0.0:
        raise BadRequest("`top_p` must be above 0", "top_p")
    top_k = _integer(body, "top_k", -1, None, 0)
    seed = _integer(body, "seed", -(2**63), 2**63 - 1, None)
    presence = _number(body, "presence_penalty", -2.0, 2.0, 0.0)
    frequency = _number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    repetition = _number(body, "repetition_penalty", 0.0, 2.0, 1.0)
    if repetition == 0.0:
        raise BadRequest("`repetition_penalty` must be above 0", "repetition_penalty")
    bias = body.get("logit_bias")
    pairs: list[tuple[int, float]] = []
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("`logit_bias` must map token ids (strings) to numbers from -100 to 100", "logit_bias")
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(f"`logit_bias` keys must be token ids, got {key!r}", "logit_bias") from None
            if token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise BadRequest(f"`logit_bias` must map token ids to numbers from -100 to 100, got {key!r}: "
                                 f"{value!r}", "logit_bias")
            pairs.append((token, float(value)))
    logprobs = None
    if kind == "completion":
        logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS["completion"], None)
        echo = _bool(body, "echo")
        if echo and logprobs is not None:
            raise BadRequest("`logprobs` with `echo` (the prompt's logprobs) is not supported", "echo")
    else:
        echo = False
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS["chat"], None)
        if _bool(body, "logprobs"):
            logprobs = top or 0
        elif top is not None:
            raise BadRequest("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    if logprobs is not None and stream:
        raise BadRequest("`logprobs` is not supported with `stream`: ask without streaming", "logprobs")
    greedy = (temperature is None or temperature == 0.0) and top_p is None and top_k in (0, -1)
    if temperature == 0.0:
        greedy = True
    sampling = Sampling(greedy=greedy, temperature=1.0 if temperature is None else temperature,
                        top_p=1.0 if top_p is None else top_p, seed=None if greedy else seed,
                        top_k=max(top_k, 0), presence_penalty=presence, frequency_penalty=frequency,
                        repetition_penalty=repetition, logit_bias=tuple(pairs), logprobs=logprobs)
    return Completion(kind, prompts, max_tokens, sampling, stream, model, stop=stop, include_usage=include_usage,
                      echo=echo, max_tokens_field=max_field)


def _choice(request: Completion, index: int, text: str, finish: str | None, stream: bool, logprobs=None) -> dict:
    if request.kind == "chat":
        key = "delta" if stream else "message"
        content = {"role": "assistant", "content": text} if not stream else ({"content": text} if text else {})
        return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def response(request: Completion, texts: list[str], finishes: list[str], prompt_tokens: int,
             completion_tokens: int, logprobs: list | None = None) -> dict:
    """The whole answer of a request that did not stream."""
    logprobs = logprobs or [None] * len(texts)
    return {
        "id": request.id,
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [_choice(request, i, t, f, False, lp)
                    for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs))],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk(request: Completion, index: int, text: str, finish: str | None) -> dict:
    """One server-sent event of a streaming request."""
    event = {
        "id": request.id,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [_choice(request, index, text, finish, True)],
    }
    if request.include_usage:
        event["usage"] = None
    return event


def usage_chunk(request: Completion, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last event of a stream with `stream_options.include_usage`: no choices, the request's usage."""
    return {"id": request.id, "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
            "created": request.created, "model": request.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_logprobs(entries: list, texts: list[str], offset: int) -> dict:
    """OpenAI's completions `logprobs` object: entries are (token text, logprob, [(text, logprob), ...])."""
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [dict(e[2]) if e[2] else None for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list) -> dict:
    """OpenAI's chat `logprobs` object."""

    def one(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(tt, tlp) for tt, tlp in top]} for t, lp, top in entries],
            "refusal": None}


def error(message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
