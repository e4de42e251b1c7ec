"""Run metrics: per-run summary, hit rate over time, and kvkeeper's retention counters.

``summarize(result)`` gives, over successful model calls: the token-weighted prefix-cache hit
rate (cached / prompt tokens from ``usage``), recomputed prompt tokens, TTFT (wall clock, and
engine time: :func:`engine_time_ttft`) and per-turn latency (mean/p50/p90/p99), throughput, job
completion time of root sessions, management-request outcomes, and kvkeeper's retention
overhead (prompt tokens recomputed by touches and warm-ups, read from its ``/metrics`` before
and after the run).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from loadgen.records import RequestRecord, RunResult

KVKEEPER_COUNTERS = (
    "kvkeeper_touch_prompt_tokens_total",
    "kvkeeper_touch_recomputed_tokens_total",
    "kvkeeper_warmup_prompt_tokens_total",
    "kvkeeper_warmup_recomputed_tokens_total",
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of every sample of each named metric in Prometheus text (labels summed over).

    A name is matched with and without the ``_total`` suffix; absent names are left out."""
    wanted: dict[str, str] = {}
    for name in names:
        wanted[name] = name
        wanted[name.removesuffix("_total")] = name
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        key = wanted[m.group(1)]
        out[key] = out.get(key, 0.0) + value
    return out


def counter_delta(
    before: Mapping[str, float], after: Mapping[str, float]
) -> dict[str, float] | None:
    """``after - before`` for counters present after the run; ``None`` if none were."""
    if not after:
        return None
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; ``None`` when empty."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of ``values``."""
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def engine_time_ttft(rec: RequestRecord) -> float | None:
    """The client's TTFT with the engine's part at its profile's speed: a simulator run ``S``
    times faster than its profile compresses the engine's time but not the proxy's, network's
    or client's, so ``ttft + (S - 1) x the engine's own wall time to the first token``. Equal
    to ``ttft`` where the engine did not report its time (a real engine) or ``S`` is 1."""
    if rec.ttft is None or rec.engine_ttft is None:
        return rec.ttft
    return rec.ttft + (rec.engine_speed - 1.0) * rec.engine_ttft


def ok_requests(result: RunResult) -> list[RequestRecord]:
    return [r for r in result.requests if r.error is None]


def summarize(result: RunResult) -> dict[str, Any]:
    """The per-run metrics as a flat JSON-able mapping (see module doc)."""
    ok = ok_requests(result)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    duration = max(result.duration, 1e-9)
    out: dict[str, Any] = {
        "label": result.label,
        "workload": result.workload,
        "hints": result.target.get("hints", {}).get("mode", "none"),
        "requests": len(result.requests),
        "errors": len(result.requests) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "recomputed_prompt_tokens": prompt - cached,
        "output_tokens": output,
        "duration_s": result.duration,
        "throughput_rps": len(ok) / duration,
        "throughput_tokens_s": (prompt + output) / duration,
        "output_tokens_s": output / duration,
        "ttft": stats([r.ttft for r in ok if r.ttft is not None]),
        "ttft_engine_time": stats([t for r in ok if (t := engine_time_ttft(r)) is not None]),
        "turn_latency": stats([r.latency for r in ok]),
        "queue_delay": stats([max(0.0, r.t_start - r.t_sched) for r in ok]),
        "job_completion": stats(job_completion_times(result)),
        "by_agent": hit_rate_by_agent(ok),
        "manage": dict(manage_outcomes(result)),
    }
    out.update(retention_overhead(result.kvkeeper, prompt - cached))
    return out


def job_completion_times(result: RunResult) -> list[float]:
    """Wall time of every root session (start to the end of its last descendant)."""
    return [s.t_end - s.t_start for s in result.sessions if s.parent_id is None and s.t_end]


def hit_rate_by_agent(ok: Sequence[RequestRecord]) -> dict[str, float | None]:
    prompt: defaultdict[str, int] = defaultdict(int)
    cached: defaultdict[str, int] = defaultdict(int)
    for r in ok:
        prompt[r.agent or "-"] += r.prompt_tokens
        cached[r.agent or "-"] += r.cached_tokens
    return {a: (cached[a] / prompt[a] if prompt[a] else None) for a in sorted(prompt)}


def manage_outcomes(result: RunResult) -> Counter[str]:
    """``"evict:applied"`` -> count over all management results; ``"evict:error"`` for a failed
    request, ``"evict:no_result"`` for an answer without results (the target is not kvkeeper)."""
    counts: Counter[str] = Counter()
    for m in result.manages:
        if m.error is not None:
            counts[f"{m.edit}:error"] += 1
        elif not m.results:
            counts[f"{m.edit}:no_result"] += 1
        for res in m.results:
            counts[f"{res.get('type', m.edit)}:{res.get('status', '?')}"] += 1
    return counts


def retention_overhead(
    kvkeeper: Mapping[str, float] | None, recomputed: int
) -> dict[str, float | None]:
    """Tokens kvkeeper spent on touches and warm-ups, alone and per workload-recomputed token."""
    if not kvkeeper:
        return {
            "retention_prompt_tokens": None,
            "retention_recomputed_tokens": None,
            "retention_overhead_ratio": None,
        }
    spent = kvkeeper.get("kvkeeper_touch_recomputed_tokens_total", 0.0) + kvkeeper.get(
        "kvkeeper_warmup_recomputed_tokens_total", 0.0
    )
    sent = kvkeeper.get("kvkeeper_touch_prompt_tokens_total", 0.0) + kvkeeper.get(
        "kvkeeper_warmup_prompt_tokens_total", 0.0
    )
    return {
        "retention_prompt_tokens": sent,
        "retention_recomputed_tokens": spent,
        "retention_overhead_ratio": spent / recomputed if recomputed else None,
    }


def hit_rate_over_time(result: RunResult, bins: int = 20) -> list[tuple[float, float | None]]:
    """Token-weighted hit rate of calls grouped by completion time into ``bins`` equal spans;
    ``(bin midpoint in seconds, rate)``, ``None`` for a bin without calls."""
    ok = ok_requests(result)
    span = max([r.t_end for r in ok], default=0.0)
    if not ok or span <= 0:
        return []
    width = span / bins
    prompt = [0] * bins
    cached = [0] * bins
    for r in ok:
        b = min(bins - 1, int(r.t_end / width))
        prompt[b] += r.prompt_tokens
        cached[b] += r.cached_tokens
    return [((b + 0.5) * width, cached[b] / prompt[b] if prompt[b] else None) for b in range(bins)]
