"""Acceptance statistics, in /metrics (Prometheus text) and the runtime-stats line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deltaserve.server.metrics import ServerMetrics
from deltaserve.spec.stats import SpecStats


def test_counts_and_rates():
    stats = SpecStats(3)
    stats.record(3, 3)
    stats.record(3, 1)
    stats.record(2, 0)
    s = stats.snapshot()
    assert (s.num_verify_rows, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert s.acceptance_rate_per_position == pytest.approx((2 / 3, 1 / 3, 1 / 2))
    assert "mean acceptance length 2.33" in stats.describe()
    with pytest.raises(ValueError):
        stats.record(2, 3)


def test_metrics_render_the_spec_counters():
    stats = SpecStats(2)
    stats.record(2, 1)
    snap = SimpleNamespace(
        running=1, waiting=0, kv_blocks_used=0, kv_blocks_total=1, state_slots_used=0,
        state_slots_total=1, spec=stats.snapshot(),
    )  # fmt: skip
    text = ServerMetrics(lambda: snap).render().decode()
    assert "deltaserve_spec_decode_num_draft_tokens_total 2.0" in text
    assert "deltaserve_spec_decode_num_accepted_tokens_total 1.0" in text
    assert "deltaserve_spec_decode_mean_acceptance_length 2.0" in text
    assert 'deltaserve_spec_decode_acceptance_rate_per_position{position="1"} 0.0' in text
    snap.spec = None
    assert "spec_decode" not in ServerMetrics(lambda: snap).render().decode()
