"""`kvkeeper demo`, the README's first command, end to end on a small swarm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_demo_runs_both_targets_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "proxy.cli", "demo", "--users", "3", "--time-scale", "0.05"]
    argv += ["--speed", "30", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run 1/2 straight to the engine" in done.stdout
    assert "run 2/2 through kvkeeper" in done.stdout
    assert "console (live while this run lasts): http://127.0.0.1:" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| direct", "| kvk"))]
    assert len(rows) == 2 and "kvkeeper vs direct: hit rate" in done.stdout
    for name in ("report.md", "ttft_cdf.png", "hit_rate.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    direct, kept = json.loads((out / "summary.json").read_text())
    assert (direct["label"], kept["label"]) == ("direct", "kvkeeper")
    assert direct["requests"] == kept["requests"] > 0  # the same workload, every call answered
    assert direct["errors"] == kept["errors"] == 0
    # kvkeeper's own metrics were read (touches happen only under pressure, which a 3-user swarm
    # on a fast simulator may not reach), and its full hints were applied: finished sessions evicted
    assert direct["retention_prompt_tokens"] is None and kept["retention_prompt_tokens"] >= 0
    assert direct["manage"] == {} and kept["manage"].get("evict:applied", 0) > 0
