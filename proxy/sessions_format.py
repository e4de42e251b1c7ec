"""Plain-text tables and trees that ``kvkeeper sessions`` and ``kvkeeper engines`` print."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def iso(ts: float | None) -> str:
    """Epoch seconds as ISO 8601 UTC to the second; '-' for none."""
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ago(ts: float | None, now: float) -> str:
    """'12s ago', '5m ago', '3h ago'; '-' for none."""
    if not ts:
        return "-"
    s = max(0.0, now - ts)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.0f}h ago"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _tokens(counters: dict[str, Any]) -> str:
    prompt, hit = int(counters.get("prompt_tokens", 0)), int(counters.get("cached_tokens", 0))
    share = f" ({100 * hit / prompt:.0f}%)" if prompt else ""
    return f"{hit}/{prompt}{share}"


def session_rows(rows: list[dict[str, Any]], now: float) -> str:
    header = ["SESSION", "TENANT", "STATE", "PARENT", "ENGINE", "TTL_LEFT", "REQS", "CACHED/PROMPT"]
    header.append("LAST_SEEN")
    body = [
        [
            str(r["session_id"]),
            str(r.get("tenant") or "-"),
            str(r.get("state") or "-"),
            str(r.get("parent_session_id") or "-"),
            str(r.get("engine") or "-"),
            f"{float(r.get('ttl_left_s') or 0):.0f}s",
            str(r.get("counters", {}).get("requests", 0)),
            _tokens(r.get("counters", {})),
            ago(r.get("last_seen"), now),
        ]
        for r in rows
    ]
    return table(header, body)


def tree_lines(
    node: dict[str, Any], prefix: str = "", last: bool = True, root: bool = True
) -> list[str]:
    label = f"{node['session_id']} [{node.get('state', '?')}]"
    lines = [label if root else f"{prefix}{'└─ ' if last else '├─ '}{label}"]
    children = node.get("children") or []
    inner = "" if root else prefix + ("   " if last else "│  ")
    for i, child in enumerate(children):
        lines += tree_lines(child, inner, i == len(children) - 1, root=False)
    return lines


def show_text(s: dict[str, Any], now: float) -> str:
    c = s.get("counters", {})
    ttl = s.get("ttl_s")
    out = [
        f"session    {s['session_id']}  (tenant {s.get('tenant') or '-'})",
        f"state      {s.get('state')}   engine {s.get('engine') or '-'}   "
        f"agent {s.get('agent') or '-'}   retention {s.get('retention') or '-'}",
        f"parent     {s.get('parent_session_id') or '-'}",
        f"created    {iso(s.get('created'))}  ({ago(s.get('created'), now)})",
        f"last seen  {iso(s.get('last_seen'))}  ({ago(s.get('last_seen'), now)})",
        f"last used  {iso(s.get('last_used'))}   last touch {iso(s.get('last_touch'))}",
        f"ttl        {'-' if ttl is None else f'{float(ttl):.0f}s'}, "
        f"{float(s.get('ttl_left_s') or 0):.0f}s left"
        + (" (guessed from its returns)" if s.get("ttl_guessed") else ""),
        f"requests   {c.get('requests', 0)}   cached/prompt tokens {_tokens(c)}   "
        f"completion tokens {c.get('completion_tokens', 0)}",
        f"retention  touches {c.get('touches', 0)} ({c.get('touch_tokens', 0)} tokens)   "
        f"warm-ups {c.get('warmups', 0)} ({c.get('warmup_tokens', 0)} tokens)   "
        f"expiries {c.get('expiries', 0)}",
        f"context    {s.get('context_bytes', 0)} bytes",
    ]
    if s.get("tree"):
        out += ["", "tree"] + ["  " + line for line in tree_lines(s["tree"])]
    residency = s.get("residency")
    if residency is not None:
        out += ["", f"residency  {residency.get('blocks', 0)} blocks in the session's prompt"]
        engines: dict[str, Any] = residency.get("engines") or {}
        seen = {m for e in engines.values() for m in e.get("resident_prefix_blocks", {})}
        media = sorted(seen, key=lambda m: (m.upper() != "GPU", m))  # the engine's own first
        if engines:
            rows = [
                [name] + [str(e.get("resident_prefix_blocks", {}).get(m, 0)) for m in media]
                for name, e in engines.items()
            ]
            header = ["  ENGINE"] + [f"{m.upper()}_PREFIX_BLOCKS" for m in media]
            out.append(table(header, [["  " + r[0], *r[1:]] for r in rows]))
    else:
        out += ["", "residency  - (retention is off on this proxy)"]
    return "\n".join(out)


def engine_rows(engines: list[dict[str, Any]], now: float) -> str:
    header = ["ENGINE", "URL", "HEALTHY", "INFLIGHT", "MODELS", "EVENTS", "HASH", "MODE", "HORIZON"]
    header += ["RESIDENT", "TIER_PINNED", "CREDIT_TOKENS", "CHECKED", "LAST_ERROR"]
    rows = []
    for e in engines:
        r: dict[str, Any] = e.get("retention") or {}
        horizon = r.get("horizon_s")
        resident = r.get("resident_blocks") or {}
        pinned = r.get("tier_pinned")
        overhead = r.get("overhead") or {}
        # the block-hash self-check: ok, mismatch (residency tracking off), pending, no_events
        hash_check = e.get("hash_check")
        hashes = hash_check.get("status") if isinstance(hash_check, dict) else None
        rows.append(
            [
                str(e.get("name")),
                str(e.get("url")),
                "yes" if e.get("healthy") else "no",
                str(e.get("inflight", 0)),
                ",".join(e.get("models") or []) or "-",
                "yes" if e.get("events") else "no",
                str(hashes or "-"),
                str(r.get("mode") or "-"),
                "-" if horizon is None else f"{float(horizon):.0f}s",
                " ".join(f"{m}={n}" for m, n in resident.items()) or "-",
                "-" if pinned is None else _pins(pinned),
                "-" if "credit_tokens" not in overhead else f"{overhead['credit_tokens']:.0f}",
                ago(e.get("last_check"), now),
                str(e.get("last_error") or "-"),
            ]
        )
    return table(header, rows)


def _pins(pinned: Any) -> str:
    if isinstance(pinned, dict):
        return " ".join(f"{k}={v}" for k, v in pinned.items() if v is not None) or "0"
    return str(pinned)
