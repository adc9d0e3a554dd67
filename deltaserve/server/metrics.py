"""Prometheus metrics of one server, in its own CollectorRegistry (never the global one).

Counters and histograms are updated on the event loop as requests progress; the gauges (queue
lengths, KV blocks and state slots in use) are read at scrape time from the engine thread's
latest snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

OUTCOMES = ("stop", "length", "abort", "error", "rejected")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.2, 0.4, 0.8, 1.0, 2.5, 5.0, 10.0)  # fmt: skip

_GAUGES = (
    ("running", "deltaserve_num_requests_running", "Sequences running in the engine."),
    ("waiting", "deltaserve_num_requests_waiting", "Sequences waiting to be scheduled."),
    ("kv_blocks_used", "deltaserve_kv_blocks_used", "Paged KV-cache blocks in use."),
    ("kv_blocks_total", "deltaserve_kv_blocks_total", "Paged KV-cache blocks in all."),
    ("state_slots_used", "deltaserve_state_slots_used", "Recurrent-state slots in use."),
    ("state_slots_total", "deltaserve_state_slots_total", "Recurrent-state slots in all."),
)


# the engine's cumulative counters (LLMEngine.prefix_cache_stats): key, metric name, help
_PREFIX_COUNTERS = (
    ("prefix_cache_queries", "deltaserve_prefix_cache_queries", "Admissions that looked up the "
     "prefix cache."),
    ("prefix_cache_hits", "deltaserve_prefix_cache_hits", "Admissions that hit the prefix cache."),
    ("prefix_cache_query_tokens", "deltaserve_prefix_cache_query_tokens", "Prompt tokens of the "
     "admissions that looked up the prefix cache."),
    ("prefix_cache_hit_tokens", "deltaserve_prefix_cache_hit_tokens", "Prompt tokens served from "
     "the prefix cache."),
    ("prefix_snapshots_taken", "deltaserve_prefix_state_snapshots_taken", "Recurrent-state "
     "snapshots taken for prefix caching."),
    ("prefix_snapshots_evicted", "deltaserve_prefix_state_snapshots_evicted", "Recurrent-state "
     "snapshots evicted for new ones."),
    ("prompt_tokens_computed", "deltaserve_prompt_tokens_computed", "Prompt tokens run through "
     "the model (prefix-cache hits excluded)."),
)  # fmt: skip
_PREFIX_GAUGES = (
    ("prefix_snapshots_held", "deltaserve_prefix_state_snapshots_held", "Recurrent-state "
     "snapshots held for prefix caching."),
    ("prefix_snapshots_total", "deltaserve_prefix_state_snapshots_total", "Recurrent-state "
     "snapshots the snapshot pool holds at most."),
)  # fmt: skip


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], object]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._snapshot()
        for attr, name, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(snap, attr))
        prefix: dict[str, int] = getattr(snap, "prefix_cache", None) or {}
        for key, name, doc in _PREFIX_COUNTERS:
            yield CounterMetricFamily(name, doc, value=prefix.get(key, 0))
        for key, name, doc in _PREFIX_GAUGES:
            yield GaugeMetricFamily(name, doc, value=prefix.get(key, 0))
        spec = getattr(snap, "spec", None)
        if spec is not None:
            yield from _spec_metrics(spec)


def _spec_metrics(spec) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding (deltaserve/spec/stats.py SpecSnapshot)."""
    for name, doc, value in (
        ("deltaserve_spec_decode_num_drafts", "Verify rows (sequences' steps with drafts).",
         spec.num_verify_rows),
        ("deltaserve_spec_decode_num_draft_tokens", "Draft tokens verified.",
         spec.num_draft_tokens),
        ("deltaserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
         spec.num_accepted_tokens),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily(
        "deltaserve_spec_decode_mean_acceptance_length",
        "Tokens a verify row emits on average (accepted drafts + 1).",
        value=spec.mean_acceptance_length,
    )
    per_pos = GaugeMetricFamily(
        "deltaserve_spec_decode_acceptance_rate_per_position",
        "Share of verify rows carrying a draft at this position that accepted it.",
        labels=["position"],
    )
    for i, rate in enumerate(spec.acceptance_rate_per_position):
        per_pos.add_metric([str(i)], rate)
    yield per_pos


class ServerMetrics:
    """`snapshot()` returns an object with the attributes named in _GAUGES."""

    def __init__(self, snapshot: Callable[[], object]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "deltaserve_requests", "Requests by outcome.", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter(
            "deltaserve_prompt_tokens", "Prompt tokens prefilled.", registry=r
        )
        self.generation_tokens = Counter(
            "deltaserve_generation_tokens", "Tokens generated.", registry=r
        )
        self.ttft = Histogram(
            "deltaserve_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "deltaserve_inter_token_latency_seconds",
            "Time between successive outputs of a request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        r.register(_SnapshotCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
