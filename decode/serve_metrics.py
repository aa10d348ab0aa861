"""Prometheus metrics of the server, under vLLM's names where vLLM has the metric, so one dashboard serves both.

vLLM's (label model_name): vllm:num_requests_running, vllm:num_requests_waiting, vllm:prompt_tokens_total,
vllm:generation_tokens_total, vllm:request_success_total{finished_reason}, vllm:e2e_request_latency_seconds,
vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds, vllm:spec_decode_num_drafts_total,
vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
vllm:spec_decode_num_accepted_tokens_per_pos_total{position}. Mean acceptance length is derived from them as
vLLM does: 1 + accepted / drafts.
Ours (specdistill:): tokens/s and tau of the last request, rejected (queue full) and cancelled requests, and
request-log write failures.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics response)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry)

        def histogram(name, doc):
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.running = gauge("vllm:num_requests_running", "Requests generating now")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for the engine")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.success = counter("vllm:request_success", "Finished requests", ["finished_reason"])
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token")
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting for the engine")
        self.drafts = counter("vllm:spec_decode_num_drafts", "Verification steps that checked a draft")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed (one per depth)")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"])
        self.tokens_per_s = gauge("specdistill:tokens_per_second", "Tokens/s of the last finished request")
        self.tau = gauge("specdistill:mean_acceptance_length", "Tokens per target forward of the last request")
        self.rejected = counter("specdistill:requests_rejected", "Requests refused because the queue was full")
        self.cancelled = counter("specdistill:requests_cancelled", "Requests whose client went away", ["stage"])
        self.log_failures = counter("specdistill:request_log_failures", "Requests the server could not log")
        self._finished, self._latency_total = 0, 0.0

    def mean_latency_s(self) -> float:
        return self._latency_total / self._finished if self._finished else 0.0

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def observe_request(self, stats: dict, prompt_tokens: int, finish_reason: str, queue_s: float,
                        ttft_s: float | None, e2e_s: float) -> None:
        m = self.model_name
        self._finished, self._latency_total = self._finished + 1, self._latency_total + e2e_s
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(stats["new_tokens"])
        self.success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(e2e_s)
        self.queue_time.labels(m).observe(queue_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        drafted = stats.get("drafted_per_position") or []
        self.drafts.labels(m).inc(drafted[0] if drafted else 0)
        self.draft_tokens.labels(m).inc(stats.get("drafted", 0))
        self.accepted_tokens.labels(m).inc(stats.get("accepted", 0))
        for pos, n in enumerate(stats.get("accepted_per_position") or []):
            self.accepted_per_pos.labels(m, str(pos)).inc(n)
        self.tokens_per_s.labels(m).set(stats.get("tokens_per_s", 0.0))
        self.tau.labels(m).set(stats.get("tau", 0.0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
