"""Markdown tables of a comparison document (one round, or mean and range over rounds)."""

from __future__ import annotations

from typing import Any

ENGINE_TIME_NOTE = (
    "TTFT: wall clock at the client. Engine-time TTFT: the client's TTFT with the engine's own "
    "part (arrival to first token, as the simulator reports it) scaled back to its profile's "
    "speed, TTFT + (speed - 1) x engine time; kvkeeper's, the network's and the client's time "
    "stay at wall time (docs/benchmarks.md). Equal to TTFT at speed 1 or on a real engine."
)


def _pct(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:+.1f}%" if signed else f"{100 * v:.1f}%"


def _sec(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def render_markdown(doc: dict[str, Any]) -> str:
    c = doc["ceilings"]
    planned, realized, admitted = c["planned"], c["realized"], c.get("admitted")
    oracle = any("ttft_mean_vs_belady" in t for t in doc["targets"].values())
    lines = [
        f"### {doc['workload']}: {len(doc['targets'])} targets, pool {planned['C']} blocks "
        f"(peak working set {planned['peak_ws']}"
        + ("; raised to fit the largest request)" if planned.get("raised_to_fit") else ")"),
        "",
        f"Base: `{doc.get('base') or '-'}` (`vs base` and gap closed, to the realized Belady).",
        "",
        "| target | hit rate | gap closed | gap closed (first token) | TTFT mean s | TTFT p90 s "
        "| TTFT mean vs base | "
        + ("TTFT mean vs engine-belady | " if oracle else "")
        + "engine-time TTFT mean s | engine-time TTFT mean vs base "
        "| recomputed prompt tok | retention prompt tok (share) | retention recomputed (share) "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if oracle else ""),
    ]
    for name, t in doc["targets"].items():
        if "skipped" in t:
            lines.append(f"| {name} | skipped: {t['skipped']} |" + " |" * (12 if oracle else 11))
            continue
        engine_time = t.get("ttft_engine_time") or {}
        ret = (
            "-"
            if t["retention_prompt_tokens"] is None
            else (f"{t['retention_prompt_tokens']:,.0f} ({_pct(t['retention_prompt_share'])})")
        )
        rec = (
            "-"
            if t["retention_recomputed_tokens"] is None
            else (
                f"{t['retention_recomputed_tokens']:,.0f} ({_pct(t['retention_recomputed_share'])})"
            )
        )
        lines.append(
            f"| {name} | {_pct(t['hit_rate'])} | {_pct(t['gap_closed'])} | "
            f"{_pct(t.get('gap_closed_first_token'))} | "
            f"{_sec(t['ttft']['mean'])} | {_sec(t['ttft']['p90'])} | "
            f"{_pct(t.get('ttft_mean_vs_base'), signed=True)} | "
            + (f"{_pct(t.get('ttft_mean_vs_belady'), signed=True)} | " if oracle else "")
            + f"{_sec(engine_time.get('mean'))} | "
            f"{_pct(t.get('ttft_engine_time_mean_vs_base'), signed=True)} | "
            f"{t['recomputed_prompt_tokens']:,} | {ret} | {rec} | {t['errors']} |"
        )
    lines += [
        "",
        "| ceiling (same capacity) | LRU | Belady | infinite | no room |",
        "|---|---|---|---|---|",
    ]
    for label, row in (
        ("planned timeline", planned),
        (f"realized ({realized['from']})" if realized else "", realized),
        (
            f"realized, held from the first token ({admitted['from']})" if admitted else "",
            admitted,
        ),
    ):
        if row:
            lines.append(
                f"| {label} | {_pct(row['lru'])} | {_pct(row['belady'])} | {_pct(row['inf'])} | {_pct(row['no_room'])} |"
            )
    lines += [
        "",
        ENGINE_TIME_NOTE,
        "",
        "Gap closed: (hit - base hit) / (realized Belady - base hit); (first token): to the "
        "Belady held from the first token. Held from the first token: each call "
        "holds its blocks from its first token, not from when it was sent (a request waiting "
        "in the engine's queue holds none). Retention prompt share: of all prompt "
        "tokens sent (workload + touches + warm-ups); retention recomputed share: of the "
        "workload's own prompt tokens.",
        "",
    ]
    lines += [f"- {n}: {t['note']}" for n, t in doc["targets"].items() if t.get("note")]
    for name, t in doc["targets"].items():
        if (work := t.get("engine")) is not None:
            lines.append(
                f"- {name}: the engines computed {work['computed_tokens']:,.0f} prompt tokens, "
                f"loaded {work['tier_loaded_tokens']:,.0f} from the tier, "
                f"{work['preemptions']:,.0f} preemptions"
                + (
                    f"; the simulator ran {work['sim_lag']:.1%} behind its modelled clock"
                    if "sim_lag" in work
                    else ""
                )
            )
    counters = {n: t.get("counters") for n, t in doc["targets"].items() if t.get("counters")}
    for name, cnt in counters.items():
        text = ", ".join(
            f"{k.removeprefix('kvkeeper_').removesuffix('_total')} {v:,.0f}" for k, v in cnt.items()
        )
        lines.append(f"- {name}: {text}")
    return "\n".join(lines) + "\n"


