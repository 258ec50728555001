"""`/metrics`: the server's counters in Prometheus' text format (prometheus_client), named after vLLM's.

requests finished (by finish reason) and refused (by status), prompt and generated tokens, sequences running and
waiting, and histograms of time to first token, inter-token latency and whole-request latency (seconds).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the front

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0)


class Metrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model}
        self.success = Counter("codegen_request_success", "Requests answered, by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.refused = Counter("codegen_request_errors", "Requests refused or failed, by HTTP status",
                               ["model_name", "status"], registry=r)
        self.prompt_tokens = Counter("codegen_prompt_tokens", "Prompt tokens prefilled", ["model_name"],
                                     registry=r).labels(**label)
        self.generation_tokens = Counter("codegen_generation_tokens", "Tokens generated", ["model_name"],
                                         registry=r).labels(**label)
        self.running = Gauge("codegen_num_requests_running", "Sequences in the running batch", ["model_name"],
                             registry=r).labels(**label)
        self.waiting = Gauge("codegen_num_requests_waiting", "Sequences waiting for a slot", ["model_name"],
                             registry=r).labels(**label)
        self.ttft = Histogram("codegen_time_to_first_token_seconds", "Arrival to first token", ["model_name"],
                              buckets=_LATENCY, registry=r).labels(**label)
        self.itl = Histogram("codegen_inter_token_latency_seconds", "Between two tokens of a sequence",
                             ["model_name"], buckets=_LATENCY, registry=r).labels(**label)
        self.e2e = Histogram("codegen_e2e_request_latency_seconds", "Arrival to last token of a request",
                             ["model_name"], buckets=_LATENCY, registry=r).labels(**label)
        self.model = model

    def finished(self, reason: str) -> None:
        self.success.labels(model_name=self.model, finished_reason=reason).inc()

    def error(self, status: int) -> None:
        self.refused.labels(model_name=self.model, status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
