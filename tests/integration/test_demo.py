"""`kvkeeper demo`, the README's first command, end to end on a small swarm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loadgen.demo_report import TARGETS
from tests.helpers.procs import Mark, kill_marked, marked


def test_the_demo_runs_the_three_stacks_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "proxy.cli", "demo", "--users", "4", "--time-scale", "0.05"]
    argv += ["--speed", "20", "--num-blocks", "700", "--tier-blocks", "700", "--rounds", "2"]
    argv += ["--out", str(out)]
    mark = Mark(tmp_path)
    env = {**os.environ, **mark.env()}
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=300, check=False, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        # every simulator, kvkeeper and embedded redis-server it started has stopped with it
        assert marked(mark) == {}
    finally:
        kill_marked(mark)
    # two rounds, the second in a rotated order: each stack once per round
    first, second = TARGETS, TARGETS[1:] + TARGETS[:1]
    for k, names in enumerate((first, second)):
        for j, name in enumerate(names):
            assert f"round {k + 1}/2, run {j + 1}/3: {name}\n" in done.stdout
        assert f"round {k + 1} (run order: {', '.join(names)}): mean TTFT " in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| vLLM")]
    assert len(rows) == 3
    assert "| mean TTFT (median of 2) |" in done.stdout
    assert "kvkeeper vs vLLM: hit rate" in done.stdout
    assert "kvkeeper vs vLLM + LMCache: hit rate" in done.stdout
    assert "kvkeeper ahead of both (hit rate and median mean TTFT): " in done.stdout
    assert " rounds" in done.stdout.split("lowest mean TTFT in ", 1)[1].splitlines()[0]
    # both TTFTs: wall clock, and the engine's part at the profile's speed (the demo runs 20x)
    assert "| mean TTFT, engine time (median of 2) |" in done.stdout
    assert "kvkeeper ahead of both (hit rate and median mean TTFT, engine time): " in done.stdout
    assert "what kvkeeper did: touches" in done.stdout and "tier pins" in done.stdout
    for name in ("report.md", "ttft_cdf.png", "hit_rate.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    vanilla, lmcache, kept = json.loads((out / "summary.json").read_text())
    assert (vanilla["label"], lmcache["label"], kept["label"]) == TARGETS
    # the same workload against each, every call answered; each stack's rounds kept apart too
    assert vanilla["requests"] == lmcache["requests"] == kept["requests"] > 0
    for k in (1, 2):
        for i in range(3):
            assert (out / f"round{k}" / f"{i}.json").is_file()
    assert vanilla["errors"] == lmcache["errors"] == kept["errors"] == 0
    for s in (vanilla, lmcache, kept):
        assert s["ttft_engine_time"]["mean"] > s["ttft"]["mean"]
    # kvkeeper's own metrics were read (it ran on its defaults: the tier found, the engine's
    # scheduling policy read) and its full hints were applied: finished sessions evicted
    assert vanilla["retention_prompt_tokens"] is None and kept["retention_prompt_tokens"] >= 0
    assert vanilla["manage"] == {} and kept["manage"].get("evict:applied", 0) > 0
    metrics = (out / "logs" / "kvkeeper-metrics.txt").read_text()
    assert "kvkeeper_retention_guard_backed_off" in metrics
    slack = [
        ln for ln in metrics.splitlines() if ln.startswith("kvkeeper_admission_slack_seconds_count")
    ]
    assert slack and float(slack[0].split()[-1]) > 0  # priorities stamped: detected, not configured


def test_demo_real_without_the_engine_venvs_says_how_to_set_them_up(tmp_path: Path) -> None:
    env = {**os.environ, "KVKEEPER_HOME": str(tmp_path / "empty")}
    argv = [sys.executable, "-m", "proxy.cli", "demo", "--real", "--out", str(tmp_path / "o")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no vLLM CPU engine venv" in done.stdout
    assert "bash deploy/local/engine-setup.sh" in done.stdout
    assert "bash deploy/local/lmcache-install.sh" in done.stdout
    assert not (tmp_path / "empty").exists()  # nothing installed or started
