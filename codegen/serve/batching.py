"""Continuous batching on rank 0: the sequences waiting and running, each step's composition, and sampling.

The HTTP front `submit`s sequences (one per prompt); rank 0's serving loop asks `plan` for the next step, which
every rank then runs (codegen.serve.engine): the running sequences that finished or were cancelled leave, the
others decode one token each, and waiting sequences join (their prompts prefilled) while a slot (`max_batch`), the
token budget (`max_num_tokens`: prompt + max_tokens of every running sequence together) and the step's prefill
budget (`max_prefill_tokens`, at least one prompt a step) allow, oldest first. `sampled` then picks each row's
next token from its logits with the row's own sampling settings (temperature, top-p/k, penalties, logit bias, a
per-sequence seeded generator), hands it to the sequence (`emit`), and ends the sequence at end-of-sequence
("stop") or its budget ("length"): its slot is free at the next step. Sequences of any length and sampling share a
step. Standard library and torch only (no model here), so the scheduling is tested without ranks.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from codegen.serve.protocol import Sampling

#: events a sequence receives, in order: ("token", (id, logprobs))*, then ("done", "stop" | "length") or
#: ("error", message)
TOKEN, DONE, ERROR = "token", "done", "error"


@dataclass
class Seq:
    """One prompt of one request, from waiting to done."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    #: called with (kind, value) on rank 0's serving thread
    emit: Callable[[str, object], None]
    id: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    finished: bool = False
    last_token_at: float | None = None
    _counts: dict = field(default_factory=dict)
    _generator: object = None

    @property
    def reserve(self) -> int:
        """The most tokens this sequence can hold in the KV cache."""
        return len(self.prompt_ids) + self.max_tokens

    def sample(self, logits):
        """The next token from this row's logits (1-D), and (logprob, top [(id, logprob)]) when asked for."""
        import torch

        s = self.sampling
        raw = logits.float()
        x = raw
        if s.repetition_penalty != 1.0 or s.presence_penalty or s.frequency_penalty or s.logit_bias:
            x = raw.clone()
            if s.repetition_penalty != 1.0:  # transformers' rule, over the prompt and the output
                ids = torch.tensor(sorted(set(self.prompt_ids) | set(self.output)), dtype=torch.long)
                seen = x[ids]
                x[ids] = torch.where(seen > 0, seen / s.repetition_penalty, seen * s.repetition_penalty)
            if (s.presence_penalty or s.frequency_penalty) and self._counts:  # OpenAI's rule, over the output
                ids = torch.tensor(list(self._counts), dtype=torch.long)
                counts = torch.tensor(list(self._counts.values()), dtype=x.dtype)
                x[ids] -= counts * s.frequency_penalty + s.presence_penalty
            if s.logit_bias:
                for token, bias in s.logit_bias:
                    if token < x.shape[0]:
                        x[token] += bias
        if s.greedy:
            token = int(torch.argmax(x))
        else:
            if self._generator is None:
                self._generator = torch.Generator().manual_seed(
                    s.seed % (2**63) if s.seed is not None else random.getrandbits(63))
            x = x / max(s.temperature, 1e-5)
            if s.top_k and s.top_k < x.shape[0]:
                kth = torch.topk(x, s.top_k).values[-1]
                x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
            probs = torch.softmax(x, dim=-1)
            if s.top_p < 1.0:
                ordered, order = torch.sort(probs, descending=True)
                keep = torch.cumsum(ordered, 0) - ordered < s.top_p  # the smallest set reaching top_p
                probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
            token = int(torch.multinomial(probs, 1, generator=self._generator))
        info = None
        if s.logprobs is not None:
            logp = torch.log_softmax(raw, dim=-1)
            top = []
            if s.logprobs:
                values, ids = torch.topk(logp, min(s.logprobs, logp.shape[0]))
                top = list(zip(ids.tolist(), values.tolist()))
            info = (float(logp[token]), top)
        self.output.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        return token, info


