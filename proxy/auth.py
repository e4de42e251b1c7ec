"""Tenants and principals: API keys map to tenants (a YAML file); the admin token sees all.

Tenants file::

    tenants:
      team-a: {api_keys: ["sk-a1", "sk-a2"]}
      team-b: {api_keys: ["sk-b1"]}

Without a tenants file every request belongs to the tenant ``default`` and the client's own
Authorization header goes to the engine untouched (a plain proxy).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from proxy.errors import Forbidden, Unauthorized
from proxy.settings import ConfigError

DEFAULT_TENANT = "default"
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who calls the admin API: an operator (tenant None = every tenant) or one tenant."""

    tenant: str | None

    def scope(self, requested: str | None) -> str:
        """The tenant a call acts on; a tenant principal can never reach another tenant."""
        if self.tenant is not None:
            if requested not in (None, self.tenant):
                raise Forbidden("this API key cannot act on another tenant", code="forbidden")
            return self.tenant
        return requested or DEFAULT_TENANT


class TenantMap:
    """Resolves API keys to tenants; keys are compared by digest, never logged."""

    def __init__(self, keys: Mapping[str, str] | None = None) -> None:
        # digest of api key -> tenant; empty map = single-tenant mode
        self._by_digest = {_digest(k): t for k, t in (keys or {}).items()}

    @property
    def multi_tenant(self) -> bool:
        return bool(self._by_digest)

    @classmethod
    def from_file(cls, path: Path | None) -> TenantMap:
        if path is None:
            return cls()
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read tenants file {path}: {exc}") from exc
        tenants = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(tenants, dict) or not tenants:
            raise ConfigError(f"tenants file {path} must hold a non-empty 'tenants' mapping")
        keys: dict[str, str] = {}
        for name, spec in tenants.items():
            if not isinstance(name, str) or not _TENANT_RE.match(name):
                raise ConfigError(f"tenant name {name!r} must match {_TENANT_RE.pattern}")
            api_keys = spec.get("api_keys") if isinstance(spec, dict) else None
            if not isinstance(api_keys, list) or not all(
                isinstance(k, str) and k for k in api_keys
            ):
                raise ConfigError(f"tenant {name!r} needs a list of api_keys")
            for key in api_keys:
                if key in keys:
                    raise ConfigError(f"an api key is listed for both {keys[key]!r} and {name!r}")
                keys[key] = name
        return cls(keys)

    def tenant_for(self, headers: Mapping[str, str]) -> str:
        """The tenant of a data-plane request (401 when keys are configured and this one is not)."""
        if not self.multi_tenant:
            return DEFAULT_TENANT
        token = bearer(headers)
        tenant = self._by_digest.get(_digest(token)) if token else None
        if tenant is None:
            raise Unauthorized("missing or unknown API key", code="invalid_api_key")
        return tenant

    @staticmethod
    def is_admin(headers: Mapping[str, str], admin_token: str | None) -> bool:
        """Whether the request carries the operator token."""
        token = bearer(headers) if admin_token else None
        return token is not None and hmac.compare_digest(_digest(token), _digest(admin_token or ""))

    def principal(self, headers: Mapping[str, str], admin_token: str | None) -> Principal:
        """The caller of an admin route: the operator token, or a tenant's API key."""
        token = bearer(headers)
        if token is None:
            raise Unauthorized(
                "admin API needs 'Authorization: Bearer <token>'", code="invalid_api_key"
            )
        if admin_token and hmac.compare_digest(_digest(token), _digest(admin_token)):
            return Principal(None)
        tenant = self._by_digest.get(_digest(token))
        if tenant is None:
            raise Unauthorized("unknown admin token or API key", code="invalid_api_key")
        return Principal(tenant)
