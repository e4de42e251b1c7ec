"""Context edits (offload / prefetch / evict) and their outcomes.

The proxy asks an :class:`EditExecutor` to realize edits; the retention layer provides the real
one. :class:`UnsupportedEdits` is the honest default: every edit answers ``unsupported``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from proxy.hint_model import Edit

EditStatus = Literal["applied", "unsupported", "rejected", "failed"]


@dataclass(frozen=True, slots=True)
class EditResult:
    edit: Edit
    status: EditStatus
    reason: str | None = None
    detail: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.edit.type, "status": self.status}
        if self.edit.block_start is not None:
            out["block_start"] = self.edit.block_start
            out["block_end"] = self.edit.block_end
        if self.reason:
            out["reason"] = self.reason
        if self.detail:
            out["detail"] = self.detail
        return out


def outcome_header(results: list[EditResult]) -> str:
    """``X-KVKeeper-Edits`` value: ``evict=applied, offload=unsupported(no_offload_tier)``."""
    parts = []
    for r in results:
        parts.append(f"{r.edit.type}={r.status}" + (f"({r.reason})" if r.reason else ""))
    return ", ".join(parts)


class EditExecutor(Protocol):
    """Realizes edits on a session's recorded context."""

    async def apply(
        self, tenant: str, session_id: str, edits: tuple[Edit, ...]
    ) -> list[EditResult]:
        """Run the edits in order; never raises for a single edit's failure."""
        ...


class UnsupportedEdits:
    """No retention layer: every edit is honestly unsupported."""

    async def apply(
        self, tenant: str, session_id: str, edits: tuple[Edit, ...]
    ) -> list[EditResult]:
        return [EditResult(e, "unsupported", "retention_not_enabled") for e in edits]
