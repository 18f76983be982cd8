"""Prometheus metrics of the HTTP server (names in vLLM's style, prefixed `pagedserve:`)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.actors.messages import RequestDelta, SchedulerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("pagedserve:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("pagedserve:num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge(
            "pagedserve:kv_cache_usage_perc", "KV blocks in use (0-1)", registry=r
        )
        self.free_blocks = Gauge("pagedserve:kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.total_blocks = Gauge("pagedserve:kv_cache_total_blocks", "KV blocks", registry=r)
        self.prompt_tokens = Counter("pagedserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "pagedserve:generation_tokens", "Generated tokens", registry=r
        )
        self.requests = Counter(
            "pagedserve:request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "pagedserve:time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "pagedserve:time_per_output_token_seconds", "TPOT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pagedserve:e2e_request_latency_seconds", "E2E", buckets=LATENCY_BUCKETS, registry=r
        )

        self.spec = {
            name: Gauge(f"pagedserve:spec_decode_{name}", help_text, registry=r)
            for name, help_text in SPEC_DECODE_GAUGES.items()
        }

    def render(self, stats: SchedulerStats | None) -> bytes:
        if stats is not None:
            self._set_spec_decode(stats)
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            total = max(stats.num_total_blocks, 1)
            self.kv_usage.set(1.0 - stats.num_free_blocks / total)
            self.free_blocks.set(stats.num_free_blocks)
            self.total_blocks.set(stats.num_total_blocks)
        return generate_latest(self.registry)

    def _set_spec_decode(self, stats: SchedulerStats) -> None:
        proposed = stats.spec_num_draft_tokens
        values = {
            "num_drafts": stats.spec_num_drafts,
            "num_draft_tokens": proposed,
            "num_accepted_tokens": stats.spec_num_accepted_tokens,
            "num_emitted_tokens": stats.spec_num_emitted_tokens,
            "acceptance_rate": stats.spec_num_accepted_tokens / proposed if proposed else 0.0,
            "mean_accepted_length": stats.spec_num_emitted_tokens / max(stats.spec_num_drafts, 1),
        }
        for name, value in values.items():
            self.spec[name].set(value)


# vLLM's spec_decode metrics (totals since start), with the two rates they derive
SPEC_DECODE_GAUGES = {
    "num_drafts": "Steps that verified drafts",
    "num_draft_tokens": "Draft tokens proposed and verified",
    "num_accepted_tokens": "Draft tokens accepted",
    "num_emitted_tokens": "Tokens emitted by steps that verified drafts",
    "acceptance_rate": "Accepted / proposed draft tokens",
    "mean_accepted_length": "Tokens emitted per verify step",
}


class RequestTimer:
    """Times one engine request for the TTFT / TPOT / e2e histograms, from `arrival` (when its
    API call reached the server, `time.perf_counter()`): queueing and tokenizing count."""

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.metrics = metrics
        self.start = arrival
        self.first: float | None = None
        self.num_tokens = 0
        self.finished = False

    def on_delta(self, delta: RequestDelta) -> None:
        count = len(delta.token_ids)
        if count and self.first is None:
            self.first = time.perf_counter()
            self.metrics.ttft.observe(self.first - self.start)
        self.num_tokens += count
        self.metrics.generation_tokens.inc(count)
        if delta.prompt_token_ids is not None:
            self.metrics.prompt_tokens.inc(len(delta.prompt_token_ids))
        if delta.finish_reason is not None:
            self.on_finish(delta.finish_reason.openai_name)

    def on_finish(self, reason: str) -> None:
        now = time.perf_counter()
        self.finished = True
        self.metrics.e2e.observe(now - self.start)
        self.metrics.requests.labels(reason).inc()
        if self.first is not None and self.num_tokens > 1:
            self.metrics.tpot.observe((now - self.first) / (self.num_tokens - 1))

    def on_abort(self) -> None:
        """The request ended unfinished (its client left, or another choice failed)."""
        if not self.finished:
            self.on_finish("abort")
