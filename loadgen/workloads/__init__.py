"""Agent workloads: ``swarm``, ``fanout``, ``multiturn``, ``trace``, ``cachescout`` and
``mooncake`` (see each module).

A workload is chosen by name and parameters, from the CLI (``--set key=value``) or a small YAML
spec (``workload: swarm`` plus ``params: {...}``); the same name, parameters and seed always
build the same :class:`~loadgen.workloads.base.Workload`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from loadgen.workloads import cachescout, fanout, mooncake, multiturn, swarm, trace
from loadgen.workloads.base import Call, Segment, SessionScript, Spawn, Workload

__all__ = [
    "WORKLOADS",
    "Call",
    "Segment",
    "SessionScript",
    "Spawn",
    "Workload",
    "build_workload",
    "load_spec",
    "make_params",
    "parse_overrides",
]

WORKLOADS: dict[str, tuple[type[Any], Callable[[Any], Workload]]] = {
    "swarm": (swarm.SwarmParams, swarm.build),
    "fanout": (fanout.FanoutParams, fanout.build),
    "multiturn": (multiturn.MultiturnParams, multiturn.build),
    "trace": (trace.TraceParams, trace.build),
    "cachescout": (cachescout.CacheScoutParams, cachescout.build),
    "mooncake": (mooncake.MooncakeParams, mooncake.build),
}
_COERCE: dict[str, Callable[[Any], Any]] = {"int": int, "float": float, "str": str}


def make_params(name: str, values: Mapping[str, Any] | None = None) -> Any:
    """The parameter dataclass of workload ``name`` with ``values`` applied and type-checked."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name][0]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in (values or {}).items():
        if key not in fields:
            raise ValueError(f"{name}: unknown parameter {key!r}; known: {', '.join(fields)}")
        kwargs[key] = _coerce(name, key, str(fields[key].type), value)
    return cls(**kwargs)


def _coerce(name: str, key: str, type_name: str, value: Any) -> Any:
    if type_name == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: {key} must be true or false, not {value!r}")
    try:
        return _COERCE[type_name](value)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{name}: {key} must be {type_name}, not {value!r}") from None


def build_workload(name: str, values: Mapping[str, Any] | None = None) -> Workload:
    """Build workload ``name`` from parameter values (defaults for the rest)."""
    return WORKLOADS[name][1](make_params(name, values))


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["users=8", "token_scale=0.1"]`` -> ``{"users": 8, "token_scale": 0.1}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def load_spec(path: str | Path) -> tuple[str, dict[str, Any]]:
    """Read a YAML spec ``{workload: NAME, params: {...}}``; returns ``(name, params)``."""
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or "workload" not in doc:
        raise ValueError(f"{path}: a spec is a mapping with a 'workload' key")
    params = doc.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{path}: 'params' must be a mapping")
    return str(doc["workload"]), dict(params)
