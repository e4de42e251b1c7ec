"""The simulated engine's state as a Prometheus exposition under vLLM's metric names."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loadgen.sim.engine import SimEngine


class EngineCollector:
    """A prometheus_client collector reading one engine at scrape time."""

    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        e, labels = self._engine, {"model_name": self._model, "engine": "0"}
        kv = e.kv.stats
        yield _counter("prefix_cache_queries", "Prefix cache queries (tokens)", kv.queries, labels)
        yield _counter("prefix_cache_hits", "Prefix cache hits (tokens)", kv.hits, labels)
        yield _counter(
            "external_prefix_cache_queries",
            "External (CPU tier) prefix cache queries (tokens)",
            e.stats.external_queries,
            labels,
        )
        yield _counter(
            "external_prefix_cache_hits",
            "External (CPU tier) prefix cache hits (tokens)",
            e.stats.external_hits,
            labels,
        )
        yield _counter("num_preemptions", "Cumulative preemptions", e.stats.preemptions, labels)
        yield _counter("prompt_tokens", "Prefill tokens processed", e.stats.prompt_tokens, labels)
        yield _counter(
            "generation_tokens", "Generation tokens processed", e.stats.generation_tokens, labels
        )
        yield from self._gauges(labels)
        yield self._success(labels)
        yield from self._latencies(labels)
        for name, doc, value in (
            ("modelled_seconds", "Wall seconds of the modelled engine steps", e.stats.modelled_s),
            ("lag_seconds", "Wall seconds the step loop ran behind its modelled clock and "
             "could not catch up (the simulator's own processing time)", e.stats.lag_s),
        ):  # fmt: skip
            fam = CounterMetricFamily(f"kvkeeper_sim_{name}", doc, labels=[])
            fam.add_metric([], value)
            yield fam
        if (oracle := e.pool.oracle) is not None:  # the simulator's own: evicting by the future
            for name, doc, value in (
                ("prompt_blocks", "Prompt blocks of admitted requests", oracle.admitted),
                ("unknown_blocks", "Of those, blocks the oracle does not list", oracle.unknown),
            ):
                fam = CounterMetricFamily(f"kvkeeper_sim_belady_{name}", doc, labels=[])
                fam.add_metric([], value)
                yield fam

    def _gauges(self, labels: dict[str, str]) -> Iterator[Metric]:
        e = self._engine
        yield _gauge("kv_cache_usage_perc", "KV-cache usage, 1 = 100%", e.pool.usage, labels)
        yield _gauge("num_requests_running", "Requests in the batch", len(e.running), labels)
        yield _gauge("num_requests_waiting", "Requests waiting", len(e.waiting), labels)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching",
                    "prefix_caching_hash_algo", "engine"],
        )  # fmt: skip
        c = e.config
        info.add_metric(
            [str(c.block_size), str(c.num_blocks), str(c.cpu_blocks), "True", "sha256_cbor", "0"],
            1.0,
        )
        yield info

    def _success(self, labels: dict[str, str]) -> Metric:
        fam = CounterMetricFamily(
            "vllm:request_success",
            "Successfully processed requests",
            labels=[*labels, "finished_reason"],
        )
        for reason, count in sorted(self._engine.stats.finished.items()):
            fam.add_metric([*labels.values(), reason], count)
        return fam

    def _latencies(self, labels: dict[str, str]) -> Iterator[Metric]:
        st = self._engine.stats
        yield st.ttft.render(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            labels,
        )
        yield st.prefill.render(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request",
            labels,
        )
        yield st.inter_token.render(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            labels,
        )


def _counter(name: str, doc: str, value: float, labels: dict[str, str]) -> Metric:
    fam = CounterMetricFamily(f"vllm:{name}", doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> Metric:
    fam = GaugeMetricFamily(f"vllm:{name}", doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam
