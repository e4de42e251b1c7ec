"""The documents point at things that exist: every repository path they name is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("proxy/", "adapters/", "policy/", "loadgen/", "deploy/", "docs/", "tests/", "scripts/",
       "benchmarks/")  # fmt: skip
# a path in backticks or a link, under one of the top-level folders
ALT = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(rf"[`(]((?:{ALT})[\w./-]+)[`)#]")
PLACEHOLDERS = ("my", "<")  # extending.md's examples of files a reader would add


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_document_names_exists(doc: Path) -> None:
    missing = []
    for path in set(PATH.findall(doc.read_text())):
        name = path.rstrip("/.")
        if any(part.startswith(PLACEHOLDERS) or "_my" in part for part in Path(name).parts):
            continue
        if not (ROOT / name).exists():
            missing.append(name)
    assert not missing, f"{doc.name} names paths that do not exist: {sorted(missing)}"


def test_the_readme_gives_the_two_commands_and_stays_short() -> None:
    text = (ROOT / "README.md").read_text()
    assert "kvkeeper demo" in text and "bash scripts/test.sh" in text
    assert len(text.splitlines()) <= 160
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci
