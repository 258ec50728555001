"""`serve`'s pieces without ranks: request parsing (OpenAI's fields and errors), the continuous-batching scheduler
and per-sequence sampling, one engine step against the model run alone, incremental text with stop strings, and
the checks `serve` / `generate` make before any rank starts."""

from __future__ import annotations

import json

import pytest
import torch

from codegen.errors import BadInput
from codegen.serve.batching import DONE, ERROR, TOKEN, Scheduler, Seq
from codegen.serve.protocol import BadRequest, Sampling, chunk, error, parse, response, usage_chunk

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier


def _chat(messages):
    return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_a_completion_request_parses_with_openais_defaults():
    request = parse({"prompt": "hi"}, "completion", "m")
    assert (request.prompts, request.max_tokens, request.stream, request.sampling) == (["hi"], None, False, Sampling())
    sampled = parse({"prompt": ["a", "b"], "temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 5,
                     "stream": True, "stream_options": {"include_usage": True}, "stop": "\n", "user": "u",
                     "model": "anything", "presence_penalty": 0.5, "frequency_penalty": -0.5,
                     "logit_bias": {"7": -100}, "top_k": 4, "repetition_penalty": 1.2}, "completion", "m")
    assert sampled.prompts == ["a", "b"] and sampled.stream and sampled.max_tokens == 5 and sampled.include_usage
    assert sampled.stop == ["\n"]
    assert sampled.sampling == Sampling(greedy=False, temperature=0.7, top_p=0.9, seed=3, top_k=4,
                                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                        logit_bias=((7, -100.0),))
    assert parse({"prompt": "x", "temperature": 0}, "completion", "m").sampling.greedy
    assert parse({"prompt": "x", "logprobs": 2, "echo": False}, "completion", "m").sampling.logprobs == 2


def test_chat_takes_max_completion_tokens_text_parts_and_logprobs():
    request = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "h"},
                                                               {"type": "text", "text": "i"}]}],
                     "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2}, "chat", "m", _chat)
    assert request.prompts == ["user:hi"] and request.max_tokens == 3
    assert request.max_tokens_field == "max_completion_tokens" and request.sampling.logprobs == 2
    plain = {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
             "parallel_tool_calls": True, "response_format": {"type": "text"}, "stream_options": None, "n": None}
    assert parse(plain, "chat", "m", _chat).prompts == ["user:x"]  # what SDKs send when no tool is given


@pytest.mark.parametrize("kind,body,param", [
    ("completion", {}, "prompt"), ("completion", {"prompt": 3}, "prompt"), ("completion", {"prompt": []}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"), ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completion", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("completion", {"prompt": "x", "temperature": 3}, "temperature"),
    ("completion", {"prompt": "x", "top_p": 0}, "top_p"), ("completion", {"prompt": "x", "n": 2}, "n"),
    ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completion", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("completion", {"prompt": "x", "suffix": "y"}, "suffix"), ("completion", {"prompt": "x", "best_of": 2}, "best_of"),
    ("completion", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completion", {"prompt": "x", "stop": [""]}, "stop"), ("completion", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("completion", {"prompt": "x", "logprobs": 1, "stream": True}, "logprobs"),
    ("completion", {"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
    ("completion", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"prompt": "x", "stream": True, "stream_options": {"other": 1}}, "stream_options"),
    ("completion", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("completion", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completion", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("completion", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ("completion", {"prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_a_bad_field_is_a_400_naming_it(kind, body, param):
    with pytest.raises(BadRequest) as info:
        parse(body, kind, "m", _chat)
    assert info.value.param == param and info.value.status == 400 and "\n" not in info.value.message
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
    chat = parse({"messages": [{"role": "user", "content": "q"}], "stream": True,
                  "stream_options": {"include_usage": True}}, "chat", "m", _chat)
    assert response(chat, ["a"], ["stop"], 1, 1)["choices"][0]["message"] == {"role": "assistant", "content": "a"}
    assert chunk(chat, 0, "a", None)["choices"][0]["delta"] == {"content": "a"}
    assert chunk(chat, 0, "", None)["usage"] is None
    assert usage_chunk(chat, 2, 3) | {"id": 0, "created": 0} == {
        "id": 0, "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    json.dumps(whole)


def _seq(prompt, max_tokens=3, sampling=Sampling(), sink=None):
    sink = [] if sink is None else sink
    return Seq(list(prompt), max_tokens, sampling, lambda kind, value: sink.append((kind, value))), sink


def _logits(favourite: int, vocab: int = 16) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[favourite] = 5.0
    return row


def test_sequences_join_and_leave_the_running_batch_at_step_boundaries():
    scheduler = Scheduler(max_batch=2, max_num_tokens=100, eos_ids={0})
    (a, ea), (b, eb), (c, ec) = _seq([1, 2], 2), _seq([3], 5), _seq([4, 4, 4], 1)
    assert scheduler.submit([a, b, c])
    plan = scheduler.plan(0)  # two slots: a and b join, c waits
    assert plan == {"drop": [], "decode": [], "new": [[a.id, [1, 2]], [b.id, [3]]]}
    scheduler.sampled({a.id: _logits(7), b.id: _logits(8)})
    plan = scheduler.plan(0)  # both decode their last token; still no slot for c
    assert plan == {"drop": [], "decode": [[a.id, 7], [b.id, 8]], "new": []}
    scheduler.sampled({a.id: _logits(9), b.id: _logits(0)})  # a has its 2 tokens, b hits end-of-sequence
    assert ea == [(TOKEN, (7, None)), (TOKEN, (9, None)), (DONE, "length")]
    assert eb == [(TOKEN, (8, None)), (DONE, "stop")]
    plan = scheduler.plan(0)  # both leave, c joins in the same step
    assert plan == {"drop": [a.id, b.id], "decode": [], "new": [[c.id, [4, 4, 4]]]}
    scheduler.sampled({c.id: _logits(5)})
    assert ec == [(TOKEN, (5, None)), (DONE, "length")] and scheduler.largest_batch == 2
    assert scheduler.plan(0) == {"drop": [c.id], "decode": [], "new": []} and scheduler.plan(0) is None


def test_the_token_budget_and_the_waiting_bound_hold_and_a_cancelled_sequence_frees_its_slot():
    scheduler = Scheduler(max_batch=8, max_num_tokens=10, eos_ids=set(), max_waiting=2)
    (a, _), (b, _), (c, _) = _seq([1] * 4, 4), _seq([1] * 3, 3), _seq([1], 1)
    assert not scheduler.fits(_seq([1] * 8, 3)[0])
    assert scheduler.submit([a, b]) and not scheduler.submit([c])  # the queue holds 2
    assert [row[0] for row in scheduler.plan(0)["new"]] == [a.id]  # 8 + 6 tokens > 10: b waits
    a.cancelled.set()
    plan = scheduler.plan(0)
    assert plan["drop"] == [a.id] and [row[0] for row in plan["new"]] == [b.id]


def test_a_failed_step_fails_only_the_running_sequences():
    scheduler = Scheduler(max_batch=1, max_num_tokens=100, eos_ids=set())
    (a, ea), (b, eb) = _seq([1]), _seq([2])
    scheduler.submit([a, b])
    scheduler.plan(0)
    scheduler.fail_running("RuntimeError: boom")
    assert ea == [(ERROR, "RuntimeError: boom")] and eb == []
    assert [row[0] for row in scheduler.plan(0)["new"]] == [b.id]


def test_each_sequence_samples_with_its_own_settings():
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0])
    greedy, _ = _seq([1])
    assert greedy.sample(logits) == (1, None)
    biased, _ = _seq([1], sampling=Sampling(logit_bias=((3, 10.0),)))
    assert biased.sample(logits)[0] == 3
    penalised, _ = _seq([1], sampling=Sampling(presence_penalty=2.0))
    assert [penalised.sample(logits)[0] for _ in range(2)] == [1, 2]  # 1 is penalised once it was produced
    repeated, _ = _seq([1], sampling=Sampling(repetition_penalty=2.0))  # 1 is in the prompt
    assert repeated.sample(logits)[0] == 2
    top1, _ = _seq([1], sampling=Sampling(greedy=False, top_k=1, seed=5))
    assert top1.sample(logits)[0] == 1

    def draws(seed):
        seq, _ = _seq([1], sampling=Sampling(greedy=False, temperature=1.5, seed=seed))
        return [seq.sample(logits)[0] for _ in range(20)]

    assert draws(3) == draws(3) and len(set(draws(3))) > 1
    with_logprobs, _ = _seq([1], sampling=Sampling(logprobs=2))
    token, (logprob, top) = with_logprobs.sample(logits)
    assert token == 1 and [t for t, _ in top] == [1, 2]
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1])) and logprob == top[0][1]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # gpt_oss: every other layer a sliding window of 8
@pytest.mark.parametrize("max_batch,first,join_at", [(3, 2, 2), (4, 1, 1), (4, 4, 0)])
def test_an_engine_step_batch_equals_each_sequence_run_alone(_tiny_templates, family, max_batch, first, join_at):
    """Sequences of different lengths joining (alone or several in one left-padded prefill) and leaving one
    left-padded batch get the tokens each gets alone, past the sliding window too."""
    from codegen.models import load
    from codegen.serve.engine import Engine

    model = load(_tiny_templates[family], False, torch.float32).eval()
    prompts, budgets = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30 + i for i in range(12)], [50, 51, 52]], [12, 5, 9, 15]

    def alone(prompt, n):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    scheduler, engine = Scheduler(max_batch=max_batch, max_num_tokens=1000, eos_ids=set()), Engine(model)
    seqs = [_seq(p, n) for p, n in zip(prompts, budgets)]
    scheduler.submit([s for s, _ in seqs[:first]])
    steps = 0
    while (plan := scheduler.plan(0)) is not None or steps <= join_at:
        if plan is not None:
            scheduler.sampled(engine.step(plan))
        steps += 1
        if steps == join_at:  # the rest arrive while the first ones run
            scheduler.submit([s for s, _ in seqs[first:]])
    assert engine.batched and scheduler.largest_batch == max_batch
    for (seq, events), prompt, n in zip(seqs, prompts, budgets):
        assert [v[0] for k, v in events if k == TOKEN] == alone(prompt, n)


def _tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from codegen.harness.examples import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path))


def test_text_deltas_never_split_a_character(tmp_path):
    from codegen.serve.text import Detokenizer

    tokenizer = _tokenizer(tmp_path)
    ids = tokenizer("wörld")["input_ids"]
    assert len(ids) == 6 and len(tokenizer) == 256  # one token per byte: ö is two
    stream = Detokenizer(tokenizer)
    deltas = [stream.add(i) for i in ids]
    assert deltas == ["w", "", "ö", "r", "l", "d"] and stream.rest() == "" and stream.sent == "wörld"


def test_a_stop_string_ends_the_text_is_not_returned_and_is_held_back_while_streaming(tmp_path):
    from codegen.serve.text import ChoiceText

    tokenizer = _tokenizer(tmp_path)
    ids = tokenizer("say END now")["input_ids"]
    streamed = ChoiceText(tokenizer, ["END", "xyz"])
    deltas = [streamed.add(i) for i in ids]
    assert "".join(deltas) == "say " and streamed.stopped and streamed.text == "say "
    assert deltas[:4] == ["", "", "s", "a"]  # two characters held back: they could begin "END"
    whole = ChoiceText(tokenizer, ["now"], hold_back=False)
    for i in ids:
        whole.add(i)
    assert whole.stopped and whole.text == "say END "
    none = ChoiceText(tokenizer, ["zzz"])
    text = "".join(none.add(i) for i in ids) + none.finish()
    assert text == "say END now" and not none.stopped


def test_the_front_times_out_a_request_nobody_answers_and_cancels_it(tmp_path):
    """The real HTTP front (uvicorn on loopback) with a scheduler that no rank serves: a request past
    --request-timeout gets a 504 with OpenAI's error body and its sequence is cancelled."""
    import http.client

    from codegen.serve.http import Frontend, listen, start_server

    scheduler = Scheduler(max_batch=1, max_num_tokens=100, eos_ids=set())
    front = Frontend(scheduler, _tokenizer(tmp_path), "m", max_model_len=64, request_timeout=0.5)
    sock = listen("127.0.0.1", 0)
    server = start_server(sock, front, limit_concurrency=8)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 2}),
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        body = json.loads(answer.read())
        assert answer.status == 504 and body["error"]["type"] == "server_error"
        assert "--request-timeout (0.5 s)" in body["error"]["message"]
        assert scheduler.waiting[0].cancelled.is_set() and scheduler.plan(0) is None
    finally:
        server.should_exit = True


def test_serve_refuses_a_max_model_len_beyond_the_models_context_before_any_rank_starts(tmp_path):
    from codegen.harness.examples import build_example, build_tokenizer
    from codegen.patch import api
    from codegen.serve import launch

    d = build_example("qwen3_moe", tmp_path / "q")
    api.patch(d)
    build_tokenizer(d)
    context = launch.model_context(d)
    assert context == json.loads((d / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(BadInput, match=f"--max-model-len {context + 1} is longer than the model's context "
                                       f"\\({context} tokens"):
        launch.serve(d, 2, "127.0.0.1", 0, "float32", 8, max_model_len=context + 1)
    with pytest.raises(BadInput, match="--max-model-len must be at least 2"):
        launch.serve(d, 2, "127.0.0.1", 0, "float32", 8, max_model_len=1)


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


# ------------------------------------------------------------------------------------- plans between ranks


@pytest.mark.parametrize("plan, follow", [
    (None, False),  # an idle beat: rank 0 may wait for requests next
    ({"stop": True}, False),
    ({"drop": [3], "decode": [], "new": []}, False),  # the last rows leaving
    ({"drop": [], "decode": [[1, 42]], "new": []}, True),
    ({"drop": [2], "decode": [], "new": [[4, [1, 2, 3]]]}, True),
])
def test_only_a_plan_that_steps_rows_sends_its_successor_over_the_all_reduce(plan, follow):
    from codegen.serve.plans import rows_follow

    assert rows_follow(plan) is follow


def test_a_plan_summed_with_the_other_ranks_zeros_arrives_whole():
    """Two ranks: rank 0 adds its plan's bytes, rank 1 zeros of the length it learnt from the first reduction."""
    import torch

    from codegen.serve.plans import PlanChannel, plan_bytes

    plan = {"drop": [7], "decode": [[1, 300], [2, 2**40]], "new": [[9, list(range(300_000))]]}
    assert plan_bytes(plan).numel() > 2**20  # its length needs both digits
    sent = []

    def rank0_reduce(tensor):  # what rank 1 adds: zeros
        sent.append(tensor.clone())

    def rank1_reduce(tensor):  # what rank 0 adds: its length, then its bytes
        tensor.add_(sent[len(received)])
        received.append(tensor.numel())

    received = []
    first = PlanChannel(0, rank0_reduce, torch.device("cpu"))
    other = PlanChannel(1, rank1_reduce, torch.device("cpu"))
    first.fast = other.fast = True
    assert first.send(plan) == plan
    assert other.send(None) == plan and received == [2, plan_bytes(plan).numel()]
    assert other.fast and first.fast  # rows stepped: the next plan comes the same way
