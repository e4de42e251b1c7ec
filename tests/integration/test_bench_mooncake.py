"""``kvkeeper bench compare --workload mooncake`` end to end: a few Mooncake trace lines played
through the command line against real simulator subprocesses, and through kvkeeper (real
kvkeeper + Redis subprocesses) on its defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.records import RunResult
from proxy.cli import main
from tests.unit.test_mooncake import LINES, write

TARGETS = ("engine-notier", "engine", "default")


def test_compare_on_a_few_mooncake_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write(tmp_path / "mc.jsonl.xz", LINES)
    out = tmp_path / "cmp"
    argv = ["bench", "compare", "--workload", "mooncake", "--set", f"path={trace}",
            "--set", "scale=0.25", "--set", "max_requests=6", "--profile", "h100-llama8b",
            "--speed", "5", "--time-scale", "0.3", "--pool-frac", "2", "--cpu-blocks", "64",
            "--base", "engine-notier", "--targets", ",".join(TARGETS), "--retention", "tick_s=0.05",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads((out / "compare.json").read_text())
    assert doc["workload"] == "mooncake" and doc["params"]["scale"] == 0.25
    for name in TARGETS:
        target = doc["targets"][name]
        assert (target["requests"], target["errors"]) == (6, 0), name
        assert target["prompt_tokens"] == 275 + 150 + 500 + 275 + 525 + 256
    # through kvkeeper with full hints: a conversation is one session, its turns in order, each
    # after the one before finished; a later turn finds the blocks the earlier ones computed
    result = RunResult.load(out / "default.json")
    by_session: dict[str, list[tuple[float, float, int, int]]] = {}
    for r in sorted(result.requests, key=lambda r: r.t_start):
        by_session.setdefault(r.session_id, []).append(
            (r.t_start, r.t_end, r.prompt_tokens, r.cached_tokens)
        )
    turns = sorted(by_session.values(), key=len)
    assert [len(t) for t in turns] == [1, 1, 1, 3]
    (a, c, e) = turns[-1]
    assert a[1] <= c[0] and c[1] <= e[0]
    assert c[3] >= 256 and e[3] >= 384  # [0, 1] of A, then [0, 1, 4] of C (128-token blocks)
    assert doc["targets"]["default"]["manage"]  # the client sent kvkeeper management requests
    assert "| default |" in (out / "compare.md").read_text()
