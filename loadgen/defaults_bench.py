"""kvkeeper's defaults against vanilla vLLM and plain LMCache on the simulator: the settings of
BENCHMARKS.md section 1 and the summary of their rounds (``scripts/bench_defaults.py`` runs them).

A results directory holds ``<setting>/r<k>/``, each the ``--out`` of one ``bench compare``
(with ``pinned.log``, the load average every 5 s, beside it); a setting run with ``--repeats``
(Mooncake) has its rounds in ``r<k>/round<j>/``, shown as round ``k.j``. :func:`write_summary`
reads them and writes ``summary.md``, ``summary.json`` and ``summary.png``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VANILLA = "engine-notier"  # vLLM without a tier, the base of every bench figure
LMCACHE = "engine"  # vLLM + plain LMCache (the tier as large as the pool), no kvkeeper
DEFAULTS = "default"  # kvkeeper on its defaults, with the same tier
BELADY = "engine-belady"  # vLLM evicting by Belady's rule, no tier
DEFAULT_TARGETS = (VANILLA, LMCACHE, DEFAULTS)

# disjoint Claude Code trace subsets, none of them the 16 older tuning used (gains.md)
TRACE_SUBSETS = {
    "a": (4, 20, 50, 237, 282, 353, 514, 603, 680, 738),
    "b": (14, 30, 176, 256, 295, 363, 558, 635, 696),
    "c": (17, 35, 218, 276, 326, 497, 594, 673, 703),
}


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    title: str
    args: tuple[str, ...]  # bench compare's arguments, less --targets, --base and --out


def _trace(subset: str, cpu_blocks: int) -> Setting:
    files = ",".join(f"trace_{n:04d}" for n in TRACE_SUBSETS[subset])
    args = f"--workload trace --set files={files} --set max_requests=10 --set max_think=60 "
    args += "--profile h100-llama8b --speed 10 --time-scale 0.1 --max-sessions 16 "
    args += f"--pool-frac 0.5 --cpu-blocks {cpu_blocks}"
    return Setting(f"traces-{subset}", f"traces {subset.upper()}", tuple(args.split()))


def _mooncake(window: int, cpu_blocks: int) -> Setting:
    start = "" if window == 1 else "--set start=600 "
    args = f"--workload mooncake --set duration=600 {start}--set every=4 --set scale=0.25 "
    args += "--profile h100-llama8b --speed 1 --time-scale 0.2 --pool-frac 0.5 "
    # two rounds per invocation, the second in rotated order; no end-of-conversation evict,
    # which no real client of this trace could send
    args += f"--cpu-blocks {cpu_blocks} --repeats 2 --no-end-evict"
    return Setting(f"mooncake-w{window}", f"Mooncake window {window}", tuple(args.split()))


_SIM2 = "--profile h100-llama8b --speed 2 --time-scale 0.5 --pool-frac 0.5"
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        _trace("a", 4614),
        _trace("b", 2987),
        _trace("c", 2236),
        Setting("swarm", "swarm", tuple(f"--workload swarm {_SIM2} --cpu-blocks 1057".split())),
        Setting(
            "fanout",
            "fan-out",
            tuple(f"--workload fanout --set jobs=8 {_SIM2} --cpu-blocks 1102".split()),
        ),
        _mooncake(1, 716),
        _mooncake(2, 746),
    )
}


def bench_args(
    setting: Setting, targets: Sequence[str], round_no: int, extra: Sequence[str] = ()
) -> list[str]:
    """The ``bench compare`` arguments of ``setting``'s round ``round_no`` (from 1), less
    ``--out``. Even rounds play the targets after the first in reverse, as ``--repeats`` does,
    so drift within a round hits them alike. ``extra`` comes last (a later ``--set`` wins)."""
    order = list(targets) if round_no % 2 else [*targets[:1], *reversed(targets[1:])]
    return [*setting.args, "--base", VANILLA, "--targets", ",".join(order), *extra]


def setting_order(names: Sequence[str], round_no: int) -> list[str]:
    """Odd rounds play the settings as given, even rounds in reverse: no setting always runs in
    the same minute of a session."""
    return list(names) if round_no % 2 else list(reversed(names))


# --- the summary ---------------------------------------------------------------------------------
@dataclass(slots=True)
class RoundFigures:
    """The defaults in one round, against vanilla and plain LMCache. Ratios: defaults' TTFT over
    the baseline's (0.8: 20% lower); hit rates in percentage points; shares of prompt tokens."""

    label: str
    path: str
    hit_vs_vanilla_pp: float | None = None
    hit_vs_lmcache_pp: float | None = None
    vs_vanilla: dict[str, float] = field(default_factory=dict)  # mean, p90, mean_et, p90_et
    vs_lmcache: dict[str, float] = field(default_factory=dict)
    lmcache_vs_vanilla: dict[str, float] = field(default_factory=dict)
    gap_to_belady_engine: float | None = None
    gap_closed: float | None = None  # to the realized Belady ceiling (compare.json's gap_closed)
    retention_recomputed: float | None = None
    sim_lag: float | None = None  # the defaults' simulator behind its modelled clock (share)
    load: dict[str, float] = field(default_factory=dict)  # mean 1-min load per target's run
    errors: int = 0
    utc: str | None = None  # first target's start to last one's end, HH:MM-HH:MM
    commit: str | None = None  # the code it ran (``commit`` beside the round, when written)


