"""loadgen.compare_doc.engine_work: what the engines did in a run, from vLLM's counters."""

from __future__ import annotations

from loadgen.compare_doc import engine_work


def test_computed_is_what_neither_the_gpu_cache_nor_the_tier_held() -> None:
    work = engine_work(
        {
            "vllm:prefix_cache_queries_total": 10_000,
            "vllm:prefix_cache_hits_total": 6_000,
            "vllm:external_prefix_cache_hits_total": 1_500,
            "vllm:num_preemptions_total": 2,
        }
    )
    assert work == {"computed_tokens": 2_500, "tier_loaded_tokens": 1_500, "preemptions": 2}


def test_an_engine_without_a_tier_or_preemption_counters_loads_nothing() -> None:
    work = engine_work({"vllm:prefix_cache_queries_total": 10, "vllm:prefix_cache_hits_total": 4})
    assert work == {"computed_tokens": 6, "tier_loaded_tokens": 0, "preemptions": 0}


def test_no_prefix_cache_counters_no_figures() -> None:
    assert engine_work(None) is None
    assert engine_work({}) is None
    assert engine_work({"vllm:num_preemptions_total": 3}) is None


def test_a_simulators_lag_is_a_share_of_its_modelled_time() -> None:
    counters = {
        "vllm:prefix_cache_queries_total": 10,
        "vllm:prefix_cache_hits_total": 4,
        "kvkeeper_sim_modelled_seconds_total": 40.0,
        "kvkeeper_sim_lag_seconds_total": 10.0,
    }
    assert engine_work(counters) == {
        "computed_tokens": 6, "tier_loaded_tokens": 0, "preemptions": 0, "sim_lag": 0.25
    }  # fmt: skip
    idle = {**counters, "kvkeeper_sim_modelled_seconds_total": 0.0}
    assert "sim_lag" not in (engine_work(idle) or {})  # nothing modelled, nothing to share
