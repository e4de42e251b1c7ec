"""The benchmark targets of ``kvkeeper bench compare``: one registry, one entry per target.

A target says what the client talks to and how the engines behind it are set up:

* ``engine``: straight to the engine (one replica only: a plain client cannot spread);
* ``kvkeeper``: through ``kvkeeper serve``, the client sending the target's hint mode
  (:mod:`loadgen.workloads.hints`) and kvkeeper running with the target's retention settings
  added to the run's own (``--retention``);
* ``router``: through ``vllm-router`` with the target's policy (several replicas only);
* ``floor``: through the barest streaming aiohttp pass-through (``loadgen.floor``, one replica):
  what any Python proxy hop costs on the machine, to set kvkeeper's own part apart.

Adding a target is one entry in :data:`TARGETS` (docs/extending.md). A kvkeeper target may
carry settings of its own after ``@`` on the command line: ``full+pins@tier_pin_share=0.8``
(several: ``@a=1@b=2``; they win over ``--retention``). ``@workers=2`` runs kvkeeper as two
worker processes (replicas sharing Redis behind the kernel's spread), ``@share=false`` without
the shared prefix index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loadgen.sim.belady import EvictRule
from loadgen.workloads import parse_overrides
from loadgen.workloads.hints import HintMode
from proxy.settings import RETENTION_KEYS

TargetKind = Literal["engine", "kvkeeper", "router", "floor"]


@dataclass(frozen=True, slots=True)
class BenchTarget:
    """One benchmark target; see the module docstring for the kinds."""

    kind: TargetKind
    help: str
    hints: HintMode = "none"  # what the client sends (kvkeeper targets)
    retention: Mapping[str, Any] = field(default_factory=dict)  # kvkeeper settings it adds
    sim: Mapping[str, Any] = field(default_factory=dict)  # SimConfig fields its simulators change
    evict_rule: EvictRule | None = None  # simulator evicting by an earlier target's future
    router_policy: str | None = None  # vllm-router --policy
    default: bool = False  # run when no --targets are given (where it applies)

    def applies(self, replicas: int) -> bool:
        """Whether the target can run on ``replicas`` engines at all."""
        if self.kind in ("engine", "floor"):
            return replicas == 1
        if self.kind == "router":
            return replicas > 1
        return True


_NO_TIER = {"cpu_blocks": 0, "cpu_l2_blocks": 0}

TARGETS: dict[str, BenchTarget] = {
    "engine": BenchTarget("engine", "vanilla vLLM LRU, straight to the engine", default=True),
    "engine-notier": BenchTarget(
        "engine", "engine on simulators without the CPU tier (what the tier itself adds)",
        sim={"cpu_blocks": 0},
    ),
    "engine-belady": BenchTarget(
        "engine", "engine evicting by Belady's rule from the first target's sends, no CPU tier "
        "(the best eviction order alone does)",
        sim=_NO_TIER, evict_rule="belady",
    ),
    "engine-deadfirst": BenchTarget(
        "engine", "engine dropping blocks never used again first, else LRU, no CPU tier",
        sim=_NO_TIER, evict_rule="dead-first",
    ),
    "floor": BenchTarget(
        "floor", "through a bare aiohttp pass-through (the hop any Python proxy adds)"
    ),
    "none": BenchTarget("kvkeeper", "through kvkeeper, no hints", hints="none", default=True),
    "session": BenchTarget(
        "kvkeeper", "through kvkeeper, session ids only", hints="session", default=True
    ),
    "full": BenchTarget(
        "kvkeeper", "through kvkeeper, every hint (TTLs, parents, evict, prefetch)",
        hints="full", default=True,
    ),
    "default": BenchTarget(
        "kvkeeper", "full on kvkeeper's default settings, engines priority-scheduled (what "
        "kvkeeper detects: the tier, the scheduling policy)",
        hints="full", sim={"scheduling_policy": "priority"},
    ),
    "full+unbounded": BenchTarget(
        "kvkeeper", "full with no retention overhead budget",
        hints="full", retention={"max_overhead_share": None},
    ),
    "none+priority": BenchTarget(
        "kvkeeper", "none with cache-aware admission order on priority-scheduled engines",
        hints="none", retention={"admission_priority": True},
        sim={"scheduling_policy": "priority"},
    ),
    "full+priority": BenchTarget(
        "kvkeeper", "full with cache-aware admission order on priority-scheduled engines",
        hints="full", retention={"admission_priority": True},
        sim={"scheduling_policy": "priority"},
    ),
    "full+pins": BenchTarget(
        "kvkeeper", "full with tier pins (protected sessions the GPU is losing pinned in the tier)",
        hints="full", retention={"tier_pin_share": 0.5},
    ),
    "round-robin": BenchTarget(
        "router", "vllm-router, round_robin policy", router_policy="round_robin", default=True
    ),
    "vllm-router": BenchTarget(
        "router", "vllm-router, cache_aware policy", router_policy="cache_aware", default=True
    ),
}  # fmt: skip


# settings after '@' that are not retention's: worker processes and the shared prefix index
PROCESS_KEYS = frozenset({"workers", "share"})


def split_target(name: str) -> tuple[str, dict[str, Any]]:
    """``full+pins@tier_pin_share=0.8`` -> ``("full+pins", {"tier_pin_share": 0.8})``."""
    base, *items = name.split("@")
    return base, parse_overrides(items)


def target_of(name: str) -> BenchTarget:
    """The registry entry of ``name`` (settings after ``@`` ignored)."""
    return TARGETS[split_target(name)[0]]


def plan_targets(
    requested: Sequence[str],
    replicas: int,
    router: str | None,
    simulated: bool = True,
) -> list[tuple[str, str | None]]:
    """``(target, reason skipped or None)`` in run order; unknown names or settings raise."""
    names = list(requested) or [n for n, t in TARGETS.items() if t.default and t.applies(replicas)]
    out: list[tuple[str, str | None]] = []
    for name in names:
        base, settings = split_target(name)
        if base not in TARGETS:
            raise ValueError(f"unknown target {base!r}; choose from {', '.join(TARGETS)}")
        target = TARGETS[base]
        if settings and target.kind != "kvkeeper":
            raise ValueError(f"{name!r}: only kvkeeper targets take settings after '@'")
        if unknown := sorted(set(settings) - RETENTION_KEYS - PROCESS_KEYS):
            raise ValueError(f"{name!r}: no retention setting {', '.join(unknown)}")
        reason = None
        if target.kind in ("engine", "floor") and replicas > 1:
            reason = "several replicas: a plain client cannot spread over them"
        elif target.evict_rule and not simulated:
            reason = "eviction by the future needs the simulator"
        elif target.evict_rule and all(skipped for _, skipped in out):
            reason = "eviction by the future needs an earlier target's timeline: name it after one"
        elif target.kind == "router" and router is None:
            reason = "vllm-router is not installed"
        out.append((name, reason))
    return out