@dataclass(slots=True)
class SettingSummary:
    name: str
    title: str
    rounds: list[RoundFigures]
    noise: float | None  # a mean-TTFT ratio within 1 +- noise says nothing
    noise_p90: float | None  # the same for p90 TTFT
    noise_rule: str
    verdict: dict[str, dict[str, int]]  # baseline -> ahead / behind / within / rounds


def _ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """TTFT ratios (mean, p90; ``_et``: engine time) of two targets' entries in compare.json."""
    out: dict[str, float] = {}
    for key, suffix in (("ttft", ""), ("ttft_engine_time", "_et")):
        a, b = mine.get(key) or {}, theirs.get(key) or {}
        for stat in ("mean", "p90"):
            if a.get(stat) is not None and b.get(stat):
                out[stat + suffix] = a[stat] / b[stat]
    return out


def round_figures(doc: dict[str, Any], label: str, path: Path) -> RoundFigures:
    """The figures of one round's ``compare.json`` (and its targets' load, from ``pinned.log``
    and the targets' run files beside it or one directory up)."""
    fig = RoundFigures(label, str(path))
    targets = {k: v for k, v in doc["targets"].items() if "skipped" not in v}
    mine, vanilla = targets.get(DEFAULTS), targets.get(VANILLA)
    lmcache, belady = targets.get(LMCACHE), targets.get(BELADY)
    fig.errors = sum(int(t.get("errors", 0)) for t in targets.values())
    windows = {n: w for n in targets if (w := _run_window(path / f"{n}.json")) is not None}
    fig.load = _target_loads(path, windows)
    if windows:
        start = min(t0 for t0, _ in windows.values())
        end = max(t0 + d for t0, d in windows.values())
        fig.utc = f"{time.strftime('%H:%M', time.gmtime(start))}-"
        fig.utc += time.strftime("%H:%M", time.gmtime(end))
    commit = next((p for p in (path / "commit", path.parent / "commit") if p.exists()), None)
    fig.commit = commit.read_text().strip() if commit else None
    if mine is None:
        return fig
    fig.retention_recomputed = mine.get("retention_recomputed_share")
    fig.gap_closed = mine.get("gap_closed")
    fig.sim_lag = (mine.get("engine") or {}).get("sim_lag")
    if vanilla is not None:
        fig.hit_vs_vanilla_pp = 100 * (mine["hit_rate"] - vanilla["hit_rate"])
        fig.vs_vanilla = _ratios(mine, vanilla)
        if belady is not None and belady["hit_rate"] > vanilla["hit_rate"]:
            gap = belady["hit_rate"] - vanilla["hit_rate"]
            fig.gap_to_belady_engine = (mine["hit_rate"] - vanilla["hit_rate"]) / gap
    if lmcache is not None:
        fig.hit_vs_lmcache_pp = 100 * (mine["hit_rate"] - lmcache["hit_rate"])
        fig.vs_lmcache = _ratios(mine, lmcache)
        if vanilla is not None:
            fig.lmcache_vs_vanilla = _ratios(lmcache, vanilla)
    return fig


