"""PNG plots of several runs: TTFT CDF and prefix-cache hit rate over time (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt

from loadgen.metrics import hit_rate_over_time, ok_requests
from loadgen.records import RunResult


def ttft_cdf(results: Sequence[RunResult], path: Path) -> Path:
    """One CDF curve of client-side TTFT per run (log x axis)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        values = sorted(r.ttft for r in ok_requests(res) if r.ttft is not None)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=res.label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("Time to first token (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def hit_rate_timeline(results: Sequence[RunResult], path: Path, bins: int = 20) -> Path:
    """Token-weighted prefix-cache hit rate per time bin, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        series = [(t, rate) for t, rate in hit_rate_over_time(res, bins) if rate is not None]
        if series:
            ax.plot([t for t, _ in series], [100 * r for _, r in series], marker=".",
                    label=res.label)  # fmt: skip
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def ratio_points(
    settings: Sequence[tuple[str, Sequence[float | None], Sequence[float | None], float | None]],
    path: Path,
) -> Path:
    """Per setting ``(name, ratios against vanilla, against plain LMCache, noise)``: each
    round's ratio as a point, the two baselines side by side, a line at 1.0 and the noise band
    (1 +- noise) shaded behind each setting."""
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(settings) + 2), 4.5))
    for label, second, dx, marker in (
        ("against vanilla vLLM", False, -0.15, "o"),
        ("against plain LMCache", True, 0.15, "s"),
    ):
        xs: list[float] = []
        ys: list[float] = []
        for i, (_name, vanilla, lmcache, _noise) in enumerate(settings):
            ratios = [r for r in (lmcache if second else vanilla) if r is not None]
            xs += [i + dx] * len(ratios)
            ys += ratios
        ax.scatter(xs, ys, marker=marker, label=label, alpha=0.8)
    for i, (_name, _v, _l, noise) in enumerate(settings):
        if noise:
            ax.fill_between([i - 0.35, i + 0.35], 1 - noise, 1 + noise, color="0.85", zorder=0)
    ax.axhline(1.0, color="0.3", linewidth=1)
    ax.set_xticks(range(len(settings)), [s[0] for s in settings], rotation=20, ha="right")
    ax.set_ylabel("defaults' mean TTFT / baseline's")
    ax.set_title("kvkeeper's defaults per round (below 1: faster; grey: noise)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
