"""Structural rules: module size, no import cycles, a pure policy package, one engine seam."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "adapters", "policy", "loadgen")
MAX_LINES = 420
IO_MODULES = ("aiohttp", "redis", "zmq", "httpx", "asyncio", "socket", "requests", "urllib")


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports (``TYPE_CHECKING`` blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found & known


def _cycles(package: str) -> list[list[str]]:
    mods = _modules(package)
    graph = {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}
    cycles, state, stack = [], dict.fromkeys(graph, 0), []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state[n] == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif state[n] == 0:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            dfs(m)
    return cycles


@pytest.mark.parametrize("path", sorted((ROOT / "proxy").glob("*.py")), ids=lambda p: p.name)
def test_no_proxy_module_is_over_the_line_limit(path: Path) -> None:
    rel = str(path.relative_to(ROOT))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{rel}: {lines} lines"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    assert _cycles(package) == []


def test_policy_does_no_io() -> None:
    for path in (ROOT / "policy").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad = [n for n in names if n.split(".")[0] in IO_MODULES or n.startswith("proxy")]
            assert not bad, f"{path.name} imports {bad}"


def test_proxy_names_no_engine_specifics() -> None:
    """Engine-specific names (vLLM metric names, its priority header, its adapter) live behind
    the adapter seam."""
    for path in (ROOT / "proxy").rglob("*.py"):
        text = path.read_text()
        for needle in ("vllm:", "X-Vllm", "adapters.vllm", "VLLMAdapter"):
            assert needle not in text, f"{path.name} names {needle!r}"
