"""``.ci/run`` hands its arguments to pytest through ``scripts/test.sh``, and an empty collection
(pytest's exit 5) fails the run. The tools the script calls are stand-ins on PATH here: the real
ones would reinstall the package and run the whole suite inside a test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# records each call, then exits with $FAKE_PYTEST_RC for pytest and 0 for anything else
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1 $2" = "-m pytest" ]; then exit "${FAKE_PYTEST_RC:-0}"; fi
exit 0
"""


def _run(tmp_path: Path, pytest_rc: int, *args: str) -> tuple[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {"python3": FAKE_PYTHON, "redis-server": "", "chromium": ""}.items():
        tool = bin_dir / name
        tool.write_text(text or "#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "FAKE_PYTEST_RC": str(pytest_rc),
        "KVKEEPER_SKIP_ENGINE": "1",
    }
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, calls.read_text().splitlines()


def test_ci_run_passes_its_arguments_to_pytest(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, 0, "-m", "not realengine", "tests/unit")
    assert rc == 0
    assert calls[-1] == "-m pytest -q -m not realengine tests/unit"


def test_ci_run_fails_when_pytest_collects_nothing(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, 5, "-k", "no_such_test")
    assert rc == 1
    assert calls[-1] == "-m pytest -q -k no_such_test"


def test_ci_run_keeps_pytest_failures(tmp_path: Path) -> None:
    assert _run(tmp_path, 1)[0] == 1
    assert _run(tmp_path, 2)[0] == 2