def render_aggregate(doc: dict[str, Any]) -> str:
    """The table of a ``--repeats`` comparison: mean (min to max) over rounds."""

    def cell(fig: dict[str, Any] | None, fmt: str) -> str:
        if fig is None:
            return "-"
        if fmt == "pp":
            f = "{:+.1f}"
        elif fmt == "pct":
            fig = {k: 100 * fig[k] for k in ("mean", "min", "max")}
            f = "{:.1f}%"
        elif fmt == "spct":
            fig = {k: 100 * fig[k] for k in ("mean", "min", "max")}
            f = "{:+.1f}%"
        else:
            f = "{:.3f}"
        return f"{f.format(fig['mean'])} ({f.format(fig['min'])} to {f.format(fig['max'])})"

    planned = doc["ceilings"]["planned"]
    oracle = any("ttft_mean_vs_belady" in t for t in doc["targets"].values())
    lines = [
        f"### {doc['workload']}: {len(doc['targets'])} targets, {doc['repeats']} rounds, "
        f"pool {planned['C']} blocks (peak working set {planned['peak_ws']})",
        "",
        "Mean over rounds (min to max). `vs base`: the same round's "
        + (f"`{doc['base']}`" if doc.get("base") else "baseline")
        + "; gap closed per round from it to that round's realized Belady (first token: to the "
        "one held from the first token).",
        "",
        "| target | hit rate | hit vs base pp | gap closed | gap closed (first token) "
        "| TTFT mean s | TTFT mean vs base | TTFT p90 vs base | "
        + ("TTFT mean vs engine-belady | " if oracle else "")
        + "engine-time TTFT mean s | engine-time TTFT mean vs base "
        "| retention recomputed share | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if oracle else ""),
    ]
    for name, t in doc["targets"].items():
        if "skipped" in t:
            lines.append(f"| {name} | skipped: {t['skipped']} |" + " |" * (11 if oracle else 10))
            continue
        errors = t.get("errors", {}).get("max", 0)
        lines.append(
            f"| {name} | {cell(t.get('hit_rate'), 'pct')} | "
            f"{cell(t.get('hit_rate_vs_base_pp'), 'pp')} | {cell(t.get('gap_closed'), 'pct')} | "
            f"{cell(t.get('gap_closed_first_token'), 'pct')} | "
            f"{cell(t.get('ttft.mean'), 's')} | {cell(t.get('ttft_mean_vs_base'), 'spct')} | "
            f"{cell(t.get('ttft_p90_vs_base'), 'spct')} | "
            + (f"{cell(t.get('ttft_mean_vs_belady'), 'spct')} | " if oracle else "")
            + f"{cell(t.get('ttft_engine_time.mean'), 's')} | "
            f"{cell(t.get('ttft_engine_time_mean_vs_base'), 'spct')} | "
            f"{cell(t.get('retention_recomputed_share'), 'pct')} | {errors:.0f} |"
        )
    lines += [
        "",
        ENGINE_TIME_NOTE,
        "",
        "| realized ceilings | LRU | Belady | infinite |",
        "|---|---|---|---|",
    ]
    for name, row in zip(doc["rounds"], doc["ceilings"]["realized"], strict=False):
        lines.append(
            f"| {name} ({row['from']}) | {_pct(row['lru'])} | {_pct(row['belady'])} "
            f"| {_pct(row['inf'])} |"
        )
    for name, row in zip(doc["rounds"], doc["ceilings"].get("admitted", []), strict=False):
        lines.append(
            f"| {name} ({row['from']}), held from the first token | {_pct(row['lru'])} "
            f"| {_pct(row['belady'])} | {_pct(row['inf'])} |"
        )
    lines.append(
        f"| planned timeline | {_pct(planned['lru'])} | {_pct(planned['belady'])} "
        f"| {_pct(planned['inf'])} |"
    )
    return "\n".join(lines) + "\n"