class Scheduler:
    """The sequences waiting for a slot and those running (thread-safe: the HTTP front submits, the serving loop
    plans)."""

    def __init__(self, max_batch: int, max_num_tokens: int, eos_ids: set[int], max_waiting: int = 256,
                 max_prefill_tokens: int = 2048, metrics=None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch, self.max_num_tokens, self.max_waiting = max_batch, max_num_tokens, max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.eos = set(eos_ids)
        self.metrics = metrics
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._ready = threading.Condition()
        self._next_id = 0
        self.largest_batch = 0
        self.steps = 0

    def submit(self, seqs: list[Seq]) -> bool:
        """Queue `seqs` (all or none): False when the queue is full."""
        with self._ready:
            if len(self.waiting) + len(seqs) > self.max_waiting:
                return False
            for seq in seqs:
                self._next_id += 1
                seq.id = self._next_id
                self.waiting.append(seq)
            self._ready.notify()
            self._gauges()
            return True

    def fits(self, seq: Seq) -> bool:
        """Whether `seq` can ever run (its reservation within the token budget)."""
        return seq.reserve <= self.max_num_tokens

    def plan(self, wait_s: float) -> dict | None:
        """The next step's composition, or None when nothing runs or waits (after waiting up to `wait_s`):
        {"drop": [ids], "decode": [[id, last token]] in batch order, "new": [[id, prompt ids]]}."""
        with self._ready:
            if not self.running and not self.waiting:
                self._ready.wait(wait_s)
            drop = [s.id for s in self.running if s.finished or s.cancelled.is_set()]
            for s in self.running:
                if s.cancelled.is_set() and not s.finished:
                    s.finished = True
            self.running = [s for s in self.running if not s.finished]
            while self.waiting and self.waiting[0].cancelled.is_set():
                self.waiting.popleft()
            new: list[Seq] = []
            used = sum(s.reserve for s in self.running)
            prefill = 0
            while self.waiting and len(self.running) + len(new) < self.max_batch:
                seq = self.waiting[0]
                if seq.cancelled.is_set():
                    self.waiting.popleft()
                    continue
                if used + seq.reserve > self.max_num_tokens:
                    break  # oldest first: the next one waits for room too (no overtaking, no starvation)
                if new and prefill + len(seq.prompt_ids) > self.max_prefill_tokens:
                    break
                self.waiting.popleft()
                new.append(seq)
                used += seq.reserve
                prefill += len(seq.prompt_ids)
            decode = [[s.id, s.output[-1]] for s in self.running]
            self.running.extend(new)
            self.largest_batch = max(self.largest_batch, len(self.running))
            self._gauges()
        if not drop and not decode and not new:
            return None
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in new))
        self.steps += 1
        return {"drop": drop, "decode": decode, "new": [[s.id, s.prompt_ids] for s in new]}

    def sampled(self, logits: dict) -> None:
        """Each stepped row's next token from `logits` ({id: 1-D logits}), handed to its sequence."""
        now = time.monotonic()
        by_id = {s.id: s for s in self.running}
        for sid, row in logits.items():
            seq = by_id.get(sid)
            if seq is None or seq.finished or seq.cancelled.is_set():
                continue
            token, info = seq.sample(row)
            if self.metrics is not None:
                if seq.last_token_at is None:
                    self.metrics.ttft.observe(now - seq.arrived)
                else:
                    self.metrics.itl.observe(now - seq.last_token_at)
            seq.last_token_at = now
            if token in self.eos:
                seq.finished = True
                seq.output.pop()
                seq.emit(DONE, "stop")
                continue
            if self.metrics is not None:
                self.metrics.generation_tokens.inc()
            seq.emit(TOKEN, (token, info))
            if len(seq.output) >= seq.max_tokens:
                seq.finished = True
                seq.emit(DONE, "length")

    def fail_running(self, message: str) -> None:
        """A step failed on the ranks (their batch is reset): every running sequence gets `message`."""
        with self._ready:
            for seq in self.running:
                if not seq.finished:
                    seq.finished = True
                    seq.emit(ERROR, message)
            self.running = []
            self._gauges()

    def idle(self) -> bool:
        with self._ready:
            return not self.running and not self.waiting

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(len(self.running))
            self.metrics.waiting.set(len(self.waiting))
