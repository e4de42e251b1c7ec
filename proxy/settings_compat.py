"""Settings names that changed: legacy flat ``retention:`` keys and retired settings."""

from __future__ import annotations

from typing import Any

# Settings that once sat flat under ``retention:``: still read there, moved to their group.
LEGACY_RETENTION_KEYS: dict[str, tuple[str, str]] = {
    "tier_pin_share": ("tier", "pin_share"),
    "admission_priority": ("admission", "enabled"),
    "priority_slack_ms_per_ktok": ("admission", "slack_ms_per_ktok"),
    "anchors": ("anchors", "enabled"),
    "block_size": ("cache", "block_size"),
    "hash_seed": ("cache", "hash_seed"),
}
# Retired: features that measured no gain (history in git) and knobs now fixed; a config
# naming one is refused clearly.
RETIRED_KEYS = frozenset(
    {
        "retention.touch_deadline_steps",
        "retention.tier_pin_anchors",
        "retention.tier_anchor_keep_factor",
        "retention.tier_skip_touches",
        "retention.dispatch_ahead",
        "retention.dispatch_max_wait_s",
        "retention.priority_resident_credit_ms_per_ktok",
        "retention.fallback_touch_interval_s",
        "retention.relearn_idle_s",
        "retention.prefetch_max_pool_share",
        "retention.anchor_pool_share",
        "retention.anchor_min_factor",
        "retention.anchor_window_s",
        "retention.anchor_min_blocks",
        "retention.anchor_relearn_calls",
        "retention.anchor_min_demand",
        "limits.max_edits",
        "limits.max_context_bytes",
        "limits.max_session_id_len",
        "limits.idle_expiry_s",
        "upstream.connect_timeout_s",
        "upstream.read_timeout_s",
        "upstream.total_timeout_s",
        "upstream.max_connections",
        "upstream.max_connections_per_engine",
    }
)


def migrate(data: Any) -> Any:
    """Move legacy flat ``retention:`` keys to their groups; refuse retired ones by name."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for group in ("retention", "upstream", "limits"):
        section = out.get(group)
        if not isinstance(section, dict):
            continue
        retired = sorted(k for k in section if f"{group}.{k}" in RETIRED_KEYS)
        if retired:
            raise ValueError(f"retired setting(s) {', '.join(f'{group}.{k}' for k in retired)}")
    retention = out.get("retention")
    if isinstance(retention, dict) and set(retention) & set(LEGACY_RETENTION_KEYS):
        retention = dict(retention)
        for old, (group, name) in LEGACY_RETENTION_KEYS.items():
            if old in retention:
                target = out.get(group)
                target = dict(target) if isinstance(target, dict) else {}
                target.setdefault(name, retention.pop(old))
                out[group] = target
        out["retention"] = retention
    return out
