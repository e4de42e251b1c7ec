"""Settings names that changed: legacy flat ``retention:`` keys and retired settings."""

from __future__ import annotations

from typing import Any

# Settings that once sat flat under ``retention:``: still read there, moved to their group.
LEGACY_RETENTION_KEYS: dict[str, tuple[str, str]] = {
    "tier_pin_share": ("tier", "pin_share"),
    "admission_priority": ("admission", "enabled"),
    "block_size": ("cache", "block_size"),
    "hash_seed": ("cache", "hash_seed"),
}
# Retired: features that measured no gain (history in git) and knobs now fixed; a config
# naming one is refused clearly.
RETIRED_KEYS = frozenset(
    {
        "retention.touch_deadline_steps",
        "retention.touch_deadline_s",  # touches are never abandoned (proxy/touches.py)
        "anchors.enabled",
        "retention.anchors",
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
        # fixed since issue 24: knobs nobody should need to tune, now constants by their code
        "retention.safety_fraction",
        "retention.max_concurrent_touches",
        "retention.overhead_burst_tokens",
        "retention.lease_ttl_s",
        "retention.priority_slack_ms_per_ktok",
        "admission.slack_ms_per_ktok",
        "placement.miss_weight",
        "placement.index_pool_factor",
        "limits.max_inflight_body_bytes",
        "limits.body_timeout_s",
        "limits.max_children",
        "response_ttl_s",
        "engines[].lmcache.chunk_size",
    }
)
_GROUPS = ("retention", "upstream", "limits", "admission", "placement", "anchors")


def migrate(data: Any) -> Any:
    """Move legacy flat ``retention:`` keys to their groups; refuse retired ones by name."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    named = [k for k in out if k in RETIRED_KEYS]
    for group in _GROUPS:
        section = out.get(group)
        if isinstance(section, dict):
            named += [f"{group}.{k}" for k in section if f"{group}.{k}" in RETIRED_KEYS]
    engines = out.get("engines")
    for engine in engines if isinstance(engines, list) else []:
        tier = engine.get("lmcache") if isinstance(engine, dict) else None
        if isinstance(tier, dict) and "chunk_size" in tier:
            named.append("engines[].lmcache.chunk_size")
    if named:
        raise ValueError(
            f"retired setting(s) {', '.join(sorted(set(named)))}: no longer settable (fixed in "
            "the code or read from the engine); remove from the config"
        )
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
