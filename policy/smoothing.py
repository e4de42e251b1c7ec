"""The one smoothing rule: an exponentially weighted moving average."""

from __future__ import annotations

from dataclasses import dataclass


def ewma(old: float | None, new: float, weight: float) -> float:
    """``new`` blended into ``old`` with ``weight`` on the newest sample (``old`` None: ``new``)."""
    if not 0.0 < weight <= 1.0:
        raise ValueError("weight must be within (0, 1]")
    return new if old is None else old + weight * (new - old)


@dataclass(slots=True)
class Ewma:
    """A running EWMA; ``value`` None until the first sample (or a given starting value)."""

    weight: float
    value: float | None = None

    def add(self, sample: float) -> float:
        self.value = ewma(self.value, sample, self.weight)
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value
