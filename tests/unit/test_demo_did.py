"""The demo's "what kvkeeper did" line, read from kvkeeper's own /metrics exposition."""

from __future__ import annotations

from loadgen.demo_report import did_from

EXPOSITION = """\
# TYPE kvkeeper_touches_total counter
kvkeeper_touches_total{engine="e0",outcome="ok"} 3.0
kvkeeper_touches_total{engine="e0",outcome="late"} 2.0
kvkeeper_touches_total{engine="e0",outcome="skipped_lost"} 7.0
kvkeeper_touches_total{engine="e1",outcome="ok"} 1.0
kvkeeper_offloads_total 4.0
kvkeeper_prefetches_total 5.0
"""


def test_touches_served_count_late_ones_and_nothing_declined() -> None:
    did = did_from(EXPOSITION)
    # a late touch still ran (kvkeeper never aborts one); a skipped one did not
    assert did["touches"] == 6.0
    assert did["tier pins"] == 4.0 and did["prefetches"] == 5.0
    assert did["evictions"] == 0.0 and did["guard back-offs"] == 0.0
