"""The ceilings of a finished ``kvkeeper bench compare`` run on its first target's timeline,
with each call holding its blocks from its first token instead of from when it was sent (the
``admitted`` ceilings that bench compare writes since they were added, for older runs).

    python scripts/held_ceilings.py results/overhead_budget/after-query-count-fix/trace-n16-p50
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.compare_ceilings import realized_replay, replay_rates
from loadgen.records import RunResult
from loadgen.workloads import build_workload


def main() -> None:
    for arg in sys.argv[1:]:
        run = Path(arg)
        rounds = sorted(run.glob("round*/compare.json")) or [run / "compare.json"]
        for path in rounds:
            doc = json.loads(path.read_text())
            workload = build_workload(doc["workload"], doc["params"])
            first = (doc["ceilings"]["realized"] or {}).get("from", "engine")
            result = RunResult.load(path.parent / f"{first}.json")
            capacity = doc["ceilings"]["planned"]["C"]
            measured = doc["targets"][first]["hit_rate"]
            print(f"{path.parent} ({first}: measured hit {100 * measured:.1f}%)")
            for held in (False, True):
                rates = replay_rates(
                    realized_replay(workload, result, from_first_token=held), capacity
                )
                label = "held from the first token" if held else "held from the send time"
                print(
                    f"  {label:26s} LRU {100 * rates['lru']:.1f}%  Belady {100 * rates['belady']:.1f}%"
                    f"  infinite {100 * rates['inf']:.1f}%"
                )


if __name__ == "__main__":
    main()
