"""The service runs without the bench extra; bench and demo answer a one-line install hint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadgen.extras import BENCH_MODULES, INSTALL_HINT
from proxy.cli import main

# a Python in which the bench extra's modules cannot be imported
WITHOUT_EXTRA = (
    "import sys; sys.modules.update(dict.fromkeys({mods!r}));"
    "from proxy.cli import main; sys.exit(main(sys.argv[1:]))"
).format(mods=[*BENCH_MODULES, "numpy"])


@pytest.mark.parametrize(
    "argv",
    [["serve", "--help"], ["sim", "--help"], ["bench", "compare", "--help"], ["--version"]],
)
def test_the_service_and_help_need_no_extra(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["demo"], "kvkeeper demo"),
        (["bench", "run", "--workload", "swarm", "--target", "http://127.0.0.1:9",
          "--model", "m", "--out", "x"], "kvkeeper bench run"),
        (["bench", "compare", "--workload", "swarm", "--out", "x"], "kvkeeper bench compare"),
    ],
)  # fmt: skip
def test_bench_and_demo_without_the_extra_print_one_line(
    argv: list[str],
    prog: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in BENCH_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: needs the bench extra (matplotlib, tqdm not installed)")
    assert err.strip().endswith(INSTALL_HINT) and len(err.splitlines()) == 1
