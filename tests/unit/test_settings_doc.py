"""docs/settings.md is generated from the settings models; legacy and retired keys."""

from __future__ import annotations

import pytest

from proxy.settings import ConfigError, Settings, load_settings
from scripts.gen_settings_doc import DOC, leaves, render

ENGINE = [{"url": "http://127.0.0.1:9"}]


def test_the_settings_reference_is_current() -> None:
    assert DOC.read_text() == render(), "run: python scripts/gen_settings_doc.py"


# a new setting retires one, or raises this with a reason: 51 for guard.enabled (issue 28),
# the one switch of retention's measured back-off
MAX_LEAF_SETTINGS = 51


def test_the_number_of_leaf_settings_does_not_grow() -> None:
    assert len(leaves(Settings)) <= MAX_LEAF_SETTINGS


def test_legacy_retention_keys_land_in_their_group() -> None:
    s = load_settings(
        engines=ENGINE,
        retention={"tier_pin_share": 0.5, "admission_priority": True, "anchors": True,
                   "block_size": 16, "tick_s": 0.1},
    )  # fmt: skip
    assert s.tier.pin_share == 0.5 and s.admission.enabled and s.anchors.enabled
    assert s.cache.block_size == 16 and s.retention.tick_s == 0.1


def test_a_retired_setting_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"retention\.dispatch_ahead"):
        load_settings(engines=ENGINE, retention={"dispatch_ahead": 2})


def test_an_unknown_engine_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown engine kind"):
        load_settings(engines=[{"url": "http://127.0.0.1:9", "kind": "nope"}])
