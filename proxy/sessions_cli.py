"""``kvkeeper sessions ...`` and ``kvkeeper engines``: the admin API from the command line (httpx).

Connection options (``--url``, ``--token``, ``--tenant``) and ``--json`` are accepted before or
after the action, so ``kvkeeper sessions list --json`` and ``kvkeeper sessions --json list`` agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
OPERATIONS = ("offload", "prefetch", "evict", "pin")
_OP_HELP = {
    "offload": "copy the session's KV blocks to the engine's offload tier (LMCache)",
    "prefetch": "load the session's blocks back into the engine (from the tier or by recompute)",
    "evict": "drop the session's blocks from the engine and unprotect them",
    "pin": "protect the session's blocks from eviction (for --ttl seconds)",
}


class AdminError(Exception):
    """An admin API call that failed: a message for the operator and an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


CLIENT_DEFAULTS: dict[str, Any] = {"url": None, "token": None, "tenant": None, "timeout": 10.0}


def _client_options() -> argparse.ArgumentParser:
    """Options every admin command takes, at every level. Their defaults are set once on the
    command's own parser (``CLIENT_DEFAULTS``; ``--json`` on the top parser): SUPPRESS keeps an
    option given before the action from being reset by the action's parser. A fresh parser per
    use: parents share action objects and ``set_defaults`` changes them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help=f"kvkeeper base URL (default: $KVKEEPER_URL or {DEFAULT_URL})",
    )
    p.add_argument(
        "--token",
        default=argparse.SUPPRESS,
        help="operator admin token or a tenant's API key (default: $KVKEEPER_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--tenant",
        default=argparse.SUPPRESS,
        help="tenant to act on (operator token only; default: all tenants the token sees)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help=f"seconds to wait for each admin call (default: {CLIENT_DEFAULTS['timeout']:g})",
    )
    p.add_argument(
        "--json",
        dest="json_output",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the API's JSON instead of a table (default: off)",
    )
    return p


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``sessions`` (list, show, free and the operations) and ``engines``."""
    p = subparsers.add_parser(
        "sessions",
        parents=[_client_options()],
        help="list, show, free and operate on sessions (admin API)",
        description="Sessions of a running kvkeeper, through its admin API.",
    )
    p.set_defaults(**CLIENT_DEFAULTS)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser(
        "list",
        parents=[_client_options()],
        help="list sessions, newest first, one page unless --all",
        description="List sessions. A footer on stderr gives the cursor of the next page.",
    )
    ls.add_argument("--parent", metavar="ID", help="only children of this session")
    ls.add_argument(
        "--state",
        choices=["active", "protected", "idle", "offloaded"],
        help="only sessions in this state (default: any)",
    )
    ls.add_argument("--limit", type=int, help="page size, 1-500 (default: 50; 500 with --all)")
    ls.add_argument("--cursor", help="start at this cursor (from a previous page's footer)")
    ls.add_argument("--all", action="store_true", help="follow cursors to the last page")
    ls.set_defaults(func=run_list)
    show = sub.add_parser(
        "show",
        parents=[_client_options()],
        help="one session: times, counters, tree, residency per engine and tier",
    )
    show.add_argument("session_id", metavar="ID")
    show.set_defaults(func=run_show)
    free = sub.add_parser("free", parents=[_client_options()], help="free a session (forget it)")
    free.add_argument("session_id", metavar="ID")
    free.add_argument("--tree", action="store_true", help="free its descendants too")
    free.set_defaults(func=run_free)
    for op in OPERATIONS:
        o = sub.add_parser(
            op, parents=[_client_options()], help=_OP_HELP[op], description=_OP_HELP[op] + "."
        )
        o.add_argument("session_id", metavar="ID")
        o.add_argument(
            "--blocks",
            metavar="START:END",
            help="only blocks START..END-1 of the session's prompt (default: all of them)",
        )
        if op == "pin":
            o.add_argument(
                "--ttl", type=float, help="seconds to keep the pin (default: the session's TTL)"
            )
        o.set_defaults(func=run_operation, operation=op)

    e = subparsers.add_parser(
        "engines",
        parents=[_client_options()],
        help="the engines a running kvkeeper routes to, with health and retention state",
        description="GET /admin/engines as a table: every configured engine, local or remote.",
    )
    e.set_defaults(func=run_engines, **CLIENT_DEFAULTS)


# --- HTTP ------------------------------------------------------------------------------------


