"""The requests waiting for the ranks, grouped into batches, and the tokens of a batch handed back to each request.

Rank 0's HTTP threads `submit` jobs (one per prompt); its serving loop takes the next `batch`: the oldest job and
every waiting job that samples the same way, up to `max_batch`, in arrival order. While the ranks generate a batch,
`BatchStreamer` (the `streamer` transformers' `generate` calls once per step) passes each row's new token to its
job; a row ends at its end-of-sequence token ("stop") or its own token budget ("length"). Standard library and the
streamer protocol only (no model here), so the grouping is tested without ranks.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field

from codegen.serve.protocol import Sampling

#: events a job receives, in order: ("token", id)*, then ("done", "stop" | "length") or ("error", message)
TOKEN, DONE, ERROR = "token", "done", "error"


@dataclass
class Job:
    """One prompt of one request."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    index: int = 0
    #: where this job's events go, tagged with `index` (a request with several prompts shares one sink)
    sink: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value) -> None:
        self.sink.put((self.index, kind, value))


class Batcher:
    """Jobs waiting for the ranks (thread-safe)."""

    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.max_batch = max_batch
        self._pending: deque[Job] = deque()
        self._ready = threading.Condition()
        self.largest_batch = 0

    def submit(self, jobs: list[Job]) -> None:
        with self._ready:
            self._pending.extend(jobs)
            self._ready.notify()

    def batch(self, wait_s: float) -> list[Job]:
        """The next batch (empty if nothing arrived within `wait_s` seconds); cancelled jobs are dropped."""
        with self._ready:
            if not self._pending:
                self._ready.wait(wait_s)
            while self._pending and self._pending[0].cancelled.is_set():
                self._pending.popleft()
            if not self._pending:
                return []
            sampling = self._pending[0].sampling
            chosen = [j for j in self._pending if j.sampling == sampling and not j.cancelled.is_set()]
            chosen = chosen[: self.max_batch]
            for job in chosen:
                self._pending.remove(job)
        self.largest_batch = max(self.largest_batch, len(chosen))
        return chosen


class BatchStreamer:
    """transformers' streamer protocol (`put`, `end`) for one batch: row r's tokens go to jobs[r]."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]) -> None:
        self.jobs = jobs
        self.eos = eos_ids
        self.counts = [0] * len(jobs)
        self.done = [False] * len(jobs)
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt itself
            self._prompt_seen = True
            return
        tokens = value.reshape(len(self.jobs), -1)[:, -1].tolist()
        for row, token in enumerate(tokens):
            if self.done[row]:
                continue
            job = self.jobs[row]
            if token in self.eos:
                self._finish(row, "stop")
                continue
            job.emit(TOKEN, token)
            self.counts[row] += 1
            if self.counts[row] >= job.max_tokens:
                self._finish(row, "length")

    def end(self) -> None:
        for row in range(len(self.jobs)):
            if not self.done[row]:
                self._finish(row, "length")

    def fail(self, message: str) -> None:
        for row in range(len(self.jobs)):
            if not self.done[row]:
                self.done[row] = True
                self.jobs[row].emit(ERROR, message)

    def _finish(self, row: int, reason: str) -> None:
        self.done[row] = True
        self.jobs[row].emit(DONE, reason)
