"""`serve`'s pieces without ranks: request parsing (OpenAI's fields and errors), batching, the per-row streamer, the
text deltas of a byte-level tokenizer, and the checks `serve` / `generate` make before any rank starts."""

from __future__ import annotations

import json
import queue

import pytest
import torch

from codegen.errors import BadInput
from codegen.serve.batching import DONE, ERROR, TOKEN, Batcher, BatchStreamer, Job
from codegen.serve.protocol import BadRequest, Sampling, chunk, error, parse, response


def _chat(messages):
    return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_a_completion_request_parses_with_openais_defaults():
    request = parse({"prompt": "hi"}, "completion", "m")
    assert (request.prompts, request.max_tokens, request.stream, request.sampling) == (["hi"], 16, False, Sampling())
    sampled = parse({"prompt": ["a", "b"], "temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 5,
                     "stream": True}, "completion", "m")
    assert sampled.prompts == ["a", "b"] and sampled.stream and sampled.max_tokens == 5
    assert sampled.sampling == Sampling(greedy=False, temperature=0.7, top_p=0.9, seed=3)
    assert parse({"prompt": "x", "temperature": 0}, "completion", "m").sampling.greedy


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"), ({"prompt": 3}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, "temperature"), ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_a_bad_field_is_a_400_naming_it(body, param):
    with pytest.raises(BadRequest) as info:
        parse(body, "completion", "m")
    assert info.value.param == param and "\n" not in info.value.message
    shape = error(info.value.message, info.value.param)
    assert shape["error"]["type"] == "invalid_request_error" and shape["error"]["param"] == param


def test_chat_needs_messages_and_a_template():
    request = parse({"messages": [{"role": "user", "content": "hi"}]}, "chat", "m", _chat)
    assert request.prompts == ["user:hi"] and request.kind == "chat"
    with pytest.raises(BadRequest, match="no chat template"):
        parse({"messages": [{"role": "user", "content": "hi"}]}, "chat", "m", None)
    with pytest.raises(BadRequest, match="`messages` must be"):
        parse({"messages": [{"role": "user"}]}, "chat", "m", _chat)
    with pytest.raises(BadRequest, match="JSON object"):
        parse([1], "chat", "m", _chat)


def test_responses_have_openais_shape():
    request = parse({"prompt": ["a", "b"]}, "completion", "m")
    whole = response(request, ["x", "y"], ["length", "stop"], 3, 4)
    assert whole["object"] == "text_completion" and [c["text"] for c in whole["choices"]] == ["x", "y"]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert chunk(request, 1, "z", None)["choices"] == [{"index": 1, "text": "z", "finish_reason": None,
                                                       "logprobs": None}]
    chat = parse({"messages": [{"role": "user", "content": "q"}]}, "chat", "m", _chat)
    assert response(chat, ["a"], ["stop"], 1, 1)["choices"][0]["message"] == {"role": "assistant", "content": "a"}
    assert chunk(chat, 0, "a", None)["choices"][0]["delta"] == {"content": "a"}
    json.dumps(whole)


def _job(prompt, sampling=Sampling(), max_tokens=3):
    return Job(prompt, max_tokens, sampling, 0, queue.Queue())


def test_a_batch_is_the_oldest_job_and_the_waiting_ones_that_sample_alike():
    batcher = Batcher(max_batch=2)
    sampled = Sampling(greedy=False, temperature=0.5)
    a, b, c, d = _job([1]), _job([2], sampled), _job([3]), _job([4])
    batcher.submit([a, b, c, d])
    assert batcher.batch(0) == [a, c]  # same sampling as the oldest, up to max_batch, in order
    c.cancelled.set()
    assert batcher.batch(0) == [b] and batcher.batch(0) == [d] and batcher.batch(0) == []
    assert batcher.largest_batch == 2


def test_the_streamer_gives_each_row_its_tokens_and_ends_it_at_eos_or_its_budget():
    jobs = [_job([1], max_tokens=2), _job([1], max_tokens=5)]
    for index, job in enumerate(jobs):
        job.index = index
    streamer = BatchStreamer(jobs, eos_ids={0})
    streamer.put(torch.tensor([[1], [1]]))  # the prompt
    streamer.put(torch.tensor([7, 8]))
    streamer.put(torch.tensor([9, 0]))   # row 1 ends at EOS
    streamer.put(torch.tensor([5, 6]))   # row 0 has had its 2 tokens
    streamer.end()
    events = [[e[1:] for e in list(j.sink.queue)] for j in jobs]
    assert events[0] == [(TOKEN, 7), (TOKEN, 9), (DONE, "length")]
    assert events[1] == [(TOKEN, 8), (DONE, "stop")]
    failing = BatchStreamer([_job([1])], eos_ids=set())
    failing.fail("RuntimeError: boom")
    assert list(failing.jobs[0].sink.queue)[-1][1:] == (ERROR, "RuntimeError: boom")


def test_text_deltas_never_split_a_character(tmp_path):
    from transformers import AutoTokenizer

    from codegen.harness.examples import build_tokenizer
    from codegen.serve.http import TextStream

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path))
    ids = tokenizer("wörld")["input_ids"]
    assert len(ids) == 6 and len(tokenizer) == 256  # one token per byte: ö is two
    stream = TextStream(tokenizer)
    deltas = [stream.add(i) for i in ids]
    assert deltas == ["w", "", "ö", "r", "l", "d"] and stream.rest() == "" and stream.sent == "wörld"


def test_serve_refuses_what_cannot_be_served_before_any_rank_starts(tmp_path):
    from codegen.harness.examples import build_example, build_tokenizer
    from codegen.patch import api
    from codegen.serve.launch import check_servable

    d = build_example("qwen2_moe", tmp_path / "q")
    with pytest.raises(BadInput, match="is not patched"):
        check_servable(d, 2)
    api.patch(d)
    with pytest.raises(BadInput, match="has no tokenizer"):
        check_servable(d, 2)
    build_tokenizer(d)
    assert check_servable(d, 2) == "qwen2_moe"
    with pytest.raises(BadInput, match="--tp 3 does not divide num_attention_heads = 4"):
        check_servable(d, 3)
    with pytest.raises(BadInput, match="--tp must be a positive integer"):
        check_servable(d, 0)
