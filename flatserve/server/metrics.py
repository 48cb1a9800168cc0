"""Prometheus metrics (own registry, so tests can start several servers in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("flatserve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("flatserve_num_requests_waiting", "Requests queued", registry=r)
        self.kv_used = Gauge("flatserve_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.kv_total = Gauge("flatserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.aborted = Counter("flatserve_num_requests_aborted", "Requests aborted before they finished "
                               "(client gone, stop pressed, shutdown)", registry=r)
        self.preemptions = Counter("flatserve_num_preemptions", "Requests preempted", registry=r)
        self.prompt_tokens = Counter("flatserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.gen_tokens = Counter("flatserve_generation_tokens", "Tokens generated", registry=r)
        self.prefix_hits = Counter("flatserve_prefix_cache_hits", "Prompt tokens served from the prefix cache (tokens)", registry=r)
        self.prefix_queries = Counter("flatserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (tokens)", registry=r)
        self.spec_drafts = Counter("flatserve_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter("flatserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.ttft = Histogram("flatserve_time_to_first_token_seconds", "TTFT", buckets=_LAT, registry=r)
        self.itl = Histogram("flatserve_inter_token_latency_seconds", "ITL", buckets=_LAT, registry=r)
        self.e2e = Histogram("flatserve_e2e_request_latency_seconds", "End-to-end latency", buckets=_LAT, registry=r)
        self.budget = Gauge("flatserve_memory_budget_bytes", "Memory budget terms", ["term"], registry=r)
        self.weight_bytes = Gauge("flatserve_weight_bytes", "Linear weights' bytes by storage format "
                                  "(q4_k, q8_0, ..., dense)", ["format"], registry=r)
        self.weight_linears = Gauge("flatserve_weight_linears", "Linear weight segments by storage "
                                    "format", ["format"], registry=r)
        self._last: dict[str, int] = {}

    def set_weights(self, formats: tuple[tuple[str, int, int], ...]) -> None:
        for name, n, nbytes in formats:
            self.weight_bytes.labels(format=name).set(nbytes)
            self.weight_linears.labels(format=name).set(n)

    def set_budget(self, terms: dict[str, int]) -> None:
        for k, v in terms.items():
            self.budget.labels(term=k).set(v)

    def update(self, stats: dict[str, int]) -> None:
        """Engine stats are cumulative; counters advance by the difference."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_used.set(stats["kv_blocks_used"])
        self.kv_total.set(stats["kv_blocks_total"])
        for key, c in (("preemptions", self.preemptions), ("prompt_tokens", self.prompt_tokens),
                       ("generation_tokens", self.gen_tokens), ("prefix_cache_hits", self.prefix_hits),
                       ("prefix_cache_queries", self.prefix_queries),
                       ("spec_draft_tokens", self.spec_drafts), ("spec_accepted_tokens", self.spec_accepted)):
            d = stats[key] - self._last.get(key, 0)
            if d > 0:
                c.inc(d)
            self._last[key] = stats[key]
