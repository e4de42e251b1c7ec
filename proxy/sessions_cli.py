"""``kvkeeper sessions list|show|free``: the admin API from the command line (httpx)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("sessions", help="list, show and free sessions (admin API)")
    p.add_argument("--url", default=os.environ.get("KVKEEPER_URL", "http://127.0.0.1:8000"))
    p.add_argument(
        "--token",
        default=os.environ.get("KVKEEPER_ADMIN_TOKEN"),
        help="admin token or tenant API key (default: $KVKEEPER_ADMIN_TOKEN)",
    )
    p.add_argument("--tenant", help="tenant to act on (operator token only)")
    p.add_argument("--json", action="store_true", help="print raw JSON")
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="list sessions, newest first")
    ls.add_argument("--parent")
    ls.add_argument("--state", choices=["active", "protected", "idle", "offloaded"])
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--all", action="store_true", help="follow cursors to the end")
    show = sub.add_parser("show", help="one session with its tree")
    show.add_argument("session_id")
    free = sub.add_parser("free", help="free a session")
    free.add_argument("session_id")
    free.add_argument("--tree", action="store_true", help="free its children first, then it")
    p.set_defaults(func=run)


def _request(args: argparse.Namespace, method: str, path: str, params: dict[str, Any]) -> Any:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    if args.tenant:
        params["tenant"] = args.tenant
    with httpx.Client(base_url=args.url, headers=headers, timeout=10.0) as client:
        resp = client.request(
            method, path, params={k: v for k, v in params.items() if v is not None}
        )
    body = (
        resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    )
    if resp.status_code >= 400:
        message = (
            body.get("error", {}).get("message", resp.text) if isinstance(body, dict) else resp.text
        )
        raise SystemExit(f"kvkeeper sessions: {resp.status_code}: {message}")
    return body


def _print_table(rows: list[dict[str, Any]]) -> None:
    cols = (
        "session_id",
        "state",
        "parent_session_id",
        "engine",
        "ttl_left_s",
        "requests",
        "cached",
    )
    table = [
        [
            str(r["session_id"]),
            str(r["state"]),
            str(r.get("parent_session_id") or "-"),
            str(r.get("engine") or "-"),
            f"{r.get('ttl_left_s', 0):.0f}",
            str(r["counters"].get("requests", 0)),
            f"{r['counters'].get('cached_tokens', 0)}/{r['counters'].get('prompt_tokens', 0)}",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "list":
            rows: list[dict[str, Any]] = []
            cursor: str | None = None
            while True:
                params = {
                    "parent": args.parent,
                    "state": args.state,
                    "limit": args.limit,
                    "cursor": cursor,
                }
                page = _request(args, "GET", "/admin/sessions", params)
                rows.extend(page["data"])
                cursor = page.get("next_cursor")
                if not cursor or not args.all:
                    break
            print(json.dumps(rows, indent=2)) if args.json else _print_table(rows)
        elif args.action == "show":
            body = _request(args, "GET", f"/admin/sessions/{args.session_id}", {})
            print(json.dumps(body, indent=2))
        else:
            body = _request(
                args,
                "DELETE",
                f"/admin/sessions/{args.session_id}",
                {"tree": str(args.tree).lower()},
            )
            print(json.dumps(body, indent=2) if args.json else "freed: " + ", ".join(body["freed"]))
    except httpx.HTTPError as exc:
        print(f"kvkeeper sessions: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0
