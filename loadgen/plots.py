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


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
