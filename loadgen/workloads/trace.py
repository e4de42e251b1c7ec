"""``trace``: replay of real agent traces (Claude Code, kv-cache-tester format) and Mooncake JSONL.

Claude Code (``loadgen/traces/claude-code/SOURCE.md``): each file is one root session whose
calls keep their order, prompt sizes, output sizes and think times; sub-agent entries become
child sessions (consecutive entries launched together after the parent call before them, at the
recorded launch delay; the parent waits for ``completed`` ones, not for ``async_launched``).
Block ids are private to a file, so each file's blocks live in their own namespace. The traces
cannot show what every conversation shares (the Claude Code system prompt and tool definitions);
with ``shared_head`` the leading ``(tool_tokens + system_tokens) // 64`` blocks of each session are
mapped onto one namespace per agent kind (``main``, ``Explore``, ...), emulating that sharing.

Mooncake (``.jsonl``): one request per line, ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks shared across the whole file; every line is a
one-call root session at its timestamp.

The default directory is the 48 Claude Code traces shipped in the package
(``loadgen/traces/claude-code``, xz-compressed); ``KVKEEPER_TRACE_DIR`` or ``path`` (the CLI's
``--trace-dir``) names another set. Files may be plain or ``.xz`` / ``.gz`` compressed.

``token_scale`` shrinks every block (and output) so a trace fits a small engine; time scaling is
the runner's (``RunOptions.time_scale``).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

from loadgen.workloads.base import (
    Call,
    Segment,
    SessionScript,
    Spawn,
    Step,
    Stop,
    Workload,
    scaled,
)

CC_BLOCK = 64
MOONCAKE_BLOCK = 512
DEFAULT_API_TIME = 6.0
SHIPPED_TRACES = Path(__file__).resolve().parent.parent / "traces" / "claude-code"
TRACE_DIR_ENV = "KVKEEPER_TRACE_DIR"  # another default directory (e.g. a full trace set)
_FORMATS = (".json", ".jsonl")
_COMPRESSED = {".xz": lzma.open, ".gz": gzip.open}


def default_trace_dir() -> str:
    """``$KVKEEPER_TRACE_DIR``, else the traces shipped with the package."""
    return os.environ.get(TRACE_DIR_ENV) or str(SHIPPED_TRACES)


@dataclass(frozen=True, slots=True)
class TraceParams:
    path: str = ""  # a directory of trace files, or one file ("": default_trace_dir())
    limit: int = 0  # use at most this many trace files (0: all), in name order
    files: str = ""  # comma-separated file names to pick from ``path`` (empty: all)
    token_scale: float = 1.0
    shared_head: bool = True
    max_think: float = 0.0  # cap on think times and launch delays in seconds (0: no cap)
    max_requests: int = 0  # keep at most this many top-level calls per trace (0: all)


def _name(path: Path) -> tuple[str, str]:
    """``trace_0291.json.xz`` -> ``("trace_0291", ".json")``; ("", "") for other files."""
    name = path.name
    for ext in _COMPRESSED:
        name = name.removesuffix(ext)
    stem, dot, fmt = name.rpartition(".")
    return (stem, dot + fmt) if dot and dot + fmt in _FORMATS else ("", "")


def _names(path: Path) -> set[str]:
    stem, fmt = _name(path)
    return {path.name, stem, stem + fmt}


def open_trace(path: Path) -> IO[str]:
    opener = _COMPRESSED.get(path.suffix)
    return opener(path, "rt") if opener else path.open()  # type: ignore[operator]


def trace_files(p: TraceParams) -> list[Path]:
    root = Path(p.path or default_trace_dir())
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"trace: no such trace file or directory: {root}")
    by_stem: dict[str, Path] = {}
    for f in sorted(root.iterdir(), key=lambda f: (f.name.count("."), f.name)):
        stem = _name(f)[0]
        if stem:
            by_stem.setdefault(stem, f)  # a plain file wins over its compressed copy
    files = [by_stem[stem] for stem in sorted(by_stem)]
    if p.files:  # by stem, or by name with or without the compression suffix
        wanted = {name.strip() for name in p.files.split(",") if name.strip()}
        files = [f for f in files if wanted & _names(f)]
        if missing := wanted.difference(*(_names(f) for f in files)):
            raise ValueError(f"trace: no {', '.join(sorted(missing))} under {root}")
    return files[: p.limit] if p.limit else files


def build(p: TraceParams) -> Workload:
    p = replace(p, path=p.path or default_trace_dir())
    sessions: list[SessionScript] = []
    block = scaled(CC_BLOCK, p.token_scale)
    for f in trace_files(p):
        if _name(f)[1] == ".jsonl":
            sessions += _mooncake(f, p)
            block = scaled(MOONCAKE_BLOCK, p.token_scale)
        else:
            sessions.append(_claude_code(f, p))
    if not sessions:
        raise ValueError(f"trace: no trace files under {p.path}")
    return Workload(
        "trace", tuple(sessions), block_tokens=block, api="completions-ids", params=asdict(p)
    )


class _Builder:
    """Turns one Claude Code file into sessions; holds what every session of it shares."""

    def __init__(self, doc: dict[str, Any], p: TraceParams) -> None:
        self.ns = str(doc["id"])
        self.p = p
        self.block = scaled(CC_BLOCK, p.token_scale)
        apis = [e["api_time"] for e in _all_requests(doc["requests"]) if e.get("api_time")]
        self.api_default = statistics.median(apis) if apis else DEFAULT_API_TIME
        self.n_tails = 0  # numbers each call's private partial block, in build order

    def cap(self, seconds: float) -> float:
        seconds = max(0.0, seconds)
        return min(seconds, self.p.max_think) if self.p.max_think > 0 else seconds

    def session(self, sid: str, entry: dict[str, Any], kind: str, start: float) -> SessionScript:
        entries = entry["requests"]
        head = self._head_map(entries, entry, kind)
        steps: list[Step] = []
        prev_t_end = 0.0
        i = n_calls = 0
        while i < len(entries):
            e = entries[i]
            if e.get("type") != "subagent":
                if self.p.max_requests and kind == "main" and n_calls >= self.p.max_requests:
                    break
                think = e.get("think_time")
                if think is None:
                    think = e["t"] - prev_t_end if steps else 0.0
                api = e.get("api_time") or self.api_default
                steps.append(self._call(e, head, kind, self.cap(think) if steps else 0.0, api))
                prev_t_end = e["t"] + api
                n_calls += 1
                i += 1
                continue
            group = []
            while i < len(entries) and entries[i].get("type") == "subagent":
                group.append(entries[i])
                i += 1
            steps += self._spawns(sid, group, prev_t_end)
        return SessionScript(sid, tuple(steps), start=start, agent=kind)

    def _spawns(self, sid: str, group: list[dict[str, Any]], prev_t_end: float) -> list[Step]:
        waited: list[SessionScript] = []
        background: list[SessionScript] = []
        for sa in group:
            if not sa.get("requests"):
                continue
            launched = sa.get("t", prev_t_end) - (sa.get("duration_ms") or 0) / 1000.0
            child_id = f"{sid}-{sa.get('agent_id', len(waited) + len(background))}"
            kind = str(sa.get("subagent_type") or "subagent")
            child = self.session(child_id, sa, kind, self.cap(launched - prev_t_end))
            (background if sa.get("status") == "async_launched" else waited).append(child)
        out: list[Step] = []
        if background:
            out.append(Spawn(tuple(background), wait=False))
        if waited:
            out.append(Spawn(tuple(waited), wait=True))
        return out

    def _head_map(
        self, entries: list[dict[str, Any]], entry: dict[str, Any], kind: str
    ) -> dict[int, int]:
        """Block id -> position for the session's leading system+tool blocks."""
        if not self.p.shared_head:
            return {}
        first = next((e for e in entries if e.get("type") != "subagent"), None)
        if first is None:
            return {}
        n_head = int(entry.get("tool_tokens") or 0) + int(entry.get("system_tokens") or 0)
        ids = first["hash_ids"][: n_head // CC_BLOCK]
        return {block_id: pos for pos, block_id in enumerate(ids)}

    def _call(
        self, e: dict[str, Any], head: dict[int, int], kind: str, think: float, api: float
    ) -> Call:
        ids: Sequence[int] = e["hash_ids"]
        n_shared = 0
        while n_shared < len(ids) and head.get(ids[n_shared]) == n_shared:
            n_shared += 1
        prompt: list[Segment] = []
        if n_shared:
            prompt.append(Segment(f"shared/cc-head/{kind}", range(n_shared), self.block))
        if n_shared < len(ids):
            prompt.append(Segment(self.ns, ids[n_shared:], self.block))
        tail = scaled(int(e["in"]) % CC_BLOCK, self.p.token_scale) if e["in"] % CC_BLOCK else 0
        if tail or not prompt:  # the unhashed partial block: private to this call
            self.n_tails += 1
            prompt.append(Segment(f"{self.ns}/tail", [self.n_tails], max(tail, 1)))
        stop: Stop = "tool_use" if e.get("stop") == "tool_use" else "end_turn"
        out = scaled(int(e.get("out") or 1), self.p.token_scale)
        return Call(tuple(prompt), out, think=think, stop=stop, agent=kind, api_time=api)


def _all_requests(entries: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for e in entries:
        if e.get("type") == "subagent":
            yield from _all_requests(e.get("requests") or [])
        else:
            yield e


def _claude_code(path: Path, p: TraceParams) -> SessionScript:
    with open_trace(path) as f:
        doc = json.load(f)
    builder = _Builder(doc, p)
    return builder.session(builder.ns, doc, "main", 0.0)


def _mooncake(path: Path, p: TraceParams) -> list[SessionScript]:
    block = scaled(MOONCAKE_BLOCK, p.token_scale)
    stem = _name(path)[0]
    out: list[SessionScript] = []
    with open_trace(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            ids = rec.get("hash_ids") or []
            n_in = int(rec["input_length"])
            last = n_in - MOONCAKE_BLOCK * (len(ids) - 1) if ids else 0
            last_scaled = scaled(min(max(last, 1), MOONCAKE_BLOCK), p.token_scale)
            if ids:
                last_tokens = None if last_scaled == block else last_scaled
                seg = Segment(f"shared/mooncake/{stem}", ids, block, last_tokens)
            else:  # shorter than one block: private content
                seg = Segment(f"{stem}/line", [n], scaled(n_in, p.token_scale))
            call = Call((seg,), scaled(int(rec["output_length"]), p.token_scale))
            start = float(rec.get("timestamp", 0)) / 1000.0
            out.append(SessionScript(f"mc-{stem}-{n}", (call,), start=start))
    return out
