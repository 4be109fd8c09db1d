"""Prometheus metrics of the server, in the `pagellm:` namespace (modelled on vLLM's `vllm:`).

Two kinds:
- Latency histograms (TTFT, inter-token latency, end-to-end) and request outcome counters,
  observed when a request finishes (from its RequestOutput.metrics timestamps).
- Engine state and engine counters (tokens, queue lengths, KV usage, prefix cache, speculative
  decoding), read from the engine's own attributes at scrape time by a custom collector, so
  no count is kept twice. Plain int/len reads are safe while the engine thread runs.

Each server gets its own CollectorRegistry, so several servers can live in one process (tests).
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagellm.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        disable_created_metrics()  # no `_created` series (process-wide; vLLM does the same)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        kw = dict(labelnames=labels, registry=self.registry)
        self.ttft = Histogram("pagellm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram("pagellm:inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.",
                             buckets=ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds",
                             "Time from arrival to the last token of a finished request.",
                             buckets=E2E_BUCKETS, **kw).labels(model_name)
        self.success = Counter("pagellm:request_success",
                               "Requests that finished, by finish reason (abort: client left, "
                               "shutdown or engine failure).",
                               labelnames=["model_name", "finished_reason"],
                               registry=self.registry)
        self.registry.register(EngineCollector(engine, model_name))

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        for a, b in zip(m.token_times, m.token_times[1:]):
            self.itl.observe(b - a)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.success.labels(self.model_name, reason or "unknown").inc()

    def observe_aborted(self) -> None:
        self.success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Reads the engine's state and counters at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []  # dynamic: no registration-time collisions to check

    def collect(self):
        e, name = self.engine, self.model_name
        bm = e.block_manager

        def gauge(metric: str, doc: str, value: float):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("pagellm:num_requests_running", "Sequences in the running batch.",
                    len(e.scheduler.running))
        yield gauge("pagellm:num_requests_waiting", "Sequences waiting to be scheduled.",
                    len(e.scheduler.waiting))
        yield gauge("pagellm:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).",
                    bm.usage)
        yield gauge("pagellm:kv_cache_num_blocks", "KV blocks in the pool.", bm.num_blocks)
        split = GaugeMetricFamily("pagellm:memory_bytes", "The memory budget's split: weights "
                                  "and KV pool of the target and of a draft model.",
                                  labels=["model_name", "model", "part"])
        for key, value in e.memory_split.items():
            which, part = key.split("_")
            split.add_metric([name, which, part], value)
        yield split
        yield counter("pagellm:prompt_tokens", "Prompt tokens of accepted requests.",
                      e.num_prompt_tokens)
        yield counter("pagellm:generation_tokens", "Generated tokens.", e.num_generation_tokens)
        yield counter("pagellm:num_preemptions", "Sequences preempted (recomputed later).",
                      e.scheduler.num_preemptions)
        yield counter("pagellm:prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache.", bm.prefix_queries)
        yield counter("pagellm:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
                      bm.prefix_hits)
        yield from _spec_metrics(getattr(e, "spec_stats", None), name)


def _spec_metrics(stats, name: str):
    """Speculative decoding counters, when the engine exposes `spec_stats`."""
    if stats is None:
        return
    for attr, metric, doc in (
            ("num_drafts", "pagellm:spec_decode_num_drafts", "Speculative drafts proposed."),
            ("num_draft_tokens", "pagellm:spec_decode_num_draft_tokens",
             "Draft tokens proposed."),
            ("num_accepted_tokens", "pagellm:spec_decode_num_accepted_tokens",
             "Draft tokens accepted.")):
        c = CounterMetricFamily(metric, doc, labels=["model_name"])
        c.add_metric([name], getattr(stats, attr, 0))
        yield c
    per_pos = CounterMetricFamily("pagellm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.",
                                  labels=["model_name", "position"])
    for pos, n in enumerate(list(getattr(stats, "accepted_per_position", []) or [])):
        per_pos.add_metric([name, str(pos)], n)
    yield per_pos
