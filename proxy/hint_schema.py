"""The session-aware KV cache hints RFC's ``agent_hint`` schema, strict: no coercion of "300"
or true into numbers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RFC_MAX_TTL = 3600.0

EditType = Literal["offload", "prefetch", "evict"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class CacheControlParams(_Strict):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: float = Field(default=300.0, ge=0, le=RFC_MAX_TTL)
    block_offset: int | None = Field(default=None, ge=0)


class ContextEdit(_Strict):
    type: EditType
    block_start: int | None = Field(default=None, ge=0)
    block_end: int | None = Field(default=None, ge=0)  # exclusive

    @model_validator(mode="after")
    def _range(self) -> ContextEdit:
        if (self.block_start is None) != (self.block_end is None):
            raise ValueError("block_start and block_end must be supplied together")
        if (
            self.block_start is not None
            and self.block_end is not None
            and (self.block_start >= self.block_end)
        ):
            raise ValueError("block_start must be less than block_end (half-open range)")
        return self


class ContextManagementParams(_Strict):
    manage_request: bool = False
    edits: list[ContextEdit] = Field(default_factory=list)


class AgentHintParams(_Strict):
    session_id: str | None = None
    parent_session_id: str | None = None
    cache_control: CacheControlParams | None = None
    context_management: ContextManagementParams | None = None
