"""How policy names a session: an opaque sortable id (the proxy passes (tenant, session))."""

from __future__ import annotations

from typing import TypeAlias

SessionId: TypeAlias = str | tuple[str, str]
