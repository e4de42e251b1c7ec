"""``scripts/bench_defaults.py``'s settings and summary (``loadgen/defaults_bench.py``).

The summary is read from ``data/defaults_bench.json`` (a results directory, file path to
text), trimmed from real ``bench compare`` output
(the fields the summary reads; run files keep only their start and duration): ``fanout/`` from
``python scripts/bench_defaults.py --only fanout --rounds 2 -- --set jobs=2 --set workers=2
--time-scale 0.2`` (pinned, with its ``pinned.log``), ``swarm/r1/`` from a swarm invocation
with ``--repeats 2`` (section 1's swarm command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.bench_cli import workload_from_args
from loadgen.bench_compare import CompareSpec
from loadgen.compare_cli import spec_from_args
from loadgen.defaults_bench import (
    DEFAULT_TARGETS,
    SETTINGS,
    _run_window,
    bench_args,
    render_markdown,
    round_figures,
    round_verdict,
    setting_order,
    summarize_setting,
    write_summary,
)
from loadgen.workloads.base import Workload
from proxy.cli import build_parser

FIXTURE = Path(__file__).parent / "data" / "defaults_bench.json"
REPO = Path(__file__).resolve().parents[2]


def _spec(name: str, round_no: int = 1) -> tuple[CompareSpec, Workload]:
    args = build_parser().parse_args(
        ["bench", "compare", *bench_args(SETTINGS[name], DEFAULT_TARGETS, round_no), "--out", "x"]
    )
    return spec_from_args(args), workload_from_args(args)


def test_settings_are_section_1s_commands() -> None:
    """Every setting parses with the real ``bench compare`` command line into section 1's
    figures: tier size, base, rounds per invocation, end-of-conversation evicts."""
    cpu_blocks = {"traces-a": 4614, "traces-b": 2987, "traces-c": 2236, "swarm": 1057,
                  "fanout": 1102, "mooncake-w1": 716, "mooncake-w2": 746}  # fmt: skip
    assert list(SETTINGS) == list(cpu_blocks)
    for name, blocks in cpu_blocks.items():
        spec, workload = _spec(name)
        assert workload.n_calls() > 0
        assert spec.sim.cpu_blocks == blocks, name
        assert spec.base == "engine-notier"
        assert spec.targets == DEFAULT_TARGETS
        mooncake = name.startswith("mooncake")
        assert spec.repeats == (2 if mooncake else 1)
        assert spec.hints.end_evict is not mooncake
    _, trace_c = _spec("traces-c")
    assert trace_c.params["files"].split(",")[:2] == ["trace_0017", "trace_0035"]
    assert trace_c.params["max_requests"] == 10
    _, w1 = _spec("mooncake-w1")
    _, w2 = _spec("mooncake-w2")
    assert w1.params["start"] == 0 and w2.params["start"] == 600
    assert (w1.n_calls(), w2.n_calls()) == (523, 536)


def test_rounds_alternate_settings_and_targets() -> None:
    swarm = SETTINGS["swarm"]
    assert bench_args(swarm, DEFAULT_TARGETS, 1)[-1] == "engine-notier,engine,default"
    assert bench_args(swarm, DEFAULT_TARGETS, 2)[-1] == "engine-notier,default,engine"
    # extra arguments come last, so a later --set or --time-scale wins
    assert bench_args(swarm, DEFAULT_TARGETS, 1, ["--set", "users=2"])[-2:] == ["--set", "users=2"]
    assert setting_order(["a", "b", "c"], 1) == ["a", "b", "c"]
    assert setting_order(["a", "b", "c"], 2) == ["c", "b", "a"]


@pytest.fixture
def results(tmp_path: Path) -> Iterator[Path]:
    """The fixture as a results directory; the load log's clock is the local one of the machine
    that wrote it (UTC)."""
    for rel, text in json.loads(FIXTURE.read_text()).items():
        (tmp_path / "res" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "res" / rel).write_text(text)
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield tmp_path / "res"
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


def test_summary_of_real_runs(results: Path) -> None:
    (results / "fanout" / "r1" / "commit").write_text("24131b4\n")  # as bench_defaults.py does
    swarm, fanout = write_summary(results)
    assert (swarm.name, fanout.name) == ("swarm", "fanout")  # section 1's order

    # fanout, 2 rounds at --set jobs=2: the defaults 35% below vanilla, 14% above plain LMCache
    # at the same hit rate; plain LMCache against vanilla moved 0.05% between rounds
    assert [r.label for r in fanout.rounds] == ["1", "2"]
    r1 = fanout.rounds[0]
    assert r1.hit_vs_vanilla_pp == pytest.approx(39.636, abs=1e-3)
    assert r1.hit_vs_lmcache_pp == pytest.approx(0.0)
    assert r1.vs_vanilla["mean"] == pytest.approx(0.65452, abs=1e-5)
    assert r1.vs_vanilla["p90_et"] == pytest.approx(0.67699, abs=1e-5)
    assert r1.vs_lmcache["mean"] == pytest.approx(1.13959, abs=1e-5)
    assert r1.lmcache_vs_vanilla["mean"] == pytest.approx(0.57434, abs=1e-5)
    assert fanout.noise == pytest.approx(0.57434 - 0.57385, abs=1e-5)
    # mean of pinned.log's 5 s samples inside each target's run
    assert r1.load == pytest.approx({"engine-notier": 0.345, "engine": 0.29, "default": 0.34})
    assert fanout.verdict["engine-notier"] == {"ahead": 2, "behind": 0, "within": 0, "rounds": 2}
    assert fanout.verdict["engine"] == {"ahead": 0, "behind": 2, "within": 0, "rounds": 2}

    # swarm, one invocation with --repeats 2: rounds 1.1 and 1.2; plain LMCache against vanilla
    # +9.1% then -11.8%, so 20.9% is noise and only one round each is ahead beyond it
    assert [r.label for r in swarm.rounds] == ["1.1", "1.2"]
    assert [r.lmcache_vs_vanilla["mean"] for r in swarm.rounds] == pytest.approx(
        [1.09138, 0.88236], abs=1e-5
    )
    assert swarm.noise == pytest.approx(0.20902, abs=1e-5)
    # p90 has its own noise: plain LMCache's p90 against vanilla +11.3% then -33.3%
    assert swarm.noise_p90 == pytest.approx(1.11343 - 0.66689, abs=1e-5)
    assert [r.vs_vanilla["mean"] for r in swarm.rounds] == pytest.approx(
        [0.81888, 0.76745], abs=1e-5
    )
    assert swarm.verdict["engine-notier"] == {"ahead": 1, "behind": 0, "within": 1, "rounds": 2}
    assert swarm.verdict["engine"] == {"ahead": 1, "behind": 0, "within": 1, "rounds": 2}
    assert swarm.rounds[0].retention_recomputed == pytest.approx(0.009964, abs=1e-6)
    assert swarm.rounds[0].load == {}  # no pinned.log

    assert (r1.utc, r1.commit) == ("16:37-16:38", "24131b4")
    assert r1.sim_lag == 0.0

    md = (results / "summary.md").read_text()
    assert "| fan-out (2) | 0.3-0.3, 0.4-0.5 | 0.0%, 0.0% | +39.6; +0.0, +39.6; +0.0 " in md
    assert "- fanout: 1 (16:37-16:38, 24131b4); 2 (16:38-16:39)" in md
    assert "- swarm: 1.1 (-); 1.2 (-)" in md  # the trimmed swarm runs kept no run files
    assert "kvkeeper bench compare --workload fanout --set jobs=8 --profile h100-llama8b" in md
    assert "**+14.0 / +13.4**, **+13.7 / +13.4**" in md  # behind plain LMCache: bold
    assert "vs vanilla: ahead 1, behind 0 of 2; vs plain LMCache: ahead 1, behind 0 of 2 " in md
    doc = json.loads((results / "summary.json").read_text())
    assert [s["name"] for s in doc["settings"]] == ["swarm", "fanout"]
    assert doc["settings"][1]["rounds"][1]["vs_lmcache"]["mean"] == pytest.approx(1.13712, 1e-4)
    assert (results / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gap_to_the_belady_engine(results: Path) -> None:
    """(defaults - vanilla hit) / (engine-belady - vanilla hit), where that target ran, beside
    the gap to the realized Belady ceiling that ``bench compare`` measured."""
    doc = json.loads((results / "fanout" / "r1" / "compare.json").read_text())
    targets = doc["targets"]
    targets["engine-belady"] = {**targets["engine-notier"], "hit_rate": 0.6}
    targets["default"]["gap_closed"] = 0.734
    vanilla, mine = targets["engine-notier"]["hit_rate"], targets["default"]["hit_rate"]
    fig = round_figures(doc, "1", results / "missing")
    assert fig.gap_to_belady_engine == pytest.approx((mine - vanilla) / (0.6 - vanilla))
    assert fig.gap_closed == 0.734
    assert fig.load == {}
    row = render_markdown([summarize_setting("fanout", [fig])]).splitlines()[6]
    assert f"| 73% [{100 * fig.gap_to_belady_engine:.0f}%] |" in row


@pytest.mark.parametrize(
    ("ratios", "noise", "verdict"),
    [
        ({"mean": 0.85, "p90": 0.9}, 0.1, "ahead"),
        ({"mean": 0.95, "p90": 0.9}, 0.1, "within"),
        ({"mean": 0.85, "p90": 1.15}, 0.1, "behind"),  # a lower mean does not excuse the p90
        ({"mean": 1.11, "p90": 1.0}, 0.1, "behind"),
        ({"mean": 1.01}, 0.0, "behind"),
        ({}, 0.1, None),
    ],
)
def test_round_verdict(ratios: dict[str, float], noise: float, verdict: str | None) -> None:
    assert round_verdict(ratios, noise) == verdict


def test_p90_is_judged_against_its_own_noise() -> None:
    """p90 moves more than the mean between rounds; its own measured noise judges it."""
    assert round_verdict({"mean": 0.8, "p90": 1.08}, 0.05, 0.1) == "ahead"
    assert round_verdict({"mean": 0.8, "p90": 1.12}, 0.05, 0.1) == "behind"
    assert round_verdict({"mean": 0.8, "p90": 1.08}, 0.05) == "behind"  # the mean's noise


def test_script_summarizes_and_refuses_bad_settings(results: Path) -> None:
    script = str(REPO / "scripts" / "bench_defaults.py")
    done = subprocess.run(
        [sys.executable, script, "--summarize", str(results)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| swarm (2) |" in done.stdout
    assert (results / "summary.png").exists()
    bad = subprocess.run(
        [sys.executable, script, "--out", str(results), "--only", "traces-d"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "unknown setting(s) traces-d" in bad.stderr


def test_run_window_past_the_head_of_a_run_file(tmp_path: Path) -> None:
    """A run file whose start lies past the 64 KB read first (large params) is read whole."""
    run = {"workload": "trace", "params": {"files": "x" * 70_000}, "started_at": 1796488667.5,
           "duration": 12.25, "requests": []}  # fmt: skip
    (tmp_path / "engine.json").write_text(json.dumps(run, indent=1))
    assert _run_window(tmp_path / "engine.json") == (1796488667.5, 12.25)
    assert _run_window(tmp_path / "missing.json") is None
