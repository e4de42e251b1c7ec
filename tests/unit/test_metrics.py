"""Run metrics and the report, on hand-built results with known figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.metrics import (
    counter_delta,
    engine_time_ttft,
    hit_rate_over_time,
    parse_counters,
    percentile,
    summarize,
)
from loadgen.records import ManageRecord, RequestRecord, RunResult, SessionRecord
from loadgen.report import render_report


def _req(
    sid: str,
    t0: float,
    t1: float,
    ttft: float,
    prompt: int,
    cached: int,
    *,
    agent: str = "a",
    parent: str | None = None,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        sid, parent, agent, 0, t0, t0, t1, ttft, prompt, cached, 10, prompt, error=error
    )


def _result(kvkeeper: dict[str, float] | None = None) -> RunResult:
    reqs = [
        _req("s1", 0.0, 1.0, 0.5, 1000, 0),
        _req("s1", 2.0, 2.5, 0.1, 1200, 1000),
        _req("s2", 1.0, 4.0, 2.0, 800, 400, agent="b", parent="s1"),
        _req("s2", 5.0, 6.0, 0.2, 900, 0, error="HTTP 500: boom"),
    ]
    sessions = [SessionRecord("s1", None, 0.0, 8.0), SessionRecord("s2", "s1", 1.0, 6.0)]
    manages = [
        ManageRecord(
            "s2", "evict", 6.0, 6.01, 200, [{"type": "evict", "status": "applied", "reason": None}]
        ),
        ManageRecord("s1", "prefetch", 1.5, 1.6, 0, [], error="ClientError: x"),
    ]
    return RunResult(
        "swarm",
        {"seed": 0},
        {"base_url": "u", "model": "m", "hints": {"mode": "full"}},
        {},
        0.0,
        8.0,
        reqs,
        manages,
        sessions,
        kvkeeper=kvkeeper,
        label="swarm/full",
    )


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_summary_figures() -> None:
    s = summarize(_result())
    assert (s["requests"], s["errors"]) == (4, 1)
    assert (s["prompt_tokens"], s["cached_tokens"]) == (3000, 1400)
    assert s["hit_rate"] == pytest.approx(1400 / 3000)
    assert s["recomputed_prompt_tokens"] == 1600
    assert s["ttft"]["mean"] == pytest.approx((0.5 + 0.1 + 2.0) / 3)
    assert s["ttft"]["p50"] == 0.5 and s["ttft"]["max"] == 2.0
    assert s["turn_latency"]["mean"] == pytest.approx((1.0 + 0.5 + 3.0) / 3)
    assert s["throughput_rps"] == pytest.approx(3 / 8.0)
    assert s["throughput_tokens_s"] == pytest.approx((3000 + 30) / 8.0)
    assert s["job_completion"]["mean"] == 8.0  # only the root session counts
    assert s["by_agent"] == {"a": pytest.approx(1000 / 2200), "b": 0.5}
    assert s["manage"] == {"evict:applied": 1, "prefetch:error": 1}
    assert s["retention_recomputed_tokens"] is None


def test_retention_overhead_from_kvkeeper_counters() -> None:
    text = """# HELP kvkeeper_touch_prompt_tokens_total touches
# TYPE kvkeeper_touch_prompt_tokens_total counter
kvkeeper_touch_prompt_tokens_total{engine="e0"} 5000
kvkeeper_touch_prompt_tokens_total{engine="e1"} 1000
kvkeeper_touch_recomputed_tokens_total 40
kvkeeper_warmup_recomputed_tokens 360.0
other_metric 7
"""
    after = parse_counters(
        text,
        [
            "kvkeeper_touch_prompt_tokens_total",
            "kvkeeper_touch_recomputed_tokens_total",
            "kvkeeper_warmup_recomputed_tokens_total",
        ],
    )
    assert after == {
        "kvkeeper_touch_prompt_tokens_total": 6000.0,
        "kvkeeper_touch_recomputed_tokens_total": 40.0,
        "kvkeeper_warmup_recomputed_tokens_total": 360.0,
    }
    delta = counter_delta({"kvkeeper_touch_recomputed_tokens_total": 10.0}, after)
    assert counter_delta({}, {}) is None
    s = summarize(_result(delta))
    assert s["retention_recomputed_tokens"] == 30.0 + 360.0
    assert s["retention_prompt_tokens"] == 6000.0
    assert s["retention_overhead_ratio"] == pytest.approx(390.0 / 1600)


def test_hit_rate_over_time_bins_by_completion() -> None:
    series = hit_rate_over_time(_result(), bins=4)  # span 4 s (last ok completion), 1 s bins
    assert [t for t, _ in series] == [0.5, 1.5, 2.5, 3.5]
    assert [r for _, r in series] == [None, 0.0, pytest.approx(1000 / 1200), 0.5]


def test_report_writes_table_and_plots(tmp_path: Path) -> None:
    other = _result()
    other.label = "swarm/none"
    path = render_report([_result(), other], tmp_path / "rep")
    text = path.read_text()
    assert "| swarm/full | full | 4 | 1 | 46.7% | 1,600 |" in text
    assert "management requests: evict:applied 1, prefetch:error 1" in text
    for png in ("ttft_cdf.png", "hit_rate.png"):
        data = (tmp_path / "rep" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert (tmp_path / "rep" / "summary.json").exists()


def test_engine_time_ttft_scales_only_the_engines_part() -> None:
    rec = _req("s1", 0.0, 1.0, 0.30, 1000, 0)
    assert engine_time_ttft(rec) == 0.30  # no engine time reported (a real engine): as measured
    rec.engine_ttft, rec.engine_speed = 0.10, 10.0
    # 0.20 s outside the engine stay; the engine's 0.10 s are 1.0 s at the profile's speed
    assert engine_time_ttft(rec) == pytest.approx(0.30 + 9 * 0.10)
    rec.engine_speed = 1.0
    assert engine_time_ttft(rec) == 0.30
    rec.ttft = None
    assert engine_time_ttft(rec) is None


def test_summary_gives_both_ttfts() -> None:
    res = _result()
    assert summarize(res)["ttft_engine_time"] == summarize(res)["ttft"]  # no engine times
    for r in res.requests:
        r.engine_ttft, r.engine_speed = 0.05, 3.0
    s = summarize(res)
    assert s["ttft_engine_time"]["mean"] == pytest.approx(s["ttft"]["mean"] + 2 * 0.05)
    assert s["ttft_engine_time"]["max"] == pytest.approx(2.0 + 0.1)
    # records saved before the field existed still load (defaults)
    doc = res.to_json()
    for r in doc["requests"]:
        del r["engine_ttft"], r["engine_speed"]
    assert summarize(RunResult.from_json(doc))["ttft_engine_time"] == summarize(_result())["ttft"]
