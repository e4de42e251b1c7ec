"""``kvkeeper demo --real`` end to end: the three stacks on the real vLLM-on-CPU + LMCache MP
stack, on a small swarm (one user, tool pauses x0.2), one round.

The command starts its own LMCache stack and two engines, so this module overrides the suite's
autouse ``_clean_prefix_cache`` (which would start the shared plain engine for nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.demo_report import TARGETS
from loadgen.realstack import missing

pytestmark = [pytest.mark.realengine, pytest.mark.lmcache]
# two eager engines start side by side (under a minute at load 6), then three short plays
TIMEOUT = 720


@pytest.fixture(autouse=True)
def _clean_prefix_cache() -> None:
    """No shared engine here: the demo starts (and stops) its own."""


def test_demo_real_plays_the_three_stacks_on_the_real_engine(tmp_path: Path) -> None:
    gap = missing()
    if gap is not None:
        pytest.skip(f"{gap}: run deploy/local/engine-setup.sh and deploy/local/lmcache-install.sh")
    out = tmp_path / "demo-real"
    argv = [sys.executable, "-m", "proxy.cli", "demo", "--real", "--users", "1"]
    argv += ["--time-scale", "0.2", "--l1-gb", "0.5", "--out", str(out)]
    argv += ["--eager"]  # no torch.compile at start-up: the plays are what this test checks
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the demo stops its engines and LMCache stack on SIGTERM
        stdout, stderr = proc.communicate(timeout=180)
        pytest.fail(f"demo --real took over {TIMEOUT}s:\n{stdout[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    for j, name in enumerate(TARGETS):
        assert f"run {j + 1}/3: {name}" in stdout
    assert "vLLM (plain) ready" in stdout and "vLLM (LMCache) ready" in stdout
    rows = [line for line in stdout.splitlines() if line.startswith("| vLLM")]
    assert [r.split(" | ")[0] for r in rows] == [f"| {t}" for t in TARGETS]
    assert "kvkeeper vs vLLM + LMCache: hit rate" in stdout
    assert "what kvkeeper did: touches" in stdout
    for name in ("report.md", "ttft_cdf.png", "hit_rate.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "hit_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    vanilla, lmcache, kept = json.loads((out / "summary.json").read_text())
    assert (vanilla["label"], lmcache["label"], kept["label"]) == TARGETS
    # the same swarm against each stack, every call answered by the real engine
    assert vanilla["requests"] == lmcache["requests"] == kept["requests"] > 0
    assert vanilla["errors"] == lmcache["errors"] == kept["errors"] == 0
    # the anchors are shared across sessions: every stack found some prompt tokens cached
    assert min(s["hit_rate"] for s in (vanilla, lmcache, kept)) > 0
    # kvkeeper was in the path of the third only: its counters were read and its hints applied
    assert vanilla["retention_prompt_tokens"] is None
    assert kept["retention_prompt_tokens"] is not None
    assert kept["manage"].get("evict:applied", 0) > 0
