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
from typing import Any

import httpx

from proxy.sessions_format import engine_rows, session_rows, show_text

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
        help="list sessions by session id, one page unless --all",
        description="List sessions by tenant, then session id. A footer on stderr gives"
        " the cursor of the next page.",
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