_LOAD_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) load ([0-9.]+)$")
_RUN_TIMES = re.compile(r'"started_at": ([0-9.e+]+),\s*"duration": ([0-9.e+]+)')


def _load_samples(log: Path) -> list[tuple[int, float]]:
    """``(seconds of the local day, 1-min load)`` from a ``pinned.log``."""
    out: list[tuple[int, float]] = []
    for line in log.read_text().splitlines():
        if m := _LOAD_LINE.match(line):
            h, mi, s, load = m.groups()
            out.append((3600 * int(h) + 60 * int(mi) + int(s), float(load)))
    return out


def _run_window(path: Path) -> tuple[float, float] | None:
    """(unix start, duration) of a target's run file (read from its head: the file is large)."""
    try:
        with path.open() as f:
            head = f.read(65536)
    except OSError:
        return None
    if m := _RUN_TIMES.search(head):
        return float(m.group(1)), float(m.group(2))
    try:  # not near the top: read it all
        doc = json.loads(path.read_text())
        return float(doc["started_at"]), float(doc["duration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _target_loads(round_dir: Path, windows: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean 1-minute load average while each target ran (``pinned.log``'s 5 s samples);
    ``windows``: each target's (unix start, duration)."""
    log = next((p for p in (round_dir / "pinned.log", round_dir.parent / "pinned.log")
                if p.exists()), None)  # fmt: skip
    if log is None:
        return {}
    samples = _load_samples(log)
    out: dict[str, float] = {}
    for name, (start, duration) in windows.items():
        t = time.localtime(start)
        day0 = start - (3600 * t.tm_hour + 60 * t.tm_min + t.tm_sec)  # the log's clock is local
        inside = []
        for sec, load in samples:
            at = day0 + sec
            at += 86400 if at < start - 43200 else 0  # past midnight
            if start <= at <= start + duration:
                inside.append(load)
        if inside:
            out[name] = sum(inside) / len(inside)
    return out


def setting_rounds(setting_dir: Path) -> list[RoundFigures]:
    """Every round of a setting directory (``r<k>/``, or ``r<k>/round<j>/`` for ``--repeats``)."""
    out: list[RoundFigures] = []
    for rdir in sorted(setting_dir.glob("r*/"), key=_number):
        path = rdir / "compare.json"
        if not re.fullmatch(r"r\d+", rdir.name) or not path.exists():
            continue
        doc = json.loads(path.read_text())
        k = rdir.name[1:]
        if "repeats" not in doc:
            out.append(round_figures(doc, k, rdir))
            continue
        for inner in doc["rounds"]:
            sub = rdir / inner
            if (sub / "compare.json").exists():
                figs = round_figures(json.loads((sub / "compare.json").read_text()), "", sub)
                figs.label = f"{k}.{inner.removeprefix('round')}"
                out.append(figs)
    return out


def _number(p: Path) -> int:
    digits = p.name.lstrip("r")
    return int(digits) if digits.isdigit() else 1 << 30


NOISE_RULE = (
    "noise, for mean and p90 each: the range (max - min) over the setting's rounds of plain "
    "LMCache's TTFT over "
    "vanilla's (a pair kvkeeper does not touch); with one round, |that ratio - 1|"
)


def measured_noise(rounds: Sequence[RoundFigures], stat: str = "mean") -> float | None:
    values = [r.lmcache_vs_vanilla[stat] for r in rounds if stat in r.lmcache_vs_vanilla]
    if not values:
        return None
    return max(values) - min(values) if len(values) > 1 else abs(values[0] - 1)


def round_verdict(
    ratios: dict[str, float], noise: float, noise_p90: float | None = None
) -> str | None:
    """``ahead`` (mean TTFT below 1 - noise, p90 not above 1 + its noise), ``behind`` (mean or
    p90 above 1 + its noise) or ``within`` (noise), on wall-clock TTFT; None without figures.
    ``noise_p90`` defaults to ``noise``."""
    if "mean" not in ratios:
        return None
    mean, p90 = ratios["mean"], ratios.get("p90", ratios["mean"])
    if mean > 1 + noise or p90 > 1 + (noise if noise_p90 is None else noise_p90):
        return "behind"
    if mean < 1 - noise:
        return "ahead"
    return "within"


def summarize_setting(name: str, rounds: list[RoundFigures]) -> SettingSummary:
    noise, noise_p90 = measured_noise(rounds), measured_noise(rounds, "p90")
    verdict: dict[str, dict[str, int]] = {}
    for base, attr in ((VANILLA, "vs_vanilla"), (LMCACHE, "vs_lmcache")):
        counts = {"ahead": 0, "behind": 0, "within": 0, "rounds": 0}
        for r in rounds:
            v = round_verdict(getattr(r, attr), noise or 0.0, noise_p90)
            if v is not None:
                counts[v] += 1
                counts["rounds"] += 1
        if counts["rounds"]:
            verdict[base] = counts
    title = SETTINGS[name].title if name in SETTINGS else name
    return SettingSummary(name, title, rounds, noise, noise_p90, NOISE_RULE, verdict)


def summarize(root: Path) -> list[SettingSummary]:
    """Every setting under ``root`` with rounds: section 1's order, then others by name."""
    dirs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    known = [root / n for n in SETTINGS if (root / n) in dirs]
    others = sorted(p for p in dirs if p.name not in SETTINGS)
    out = []
    for d in [*known, *others]:
        rounds = setting_rounds(d)
        if rounds:
            out.append(summarize_setting(d.name, rounds))
    return out


# --- rendering -----------------------------------------------------------------------------------
def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * (ratio - 1):+.1f}"


def _pair(r: dict[str, float], stat: str, noise: float | None) -> str:
    """``wall / engine time`` change in percent; bold when the wall figure is behind beyond
    noise."""
    wall = r.get(stat)
    text = f"{_pct(wall)} / {_pct(r.get(stat + '_et'))}"
    behind = wall is not None and noise is not None and wall > 1 + noise
    return f"**{text}**" if behind else text


def _cells(values: Sequence[str]) -> str:
    return ", ".join(values) if values else "-"


def _verdict_cell(s: SettingSummary) -> str:
    parts = []
    for base, label in ((VANILLA, "vanilla"), (LMCACHE, "plain LMCache")):
        if (v := s.verdict.get(base)) is not None:
            parts.append(f"vs {label}: ahead {v['ahead']}, behind {v['behind']} of {v['rounds']}")
    noise = "/".join("-" if n is None else f"{100 * n:.1f}%" for n in (s.noise, s.noise_p90))
    return "; ".join(parts) + f" (noise mean/p90 {noise})"


def render_markdown(settings: Sequence[SettingSummary]) -> str:
    lines = [
        "# kvkeeper's defaults against vanilla vLLM and plain LMCache",
        "",
        f"Defaults (`{DEFAULTS}`) against vanilla (`{VANILLA}`, no tier) and plain LMCache "
        f"(`{LMCACHE}`, the tier, no kvkeeper); one cell per round, in round order. TTFT: change "
        "in percent, wall clock / engine time (bold: behind beyond noise at wall clock). Hit rate "
        "in percentage points. Load: mean 1-minute load average while each target ran, lowest-"
        "highest over the round's targets. Sim lag: how far the defaults' simulator ran behind "
        "its modelled clock. Retention: recomputed share of the workload's prompt tokens. Gap "
        "closed: (defaults - vanilla hit) / (Belady - vanilla hit), to the realized Belady ceiling "
        "of vanilla's sends (`bench compare`'s gap closed) and, in brackets, to the `engine-belady` "
        "target where it ran. Verdict on wall-clock TTFT: ahead = mean below 1 - noise "
        f"and p90 not above 1 + its noise; behind = mean or p90 above 1 + its noise; {NOISE_RULE}.",
        "",
        "| setting (rounds) | load | sim lag | hit vs vanilla; vs plain LMCache (pp) "
        "| mean TTFT vs vanilla | p90 TTFT vs vanilla | mean TTFT vs plain LMCache "
        "| p90 TTFT vs plain LMCache | plain LMCache mean vs vanilla | gap to Belady closed "
        "| retention recomputed | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in settings:
        rs = s.rounds
        loads = [
            f"{min(r.load.values()):.1f}-{max(r.load.values()):.1f}" if r.load else "-" for r in rs
        ]
        hits = [
            f"{_signed(r.hit_vs_vanilla_pp)}; {_signed(r.hit_vs_lmcache_pp)}"
            if r.hit_vs_lmcache_pp is not None
            else _signed(r.hit_vs_vanilla_pp)
            for r in rs
        ]
        gaps = [_gap(r) for r in rs]
        ret = [_share(r.retention_recomputed, "{:.2f}%") for r in rs]
        lag = [_share(r.sim_lag, "{:.1f}%") for r in rs]
        errors = sum(r.errors for r in rs)
        name = f"{s.title} ({len(rs)}{f', {errors} errors' if errors else ''})"
        lines.append(
            f"| {name} | {_cells(loads)} | {_cells(lag)} | {_cells(hits)} "
            f"| {_cells([_pair(r.vs_vanilla, 'mean', s.noise) for r in rs])} "
            f"| {_cells([_pair(r.vs_vanilla, 'p90', s.noise_p90) for r in rs])} "
            f"| {_cells([_pair(r.vs_lmcache, 'mean', s.noise) for r in rs])} "
            f"| {_cells([_pair(r.vs_lmcache, 'p90', s.noise_p90) for r in rs])} "
            f"| {_cells([_pct(r.lmcache_vs_vanilla.get('mean')) for r in rs])} "
            f"| {_cells(gaps)} | {_cells(ret)} | {_verdict_cell(s)} |"
        )
    lines += ["", "Rounds (UTC, code where recorded):", ""]
    for s in settings:
        rounds = [
            f"{r.label} ({', '.join(x for x in (r.utc, r.commit) if x) or '-'})" for r in s.rounds
        ]
        lines.append(f"- {s.name}: {'; '.join(rounds)}")
    lines += ["", "Commands (`python scripts/bench_defaults.py --out DIR` runs them all):", ""]
    for s in settings:
        if s.name in SETTINGS:
            args = " ".join(SETTINGS[s.name].args)
            lines.append(
                f"    kvkeeper bench compare {args} --base {VANILLA} --targets ... --out DIR"
            )
    return "\n".join(lines) + "\n"


def _gap(r: RoundFigures) -> str:
    text = _share(r.gap_closed, "{:.0f}%")
    if r.gap_to_belady_engine is not None:
        text += f" [{100 * r.gap_to_belady_engine:.0f}%]"
    return text


def _share(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(100 * v)


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}"


def write_summary(root: Path) -> list[SettingSummary]:
    """``summary.md``, ``summary.json`` and ``summary.png`` in ``root``; the settings."""
    from loadgen.plots import ratio_points

    settings = summarize(root)
    (root / "summary.md").write_text(render_markdown(settings))
    doc = {"noise_rule": NOISE_RULE, "settings": [asdict(s) for s in settings]}
    (root / "summary.json").write_text(json.dumps(doc, indent=1))
    series = [
        (
            s.title,
            [r.vs_vanilla.get("mean") for r in s.rounds],
            [r.vs_lmcache.get("mean") for r in s.rounds],
            s.noise,
        )
        for s in settings
    ]
    ratio_points(series, root / "summary.png")
    return settings
