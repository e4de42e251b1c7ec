"""Render several runs as one Markdown report with PNG plots.

``render_report([RunResult, ...], out_dir)`` writes ``report.md``, ``summary.json`` (the
:func:`~loadgen.metrics.summarize` dicts), ``ttft_cdf.png`` and ``hit_rate.png``; returns the path
of ``report.md``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.metrics import summarize
from loadgen.records import RunResult

# (column title, summary key path, format)
_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("run", ("label",), "{}"),
    ("hints", ("hints",), "{}"),
    ("requests", ("requests",), "{}"),
    ("errors", ("errors",), "{}"),
    ("hit rate", ("hit_rate",), "pct"),
    ("recomputed prompt tok", ("recomputed_prompt_tokens",), "{:,}"),
    ("TTFT mean", ("ttft", "mean"), "s"),
    ("TTFT p50", ("ttft", "p50"), "s"),
    ("TTFT p90", ("ttft", "p90"), "s"),
    ("TTFT p99", ("ttft", "p99"), "s"),
    ("engine-time TTFT mean", ("ttft_engine_time", "mean"), "s"),
    ("engine-time TTFT p90", ("ttft_engine_time", "p90"), "s"),
    ("turn latency mean", ("turn_latency", "mean"), "s"),
    ("job completion mean", ("job_completion", "mean"), "s"),
    ("req/s", ("throughput_rps",), "{:.2f}"),
    ("tok/s", ("throughput_tokens_s",), "{:,.0f}"),
    ("retention recomputed tok", ("retention_recomputed_tokens",), "{:,.0f}"),
)


def _cell(summary: dict[str, Any], keys: tuple[str, ...], fmt: str) -> str:
    value: Any = summary
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        return "-"
    if fmt == "pct":
        return f"{100 * value:.1f}%"
    if fmt == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    return fmt.format(value)


def markdown_table(summaries: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(title for title, _, _ in _COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    for s in summaries:
        lines.append("| " + " | ".join(_cell(s, k, f) for _, k, f in _COLUMNS) + " |")
    return "\n".join(lines)


def render_report(results: Sequence[RunResult], out_dir: str | Path) -> Path:
    """Write the report for ``results`` into ``out_dir``."""
    from loadgen import plots  # matplotlib is imported only when a report is drawn

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in results]
    (out / "summary.json").write_text(json.dumps(summaries, indent=1))
    plots.ttft_cdf(results, out / "ttft_cdf.png")
    plots.hit_rate_timeline(results, out / "hit_rate.png")
    body = [
        "# kvkeeper benchmark report",
        "",
        markdown_table(summaries),
        "",
        "Hit rate: cached / prompt tokens from `usage` (token-weighted). Retention recomputed: "
        "prompt tokens kvkeeper's touches and warm-ups made the engine recompute (from its "
        "`/metrics`; `-` when the target was not kvkeeper).",
        "",
        *_manage_lines(summaries),
        "![TTFT CDF](ttft_cdf.png)",
        "",
        "![hit rate over time](hit_rate.png)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(body))
    return path


def _manage_lines(summaries: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for s in summaries:
        if s["manage"]:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(s["manage"].items()))
            lines.append(f"- {s['label']}: management requests: {counts}")
    return [*lines, ""] if lines else []
