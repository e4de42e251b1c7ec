"""Prometheus text exposition parsing, and the vLLM metric names kvkeeper reads.

Pure functions: the HTTP scrape itself lives in the engine adapter (one place maps its errors).
vLLM renames counters between versions (``_total`` suffix or not), so lookups accept both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from adapters.base import CacheConfig, EngineMetrics, HistogramReading

# name{labels} value [timestamp]; labels are parsed separately because values may hold '}'.
_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: metric name, its labels and its value."""

    name: str
    labels: Mapping[str, str]
    value: float


class PromParseError(ValueError):
    """A line of the exposition could not be parsed."""


def _unescape(raw: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], raw)


def _parse_labels(text: str, line: str) -> tuple[dict[str, str], str]:
    """Parse ``{a="b",...}`` at the start of ``text``; return labels and the rest of the line."""
    labels: dict[str, str] = {}
    pos = 1  # past '{'
    while True:
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and text[pos] == "}":
            return labels, text[pos + 1 :]
        match = _LABEL_RE.match(text, pos)
        if match is None:
            raise PromParseError(f"bad labels in line: {line!r}")
        labels[match.group(1)] = _unescape(match.group(2))
        pos = match.end()


def _parse_value(raw: str, line: str) -> float:
    try:
        return float(raw)  # float() already accepts NaN, +Inf, -Inf
    except ValueError as exc:
        raise PromParseError(f"bad value in line: {line!r}") from exc


def parse_line(line: str) -> Sample | None:
    """Parse one exposition line; comments and blank lines give None."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    match = _NAME_RE.match(line)
    if match is None:
        raise PromParseError(f"bad metric name in line: {line!r}")
    name, rest = match.group(0), line[match.end() :]
    labels: dict[str, str] = {}
    if rest.startswith("{"):
        labels, rest = _parse_labels(rest, line)
    fields = rest.split()
    if not fields:
        raise PromParseError(f"missing value in line: {line!r}")
    return Sample(name=name, labels=labels, value=_parse_value(fields[0], line))


def parse_text(text: str) -> list[Sample]:
    """Parse a whole Prometheus text exposition."""
    out: list[Sample] = []
    for line in text.splitlines():
        sample = parse_line(line)
        if sample is not None:
            out.append(sample)
    return out


# the histograms ``engine_metrics_from`` reads (under their successive names): the only ones
# whose buckets an engine scrape parses
_READ_HISTOGRAMS = {
    "prefill": ("vllm:request_prefill_time_seconds",),
    "inter_token": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
_READ_BUCKETS = tuple(f"{n}_bucket" for names in _READ_HISTOGRAMS.values() for n in names)


def parse_engine_text(text: str) -> list[Sample]:
    """The samples of a vLLM ``/metrics`` page that ``engine_metrics_from`` reads: ``vllm:``
    ones, less the buckets of histograms it does not read (most of a page's lines), so a
    scrape parses a fraction of the page; the same figures as from ``parse_text``."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(None, 1)[0]
        if name.endswith("_bucket") and not name.startswith(_READ_BUCKETS):
            continue
        sample = parse_line(line)
        if sample is not None:
            out.append(sample)
    return out


def _names(name: str) -> tuple[str, ...]:
    """A metric name with and without the ``_total`` counter suffix."""
    if name.endswith("_total"):
        return (name, name.removesuffix("_total"))
    return (name, f"{name}_total")


def find(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples named ``name`` (or its ``_total`` twin) whose labels include ``labels``."""
    wanted = _names(name)
    return [
        s
        for s in samples
        if s.name in wanted and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum of the matching samples' values across label sets; None when none match."""
    found = [s.value for s in find(samples, name, **labels) if not math.isnan(s.value)]
    return sum(found) if found else None


def histogram(samples: Iterable[Sample], *names: str) -> HistogramReading | None:
    """The first of ``names`` (one histogram under its successive names) that the exposition
    has, its sum, count and buckets summed across label sets; None when none is there."""
    for name in names:
        sums, counts = total(samples, name + "_sum"), total(samples, name + "_count")
        if sums is None or counts is None:
            continue
        buckets: dict[float, float] = {}
        for s in find(samples, name + "_bucket"):
            try:
                le = float(s.labels.get("le", ""))
            except ValueError:
                continue
            buckets[le] = buckets.get(le, 0.0) + s.value
        return HistogramReading(sums, counts, tuple(sorted(buckets.items())))
    return None


def _int_label(labels: Mapping[str, str], *keys: str) -> int | None:
    for key in keys:
        raw = labels.get(key)
        if raw is not None and raw not in ("", "None"):
            try:
                return int(float(raw))
            except ValueError:
                continue
    return None


def cache_config_from(samples: Iterable[Sample], *, hash_seed: str = "0") -> CacheConfig | None:
    """The engine's cache geometry from ``vllm:cache_config_info`` labels, if exposed.

    The hash seed is not exposed by the engine (it is the server's PYTHONHASHSEED), so it comes
    from configuration.
    """
    found = find(samples, "vllm:cache_config_info")
    if not found:
        return None
    labels = found[0].labels
    block_size = _int_label(labels, "block_size")
    if block_size is None:
        return None
    return CacheConfig(
        block_size=block_size,
        num_blocks=_int_label(labels, "num_gpu_blocks", "num_gpu_blocks_override"),
        hash_algo=labels.get("prefix_caching_hash_algo") or "sha256",
        hash_seed=hash_seed,
    )


def engine_metrics_from(samples: list[Sample], *, hash_seed: str = "0") -> EngineMetrics:
    """The figures kvkeeper uses from one scrape of a vLLM ``/metrics`` page."""
    raw: dict[str, float] = {}
    for s in samples:
        if s.name.startswith("vllm:") and not s.labels.keys() - {"model_name", "engine"}:
            raw[s.name] = raw.get(s.name, 0.0) + s.value
    return EngineMetrics(
        kv_cache_usage=total(samples, "vllm:kv_cache_usage_perc")
        if find(samples, "vllm:kv_cache_usage_perc")
        else total(samples, "vllm:gpu_cache_usage_perc"),
        running=total(samples, "vllm:num_requests_running"),
        waiting=total(samples, "vllm:num_requests_waiting"),
        prefix_cache_queries=total(samples, "vllm:prefix_cache_queries"),
        prefix_cache_hits=total(samples, "vllm:prefix_cache_hits"),
        external_prefix_cache_hits=total(samples, "vllm:external_prefix_cache_hits"),
        preemptions=total(samples, "vllm:num_preemptions"),
        prefill_time=histogram(samples, *_READ_HISTOGRAMS["prefill"]),
        inter_token=histogram(samples, *_READ_HISTOGRAMS["inter_token"]),
        cache_config=cache_config_from(samples, hash_seed=hash_seed),
        raw=raw,
    )
