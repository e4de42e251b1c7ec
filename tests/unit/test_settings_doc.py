"""docs/settings.md is generated from the settings models; legacy and retired keys."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.settings import ConfigError, Settings, load_settings
from scripts.gen_settings_doc import DOC, leaves, render

ENGINE = [{"url": "http://127.0.0.1:9"}]


def test_the_settings_reference_is_current() -> None:
    assert DOC.read_text() == render(), "run: python scripts/gen_settings_doc.py"


# a new setting retires one, or raises this with a reason: 39 since issue 24 made the knobs
# nobody should need to tune module constants by their code (settings_compat.RETIRED_KEYS);
# 39: retention.return_ttl_factor, the switch of the return protection (0: off)
MAX_LEAF_SETTINGS = 39


def test_the_number_of_leaf_settings_does_not_grow() -> None:
    assert len(leaves(Settings)) <= MAX_LEAF_SETTINGS


def test_legacy_retention_keys_land_in_their_group() -> None:
    s = load_settings(
        engines=ENGINE,
        retention={"tier_pin_share": 0.5, "admission_priority": True,
                   "block_size": 16, "tick_s": 0.1},
    )  # fmt: skip
    assert s.tier.pin_share == 0.5 and s.admission.enabled
    assert s.cache.block_size == 16 and s.retention.tick_s == 0.1


def test_a_retired_setting_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"retention\.dispatch_ahead"):
        load_settings(engines=ENGINE, retention={"dispatch_ahead": 2})


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"retention": {"lease_ttl_s": 1.0}}, "retention.lease_ttl_s"),
        ({"placement": {"miss_weight": 1.0}}, "placement.miss_weight"),
        ({"admission": {"slack_ms_per_ktok": 10}}, "admission.slack_ms_per_ktok"),
        ({"limits": {"body_timeout_s": 5}}, "limits.body_timeout_s"),
        ({"response_ttl_s": 60}, "response_ttl_s"),
        # the agent-anchor feature, removed (it measured no gain on CacheScout's own setting)
        ({"anchors": {"enabled": True}}, "anchors.enabled"),
        ({"retention": {"anchors": True}}, "retention.anchors"),
    ],
)
def test_a_setting_made_a_constant_is_refused_in_one_line(
    overrides: dict[str, Any], name: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(engines=ENGINE, **overrides)
    assert name in str(err.value) and "\n" not in str(err.value)


def test_the_lmcache_chunk_size_is_refused_it_is_read_from_the_tier() -> None:
    tier = {"coordinator_url": "http://c:1", "server_url": "http://s:2", "model_name": "m"}
    assert load_settings(engines=[{"url": "http://127.0.0.1:9", "lmcache": tier}])
    with pytest.raises(ConfigError, match=r"engines\[\]\.lmcache\.chunk_size"):
        load_settings(
            engines=[{"url": "http://127.0.0.1:9", "lmcache": {**tier, "chunk_size": 256}}]
        )


def test_an_unknown_engine_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown engine kind"):
        load_settings(engines=[{"url": "http://127.0.0.1:9", "kind": "nope"}])