def _request(
    args: argparse.Namespace,
    method: str,
    path: str,
    params: dict[str, Any] | None = None,
    body: dict[str, Any] | None = None,
) -> Any:
    url = args.url or os.environ.get("KVKEEPER_URL") or DEFAULT_URL
    token = args.token or os.environ.get("KVKEEPER_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    query = {k: v for k, v in (params or {}).items() if v is not None}
    if args.tenant:
        query["tenant"] = args.tenant
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=args.timeout) as client:
            resp = client.request(method, path, params=query, json=body)
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach {url}: {exc}") from None
    try:
        data = resp.json()
    except ValueError:
        data = None
    if resp.status_code >= 400:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else resp.text.strip()
        raise AdminError(f"{resp.status_code}: {message or resp.reason_phrase}")
    if data is None:
        raise AdminError(f"{url}{path} did not answer JSON ({resp.status_code})")
    return data


def _guard(name: str, args: argparse.Namespace, fn: Any) -> int:
    try:
        code: int = fn(args)
    except AdminError as exc:
        print(f"kvkeeper {name}: {exc}", file=sys.stderr)
        return exc.code
    return code


def _dump(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


# --- formatting ------------------------------------------------------------------------------


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
        f"{float(s.get('ttl_left_s') or 0):.0f}s left",
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


# --- actions ---------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    cursor: str | None = args.cursor
    while True:
        limit = args.limit if args.limit is not None else (500 if args.all else 50)
        params = {"parent": args.parent, "state": args.state, "limit": limit}
        page = _request(args, "GET", "/admin/sessions", {**params, "cursor": cursor})
        rows.extend(page.get("data") or [])
        cursor = page.get("next_cursor")
        if not cursor or not args.all:
            break
    if args.json_output:
        _dump({"object": "list", "data": rows, "next_cursor": cursor})
        return 0
    if rows:
        print(session_rows(rows, time.time()))
    else:
        print("no sessions" + (" on this page" if args.cursor else ""))
    if cursor:
        print(
            f"-- {len(rows)} shown; more: --cursor {cursor} (next page) or --all", file=sys.stderr
        )
    elif rows:
        print(f"-- {len(rows)} session{'s' if len(rows) != 1 else ''}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    body = _request(args, "GET", f"/admin/sessions/{args.session_id}")
    _dump(body) if args.json_output else print(show_text(body, time.time()))
    return 0


def _free(args: argparse.Namespace) -> int:
    body = _request(
        args, "DELETE", f"/admin/sessions/{args.session_id}", {"tree": str(args.tree).lower()}
    )
    _dump(body) if args.json_output else print("freed: " + ", ".join(body["freed"]))
    return 0


def _blocks(spec: str | None) -> dict[str, int]:
    if spec is None:
        return {}
    start, sep, end = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        return {"block_start": int(start), "block_end": int(end)}
    except ValueError:
        raise AdminError(f"--blocks must be START:END, got {spec!r}", code=2) from None


def _operation(args: argparse.Namespace) -> int:
    body: dict[str, Any] = _blocks(args.blocks)
    if getattr(args, "ttl", None) is not None:
        body["ttl"] = args.ttl
    result = _request(
        args, "POST", f"/admin/sessions/{args.session_id}/{args.operation}", body=body or None
    )
    if args.json_output:
        _dump(result)
    else:
        line = f"{args.operation} {args.session_id}: {result.get('status')}"
        if result.get("reason"):
            line += f" ({result['reason']})"
        detail = result.get("detail")
        if detail:
            line += "  " + " ".join(f"{k}={v}" for k, v in detail.items())
        print(line)
    return 0 if result.get("status") == "applied" else 3


def _engines(args: argparse.Namespace) -> int:
    body = _request(args, "GET", "/admin/engines")
    data = body.get("data") or []
    if args.json_output:
        _dump(body)
    elif data:
        print(engine_rows(data, time.time()))
    else:
        print("no engines")
    return 0 if data and all(e.get("healthy") for e in data) else 1


def run_list(args: argparse.Namespace) -> int:
    return _guard("sessions", args, _list)


def run_show(args: argparse.Namespace) -> int:
    return _guard("sessions", args, _show)


def run_free(args: argparse.Namespace) -> int:
    return _guard("sessions", args, _free)


def run_operation(args: argparse.Namespace) -> int:
    return _guard("sessions", args, _operation)


def run_engines(args: argparse.Namespace) -> int:
    return _guard("engines", args, _engines)
